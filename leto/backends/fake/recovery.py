"""Recovery on the simulated ranks: the core's recovery events fed in its order, and
its reconcile plan carried out on real tensors.

The core decides every step of a recovery (:func:`leto.core.schedule.next_event`: which
event next; :meth:`~leto.core.cluster.ClusterModel.plan`: roll forward, roll back, or
restore tier 2; which chunks tier 1 rebuilds). This module only gathers what an event
needs first and runs the plan through the one recovery executor
(:mod:`leto.retained.recovery`), then checks every chunk and rebuilds the redundancy
before anything resumes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from leto.core import effects as fx
from leto.core import events as ev
from leto.core import schedule
from leto.core.chunk import LOST
from leto.core.cluster import ClusterState, Effect
from leto.core.recovery import Kind, Phase
from leto.retained import recovery as rx
from leto.retained.process_state import restore_buffers, step_scheduler

from . import integrity, snapshots, tier1
from .backend import RECOVERY_WHERE
from .layouts import ensure
from .rank import UnrecoverableError

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["lost_message", "note_recovered", "rebuild_redundancy", "reconcile", "run"]


def run(eng: Engine) -> None:
    """Feed the recovery the core schedules until every rank runs again (or raise).

    The order is the core's (:func:`leto.core.schedule.next_event`); the engine
    only gathers what an event needs first: before ``Reconcile`` it checks every
    rank's retained memory (a checksum failure is a lost memory), and a shadow
    still spawning warms at once (simulated ranks start instantly).
    """
    V = eng._current_step
    for _ in range(10_000):
        s = eng.state
        if s.phase is Phase.RECONCILING:
            bad = integrity.scan(eng, s)
            if bad:
                for r, why in bad.items():
                    integrity.failure(eng, r, why)
                continue
        e = schedule.next_event(eng.model, s)
        if e is None:
            break
        if isinstance(e, ev.GoFallback) and eng.checkpointer is None:
            reason = eng.model.plan(s).reason
            eng._log("unrecoverable", step=V, detail=reason)
            raise UnrecoverableError(lost_message(eng, s, reason))
        name = type(e).__name__
        if eng.injector is not None and name in RECOVERY_WHERE:
            hits = [
                f for r in range(eng.W) for f in eng.injector.take(r, V, "recovery", None, name)
            ]
            if hits:
                eng.points.fire(hits)
                continue
        eng.feed(e)
        if isinstance(e, ev.Fence):
            for r in sorted(eng.stale):  # the fenced process wakes up and tries to write
                eng._try(ev.StaleWrite(r, 0))
    else:  # pragma: no cover
        raise RuntimeError("recovery did not end")
    eng._warm_shadows()


def reconcile(
    eng: Engine, before: ClusterState, after: ClusterState, effects: tuple[Effect, ...]
) -> None:
    """The ``Reconcile`` event: its plan (``RunRepair`` effects, then ``Reconciled``)
    carried out as a whole, on every rank, then the redundancy rebuilt at the target."""
    target, kind = after.target, after.kind
    lost = {r for r in range(eng.W) if all(d == LOST for d in before.data[r])}
    for r in range(eng.W):
        ensure(eng, r, r in lost)
    reason = next((a.reason for a in effects if isinstance(a, fx.Reconciled)), "")
    rec = eng._rec
    if kind is Kind.TIER2:
        snapshots.restore(eng, target)
        eng.stats["snapshot_restores"] += 1
    else:
        # a run of chunks (RunRepair.count) is each chunk's repair, in order
        chunk_level = [x for a in effects if isinstance(a, fx.RunRepair) for x in a.expand()]
        for a in chunk_level:
            if a.what == "tier1":
                tier1.decode_chunk(eng, a.rank, a.chunk, a.step)
                eng.stats["chunks_repaired_from_parity"] += 1
                if rec:
                    rec.tier1_chunks += 1
            elif a.what == "grad-tier1":
                tier1.decode_grads(eng, a.rank, a.step)
                eng.stats["grad_blocks_repaired_from_parity"] += 1
                if rec:
                    rec.tier1_grads += 1
        rolled, dropped = 0, False
        for r in range(eng.W):
            n, d = _settle(eng, r, target)
            rolled += n
            dropped = dropped or d
        eng.stats["chunks_rolled_forward"] += rolled
        if rolled:
            eng.stats["rolled_forward"] += 1
        if dropped or kind is Kind.BACK:
            eng.stats["rolled_back"] += 1
        if rec:
            rec.forward_chunks += rolled
            rec.dropped = rec.dropped or dropped or kind is Kind.BACK
    # the tier-2 snapshot is retaken only if it lost blocks (the model's rule)
    rebuild_redundancy(eng, target, snapshot=bool(before.t2lost))
    note_recovered(eng, kind.value, target, after.loss, reason)


def _settle(eng: Engine, r: int, target: int) -> tuple[int, bool]:
    """Bring rank ``r`` to ``target`` (:func:`leto.retained.recovery.settle`).
    Returns (chunks rolled forward, uncommitted gradients dropped)."""
    p = eng.procs[r]
    assert p.ropt is not None
    store = eng._store(r)
    done = rx.settle(
        p.layout,
        p.ropt,
        target,
        history=store.process_states.get(r, {}),
        pending=rx.load_pending(store.pending.get(r)),
        load_ps=p.load_ps,
        step_scheduler=lambda: step_scheduler(p.replica.scheduler),
        who=f"rank {r}",
    )
    if done.rng is not None:
        p.rng = done.rng
        p.sampler_state = done.sampler
    if done.buffers is not None:
        restore_buffers(p.replica.model, done.buffers)
    return done.forward, done.dropped


def note_recovered(eng: Engine, kind: str, target: int, loss: int, reason: str = "") -> None:
    """What the recovery under way did, for its timeline entry at Resume."""
    if eng._rec is not None:
        eng._rec.kind = kind
        eng._rec.target = target
        eng._rec.loss = loss
        eng._rec.reason = reason


def rebuild_redundancy(eng: Engine, target: int, *, snapshot: bool = True) -> None:
    """Verify every chunk, then rebuild the redundancy at ``target``: process states,
    tier-1 parity, empty gradient parity, and (``snapshot``) the tier-2 snapshot."""
    for p in eng.procs:
        rx.check_resumable(p.layout, p.ropt, target, f"rank {p.rank}")
    for n in range(eng.backend.nodes):
        eng.backend.node_store(n).pending.clear()
    for p in eng.procs:
        eng._store(p.rank).process_states[p.rank] = {target: p.ps_json(target)}
    tier1.encode_all(eng, target)
    if snapshot:
        snapshots.take(eng, target)


def lost_message(eng: Engine, s: ClusterState, reason: str) -> str:
    """Why training stops: what was lost, beyond which tier, and that no checkpoint
    is configured to fall back to."""
    topo = eng.backend.topology
    parts = []
    if s.nlost:
        parts.append(
            f"node(s) {sorted(s.nlost)} (their ranks' retained memory, their tier-1 parity "
            "and their tier-2 snapshot blocks)"
        )
    lost_nodes_ranks = {r for n in s.nlost for r in topo.ranks_of(n)}
    mem = sorted(set(s.mlost) - lost_nodes_ranks)
    if mem:
        parts.append(f"the retained memory of rank(s) {mem}")
    what = "; ".join(parts) or "retained state"
    return (
        f"leto: cannot recover in place from step {s.committed}: lost {what}. "
        f"Why: {reason}; tier 2's single cross-node parity rebuilds at most one node "
        f"(snapshot blocks lost on nodes {sorted(s.t2lost)}). No checkpoint is configured "
        "(set checkpoint_dir), so training stops here instead of resuming on wrong "
        "state; the retained state was left as it was."
    )
