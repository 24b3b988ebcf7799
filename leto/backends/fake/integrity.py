"""Integrity failures: a checksum caught bad bytes in a rank's retained memory.

Bad bytes are never repaired in place: the rank's keeper discards the memory (the
core's LoseMemory), and the core's recovery rebuilds it from the tiers like any other
lost memory. This module finds such ranks and reports them to the core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from leto.core import events as ev
from leto.core.chunk import LOST
from leto.core.cluster import ClusterState
from leto.retained.layout import ChecksumError, ChunkStatus, LayoutError, ShapeMismatchError

from .layouts import attach

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["failure", "scan"]


def scan(eng: Engine, s: ClusterState) -> dict[int, str]:
    """Ranks whose retained memory fails a check (chunks, undo copies, sealed grads)."""
    bad: dict[int, str] = {}
    for r in range(eng.W):
        if all(d == LOST for d in s.data[r]):
            continue
        p = eng.procs[r]
        if p.ropt is None:
            try:
                attach(eng, p)
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


def failure(eng: Engine, r: int, why: str) -> None:
    """A checksum caught bad bytes on rank ``r``: its keeper discards the memory."""
    eng.stats["integrity_failures"] += 1
    if eng.injector is not None:
        for f in eng.injector.faults:
            if f.kind == "corrupt" and f.rank == r and f.fired and not f.detected:
                f.detected += 1
    if eng._rec is not None:
        eng._rec.integrity.append(f"rank {r}: {why}")
    else:
        eng._integrity_notes.append(f"rank {r}: {why}")
    eng._log("integrity", rank=r, detail=f"checksum mismatch ({why}); memory of rank {r} discarded")
    eng._try(ev.LoseMemory(r))
