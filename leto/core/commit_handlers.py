"""The commit path, chunk by chunk: a rank computes, reduces and prepares its step, the
coordinator decides, the rank applies its chunks (each saved to undo, written, its parity
updated) and finishes, then closes its loop tail.

:func:`_trainer_guard` is what every rank's event needs: a valid rank, the cluster
running, the rank's trainer alive and of the current generation, and its transaction
machine accepting the event.
"""

from __future__ import annotations

from typing import Any

import attrs

from leto.core import effects as fx
from leto.core import events as ev
from leto.core.chunk import NONE, TORN, ChunkState, classify
from leto.core.config import Mutant
from leto.core.effects import Effect
from leto.core.errors import ProtocolError
from leto.core.handlers import Handlers, ModelView, _err, _rank_ok, _set, _set2, registrar
from leto.core.recovery import RECOVERY, Phase
from leto.core.state import ClusterState
from leto.core.trainer import TrainerState
from leto.core.txn import COMMIT, TXN, TxnState

HANDLERS: Handlers = {}
_handler = registrar(HANDLERS)


def _trainer_guard(m: ModelView, s: ClusterState, e: Any) -> ProtocolError | None:
    """Rank index valid, the cluster running, and the writer of the current generation."""
    err = _rank_ok(m, s, e)
    if err:
        return err
    r = e.rank
    if s.phase is not Phase.RUNNING:
        return _err("recovery", s.phase, e, "training is paused during recovery")
    if s.trainer[r] is not TrainerState.ALIVE:
        return _err("trainer", s.trainer[r], e, f"rank {r}'s trainer is not alive")
    if s.tgen[r] != s.gen:
        return _err("keeper", s.phase, e, f"generation {s.tgen[r]} is fenced (current {s.gen})")
    if not TXN.accepts(s.pc[r], e):
        return _err("txn", s.pc[r], e, "")
    return None


# Compute -------------------------------------------------------------------------


def _g_compute(m: ModelView, s: ClusterState, e: ev.Compute) -> ProtocolError | None:
    err = _trainer_guard(m, s, e)
    if err:
        return err
    if s.step[e.rank] >= m.config.max_step:
        return _err("txn", s.pc[e.rank], e, f"training is done at step {m.config.max_step}")
    if s.step[e.rank] - s.t2 >= m.config.k:
        return _err("txn", s.pc[e.rank], e, "tier 2 lags K steps: waiting for the snapshot")
    return None


@_handler(ev.Compute)(_g_compute)
def _u_compute(
    m: ModelView, s: ClusterState, e: ev.Compute
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r = e.rank
    return attrs.evolve(s, pc=_set(s.pc, r, TxnState.COMPUTED)), (
        fx.ForwardBackward(r, s.step[r] + 1),
    )


# Reduce --------------------------------------------------------------------------


def _g_reduce(m: ModelView, s: ClusterState, e: ev.Reduce) -> ProtocolError | None:
    err = _trainer_guard(m, s, e)
    if err:
        return err
    st = s.step[e.rank]
    in_collective = (TxnState.COMPUTED, TxnState.REDUCED, TxnState.PREPARED)
    for q in range(m.config.ranks):
        if not (
            s.trainer[q] is TrainerState.ALIVE
            and s.tgen[q] == s.gen
            and s.step[q] == st
            and s.pc[q] in in_collective
        ):
            return _err("txn", s.pc[e.rank], e, f"rank {q} is not in the gradient collective")
    return None


@_handler(ev.Reduce)(_g_reduce)
def _u_reduce(
    m: ModelView, s: ClusterState, e: ev.Reduce
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r = e.rank
    nxt = s.step[r] + 1
    return attrs.evolve(s, pc=_set(s.pc, r, TxnState.REDUCED), grad=_set(s.grad, r, nxt)), (
        fx.AllReduceGradients(r, nxt),
    )


# Prepare -------------------------------------------------------------------------


@_handler(ev.Prepare)(_trainer_guard)
def _u_prepare(
    m: ModelView, s: ClusterState, e: ev.Prepare
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r = e.rank
    n = m.node_of[r]
    gp = s.gpar[n]
    gpar = s.gpar if gp is None else _set(s.gpar, n, _set(gp, m.member[r], s.grad[r]))
    return attrs.evolve(
        s,
        pc=_set(s.pc, r, TxnState.PREPARED),
        gpar=gpar,
        prepared=s.prepared | {r},
        commit=COMMIT.next(s.commit, e),
    ), (
        fx.WriteGradientParity(r, s.grad[r]),
        fx.Vote(r, s.grad[r]),
    )


# Decide --------------------------------------------------------------------------


def _g_decide(m: ModelView, s: ClusterState, e: ev.Decide) -> ProtocolError | None:
    if not RECOVERY.accepts(s.phase, e):
        return _err("recovery", s.phase, e, "")
    if not COMMIT.accepts(s.commit, e):
        return _err("commit", s.commit, e, "no vote yet")
    need = 1 if m.config.mutant is Mutant.EARLY_COMMIT else m.config.ranks
    if len(s.prepared) < need:
        missing = sorted(set(range(m.config.ranks)) - s.prepared)
        return _err("commit", s.commit, e, f"ranks {missing} have not prepared")
    if any(s.grad[r] != s.committed + 1 for r in s.prepared):
        return _err("commit", s.commit, e, "a vote is not for the next step")
    return None


@_handler(ev.Decide)(_g_decide)
def _u_decide(
    m: ModelView, s: ClusterState, e: ev.Decide
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return attrs.evolve(
        s, committed=s.committed + 1, prepared=frozenset(), commit=COMMIT.next(s.commit, e)
    ), (fx.RecordCommit(s.committed + 1),)


# BeginChunk / EndChunk / ParityChunk / Finish -----------------------------------------


def _g_begin(m: ModelView, s: ClusterState, e: ev.BeginChunk) -> ProtocolError | None:
    err = _trainer_guard(m, s, e)
    if err:
        return err
    r, c = e.rank, e.chunk
    st = s.step[r]
    if s.committed != st + 1:
        return _err("commit", s.commit, e, f"step {st + 1} is not committed")
    state = classify(s.data[r][c], s.undo[r][c])
    if not m.chunk_table.accepts(state, e) or s.data[r][c] != st:
        return _err("chunk", state, e, f"chunk is not clean at step {st}")
    for lower in range(c):
        if s.data[r][lower] != st + 1 or s.undo[r][lower] != NONE:
            return _err("chunk", state, e, f"chunk {lower} is not done yet (chunks apply in order)")
    return None


@_handler(ev.BeginChunk)(_g_begin)
def _u_begin(
    m: ModelView, s: ClusterState, e: ev.BeginChunk
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r, c = e.rank, e.chunk
    return attrs.evolve(
        s,
        undo=_set2(s.undo, r, c, s.data[r][c]),
        data=_set2(s.data, r, c, TORN),
        pc=_set(s.pc, r, TXN.next(s.pc[r], e)),
    ), (
        fx.SaveUndo(r, c, s.data[r][c]),
        fx.ApplyChunk(r, c, s.step[r] + 1),
    )


def _g_end(m: ModelView, s: ClusterState, e: ev.EndChunk) -> ProtocolError | None:
    err = _trainer_guard(m, s, e)
    if err:
        return err
    state = classify(s.data[e.rank][e.chunk], s.undo[e.rank][e.chunk])
    if not m.chunk_table.accepts(state, e):
        return _err("chunk", state, e, "")
    return None


@_handler(ev.EndChunk)(_g_end)
def _u_end(
    m: ModelView, s: ClusterState, e: ev.EndChunk
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r, c = e.rank, e.chunk
    return attrs.evolve(s, data=_set2(s.data, r, c, s.step[r] + 1)), (
        fx.ChunkWritten(r, c, s.step[r] + 1),
    )


def _g_parity(m: ModelView, s: ClusterState, e: ev.ParityChunk) -> ProtocolError | None:
    err = _trainer_guard(m, s, e)
    if err:
        return err
    r, c = e.rank, e.chunk
    state = classify(s.data[r][c], s.undo[r][c])
    if not m.chunk_table.accepts(state, e):
        return _err("chunk", state, e, "")
    if state is ChunkState.WRITING:  # the parity-first mutant: once per chunk
        par = s.par[m.node_of[r]]
        if par is not None and par[c][m.member[r]] == s.step[r] + 1:
            return _err("chunk", state, e, "parity already written")
    return None


@_handler(ev.ParityChunk)(_g_parity)
def _u_parity(
    m: ModelView, s: ClusterState, e: ev.ParityChunk
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r, c = e.rank, e.chunk
    n = m.node_of[r]
    new = s.step[r] + 1
    p = s.par[n]
    par = s.par if p is None else _set(s.par, n, _set2(p, c, m.member[r], new))
    torn = s.data[r][c] == TORN
    undo = s.undo if torn else _set2(s.undo, r, c, NONE)
    effects: tuple[Effect, ...] = (fx.UpdateParity(r, c, new),)
    if not torn:
        effects += (fx.ReleaseUndo(r, c),)
    return attrs.evolve(s, par=par, undo=undo), effects


def _g_finish(m: ModelView, s: ClusterState, e: ev.Finish) -> ProtocolError | None:
    err = _trainer_guard(m, s, e)
    if err:
        return err
    r = e.rank
    new = s.step[r] + 1
    if any(d != new for d in s.data[r]) or any(u != NONE for u in s.undo[r]):
        return _err("txn", s.pc[r], e, "not every chunk is done")
    return None


@_handler(ev.Finish)(_g_finish)
def _u_finish(
    m: ModelView, s: ClusterState, e: ev.Finish
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r = e.rank
    return attrs.evolve(
        s, step=_set(s.step, r, s.step[r] + 1), pc=_set(s.pc, r, TXN.next(s.pc[r], e))
    ), (fx.StepDone(r, s.step[r] + 1),)


# Close -----------------------------------------------------------------------------


@_handler(ev.Close)(_trainer_guard)
def _u_close(m: ModelView, s: ClusterState, e: ev.Close) -> tuple[ClusterState, tuple[Effect, ...]]:
    r = e.rank
    return attrs.evolve(
        s, pc=_set(s.pc, r, TXN.next(s.pc[r], e)), tail=_set(s.tail, r, s.step[r])
    ), (fx.KeepProcessState(r, s.step[r]),)
