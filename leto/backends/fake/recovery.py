"""Recovery on the simulated ranks: the core's recovery events fed in its order, and
its reconcile plan carried out on real tensors.

The core decides every step of a recovery (:func:`leto.core.schedule.next_event`: which
event next; :meth:`~leto.core.cluster.ClusterModel.plan`: roll forward, roll back, or
restore tier 2; which chunks tier 1 rebuilds). This module only gathers what an event
needs first and runs the plan through the one plan interpreter
(:func:`leto.retained.recovery.carry_out`, over this module's ``_Ops``: every simulated
rank at once, tier 1 as parity), then checks every chunk and rebuilds the redundancy
before anything resumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from leto.core import effects as fx
from leto.core import events as ev
from leto.core import schedule
from leto.core.chunk import LOST
from leto.core.cluster import ClusterState, Effect
from leto.core.reconcile import Plan, Repair, expand_repairs
from leto.core.recovery import Kind, Phase
from leto.retained import recovery as rx
from leto.retained.process_state import restore_buffers, step_scheduler
from leto.retained.recovery import IntegrityError

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
    repairs = tuple(a.repair() for a in effects if isinstance(a, fx.RunRepair))
    done = rx.carry_out(Plan(target, kind, repairs, reason), _Ops(eng))
    if kind is not Kind.TIER2:
        eng.stats["chunks_repaired_from_parity"] += done.chunks_repaired_tier1
        eng.stats["grad_blocks_repaired_from_parity"] += done.grads_repaired_tier1
        rolled = done.chunks_rolled_forward
        eng.stats["chunks_rolled_forward"] += rolled
        if rolled:
            eng.stats["rolled_forward"] += 1
        if done.dropped or kind is Kind.BACK:
            eng.stats["rolled_back"] += 1
        rec = eng._rec
        if rec:
            rec.tier1_chunks += done.chunks_repaired_tier1
            rec.tier1_grads += done.grads_repaired_tier1
            rec.forward_chunks += rolled
            rec.dropped = rec.dropped or done.dropped or kind is Kind.BACK
    # the tier-2 snapshot is retaken only if it lost blocks (the model's rule)
    rebuild_redundancy(eng, target, snapshot=bool(before.t2lost))
    note_recovered(eng, kind.value, target, after.loss, reason)


class _Ops:
    """:class:`~leto.retained.recovery.RepairOps` of the simulated ranks: every rank at
    once, tier 1 as parity over each node's in-process group (:mod:`.tier1`)."""

    copies_from_settled = False

    def __init__(self, eng: Engine) -> None:
        self.eng = eng

    def ranks(self) -> Sequence[int]:
        return range(self.eng.W)

    def repairs(self, plan: Plan) -> Sequence[Repair]:
        return expand_repairs(plan.repairs)  # a run of chunks is each chunk's repair

    def check_sources(self, repairs: Sequence[Repair]) -> None:
        pass  # the engine checked every rank's memory before Reconcile (integrity.scan)

    def restore_snapshot(self, target: int) -> int:
        snapshots.restore(self.eng, target)
        self.eng.stats["snapshot_restores"] += 1
        return sum(p.layout.n_chunks for p in self.eng.procs)

    def restore_checkpoint(self, target: int) -> int:
        raise IntegrityError("the fake backend restores its checkpoint at GoFallback")

    def rebuild_chunks(self, repairs: Sequence[Repair], target: int) -> int:
        for x in repairs:
            tier1.decode_chunk(self.eng, x.rank, x.chunk, x.version)
        return len(repairs)

    def rebuild_grads(self, repairs: Sequence[Repair]) -> int:
        for x in repairs:
            tier1.decode_grads(self.eng, x.rank, x.version)
        return len(repairs)

    def forget_grad_parity(self) -> None:
        pass  # rebuilt at the target by rebuild_redundancy, before anything reads it

    def settle(self, rank: int, target: int) -> rx.Settled:
        return _settle(self.eng, rank, target)

    def finish(self) -> None:
        pass


def _settle(eng: Engine, r: int, target: int) -> rx.Settled:
    """Bring rank ``r`` to ``target`` (:func:`leto.retained.recovery.settle`)."""
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
    return done


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
