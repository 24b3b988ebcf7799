"""Binding each simulated rank to its retained state in its keeper.

A rank's model and optimizer are torch objects in the (simulated) trainer process; the
bytes they train live in the keeper's memory, which outlives the process. A rank gets
fresh retained state when its memory is gone (then tier 1, tier 2 or a checkpoint
fills it), and attaches to what is there otherwise: after a promotion, or when a new
engine takes over a job an earlier one left between steps.
"""

from __future__ import annotations

from typing import Any, Protocol

from leto.core.recovery import Phase
from leto.core.txn import TxnState
from leto.errors import ConfigError
from leto.retained.checkpoint import Checkpointer
from leto.retained.layout import LayoutError, RetainedLayout
from leto.retained.optim import retain
from leto.retained.process_state import BatchCursor

from .backend import FaultInjector
from .host import RanksHost
from .inspect import describe
from .rank import RankProc, Replica

__all__ = ["AttachHost", "attach", "attach_all", "create", "ensure"]


def create(ranks: RanksHost, p: RankProc) -> None:
    """Fresh retained state for ``p`` in its keeper (at version 0; repairs follow)."""
    ranks.backend.reset_memory(p.rank)
    _bind(ranks, p, attach=False)


def attach(ranks: RanksHost, p: RankProc) -> None:
    """Bind ``p`` to the retained state in its keeper (validates shapes first)."""
    _bind(ranks, p, attach=True)


def ensure(ranks: RanksHost, r: int, lost: bool) -> None:
    """Rank ``r`` bound before a repair: fresh state if its memory is ``lost``."""
    p = ranks.procs[r]
    if lost or ranks.backend.memory_lost(r):
        create(ranks, p)
    elif p.ropt is None:
        attach(ranks, p)


def _bind(ranks: RanksHost, p: RankProc, *, attach: bool) -> None:
    rep = p.replica
    p.ropt = retain(
        rep.model,
        rep.optimizer,
        chunk_numel=ranks.options.chunk_numel,
        alloc=ranks.backend.allocator(p.rank),
        attach=attach,
        align_bytes=ranks.options.align_bytes,
        master_weights=ranks.options.master_weights,
        # chunks are verified at PREPARE (all of them, before the step's vote) and
        # at every recovery; not again before each chunk's undo copy
        verify=False,
    )


class AttachHost(RanksHost, Protocol):
    """What taking over an earlier engine's job sets up besides the ranks: the batch
    cursor, the fault injector's chunk count, the shadows, the timeline."""

    @property
    def cursor(self) -> BatchCursor: ...

    @property
    def injector(self) -> FaultInjector | None: ...

    @property
    def checkpointer(self) -> Checkpointer | None: ...

    def new_shadow(self) -> Replica: ...

    def log(self, event: str, **kw: Any) -> None: ...


def attach_all(host: AttachHost) -> None:
    """Every rank takes over the retained job an earlier engine left on the backend
    (it must be idle between steps: a job mid-step recovers first)."""
    coord = host.backend.record
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
    meta = RetainedLayout.read_meta(host.backend.allocator(0))
    if meta["chunk_numel"] != host.options.chunk_numel:
        raise ConfigError(
            "chunk_size",
            f"{host.options.chunk_numel} elements, but the retained state is chunked by "
            f"{meta['chunk_numel']}",
        )
    for p in host.procs:  # validates shapes before binding anything; copies nothing
        attach(host, p)
    step = s.step[0]
    for p in host.procs:
        p.load_ps(host.store(p.rank).process_states[p.rank][step])
        p.gen = s.gen
        host.backend.spawn_shadow(p.rank, host.new_shadow)
    sampler = host.procs[0].sampler_state
    assert sampler is not None
    host.cursor.restore(sampler)
    if host.injector is not None:
        host.injector.n_chunks = host.procs[0].layout.n_chunks
    host.log("attach", step=step, detail=describe(host, host.checkpointer))
