"""Where the backend's fault injector strikes: the points of a step and their faults.

The injector (:class:`~leto.backends.fake.backend.FaultInjector`) plans faults;
:class:`FaultPoints` consults it at each point the engine passes and turns a fault into
the core's event (Crash, Hang, LoseMemory, LoseNode) or, for a silent corruption, into
a flipped bit that only a checksum can catch. Which recovery follows is the core's
decision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from leto.core import events as ev
from leto.retained.parity import as_bytes

from .backend import Fault, FaultInjector
from .rank import InjectedFault, RankProc, _Interrupted

__all__ = ["FaultHost", "FaultPoints"]


class FaultHost(Protocol):
    """What a fault point reads and strikes: the injector, the counters, the faults
    open until the next resume, the timeline, the core, and (for a flipped bit) the
    ranks' retained bytes."""

    @property
    def injector(self) -> FaultInjector | None: ...

    @property
    def stats(self) -> dict[str, int]: ...

    @property
    def open_faults(self) -> list[Fault]: ...

    @property
    def procs(self) -> list[RankProc]: ...

    def log(self, event: str, **kw: Any) -> None: ...

    def try_feed(self, e: ev.Event) -> bool: ...


class FaultPoints:
    """The engine's fault points (none fire without an injector on the backend)."""

    def __init__(self, host: FaultHost) -> None:
        self.host = host

    def _due(
        self, rank: int, step: int, phase: str, chunk: int | None, where: str | None
    ) -> list[Fault]:
        """The faults planned at this point, taken from the injector (none: empty)."""
        inj = self.host.injector
        if inj is None or not inj.pending_at(rank, step, phase, chunk, where):
            return []
        return list(inj.take(rank, step, phase, chunk, where))

    def inside(
        self,
        rank: int,
        step: int,
        phase: str,
        *,
        adopt: bool,
        chunk: int | None = None,
        where: str | None = None,
        tear: Callable[[], None] | None = None,
    ) -> None:
        """A fault point inside an event's effects: the driver (``Engine.feed``) fires
        it, after adopting the state before the event or, with ``adopt``, after it."""
        faults = self._due(rank, step, phase, chunk, where)
        if not faults:
            return
        if tear is not None:
            tear()
        raise InjectedFault(faults, adopt)

    def between(
        self, rank: int, step: int, phase: str, chunk: int | None = None, where: str | None = None
    ) -> None:
        """A fault point between events: fire its faults; any but a silent corruption
        interrupts the step."""
        faults = self._due(rank, step, phase, chunk, where)
        if not faults:
            return
        self.fire(faults)
        if any(f.kind != "corrupt" for f in faults):
            raise _Interrupted

    def fire(self, faults: list[Any]) -> None:
        """Strike: each fault becomes the core's event for it (or a flipped bit)."""
        host = self.host
        for f in faults:
            host.stats["failures_injected"] += 1
            host.open_faults.append(f)
            host.log("fault", step=f.step, detail=f.label)
            if f.kind == "crash":
                host.try_feed(ev.Crash(f.rank))
            elif f.kind == "hang":
                host.try_feed(ev.Hang(f.rank))
            elif f.kind == "lose_memory":
                host.try_feed(ev.LoseMemory(f.rank))
            elif f.kind == "lose_node":
                host.try_feed(ev.LoseNode(f.node))
            elif f.kind == "corrupt":
                self._flip(f)
            else:  # pragma: no cover - the injector validates kinds
                raise ValueError(f.kind)

    def _flip(self, f: Any) -> None:
        """Silent corruption: one bit of the chunk's first byte, and no event (no one
        saw it happen)."""
        lay = self.host.procs[f.rank].layout
        b = as_bytes(lay.chunk_data(f.target_chunk)[0])
        with torch.no_grad():
            b[0] = int(b[0]) ^ (1 << f.bit)
