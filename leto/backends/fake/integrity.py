"""Integrity failures: a checksum caught bad bytes in a rank's retained memory.

Bad bytes are never repaired in place: the rank's keeper discards the memory (the
core's LoseMemory), and the core's recovery rebuilds it from the tiers like any other
lost memory. This module finds such ranks and reports them to the core.
"""

from __future__ import annotations

from typing import Any, Protocol

from leto.core import events as ev
from leto.core.chunk import LOST
from leto.core.cluster import ClusterState
from leto.retained.layout import ChecksumError, ChunkStatus, LayoutError, ShapeMismatchError

from .backend import FaultInjector
from .host import RanksHost
from .layouts import attach
from .rank import RecoveryRecord

__all__ = ["IntegrityHost", "failure", "scan"]


class IntegrityHost(Protocol):
    """Where an integrity failure is reported: the counters, the fault it detects, the
    recovery under way (or the notes for the next one), the timeline, and the core."""

    @property
    def stats(self) -> dict[str, int]: ...

    @property
    def injector(self) -> FaultInjector | None: ...

    @property
    def recovery_record(self) -> RecoveryRecord | None: ...

    @property
    def integrity_notes(self) -> list[str]: ...

    def log(self, event: str, **kw: Any) -> None: ...

    def try_feed(self, e: ev.Event) -> bool:
        """Feed ``e`` to the core if it is enabled; whether it was."""
        ...


def scan(ranks: RanksHost, s: ClusterState) -> dict[int, str]:
    """Ranks whose retained memory fails a check (chunks, undo copies, sealed grads)."""
    bad: dict[int, str] = {}
    for r in range(ranks.W):
        if all(d == LOST for d in s.data[r]):
            continue
        p = ranks.procs[r]
        if p.ropt is None:
            try:
                attach(ranks, p)
            except ShapeMismatchError:
                raise  # the shadow's model does not fit: a program error, not lost memory
            except (LayoutError, ChecksumError) as e:
                bad[r] = f"cannot attach its retained state: {e}"
                continue
        lay = p.layout
        chunks = lay.verify()
        undo = [
            c
            for c in range(lay.n_chunks)
            if lay.chunk_status(c) is not ChunkStatus.CLEAN and not lay.undo.verify(c)
        ]
        grads = lay.grads.verify(lay.prepared_step) if lay.prepared_step >= 0 else []
        if chunks or undo or grads:
            bad[r] = (
                f"chunks {chunks} / undo copies {undo} / gradient chunks {grads} fail their checksums"
            )
    return bad


def failure(host: IntegrityHost, r: int, why: str) -> None:
    """A checksum caught bad bytes on rank ``r``: its keeper discards the memory."""
    host.stats["integrity_failures"] += 1
    if host.injector is not None:
        for f in host.injector.faults:
            if f.kind == "corrupt" and f.rank == r and f.fired and not f.detected:
                f.detected += 1
    if host.recovery_record is not None:
        host.recovery_record.integrity.append(f"rank {r}: {why}")
    else:
        host.integrity_notes.append(f"rank {r}: {why}")
    host.log("integrity", rank=r, detail=f"checksum mismatch ({why}); memory of rank {r} discarded")
    host.try_feed(ev.LoseMemory(r))
