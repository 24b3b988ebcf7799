"""What the engine's parts see of it: the simulated ranks on their backend.

The engine (:mod:`.engine`) holds the state its parts share. Each part declares the
narrow view it uses as a Protocol, this one or one in its own module built on it, and
the engine passes itself: ``mypy --strict`` checks that it fits, and no part imports
the engine back.
"""

from __future__ import annotations

from typing import Protocol

from leto.backends.base import Backend, NodeStore

from .rank import EngineOptions, RankProc

__all__ = ["RanksHost"]


class RanksHost(Protocol):
    """The simulated ranks (one :class:`~.rank.RankProc` each), their backend and node
    stores, the engine's options, and the run's counters."""

    @property
    def backend(self) -> Backend: ...

    @property
    def options(self) -> EngineOptions: ...

    @property
    def procs(self) -> list[RankProc]: ...

    @property
    def W(self) -> int: ...

    @property
    def stats(self) -> dict[str, int]: ...

    def store(self, rank: int) -> NodeStore:
        """The node store of ``rank``'s node."""
        ...

    def member(self, rank: int) -> int:
        """``rank``'s index among its node's members."""
        ...
