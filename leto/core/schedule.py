"""Which recovery event comes next: one scheduler for every backend.

The cluster model (:mod:`leto.core.cluster`) says which events are *legal*; this
module says which one a recovery *takes*. Every backend's recovery driver (the fake
engine, the gloo coordinator, the CUDA backend next) asks :func:`next_events` and
feeds what it returns, so the order of a recovery is decided once, here, and the
explicit-state checker verifies it (:func:`leto.core.checker.check`, "Scheduled"):
from every reachable state, feeding the scheduled events reaches RUNNING with every
trainer alive, and every scheduled event is enabled where it is scheduled.

What a backend still decides is *when* it has the inputs an event needs: the gloo
coordinator feeds ``Reconcile`` only once every trainer reported its retained
state; it feeds ``ShadowWarm(r)`` when the shadow reports warm rather than at once.
Those are observations of the world, not protocol decisions.
"""

from __future__ import annotations

from leto.core import events as ev
from leto.core.cluster import ClusterModel, ClusterState
from leto.core.recovery import Phase
from leto.core.shadow import ShadowState
from leto.core.trainer import TrainerState

__all__ = ["in_recovery", "next_event", "next_events"]


def in_recovery(s: ClusterState) -> bool:
    """A recovery is under way or due (a trainer is not alive), and the job has not
    failed."""
    if s.phase is Phase.FAILED:
        return False
    return s.phase is not Phase.RUNNING or any(t is not TrainerState.ALIVE for t in s.trainer)


def next_events(
    model: ClusterModel, s: ClusterState, *, overdue: bool = False
) -> tuple[ev.Event, ...]:
    """The events the recovery takes next from ``s``, in order; ``()`` when none is due.

    ``overdue``: the backend observed the recovery deadline pass (the clock is the
    backend's; the decision is this one): a recovery under way gives up, whatever it
    waits for. A failure seen while running is detected first, so the deadline only
    ends a recovery that started.

    More than one only while promoting: every dead rank whose shadow is not still
    spawning can be promoted at once (each ``Promote`` leaves the others enabled),
    then each rank whose shadow is spawning needs its ``ShadowWarm`` first.
    """
    if not in_recovery(s):
        return ()
    if overdue and s.phase is not Phase.RUNNING:
        return (ev.GiveUp(),)
    alive = all(t is TrainerState.ALIVE for t in s.trainer)
    if not alive and s.phase not in (Phase.FENCING, Phase.PROMOTING):
        return (ev.Detect(),)  # a failure while running, or during a recovery: (re)start
    if s.phase is Phase.FENCING:
        return (ev.Fence(),)
    if s.phase is Phase.PROMOTING:
        if TrainerState.HUNG in s.trainer:
            return (ev.Detect(),)  # a hang during promotion restarts the recovery
        dead = [r for r, t in enumerate(s.trainer) if t is TrainerState.DEAD]
        if not dead:
            return (ev.EndPromote(),)
        spawning = [r for r in dead if s.shadow[r] is ShadowState.SPAWNING]
        return tuple(ev.Promote(r) for r in dead if r not in spawning) + tuple(
            ev.ShadowWarm(r) for r in spawning
        )
    if s.phase is Phase.RECONCILING:
        return (ev.GoFallback(),) if model.plan(s).fallback else (ev.Reconcile(),)
    if s.phase is Phase.FALLBACK:
        return (ev.RestoreCheckpoint(),)
    if s.phase is Phase.REBUILDING:
        return (ev.Rebuild(),)
    if s.phase is Phase.RESUMING:
        return (ev.Resume(),)
    raise AssertionError(f"no recovery event scheduled in phase {s.phase.name}")  # unreachable


def next_event(model: ClusterModel, s: ClusterState, *, overdue: bool = False) -> ev.Event | None:
    """The first of :func:`next_events`, or None when no recovery is due."""
    nxt = next_events(model, s, overdue=overdue)
    return nxt[0] if nxt else None
