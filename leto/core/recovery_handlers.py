"""The recovery coordinator: detect a failed trainer, fence its generation, promote the
failed ranks' shadows, reconcile the survivors to one step (or fall back to the disk
checkpoint), rebuild the communicator and resume; or give up at the deadline.
"""

from __future__ import annotations

from typing import Any

import attrs

from leto.core import effects as fx
from leto.core import events as ev
from leto.core.chunk import GARBAGE, NONE, TORN, uniform_row
from leto.core.config import Mutant
from leto.core.effects import Effect
from leto.core.errors import ProtocolError
from leto.core.handlers import Handlers, ModelView, _err, _rank_ok, _set, registrar
from leto.core.reconcile import empty_grad_parity, reencoded_parity
from leto.core.recovery import RECOVERY, Kind, Phase
from leto.core.shadow import SHADOW, ShadowState
from leto.core.state import ClusterState
from leto.core.trainer import TRAINER, TrainerState
from leto.core.txn import COMMIT, TXN

HANDLERS: Handlers = {}
_handler = registrar(HANDLERS)


# Recovery coordinator --------------------------------------------------------------


def _phase_guard(m: ModelView, s: ClusterState, e: Any) -> ProtocolError | None:
    if not RECOVERY.accepts(s.phase, e):
        return _err("recovery", s.phase, e, "")
    return None


def _all_alive(m: ModelView, s: ClusterState, e: Any) -> ProtocolError | None:
    err = _phase_guard(m, s, e)
    if err:
        return err
    for r, t in enumerate(s.trainer):
        if t is not TrainerState.ALIVE:
            return _err("recovery", s.phase, e, f"rank {r}'s trainer is {t.name}")
    return None


def _g_detect(m: ModelView, s: ClusterState, e: ev.Detect) -> ProtocolError | None:
    err = _phase_guard(m, s, e)
    if err:
        return err
    if all(t is TrainerState.ALIVE for t in s.trainer):
        return _err("recovery", s.phase, e, "no failed trainer")
    if s.phase is Phase.PROMOTING and TrainerState.HUNG not in s.trainer:
        return _err("recovery", s.phase, e, "failed ranks are being promoted")
    return None


@_handler(ev.Detect)(_g_detect)
def _u_detect(
    m: ModelView, s: ClusterState, e: ev.Detect
) -> tuple[ClusterState, tuple[Effect, ...]]:
    failed = [r for r, t in enumerate(s.trainer) if t is not TrainerState.ALIVE]
    return attrs.evolve(s, phase=RECOVERY.next(s.phase, e)), (
        fx.Detected(failed, s.phase is not Phase.RUNNING),
    )


@_handler(ev.Fence)(_phase_guard)
def _u_fence(m: ModelView, s: ClusterState, e: ev.Fence) -> tuple[ClusterState, tuple[Effect, ...]]:
    trainer = list(s.trainer)
    stale = list(s.stale)
    for r, t in enumerate(s.trainer):
        if TRAINER.accepts(t, e):  # a hung trainer becomes a stale process
            trainer[r] = TRAINER.next(t, e)
            stale[r] = True
    gen = s.gen + 1
    # a checkpoint in progress is aborted: its writers are fenced
    abort: tuple[Effect, ...] = () if s.cpend == NONE else (fx.AbortCheckpoint(s.cpend),)
    return attrs.evolve(
        s,
        gen=gen,
        trainer=tuple(trainer),
        stale=tuple(stale),
        prepared=frozenset(),
        commit=COMMIT.next(s.commit, e),
        phase=RECOVERY.next(s.phase, e),
        cpend=NONE,
        ckdone=frozenset(),
    ), (fx.Fence(gen), fx.AbortCollectives(gen - 1), *abort)


def _g_give_up(m: ModelView, s: ClusterState, e: ev.GiveUp) -> ProtocolError | None:
    err = _phase_guard(m, s, e)
    if err:
        return err
    if m.config.mutant is Mutant.NO_TIMEOUT and s.phase is Phase.PROMOTING:
        return _err("recovery", s.phase, e, "mutant no_timeout: no deadline while promoting")
    return None


@_handler(ev.GiveUp)(_g_give_up)
def _u_give_up(
    m: ModelView, s: ClusterState, e: ev.GiveUp
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return attrs.evolve(s, phase=RECOVERY.next(s.phase, e)), (fx.JobFailed(s.phase.value, s.gen),)


def _g_promote(m: ModelView, s: ClusterState, e: ev.Promote) -> ProtocolError | None:
    err = _rank_ok(m, s, e) or _phase_guard(m, s, e)
    if err:
        return err
    r = e.rank
    if not TRAINER.accepts(s.trainer[r], e):
        return _err("trainer", s.trainer[r], e, "")
    if not SHADOW.accepts(s.shadow[r], e):
        return _err("shadow", s.shadow[r], e, "no shadow ready")
    return None


@_handler(ev.Promote)(_g_promote)
def _u_promote(
    m: ModelView, s: ClusterState, e: ev.Promote
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r = e.rank
    warm = s.shadow[r] is ShadowState.WARM
    return attrs.evolve(
        s,
        trainer=_set(s.trainer, r, TRAINER.next(s.trainer[r], e)),
        tgen=_set(s.tgen, r, s.gen),
        pc=_set(s.pc, r, TXN.next(s.pc[r], e)),
        shadow=_set(s.shadow, r, SHADOW.next(s.shadow[r], e)),
        promoted=s.promoted | {r},
    ), (fx.Promote(r, warm, s.gen), fx.SpawnShadow(r))


_handler(ev.EndPromote)(_all_alive)(
    lambda m, s, e: (attrs.evolve(s, phase=RECOVERY.next(s.phase, e)), ())
)


def _g_reconcile(m: ModelView, s: ClusterState, e: Any) -> ProtocolError | None:
    err = _phase_guard(m, s, e)
    if err:
        return err
    fallback = m.plan(s).fallback
    if isinstance(e, ev.Reconcile) and fallback:
        return _err("recovery", s.phase, e, "the loss is beyond both tiers: fall back")
    if isinstance(e, ev.GoFallback) and not fallback:
        return _err("recovery", s.phase, e, "recoverable in place: no fallback")
    return None


def _recovered(m: ModelView, s: ClusterState, e: Any, target: int, kind: Kind) -> ClusterState:
    cfg = m.config
    if cfg.mutant is Mutant.NO_UNDO and isinstance(e, ev.Reconcile):
        data = tuple(tuple(GARBAGE if d == TORN else target for d in row) for row in s.data)
    elif isinstance(e, ev.RestoreCheckpoint) and s.ckmiss:
        # a writer's missing shard (only the early_durable mutant leaves one) loads
        # bytes of no step
        data = tuple(
            uniform_row(GARBAGE if r in s.ckmiss else target, cfg.chunks) for r in range(cfg.ranks)
        )
    else:
        data = (uniform_row(target, cfg.chunks),) * cfg.ranks
    return attrs.evolve(
        s,
        data=data,
        undo=(uniform_row(NONE, cfg.chunks),) * cfg.ranks,
        grad=(NONE,) * cfg.ranks,
        par=reencoded_parity(cfg.groups, cfg.chunks, target),
        gpar=empty_grad_parity(cfg.groups),
        # an intact snapshot (no block lost) is kept: it is at most K steps back and
        # still covers a node loss; one that lost blocks is retaken at the target
        t2=s.t2 if isinstance(e, ev.Reconcile) and not s.t2lost else target,
        t2lost=frozenset(),
        committed=target,
        prepared=frozenset(),
        commit=COMMIT.next(s.commit, e),
        target=target,
        kind=kind,
        loss=s.committed - target,
        phase=RECOVERY.next(s.phase, e),
    )


@_handler(ev.Reconcile)(_g_reconcile)
def _u_reconcile(
    m: ModelView, s: ClusterState, e: ev.Reconcile
) -> tuple[ClusterState, tuple[Effect, ...]]:
    p = m.plan(s)
    assert p.target is not None
    effects: tuple[Effect, ...] = tuple(
        fx.RunRepair(x.what, x.rank, x.chunk, x.version, x.count) for x in p.repairs
    ) + (fx.Reconciled(p.target, p.kind.value, p.reason),)
    return _recovered(m, s, e, p.target, p.kind), effects


@_handler(ev.GoFallback)(_g_reconcile)
def _u_fallback(
    m: ModelView, s: ClusterState, e: ev.GoFallback
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return attrs.evolve(s, phase=RECOVERY.next(s.phase, e)), (fx.Fallback(m.plan(s).reason),)


@_handler(ev.RestoreCheckpoint)(_phase_guard)
def _u_restore(
    m: ModelView, s: ClusterState, e: ev.RestoreCheckpoint
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return _recovered(m, s, e, s.ckpt, Kind.CKPT), (fx.LoadCheckpoint(s.ckpt),)


@_handler(ev.Rebuild)(_all_alive)
def _u_rebuild(
    m: ModelView, s: ClusterState, e: ev.Rebuild
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return attrs.evolve(s, tgen=(s.gen,) * m.config.ranks, phase=RECOVERY.next(s.phase, e)), (
        fx.RebuildCommunicator(s.gen),
    )


@_handler(ev.Resume)(_all_alive)
def _u_resume(
    m: ModelView, s: ClusterState, e: ev.Resume
) -> tuple[ClusterState, tuple[Effect, ...]]:
    R, target = m.config.ranks, s.target
    stale_shadow = m.config.mutant is Mutant.STALE_SHADOW
    step = tuple(0 if stale_shadow and r in s.promoted else target for r in range(R))
    # every rank resumes with the process state of the target after its loop tail: the
    # closed state its agent kept (or the snapshot's, the checkpoint's), else the closed
    # state of target - 1 with the tail replayed; the mutant restores the open state a
    # rank that finished the target sent (before its tail), not replayed
    stale_tail = m.config.mutant is Mutant.STALE_TAIL
    tail = tuple(
        step[r] if stale_shadow and r in s.promoted  # the shadow's own state, all of it
        else target - 1 if stale_tail and s.tail[r] < target <= s.step[r]
        else target
        for r in range(R)
    )  # fmt: skip
    return attrs.evolve(
        s,
        step=step,
        tail=tail,
        pc=tuple(TXN.next(p, e) for p in s.pc),
        target=NONE,
        promoted=frozenset(),
        mlost=frozenset(),
        nlost=frozenset(),
        phase=RECOVERY.next(s.phase, e),
    ), (fx.Resume(s.target, s.gen),)
