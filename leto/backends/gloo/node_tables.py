"""What every part of a node agent sees of it (:mod:`.agent`): its options, the node's
local ranks, whether it is stopping, and the tables of the node's processes, held by
the agent and changed in place by its parts. A part's own Protocol (``ShadowsHost``,
``ChildrenHost``, ...) extends :class:`NodeTables` with the rest of what it uses."""

from __future__ import annotations

from typing import Any, Protocol

from .keeper import KeeperHandle
from .records import AgentOptions, Proc

__all__ = ["NodeTables"]


class NodeTables(Protocol):
    """The agent's options, its node's ranks and its processes' tables."""

    @property
    def o(self) -> AgentOptions: ...

    @property
    def node(self) -> int: ...

    @property
    def local_ranks(self) -> range: ...

    def rank(self, lr: int) -> int: ...

    def say(self, text: str) -> None: ...

    @property
    def stop(self) -> bool: ...

    @property
    def complete(self) -> bool: ...

    @property
    def trainer(self) -> dict[int, Proc | None]: ...

    @property
    def shadow(self) -> dict[int, Proc | None]: ...

    @property
    def shadow_state(self) -> dict[int, str]: ...

    @property
    def shadow_failures(self) -> dict[int, int]: ...

    @property
    def degraded(self) -> dict[int, str]: ...

    @property
    def asked(self) -> set[int]: ...

    @property
    def spawns(self) -> dict[int, dict[str, Any]]: ...

    @property
    def keepers(self) -> dict[int, KeeperHandle]: ...
