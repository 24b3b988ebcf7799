"""The copies of the model taken while every rank is idle: the tier-2 snapshot
(Tier2Snapshot), and the periodic disk checkpoint, the fallback (BeginCheckpoint, each
writer's WriteShard, CheckpointDurable).
"""

from __future__ import annotations

import attrs

from leto.core import effects as fx
from leto.core import events as ev
from leto.core.chunk import NONE, is_uniform
from leto.core.config import Mutant
from leto.core.effects import Effect
from leto.core.errors import ProtocolError
from leto.core.handlers import Handlers, ModelView, _err, _rank_ok, registrar
from leto.core.recovery import RECOVERY
from leto.core.state import ClusterState
from leto.core.txn import TxnState

HANDLERS: Handlers = {}
_handler = registrar(HANDLERS)


# Tier2Snapshot ---------------------------------------------------------------------


def _g_t2(m: ModelView, s: ClusterState, e: ev.Tier2Snapshot) -> ProtocolError | None:
    if not RECOVERY.accepts(s.phase, e):
        return _err("recovery", s.phase, e, "")
    st = s.step[0]
    if st <= s.t2:
        return _err("recovery", s.phase, e, "the snapshot is current")
    for r in range(m.config.ranks):
        if s.pc[r] is not TxnState.IDLE or s.step[r] != st or not is_uniform(s.data[r], st):
            return _err("txn", s.pc[r], e, f"rank {r} is not idle at step {st}")
    return None


@_handler(ev.Tier2Snapshot)(_g_t2)
def _u_t2(
    m: ModelView, s: ClusterState, e: ev.Tier2Snapshot
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return attrs.evolve(s, t2=s.step[0], t2lost=frozenset()), (fx.TakeSnapshot(s.step[0]),)


# BeginCheckpoint / WriteShard / CheckpointDurable ----------------------------------


def _g_begin_ckpt(m: ModelView, s: ClusterState, e: ev.BeginCheckpoint) -> ProtocolError | None:
    if not RECOVERY.accepts(s.phase, e):
        return _err("recovery", s.phase, e, "")
    if s.cpend != NONE:
        return _err("checkpoint", s.phase, e, f"the checkpoint at step {s.cpend} is in progress")
    st = s.step[0]
    if st <= s.ckpt:
        return _err("checkpoint", s.phase, e, f"step {st} is not past the durable {s.ckpt}")
    for r in range(m.config.ranks):
        if s.pc[r] is not TxnState.IDLE or s.step[r] != st or not is_uniform(s.data[r], st):
            return _err("txn", s.pc[r], e, f"rank {r} is not idle at step {st}")
    return None


@_handler(ev.BeginCheckpoint)(_g_begin_ckpt)
def _u_begin_ckpt(
    m: ModelView, s: ClusterState, e: ev.BeginCheckpoint
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return attrs.evolve(s, cpend=s.step[0], ckdone=frozenset()), (fx.SaveCheckpoint(s.step[0]),)


def _g_shard(m: ModelView, s: ClusterState, e: ev.WriteShard) -> ProtocolError | None:
    err = _rank_ok(m, s, e)
    if err:
        return err
    r = e.rank
    if not m.active(s, r):
        return _err("keeper", s.phase, e, f"rank {r} is not a writer of generation {s.gen}")
    if s.cpend == NONE:
        return _err("checkpoint", s.phase, e, "no checkpoint in progress")
    if r in s.ckdone:
        return _err("checkpoint", s.phase, e, f"rank {r}'s shard is written already")
    return None


@_handler(ev.WriteShard)(_g_shard)
def _u_shard(
    m: ModelView, s: ClusterState, e: ev.WriteShard
) -> tuple[ClusterState, tuple[Effect, ...]]:
    # no effect: the writer did the work before the coordinator heard of it
    return attrs.evolve(s, ckdone=s.ckdone | {e.rank}), ()


def _g_durable(m: ModelView, s: ClusterState, e: ev.CheckpointDurable) -> ProtocolError | None:
    if not RECOVERY.accepts(s.phase, e):
        return _err("recovery", s.phase, e, "")
    if s.cpend == NONE:
        return _err("checkpoint", s.phase, e, "no checkpoint in progress")
    need = 1 if m.config.mutant is Mutant.EARLY_DURABLE else m.config.ranks
    if len(s.ckdone) < need:
        missing = sorted(set(range(m.config.ranks)) - s.ckdone)
        return _err("checkpoint", s.phase, e, f"writers {missing} have not finished")
    return None


@_handler(ev.CheckpointDurable)(_g_durable)
def _u_durable(
    m: ModelView, s: ClusterState, e: ev.CheckpointDurable
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return attrs.evolve(
        s,
        ckpt=s.cpend,
        ckmiss=frozenset(range(m.config.ranks)) - s.ckdone,
        cpend=NONE,
        ckdone=frozenset(),
    ), (fx.PublishCheckpoint(s.cpend),)
