"""What happens to the job from outside the protocol: a shadow warmed or its memory
reclaimed, the faults (a trainer crashes or hangs, a rank's memory or a whole node is
lost, each counted against the model's fault budget), and a fenced process of an old
generation writing to the keeper.
"""

from __future__ import annotations

from typing import Any

import attrs

from leto.core import effects as fx
from leto.core import events as ev
from leto.core.chunk import CHUNK, GARBAGE, LOST, NONE, ChunkState, classify
from leto.core.config import Mutant
from leto.core.effects import Effect
from leto.core.errors import ProtocolError
from leto.core.handlers import Handlers, ModelView, _err, _rank_ok, _set, _set2, registrar
from leto.core.shadow import SHADOW, ShadowState
from leto.core.state import ClusterState
from leto.core.trainer import TRAINER

HANDLERS: Handlers = {}
_handler = registrar(HANDLERS)


# Shadows ---------------------------------------------------------------------------


def _shadow_guard(m: ModelView, s: ClusterState, e: Any) -> ProtocolError | None:
    err = _rank_ok(m, s, e)
    if err:
        return err
    if isinstance(e, ev.ShadowReclaim) and not m.config.reclaim:
        return _err("shadow", s.shadow[e.rank], e, "memory reclaim is off")
    if not SHADOW.accepts(s.shadow[e.rank], e):
        return _err("shadow", s.shadow[e.rank], e, "")
    return None


def _u_shadow(m: ModelView, s: ClusterState, e: Any) -> tuple[ClusterState, tuple[Effect, ...]]:
    r = e.rank
    new = SHADOW.next(s.shadow[r], e)
    effect = fx.WarmShadow(r) if new is ShadowState.WARM else fx.ReclaimShadow(r)
    return attrs.evolve(s, shadow=_set(s.shadow, r, new)), (effect,)


_handler(ev.ShadowWarm)(_shadow_guard)(_u_shadow)
_handler(ev.ShadowReclaim)(_shadow_guard)(_u_shadow)


# Faults ----------------------------------------------------------------------------


def _fault_budget(m: ModelView, s: ClusterState, e: Any, kind: str) -> ProtocolError | None:
    if kind not in m.config.faults:
        return _err("fault", s.phase, e, f"{kind} faults are not in this model")
    if s.faults >= m.config.max_faults:
        return _err("fault", s.phase, e, f"fault budget {m.config.max_faults} spent")
    return None


def _g_trainer_fault(m: ModelView, s: ClusterState, e: Any) -> ProtocolError | None:
    err = _rank_ok(m, s, e) or _fault_budget(
        m, s, e, "crash" if isinstance(e, ev.Crash) else "hang"
    )
    if err:
        return err
    if not TRAINER.accepts(s.trainer[e.rank], e):
        return _err("trainer", s.trainer[e.rank], e, "")
    return None


def _u_trainer_fault(
    m: ModelView, s: ClusterState, e: Any
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r = e.rank
    return attrs.evolve(
        s, trainer=_set(s.trainer, r, TRAINER.next(s.trainer[r], e)), faults=s.faults + 1
    ), (fx.Crash(r) if isinstance(e, ev.Crash) else fx.Hang(r),)


_handler(ev.Crash)(_g_trainer_fault)(_u_trainer_fault)
_handler(ev.Hang)(_g_trainer_fault)(_u_trainer_fault)


def _lose_rank_memory(s: ClusterState, r: int, e: Any) -> dict[str, Any]:
    C = len(s.data[r])
    return {
        "data": _set(s.data, r, (LOST,) * C),
        "undo": _set(s.undo, r, (NONE,) * C),
        "grad": _set(s.grad, r, LOST),
        "trainer": _set(s.trainer, r, TRAINER.next(s.trainer[r], e)),
        "mlost": s.mlost | {r},
    }


def _g_lose_memory(m: ModelView, s: ClusterState, e: ev.LoseMemory) -> ProtocolError | None:
    err = _rank_ok(m, s, e) or _fault_budget(m, s, e, "lose_memory")
    if err:
        return err
    if all(d == LOST for d in s.data[e.rank]):
        return _err("chunk", ChunkState.LOST, e, "already lost")
    return None


@_handler(ev.LoseMemory)(_g_lose_memory)
def _u_lose_memory(
    m: ModelView, s: ClusterState, e: ev.LoseMemory
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return attrs.evolve(s, faults=s.faults + 1, **_lose_rank_memory(s, e.rank, e)), (
        fx.LoseMemory(e.rank),
    )


def _g_lose_node(m: ModelView, s: ClusterState, e: ev.LoseNode) -> ProtocolError | None:
    if e.node >= m.config.topology.nodes:
        return _err("cluster", s.phase, e, f"node {e.node} out of range")
    err = _fault_budget(m, s, e, "lose_node")
    if err:
        return err
    if e.node in s.nlost:
        return _err("fault", s.phase, e, "node already lost in this recovery")
    return None


@_handler(ev.LoseNode)(_g_lose_node)
def _u_lose_node(
    m: ModelView, s: ClusterState, e: ev.LoseNode
) -> tuple[ClusterState, tuple[Effect, ...]]:
    n = e.node
    for r in m.config.groups[n]:
        s = attrs.evolve(
            s,
            shadow=_set(s.shadow, r, SHADOW.next(s.shadow[r], e)),
            stale=_set(s.stale, r, False),
            **_lose_rank_memory(s, r, e),
        )
    return attrs.evolve(
        s,
        par=_set(s.par, n, None),
        gpar=_set(s.gpar, n, None),
        t2lost=s.t2lost | {n},
        nlost=s.nlost | {n},
        faults=s.faults + 1,
    ), (fx.LoseNode(n),)


# Keeper fencing --------------------------------------------------------------------


def _g_stale(m: ModelView, s: ClusterState, e: ev.StaleWrite) -> ProtocolError | None:
    err = _rank_ok(m, s, e)
    if err:
        return err
    if not s.stale[e.rank]:
        return _err("keeper", s.phase, e, f"rank {e.rank} has no process of an old generation")
    return None


@_handler(ev.StaleWrite)(_g_stale)
def _u_stale(
    m: ModelView, s: ClusterState, e: ev.StaleWrite
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r, c = e.rank, e.chunk
    stale = _set(s.stale, r, False)
    state = classify(s.data[r][c], s.undo[r][c])
    if m.config.mutant is Mutant.NO_FENCING and CHUNK.accepts(state, e):
        return attrs.evolve(
            s,
            stale=stale,
            data=_set2(s.data, r, c, GARBAGE),
            undo=_set2(s.undo, r, c, NONE),
            stale_writes=s.stale_writes + 1,
        ), (fx.StaleWriteAccepted(r, c),)
    return attrs.evolve(s, stale=stale), (
        fx.RefuseStaleWrite(r, c),
        fx.KillStale(r),
    )
