"""Binding each simulated rank to its retained state in its keeper.

A rank's model and optimizer are torch objects in the (simulated) trainer process; the
bytes they train live in the keeper's memory, which outlives the process. A rank gets
fresh retained state when its memory is gone (then tier 1, tier 2 or a checkpoint
fills it), and attaches to what is there otherwise: after a promotion, or when a new
engine takes over a job an earlier one left between steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from leto.core.recovery import Phase
from leto.core.txn import TxnState
from leto.errors import ConfigError
from leto.retained.layout import LayoutError, RetainedLayout
from leto.retained.optim import retain

from .inspect import describe
from .rank import RankProc

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["attach", "attach_all", "create", "ensure"]


def create(eng: Engine, p: RankProc) -> None:
    """Fresh retained state for ``p`` in its keeper (at version 0; repairs follow)."""
    eng.backend.reset_memory(p.rank)
    _bind(eng, p, attach=False)


def attach(eng: Engine, p: RankProc) -> None:
    """Bind ``p`` to the retained state in its keeper (validates shapes first)."""
    _bind(eng, p, attach=True)


def ensure(eng: Engine, r: int, lost: bool) -> None:
    """Rank ``r`` bound before a repair: fresh state if its memory is ``lost``."""
    p = eng.procs[r]
    if lost or eng.backend.memory_lost(r):
        create(eng, p)
    elif p.ropt is None:
        attach(eng, p)


def _bind(eng: Engine, p: RankProc, *, attach: bool) -> None:
    rep = p.replica
    p.ropt = retain(
        rep.model,
        rep.optimizer,
        chunk_numel=eng.options.chunk_numel,
        alloc=eng.backend.allocator(p.rank),
        attach=attach,
        align_bytes=eng.options.align_bytes,
        master_weights=eng.options.master_weights,
        # chunks are verified at PREPARE (all of them, before the step's vote) and
        # at every recovery; not again before each chunk's undo copy
        verify=False,
    )


def attach_all(eng: Engine) -> None:
    """Every rank takes over the retained job an earlier engine left on the backend
    (it must be idle between steps: a job mid-step recovers first)."""
    coord = eng.backend.record
    if coord is None:
        raise LayoutError("the backend holds no retained job to attach to")
    s = coord.state
    if (
        s.phase is not Phase.RUNNING
        or len(set(s.step)) != 1
        or any(pc is not TxnState.IDLE for pc in s.pc)
    ):
        raise LayoutError(
            f"the retained job is not idle between steps (phase {s.phase.name}): "
            "it must recover first"
        )
    meta = RetainedLayout.read_meta(eng.backend.allocator(0))
    if meta["chunk_numel"] != eng.options.chunk_numel:
        raise ConfigError(
            "chunk_size",
            f"{eng.options.chunk_numel} elements, but the retained state is chunked by "
            f"{meta['chunk_numel']}",
        )
    for p in eng.procs:  # validates shapes before binding anything; copies nothing
        attach(eng, p)
    step = s.step[0]
    for p in eng.procs:
        p.load_ps(eng._store(p.rank).process_states[p.rank][step])
        p.gen = s.gen
        eng.backend.spawn_shadow(p.rank, eng._shadow_factory)
    sampler = eng.procs[0].sampler_state
    assert sampler is not None
    eng.cursor.restore(sampler)
    if eng.injector is not None:
        eng.injector.n_chunks = eng.procs[0].layout.n_chunks
    eng._log("attach", step=step, detail=describe(eng))
