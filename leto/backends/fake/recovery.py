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
from typing import Protocol

from leto.core import effects as fx
from leto.core import events as ev
from leto.core import schedule
from leto.core.chunk import LOST
from leto.core.cluster import ClusterModel, ClusterState, Effect
from leto.core.erasure import Topology
from leto.core.reconcile import Plan, Repair, expand_repairs
from leto.core.recovery import Kind, Phase
from leto.retained import recovery as rx
from leto.retained.checkpoint import Checkpointer
from leto.retained.process_state import restore_buffers, step_scheduler
from leto.retained.recovery import IntegrityError

from . import integrity, snapshots, tier1
from .backend import RECOVERY_WHERE
from .faults import FaultPoints
from .host import RanksHost
from .integrity import IntegrityHost
from .layouts import ensure
from .rank import RankProc, RecoveryRecord, UnrecoverableError

__all__ = [
    "RecoveryHost",
    "RepairHost",
    "lost_message",
    "note_recovered",
    "rebuild_redundancy",
    "reconcile",
    "run",
]


class RepairHost(RanksHost, Protocol):
    """The ranks a reconcile plan repairs, and the record of the recovery under way."""

    @property
    def recovery_record(self) -> RecoveryRecord | None: ...


class RecoveryHost(RepairHost, IntegrityHost, Protocol):
    """What the recovery driver feeds and reads besides the ranks: the core, the step
    that failed, the fault points, the fenced processes, the checkpointer (none: no
    fallback), the shadows."""

    @property
    def state(self) -> ClusterState: ...

    @property
    def model(self) -> ClusterModel: ...

    @property
    def current_step(self) -> int: ...

    @property
    def checkpointer(self) -> Checkpointer | None: ...

    @property
    def points(self) -> FaultPoints: ...

    @property
    def stale(self) -> dict[int, RankProc]: ...

    def feed(self, e: ev.Event) -> None: ...

    def warm_shadows(self) -> None: ...


def run(host: RecoveryHost) -> None:
    """Feed the recovery the core schedules until every rank runs again (or raise).

    The order is the core's (:func:`leto.core.schedule.next_event`); the engine
    only gathers what an event needs first: before ``Reconcile`` it checks every
    rank's retained memory (a checksum failure is a lost memory), and a shadow
    still spawning warms at once (simulated ranks start instantly).
    """
    V = host.current_step
    for _ in range(10_000):
        s = host.state
        if s.phase is Phase.RECONCILING:
            bad = integrity.scan(host, s)
            if bad:
                for r, why in bad.items():
                    integrity.failure(host, r, why)
                continue
        e = schedule.next_event(host.model, s)
        if e is None:
            break
        if isinstance(e, ev.GoFallback) and host.checkpointer is None:
            reason = host.model.plan(s).reason
            host.log("unrecoverable", step=V, detail=reason)
            raise UnrecoverableError(lost_message(host.backend.topology, s, reason))
        name = type(e).__name__
        if host.injector is not None and name in RECOVERY_WHERE:
            hits = [
                f for r in range(host.W) for f in host.injector.take(r, V, "recovery", None, name)
            ]
            if hits:
                host.points.fire(hits)
                continue
        host.feed(e)
        if isinstance(e, ev.Fence):
            for r in sorted(host.stale):  # the fenced process wakes up and tries to write
                host.try_feed(ev.StaleWrite(r, 0))
    else:  # pragma: no cover
        raise RuntimeError("recovery did not end")
    host.warm_shadows()


def reconcile(
    host: RepairHost, before: ClusterState, after: ClusterState, effects: tuple[Effect, ...]
) -> None:
    """The ``Reconcile`` event: its plan (``RunRepair`` effects, then ``Reconciled``)
    carried out as a whole, on every rank, then the redundancy rebuilt at the target."""
    target, kind = after.target, after.kind
    lost = {r for r in range(host.W) if all(d == LOST for d in before.data[r])}
    for r in range(host.W):
        ensure(host, r, r in lost)
    reason = next((a.reason for a in effects if isinstance(a, fx.Reconciled)), "")
    repairs = tuple(a.repair() for a in effects if isinstance(a, fx.RunRepair))
    done = rx.carry_out(Plan(target, kind, repairs, reason), _Ops(host))
    if kind is not Kind.TIER2:
        host.stats["chunks_repaired_from_parity"] += done.chunks_repaired_tier1
        host.stats["grad_blocks_repaired_from_parity"] += done.grads_repaired_tier1
        rolled = done.chunks_rolled_forward
        host.stats["chunks_rolled_forward"] += rolled
        if rolled:
            host.stats["rolled_forward"] += 1
        if done.dropped or kind is Kind.BACK:
            host.stats["rolled_back"] += 1
        rec = host.recovery_record
        if rec:
            rec.tier1_chunks += done.chunks_repaired_tier1
            rec.tier1_grads += done.grads_repaired_tier1
            rec.forward_chunks += rolled
            rec.dropped = rec.dropped or done.dropped or kind is Kind.BACK
    # the tier-2 snapshot is retaken only if it lost blocks (the model's rule)
    rebuild_redundancy(host, target, snapshot=bool(before.t2lost))
    note_recovered(host.recovery_record, kind.value, target, after.loss, reason)


class _Ops:
    """:class:`~leto.retained.recovery.RepairOps` of the simulated ranks: every rank at
    once, tier 1 as parity over each node's in-process group (:mod:`.tier1`)."""

    copies_from_settled = False

    def __init__(self, host: RepairHost) -> None:
        self.host = host

    def ranks(self) -> Sequence[int]:
        return range(self.host.W)

    def repairs(self, plan: Plan) -> Sequence[Repair]:
        return expand_repairs(plan.repairs)  # a run of chunks is each chunk's repair

    def check_sources(self, repairs: Sequence[Repair]) -> None:
        pass  # the engine checked every rank's memory before Reconcile (integrity.scan)

    def restore_snapshot(self, target: int) -> int:
        snapshots.restore(self.host, target)
        self.host.stats["snapshot_restores"] += 1
        return sum(p.layout.n_chunks for p in self.host.procs)

    def restore_checkpoint(self, target: int) -> int:
        raise IntegrityError("the fake backend restores its checkpoint at GoFallback")

    def rebuild_chunks(self, repairs: Sequence[Repair], target: int) -> int:
        for x in repairs:
            tier1.decode_chunk(self.host, x.rank, x.chunk, x.version)
        return len(repairs)

    def rebuild_grads(self, repairs: Sequence[Repair]) -> int:
        for x in repairs:
            tier1.decode_grads(self.host, x.rank, x.version)
        return len(repairs)

    def forget_grad_parity(self) -> None:
        pass  # rebuilt at the target by rebuild_redundancy, before anything reads it

    def settle(self, rank: int, target: int) -> rx.Settled:
        return _settle(self.host, rank, target)

    def finish(self) -> None:
        pass


def _settle(ranks: RanksHost, r: int, target: int) -> rx.Settled:
    """Bring rank ``r`` to ``target`` (:func:`leto.retained.recovery.settle`)."""
    p = ranks.procs[r]
    assert p.ropt is not None
    store = ranks.store(r)
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


def note_recovered(
    record: RecoveryRecord | None, kind: str, target: int, loss: int, reason: str = ""
) -> None:
    """What the recovery under way (``record``; none: none is) did, for its timeline
    entry at Resume."""
    if record is not None:
        record.kind = kind
        record.target = target
        record.loss = loss
        record.reason = reason


def rebuild_redundancy(ranks: RanksHost, target: int, *, snapshot: bool = True) -> None:
    """Verify every chunk, then rebuild the redundancy at ``target``: process states,
    tier-1 parity, empty gradient parity, and (``snapshot``) the tier-2 snapshot."""
    for p in ranks.procs:
        rx.check_resumable(p.layout, p.ropt, target, f"rank {p.rank}")
    for n in range(ranks.backend.nodes):
        ranks.backend.node_store(n).pending.clear()
    for p in ranks.procs:
        ranks.store(p.rank).process_states[p.rank] = {target: p.ps_json(target)}
    tier1.encode_all(ranks, target)
    if snapshot:
        snapshots.take(ranks, target)


def lost_message(topo: Topology, s: ClusterState, reason: str) -> str:
    """Why training stops: what was lost, beyond which tier, and that no checkpoint
    is configured to fall back to."""
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
