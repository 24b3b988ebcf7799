"""The commit path, aggregated: CommitStep, ApplyStep and CloseRanks.

Each stands for a sequence of the chunk-level events (:mod:`leto.core.commit_handlers`;
leto.core.aggregate.expand) and must leave the state that sequence leaves, accepted
exactly where the sequence runs (leto.core.aggregate.check_refinement). They cost
O(ranks + nodes) per step, not O(ranks x chunks): every rank's guard reads its rows by
identity (uniform_row), and the rows they write are the shared ones.
"""

from __future__ import annotations

import attrs

from leto.core import effects as fx
from leto.core import events as ev
from leto.core.chunk import NONE, is_uniform, repeated, uniform_row
from leto.core.config import Aggregation
from leto.core.effects import Effect
from leto.core.errors import ProtocolError
from leto.core.handlers import Handlers, ModelView, _err, registrar
from leto.core.recovery import Phase
from leto.core.state import ClusterState
from leto.core.trainer import TrainerState
from leto.core.txn import CommitState, TxnState

HANDLERS: Handlers = {}
_handler = registrar(HANDLERS)


def _g_commit_step(m: ModelView, s: ClusterState, e: ev.CommitStep) -> ProtocolError | None:
    cfg = m.config
    R = cfg.ranks
    if s.phase is not Phase.RUNNING:
        return _err("recovery", s.phase, e, "training is paused during recovery")
    if e.step != s.committed + 1:
        return _err("commit", s.commit, e, f"the model's next step is {s.committed + 1}")
    v = s.committed
    if s.trainer.count(TrainerState.ALIVE) != R:
        r = next(q for q in range(R) if s.trainer[q] is not TrainerState.ALIVE)
        return _err("trainer", s.trainer[r], e, f"rank {r}'s trainer is not alive")
    if s.tgen.count(s.gen) != R:
        r = next(q for q in range(R) if s.tgen[q] != s.gen)
        return _err("keeper", s.phase, e, f"generation {s.tgen[r]} is fenced (current {s.gen})")
    if s.pc.count(TxnState.IDLE) != R:
        r = next(q for q in range(R) if s.pc[q] is not TxnState.IDLE)
        return _err("txn", s.pc[r], e, f"rank {r} is not idle")
    if s.step.count(v) != R:
        r = next(q for q in range(R) if s.step[q] != v)
        return _err("txn", s.pc[r], e, f"rank {r} is at step {s.step[r]}, not {v}")
    if v >= cfg.max_step:
        return _err("txn", TxnState.IDLE, e, f"training is done at step {cfg.max_step}")
    if v - s.t2 >= cfg.k:
        return _err("txn", TxnState.IDLE, e, "tier 2 lags K steps: waiting for the snapshot")
    return None


@_handler(ev.CommitStep)(_g_commit_step)
def _u_commit_step(
    m: ModelView, s: ClusterState, e: ev.CommitStep
) -> tuple[ClusterState, tuple[Effect, ...]]:
    R, new = m.config.ranks, e.step
    gpar = tuple(None if gp is None else uniform_row(new, len(gp)) for gp in s.gpar)
    return attrs.evolve(
        s,
        pc=(TxnState.PREPARED,) * R,
        grad=uniform_row(new, R),
        gpar=gpar,
        committed=new,
        prepared=frozenset(),
        commit=CommitState.OPEN,
    ), (fx.RecordCommit(new),)


def _g_apply_step(m: ModelView, s: ClusterState, e: ev.ApplyStep) -> ProtocolError | None:
    cfg = m.config
    if s.phase is not Phase.RUNNING:
        return _err("recovery", s.phase, e, "training is paused during recovery")
    if e.ranks[-1] >= cfg.ranks:
        return _err("cluster", s.phase, e, f"rank {e.ranks[-1]} out of range 0..{cfg.ranks - 1}")
    old = e.step - 1
    if len(e.ranks) == cfg.ranks and _all_ready(m, s, old):
        return _committed(m, s, e)
    for r in e.ranks:
        if s.trainer[r] is not TrainerState.ALIVE:
            return _err("trainer", s.trainer[r], e, f"rank {r}'s trainer is not alive")
        if s.tgen[r] != s.gen:
            return _err("keeper", s.phase, e, f"generation {s.tgen[r]} is fenced (current {s.gen})")
        if s.step[r] != old:
            why = f"rank {r} is at step {s.step[r]}: it can finish step {s.step[r] + 1} only"
            return _err("txn", s.pc[r], e, why)
        if s.pc[r] is not TxnState.PREPARED:
            return _err("txn", s.pc[r], e, f"rank {r} has not prepared (or began applying)")
        if not is_uniform(s.data[r], old) or not is_uniform(s.undo[r], NONE):
            return _err("chunk", s.pc[r], e, f"rank {r}'s chunks are not all clean at step {old}")
    return _committed(m, s, e)


def _all_ready(m: ModelView, s: ClusterState, old: int) -> bool:
    """Every rank ready to apply the step after ``old`` (the per-rank checks of
    ``ApplyStep``'s guard, counted over the whole tuples at once)."""
    R, C = m.config.ranks, m.config.chunks
    return (
        s.trainer.count(TrainerState.ALIVE) == R
        and s.tgen.count(s.gen) == R
        and s.step.count(old) == R
        and s.pc.count(TxnState.PREPARED) == R
        and s.data.count(uniform_row(old, C)) == R
        and s.undo.count(uniform_row(NONE, C)) == R
    )


def _committed(m: ModelView, s: ClusterState, e: ev.ApplyStep) -> ProtocolError | None:
    if m.aggregation is not Aggregation.UNCOMMITTED and s.committed != e.step:
        return _err("commit", s.commit, e, f"step {e.step} is not committed")
    return None


def _fold(
    p: tuple[tuple[int, ...], ...], members: list[int], new: int
) -> tuple[tuple[int, ...], ...]:
    """Node parity ``p`` with the columns of ``members`` at ``new`` in every chunk."""

    def row(x: tuple[int, ...]) -> tuple[int, ...]:
        out = list(x)
        for i in members:
            out[i] = new
        return uniform_row(new, len(out)) if out.count(new) == len(out) else tuple(out)

    if p and (p is repeated(p[0], len(p)) or p.count(p[0]) == len(p)):
        return repeated(row(p[0]), len(p))  # every chunk's row alike: fold once
    return tuple(row(x) for x in p)


@_handler(ev.ApplyStep)(_g_apply_step)
def _u_apply_step(
    m: ModelView, s: ClusterState, e: ev.ApplyStep
) -> tuple[ClusterState, tuple[Effect, ...]]:
    cfg = m.config
    new = e.step
    row = uniform_row(new, cfg.chunks)
    ranks = set(e.ranks)
    if len(ranks) == cfg.ranks:
        data = (row,) * cfg.ranks
        step = uniform_row(new, cfg.ranks)
        pc = (TxnState.TAIL,) * cfg.ranks
    else:
        data = tuple(row if r in ranks else d for r, d in enumerate(s.data))
        step = tuple(new if r in ranks else x for r, x in enumerate(s.step))
        pc = tuple(TxnState.TAIL if r in ranks else p for r, p in enumerate(s.pc))
    par = s.par
    if m.aggregation is not Aggregation.NO_PARITY_FOLD:
        touched: dict[int, list[int]] = {}
        for r in e.ranks:
            touched.setdefault(m.node_of[r], []).append(m.member[r])
        par = tuple(
            p if p is None or n not in touched else _fold(p, touched[n], new)
            for n, p in enumerate(s.par)
        )
    # no effect: the ranks did the work before the coordinator heard of it
    return attrs.evolve(s, data=data, step=step, pc=pc, par=par), ()


def _g_close_ranks(m: ModelView, s: ClusterState, e: ev.CloseRanks) -> ProtocolError | None:
    if e.ranks[-1] >= m.config.ranks:
        return _err(
            "cluster", s.phase, e, f"rank {e.ranks[-1]} out of range 0..{m.config.ranks - 1}"
        )
    if s.phase is not Phase.RUNNING:
        return _err("recovery", s.phase, e, "training is paused during recovery")
    R = m.config.ranks
    if (
        len(e.ranks) == R
        and s.pc.count(TxnState.TAIL) == R
        and s.trainer.count(TrainerState.ALIVE) == R
        and s.tgen.count(s.gen) == R
    ):
        return None  # every rank, each in its tail: the checks below, counted in C
    for r in e.ranks:
        if s.trainer[r] is not TrainerState.ALIVE:
            return _err("trainer", s.trainer[r], e, f"rank {r}'s trainer is not alive")
        if s.tgen[r] != s.gen:
            return _err("keeper", s.phase, e, f"generation {s.tgen[r]} is fenced (current {s.gen})")
        if s.pc[r] is not TxnState.TAIL:
            return _err("txn", s.pc[r], e, f"rank {r} is not in its loop tail")
    return None


@_handler(ev.CloseRanks)(_g_close_ranks)
def _u_close_ranks(
    m: ModelView, s: ClusterState, e: ev.CloseRanks
) -> tuple[ClusterState, tuple[Effect, ...]]:
    pc, tail = list(s.pc), list(s.tail)
    for r in e.ranks:
        pc[r] = TxnState.IDLE
        if m.aggregation is not Aggregation.OPEN_TAIL:
            tail[r] = s.step[r]
    return attrs.evolve(s, pc=tuple(pc), tail=tuple(tail)), tuple(
        fx.KeepProcessState(r, s.step[r]) for r in e.ranks
    )
