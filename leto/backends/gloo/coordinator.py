"""The recovery coordinator of a gloo job: the core's ClusterModel, fed by real events.

It runs inside the agent of node 0, or with etcd of the agent elected
(:mod:`.control_plane`): no torch, no IO but the event log; time comes in as an
argument. Agents forward what their processes report; the coordinator
turns it into the core's events, steps :class:`~leto.core.cluster.ClusterModel`
(the same model the TLA+ spec and the explicit-state checker verify), and turns
the effects into commands for the agents (``outbox``: ``(node or None for every
node, message)``) through one table, :data:`.commands.COMMANDS`; each command sent
is logged (a ``command`` record, checked by ``leto spec trace``).

Training path, per step ``V``: every rank's ``vote`` (gradients sealed, gradient
parity written, prepare record in its node's memory) -> once all ``W`` are in, the
step's ``Compute``/``Reduce``/``Prepare`` of every rank and ``Decide`` are fed and
``commit(V)`` is broadcast, as one aggregated ``CommitStep(V)``: COMMIT is recorded
first, outside every trainer (:mod:`.commit_record`: here, or in etcd with
``--rdzv-backend etcd``), and only then sent. Each rank's ``finished(V)`` is judged on arrival (the
model's guard of ``ApplyStep(V, [rank])``) and gathered; the step's ``ApplyStep(V,
ranks)`` (its ``BeginChunk``/``EndChunk``/``ParityChunk`` per chunk and ``Finish`` of
each rank, :mod:`leto.core.aggregate`) is fed once every rank finished, or before
anything else is fed: O(ranks) per step, not O(ranks x chunks). Every K steps the ranks' ``snapshot_done`` feed ``Tier2Snapshot``. So
between failures the model's state is exactly the job's at step boundaries.

Node membership (the nodes up, the lost ones awaiting a replacement, the pool of spare
agents and which spare takes which lost node: :meth:`.SparePool.assign`) is
kept here too, but it is the agents' business, not the protocol's: nothing of it is
fed to the model, which sees a ``LoseNode`` and later the new node's ``ShadowWarm``.

Recovery (a failure report, then the core's schedule to ``Resume``) is carried out by
:class:`~.recovery_driver.RecoveryDriver`; everything fed to the model goes through
:class:`~.model_feed.ModelFeeder`, which judges what the model refuses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import attrs

from leto.core import events as ev
from leto.core import reshape, restart, world
from leto.core.chunk import NONE
from leto.core.cluster import ClusterModel, ClusterState
from leto.core.erasure import Topology
from leto.core.recovery import Phase
from leto.core.shadow import ShadowState
from leto.core.trainer import TrainerState
from leto.spec.state_record import state_to_record
from leto.spec.trace import CoreSetup, Item, Snapshot, rebuild

from . import messages as M
from .commands import Narrow, commands, logged
from .commit_record import CommitRecord, Embedded, RecordError
from .eventlog import EventLog
from .exclusion import Exclusions
from .model_feed import Fed, ModelFeeder
from .recovery_driver import RecoveryDriver, failed_what
from .replica_checks import ReplicaChecks
from .spare_pool import SparePool
from .tier2_record import Tier2Record

__all__ = ["Coordinator", "CoordinatorOptions"]

Out = tuple[int | None, M.Message]


@dataclass
class CoordinatorOptions:
    spare_timeout: float = 60.0  # a lost node's replacement must join within this
    # a recovery not ended this long after its failure fails the job, in one line (the
    # clock stops while a lost node's replacement is awaited: spare_timeout bounds that)
    recovery_timeout: float = 180.0
    stopped_grace: float = 2.0  # a collective error with no failure reported: then blame it
    max_recoveries: int = 100
    # an event the model refuses stops the job; off: logged as model_mismatch, carried on
    strict: bool = True
    # --max-restarts: how many whole-job restarts the job may make, and has made
    max_restarts: int = 0
    restarts: int = 0
    # --exclude-after / --exclude-window: a host whose nodes failed that often within
    # that many seconds is not taken back (0: never)
    exclude_after: int = 3
    exclude_window: float = 600.0
    # --nnodes MIN:MAX (MIN < MAX): a lost node with no replacement within the spare
    # timeout shrinks the world while MIN are left (leto.core.world); (0, 0): fixed world
    nodes_range: tuple[int, int] = (0, 0)


class Coordinator:
    """See the module docstring. Drive it with :meth:`handle` and :meth:`tick`."""

    def __init__(
        self,
        nodes: int,
        per_node: int,
        *,
        log: EventLog,
        options: CoordinatorOptions | None = None,
        record: CommitRecord | None = None,
    ) -> None:
        self.topology = Topology.uniform(nodes, per_node)
        self.W = nodes * per_node
        self.log = log
        self.opt = options or CoordinatorOptions()
        self.outbox: list[Out] = []
        self.record: CommitRecord = record if record is not None else Embedded()
        self.model: ClusterModel | None = None
        self.state: ClusterState | None = None
        self.info: dict[str, Any] = {}  # from the trainers' ready reports
        self.ready: dict[int, dict[str, Any]] = {}  # the ranks' ready messages, as sent
        self.votes: dict[int, set[int]] = {}
        self.finished: dict[int, set[int]] = {}
        self.snaps: dict[int, dict[int, Any]] = {}
        self.ckpts: dict[int, set[int]] = {}  # step -> ranks that wrote their part
        # (generation, step) -> ranks that staged an asynchronous checkpoint of step
        self.staged: dict[tuple[int, int], set[int]] = {}
        # the confirmed tier-2 snapshot (kept in the commit record, which a test swaps)
        self.tier2 = Tier2Record(lambda k, v: self.record.keep(k, v), self.log)
        self.base_not_kept = False  # nor a compacted log (the state too large)
        self.core_init: dict[str, Any] | None = None  # the model's constants, as a record
        self.nodes_up: set[int] = set()
        self.nodes_lost_at: dict[int, float] = {}
        self.node_back_at = 0.0  # when the last lost node's replacement joined
        # the pooled spare agents: a lost node's rank goes to the lowest id
        self.exclusions = Exclusions(log, self.opt.exclude_after, self.opt.exclude_window)
        self.spares = SparePool(
            log,
            lambda: self.failed is None and not self.complete,
            usable=lambda peer: self.exclusions.refusal(peer) is None,
        )
        self.degraded: dict[int, str] = {}  # ranks whose shadow could not be built: why
        self.shadow_pending: list[tuple[int, str]] = []
        self.done: dict[int, M.Done] = {}
        self.finished_nodes: set[int] = set()
        self.failed: str | None = None
        self.restart: restart.Restart | None = None  # the core's decision, when failed
        # the new world's generation and the old one's checkpoint (CoreSetup's gen, ckpt),
        # while an in-place change of the world awaits the ready reports
        self.reshaped_from: dict[str, int] = {}
        # a grow in place awaiting its new node's trainers (node, step, gen), those up
        self.growing: dict[str, int] = {}
        self.joined: set[int] = set()
        self.growing_since = 0.0
        self.complete = False
        self.losses: dict[int, float] = {}
        # all the model is fed, judged
        self.feeder = ModelFeeder(self, log=log, strict=self.opt.strict)
        # a recovery, from its failure to Resume (its state: the recovery under way, what
        # it waits for, the trainers' reports, the recoveries so far)
        self.driver = RecoveryDriver(
            self,
            log=log,
            feeder=self.feeder,
            max_recoveries=self.opt.max_recoveries,
        )
        self.replicas = replica_checks(self)  # the data-parallel replicas agree, or are repaired

    # ------------------------------------------------------------------ plumbing

    def send(self, node: int | None, msg: M.Message) -> None:
        self.outbox.append((node, msg))

    def carry_out(self, fed: Fed) -> list[M.Message]:
        """Send the commands that carry out ``fed``'s effects (:mod:`.commands`: the
        caller decides only when), each logged as a ``command`` record that ``leto spec
        trace`` checks against those effects."""
        rec = self.driver.rec
        diverged = (
            ()
            if rec is None
            else tuple(
                sorted({int(f["rank"]) for f in rec.failures if f.get("kind") == "diverged"})
            )
        )
        narrow = Narrow(self.topology.node_of, self.tier2.step, self.tier2.meta, diverged)
        out = commands(fed, narrow)
        for node, msg in out:
            self.send(node, msg)
            self.log.write("command", **logged(node, msg))
        return [msg for _, msg in out]

    @property
    def generation(self) -> int:
        if self.state is None:  # none yet, or the world changes in place to a new one
            return self.reshaped_from.get("gen", 0)
        return self.state.gen

    def lost_node(self, node: int, now: float) -> None:
        """``node`` is lost since ``now`` (unless it was already): its replacement is due
        within ``spare_timeout``."""
        self.nodes_lost_at.setdefault(node, now)

    def forget_done(self) -> None:
        """A recovery began: the ranks' done reports so far are void."""
        self.done.clear()

    def forget_gathered(self) -> None:
        """Training resumes: the votes, finishes and snapshots gathered before are void."""
        self.votes.clear()
        self.finished.clear()
        self.snaps.clear()

    def fail(
        self, message: str, *, ending: restart.Ending = restart.Ending.FATAL, **fields: Any
    ) -> None:
        """The job ends: it stops, or the core decides it starts again from its disk
        checkpoint (:func:`leto.core.restart.after`); every agent is told which."""
        if self.failed is not None:
            return
        self.failed = message
        self.restart = restart.after(ending, self.opt.restarts, self.opt.max_restarts)
        if self.restart is None:
            self.log.write("job_failed", error=message, **fields)
            self.send(None, M.Fail(error=message))
            return
        r = self.restart
        self.log.write("job_restart", attempt=r.attempt, of=r.of, cause=message, **fields)
        self.send(None, M.Fail(error=message, restart=r.attempt))

    def model_record(self, name: str, **fields: Any) -> None:
        """A record of what the model was fed (``core_init``, ``core``): to the event log,
        and to the commit record (where another coordinator can replay it)."""
        self.log.write(name, **fields)
        self.record.note({"event": name, **fields})

    def take_over(self, records: list[dict[str, Any]], kept: dict[str, dict[str, Any]]) -> None:
        """A successor: the model rebuilt from its predecessor's records (the commit
        record's log, :meth:`.commit_record.EtcdRecord.take_over`), with the settings and
        the tier-2 snapshot they carry; what else it kept (votes, the nodes up, the spare
        pool) comes back as the agents reconnect and the ranks report."""
        self.model, self.state = rebuild(records)
        for rec in records:
            if rec.get("event") == "coordinator_info":
                self.info = dict(rec["info"])
            elif rec.get("event") == "core_init":
                self.core_init = dict(rec)
        self.tier2.take_over(kept)
        self.ready = dict.fromkeys(range(self.W), {})  # training started long ago
        self.log.write(
            "coordinator_took_over",
            generation=self.state.gen,
            committed=self.state.committed,
            records=len(records),
            state=state_to_record(self.state),  # where the trace goes on (leto spec trace)
            core_init=self.core_init,  # and its constants (this log may be a new file)
        )

    def tell_tier2(self, node: int) -> None:
        """The current tier-2 snapshot, told again to ``node``: a successor's own node and
        each that rejoins it may not have heard it from the predecessor, which kept it
        (:meth:`.tier2_record.Tier2Record.set`) before the ranks heard; a keeper that did not hear it would
        count its node's snapshot gone at the next tier-2 restore."""
        self.send(node, M.Tier2(step=self.tier2.step, gen=self.generation))

    def _compact(self) -> None:
        """The commit record's log so far replaced by what rebuilds the model as it is
        now (the model's constants, the settings, the state: ``core_state``)."""
        assert self.state is not None and self.core_init is not None
        base = [
            self.core_init,
            {"event": "coordinator_info", "info": self.info},
            {"event": "core_state", "state": state_to_record(self.state)},
        ]
        if not self.record.compact(base) and not self.base_not_kept:
            self.base_not_kept = True
            self.log.write(
                "warning",
                what="the model's state is too large for one record of the commit record: "
                "its log is not compacted",
            )

    def make_durable(self) -> None:
        """Before the outbox leaves: every model record so far is in the commit record
        (a message never follows from an input a successor could not replay); if it
        cannot be written, only the job's end leaves."""
        try:
            self.record.flush()
        except RecordError as e:
            self.outbox = [(n, m) for n, m in self.outbox if isinstance(m, M.Fail)]
            self.fail(str(e))

    def durable(self, write: Callable[[], None]) -> bool:
        """Write a COMMIT or a fence to the commit record; a record that cannot be written
        stops the job with its line (False)."""
        try:
            write()
        except RecordError as e:
            self.fail(str(e))
            return False
        return True

    # ------------------------------------------------------------------ inputs

    def handle(self, node: int, msg: M.Message, now: float) -> None:
        """One message from the agent of ``node``."""
        with self.feeder.judging():
            match msg:
                case M.Ready():
                    self._on_ready(msg)
                case M.Vote():
                    self._on_vote(msg)
                case M.Finished():
                    self._on_finished(msg, now)
                case M.SnapshotDone():
                    self._on_snapshot_done(msg)
                case M.CheckpointStaged():
                    self._on_ckpt_staged(msg)
                case M.CheckpointWritten():
                    self._on_ckpt_written(msg)
                case M.Done():
                    self._on_done(msg)
                case M.NodeFinished():
                    self.finished_nodes.add(node)
                case M.Started():
                    started(self.log, self.driver.pids, node, msg)
                case M.Unprotected():
                    self.log.write("unprotected", rank=msg.rank, node=node, detail=msg.detail)
                case M.Shadow():
                    self._on_shadow(msg)
                case M.Failure():
                    self.driver.on_failure(msg, now)
                case M.Fatal():
                    self.fail(f"rank {msg.rank}: {msg.error}", rank=msg.rank)
                case M.Stopped():
                    self.driver.on_stopped(msg, now)
                case M.Kept():
                    if self._current(msg.gen):
                        self.log.write("compute_kept", rank=msg.rank, step=msg.step)
                case M.Replayed():
                    if self._current(msg.gen):
                        fields = {"rank", "step", "owner", "micro_batches"}
                        self.log.write(
                            "replayed", **attrs.asdict(msg, filter=lambda a, _v: a.name in fields)
                        )
                case M.Fenced():
                    self.driver.ack("fence", node, msg.gen)
                case M.Promoted():
                    if not on_joined(self, msg.rank):
                        self.driver.on_promoted(msg)
                case M.Report():
                    self.driver.on_report(msg)
                case M.Reconciled():
                    self.driver.on_reconciled(msg)
                case M.Rebuilt():
                    self.driver.ack("rebuild", msg.rank, msg.gen)
                case _:
                    self.log.write("unknown_message", node=node, message=msg.to_wire())
                    return
            if self.model is not None and self.failed is None and not self.complete:
                self.driver.advance(now)

    def node_up(self, node: int, *, spare: bool, now: float) -> None:
        self.nodes_up.add(node)
        if self.nodes_lost_at.pop(node, None) is not None:
            self.node_back_at = now
        self.log.write("node_joined", node=node, spare=spare)
        on_node_up(self, node)

    def node_down(self, node: int, now: float, why: str = "agent link closed") -> None:
        """The link to ``node``'s agent closed: the node is lost (unless the job is over)."""
        self.nodes_up.discard(node)
        if self.complete or self.failed is not None:
            self.finished_nodes.add(node)  # gone after the job completed: done too
            return
        if self.model is None:
            when = "while the world changed in place" if self.reshaped_from else ""
            self.fail(f"node {node} was lost {when or 'before training started'} ({why})")
            return
        self.nodes_lost_at[node] = now
        with self.feeder.judging():
            self.driver.failure(
                {"kind": "node_lost", "node": node, "detected_by": why, "rank": None}, now
            )
            self.driver.advance(now)

    # --- the spare pool (node membership: the agents', not a protocol event) -----

    def start_world(self, nodes: int) -> list[tuple[int, int]]:
        """``--nnodes MIN:MAX``: the rendezvous closed with ``nodes`` nodes (node 0 and
        the pooled agents that joined first, :func:`leto.core.elastic.world_at_close`):
        the job's world from here on; ``(spare id, node)`` for nodes 1.., the lowest ids
        (the first to join) first. The rest stay in the pool, as spares."""
        if self.model is not None or not 1 <= nodes <= len(self.spares.ids) + 1:
            raise ValueError(f"cannot start a world of {nodes} node(s) now")
        self.topology = Topology.uniform(nodes, self.W // self.topology.nodes)
        self.W = self.topology.world_size
        placed = [(self.spares.ids.pop(0), n) for n in range(1, nodes)]
        self.log.write(
            "rendezvous_closed",
            nodes=nodes,
            world_size=self.W,
            placed=placed,
            pool=len(self.spares.ids),
        )
        return placed

    def tick(self, now: float) -> None:
        """Timers: a spare that does not come, a recovery stuck waiting."""
        if (
            self.failed is None
            and self.growing
            and now - self.growing_since > self.opt.spare_timeout
        ):
            self.fail(
                f"the spare that was to grow the world to {self.topology.nodes} nodes in place "
                f"did not start its trainers within {self.opt.spare_timeout:g} s (--spare-timeout)"
            )
        if self.failed is not None or self.complete or self.model is None:
            return
        for node, since in list(self.nodes_lost_at.items()):
            if now - since > self.opt.spare_timeout and node not in self.nodes_up:
                passed = len(self.spares.ids)  # pooled, every one on an excluded host
                pool = (
                    f"the spare pool's {passed} spare(s) are on excluded hosts: "
                    + "; ".join(sorted(set(self.exclusions.excluded.values())))
                    if passed
                    else "the spare pool was empty"
                )
                if resize(self, True, now):
                    return
                self.driver.give_up(
                    f"node {node} was lost and no replacement joined within "
                    f"{self.opt.spare_timeout:g} s ({pool}{no_shrink(self)}): start "
                    f"`leto launch` with --node-rank {node} on a spare node (same arguments), "
                    "or keep spare agents in the pool (--spare, --spares N), to recover in place"
                )
                return
        rec = self.driver.rec
        if rec is not None and not self.nodes_lost_at:
            if now - max(rec.started, self.node_back_at) > self.opt.recovery_timeout:
                self.driver.give_up(
                    f"the recovery from the failure of {failed_what(rec)} did not end within "
                    f"{self.opt.recovery_timeout:g} s: {self.driver.waiting_for()}"
                )
                return
        s = self.state
        if s is None:  # the world changed in place: the new one's ready reports come
            return
        if (
            rec is None
            and s.phase is Phase.RUNNING
            and self.spares.ids
            and resize(self, False, now)
        ):
            return
        stopped_at = self.driver.stopped_at
        for rank, since in list(stopped_at.items()):
            if rank not in stopped_at:  # cleared: another rank's failure explains it
                continue
            if now - since > self.opt.stopped_grace:
                del stopped_at[rank]
                running = s.phase is Phase.RUNNING
                if s.trainer[rank] is TrainerState.ALIVE and (
                    running or self.driver.waits_on(rank, s.gen)
                ):
                    with self.feeder.judging():
                        self.driver.failure(
                            {
                                "kind": "collective_error",
                                "rank": rank,
                                "detected_by": "collective error with no failure reported"
                                if running
                                else "its recovery step failed with no failure reported",
                            },
                            now,
                        )
                        self.driver.advance(now)

    # --- start ---------------------------------------------------------------

    def _on_ready(self, msg: M.Ready) -> None:
        self.ready[msg.rank] = msg.to_wire()
        if len(self.ready) < self.W or self.model is not None:
            return
        infos = list(self.ready.values())
        keys = (
            "n_chunks",
            "chunk_numel",
            "tier1",
            "tier1_kind",
            "tier2",
            "tier2_interval",
            "tier2_parity",
            "checkpoint",
            "start",
            "shard",
        )
        for k in keys:
            vals = {str(i.get(k)) for i in infos}
            if len(vals) > 1:
                self.fail(
                    f"ranks disagree on {k}: {sorted(vals)} (is every node running the same script and config?)"
                )
                return
        self.info = {k: infos[0].get(k) for k in keys}
        refused = restart.refusal(self.opt.max_restarts, bool(self.info["checkpoint"]))
        if refused is not None:
            self.fail(refused)
            return
        setup = CoreSetup(
            nodes=self.topology.node_sizes,
            chunks=int(self.info["n_chunks"]),
            k=int(self.info["tier2_interval"]) if self.info["tier2"] else None,
            tier1=bool(self.info.get("tier1", True)),
            tier2_parity=int(self.info.get("tier2_parity") or 1),
            # shadows are started with the trainers: spawning until they report warm
            shadows=ShadowState.SPAWNING,
            start=int(self.info.get("start") or 0),
            **self.reshaped_from,  # in place: the old world's generation and checkpoint
        )
        self.reshaped_from = {}
        self.model = setup.model()
        self.state = setup.initial(self.model)
        self.model_record("core_init", **setup.to_record())
        self.core_init = {"event": "core_init", **setup.to_record()}
        self.record.note({"event": "coordinator_info", "info": self.info})
        self.tier2.set(setup.start, {r: i.get("snapshot") for r, i in self.ready.items()})
        self.log.write(
            "training_started",
            n_chunks=setup.chunks,
            chunk_numel=self.info["chunk_numel"],
            tier1=self.info["tier1"],
            tier1_kind=self.info["tier1_kind"],
            tier2=self.info["tier2"],
            tier2_interval=self.info["tier2_interval"],
            checkpoint=self.info["checkpoint"],
            world_size=self.W,
            nodes=self.topology.nodes,
        )
        for r, st in self.shadow_pending:
            self.driver.shadow_state(r, st)
        self.shadow_pending.clear()
        # the start's snapshot is current (an in-place change's: re-encoded at its start)
        self.send(None, M.Tier2(step=setup.start, gen=self.state.gen))
        self._all_done()

    # --- training path ---------------------------------------------------------

    def _current(self, gen: int) -> bool:
        return self.state is not None and gen == self.state.gen

    def _on_vote(self, msg: M.Vote) -> None:
        if not self._current(msg.gen):
            return
        s = self.state
        assert s is not None
        step = msg.step
        votes = self.votes.setdefault(step, set())
        votes.add(msg.rank)
        if len(votes) < self.W or s.phase is not Phase.RUNNING:
            return
        fed = self.feeder.run([ev.CommitStep(step)], f"the votes for step {step}")
        del self.votes[step]
        if not self.durable(lambda: self.record.commit(step, s.gen)):
            return  # not durable: no chunk may move on it
        if self.record.compaction_due() and not self.durable(self._compact):
            return
        self.carry_out(fed)  # Commit

    def _on_finished(self, msg: M.Finished, now: float) -> None:
        if not self._current(msg.gen):
            return
        r, step = msg.rank, msg.step
        self.feeder.gather_applied(step, r, self.W)
        fin = self.finished.setdefault(step, set())
        fin.add(r)
        if msg.replica is not None:
            self.replicas.add(step, r, msg.replica)
        if msg.loss is not None:  # the user's own loop gives none
            self.losses[step] = self.losses.get(step, 0.0) + float(msg.loss) / self.W
        if len(fin) == self.W:
            del self.finished[step]
            self.replicas.check(
                step, tier1_replicas=self.info.get("tier1_kind") == "replica", now=now
            )
            # the model first: a partial gather flushed earlier (before another event)
            # leaves the last ranks pending, and the record says every rank finished
            self.feeder.flush_applied()
            loss = self.losses.get(step)
            self.log.write("step", step=step, loss=None if loss is None else round(loss, 6))

    def _on_snapshot_done(self, msg: M.SnapshotDone) -> None:
        if not self._current(msg.gen):
            return
        step = msg.step
        got = self.snaps.setdefault(step, {})
        got[msg.rank] = msg.meta
        if len(got) < self.W:
            return
        del self.snaps[step]
        fed = self.feeder.run(
            [Snapshot(step)], f"every rank took the tier-2 snapshot of step {step}"
        )
        self.tier2.set(step, got)
        self.carry_out(fed)  # Tier2
        self.log.write("tier2_snapshot", step=step)

    def _on_ckpt_staged(self, msg: M.CheckpointStaged) -> None:
        """Every rank staged its state of ``step`` for an asynchronous checkpoint (each
        sent it before its next vote: the model has them all idle at ``step``):
        BeginCheckpoint. Their writes go on beside the steps; each one's report feeds its
        WriteShard (:meth:`_on_ckpt_written`). A checkpoint still in progress in the model
        (a writer failed without a recovery) leaves this one unbegun: its reports are
        dropped, and the durable step stays where every writer completed."""
        if not self._current(msg.gen):
            return
        key = (msg.gen, msg.step)
        got = self.staged.setdefault(key, set())
        got.add(msg.rank)
        if len(got) < self.W:
            return
        del self.staged[key]
        assert self.state is not None
        if msg.step <= self.state.ckpt or self.state.cpend != NONE:
            self.log.write("checkpoint_not_begun", step=msg.step, in_progress=self.state.cpend)
            return
        self.feeder.run(
            [ev.BeginCheckpoint()], f"every rank staged the checkpoint of step {msg.step}"
        )

    def _on_ckpt_written(self, msg: M.CheckpointWritten) -> None:
        """Every rank wrote its part of the checkpoint of ``step``: BeginCheckpoint (they
        staged it idle at ``step``), each WriteShard, then CheckpointDurable: the
        fallback step moves. (The job's start is durable in the model from the start.)
        An asynchronous checkpoint (begun when every rank staged it) feeds each rank's
        WriteShard as its report comes, and CheckpointDurable with the last."""
        if not self._current(msg.gen):
            return
        assert self.state is not None
        if self.state.cpend == msg.step and self.state.cpend != NONE:
            self.feeder.run(
                [ev.WriteShard(msg.rank)],
                f"rank {msg.rank} wrote its part of the checkpoint of step {msg.step}",
            )
            if len(self.state.ckdone) == self.W:
                self.feeder.run(
                    [ev.CheckpointDurable()],
                    f"every rank wrote its part of the checkpoint of step {msg.step}",
                )
                self.log.write("checkpoint", step=msg.step)
            return
        got = self.ckpts.setdefault(msg.step, set())
        got.add(msg.rank)
        if len(got) < self.W:
            return
        del self.ckpts[msg.step]
        assert self.state is not None
        if msg.step <= self.state.ckpt:
            return
        items: list[Item] = [ev.BeginCheckpoint()]
        items += [ev.WriteShard(r) for r in range(self.W)]
        items.append(ev.CheckpointDurable())
        self.feeder.run(items, f"every rank wrote its part of the checkpoint of step {msg.step}")
        self.log.write("checkpoint", step=msg.step)

    def _on_done(self, msg: M.Done) -> None:
        if self.model is None and msg.gen == 0:
            # done before every rank was ready (a job of no step): kept until it starts
            self.done[msg.rank] = msg
            return
        if not self._current(msg.gen):
            return
        self.done[msg.rank] = msg
        self._all_done()

    def _all_done(self) -> None:
        if len(self.done) < self.W:
            return
        steps = {m.step for m in self.done.values()}
        if len(steps) != 1:
            self.fail(f"ranks finished at different steps: {sorted(steps)}")
            return
        kept = {  # the retained buffers of every replica, at the end
            r: ";".join(f"{k}={v}" for k, v in sorted(m.digest.items()) if k != "process_state")
            for r, m in self.done.items()
            if isinstance(m.digest, dict)
        }
        if not self.replicas.check_end(next(iter(steps)), kept):
            return
        self.complete = True
        self.log.write("commit_record", **self.record.stats())
        self.log.write(
            "training_done",
            step=steps.pop(),
            digests={str(r): m.digest for r, m in sorted(self.done.items())},
            memory={str(r): m.memory for r, m in sorted(self.done.items())},
            recoveries=len(self.driver.recoveries),
            degraded=sorted(self.degraded),
            replica_checks=self.replicas.agreed,
            replica_repairs=self.replicas.repairs,
        )
        self.send(None, M.Complete())

    # --- shadows -----------------------------------------------------------------

    def _on_shadow(self, msg: M.Shadow) -> None:
        r, st = msg.rank, msg.state
        self.log.write("shadow", rank=r, state=st, reason=msg.reason or "")
        why = msg.degraded
        if why and r not in self.degraded:  # its agent said so on its console, at once
            self.degraded[r] = str(why)
            self.log.write("degraded", rank=r, reason=str(why))
        if self.model is None:
            self.shadow_pending.append((r, st))
            return
        self.driver.shadow_state(r, st)

    # ------------------------------------------------------------------ queries

    def summary(self) -> dict[str, Any]:
        s = self.state
        return {
            "phase": None if s is None else s.phase.value,
            "committed": None if s is None else s.committed,
            "generation": self.generation,
            "recoveries": len(self.driver.recoveries),
            "failed": self.failed,
            "complete": self.complete,
        }


def started(log: Any, pids: dict[int, int], node: int, msg: M.Started) -> None:
    """A process of ``node`` started: its pid in the log (which process is rank 3's
    trainer), and a trainer's kept in ``pids`` for the promotion that replaces it."""
    if msg.role == "trainer" and msg.rank is not None:
        pids[msg.rank] = msg.pid
    fields = {"rank": msg.rank, "incarnation": msg.incarnation}
    log.write(
        "process_started",
        role=msg.role,
        pid=msg.pid,
        node=node,
        **{k: v for k, v in fields.items() if v is not None},
    )


def replica_checks(c: Coordinator) -> ReplicaChecks:
    """The checks that the data-parallel replicas of ``c``'s world agree."""
    nodes = [c.topology.node_of(r) for r in range(c.W)]
    return ReplicaChecks(nodes, c.log, send=c.send, lose=c.driver.failure, fail=c.fail)


def shrink_in_place(c: Coordinator, lost: list[int], left: int) -> None:
    """The core shrank the world (:func:`leto.core.world.decide`): the job goes on in
    place (:mod:`leto.core.reshape`). The recovery under way ends in the change; the
    keepers are fenced at a new generation; the nodes after a lost one are renumbered,
    their ranks with them (:func:`leto.core.reshape.survivors`: here at once, in each
    agent and trainer as the :class:`~.messages.Reshape` reaches it); every surviving
    trainer rolls to the committed step, takes its new rank, forms the new world's
    groups and says ready again, and the new world's model starts from the old one's
    state there (:meth:`Coordinator._on_ready`). No process restarts, nothing is read
    from disk, no committed step is lost (sharded state: every rank goes to the tier-2
    snapshot's step, the lost shards being only there, and reshards from it)."""
    s = c.state
    assert s is not None
    nodes, per_node = c.topology.nodes, c.W // c.topology.nodes
    kept = reshape.survivors(nodes, per_node, frozenset(lost))
    gen, step = s.gen + 1, s.committed
    snapshot = None
    if c.info.get("shard"):  # the lost shards are the tier-2 snapshot's: every rank goes there
        step = c.tier2.step
        snapshot = {"step": step, "meta": {str(r): m for r, m in c.tier2.meta.items()}}
    moved = {n: reshape.renumbered(n, frozenset(lost)) for n in range(nodes) if n not in lost}
    c.log.write(
        "world_shrink", nodes=left, lost=lost, was=nodes, in_place=True, step=step,
        generation=gen, ranks=list(kept),
        renumbered={str(n): m for n, m in moved.items() if n != m},
    )  # fmt: skip
    for n in lost:
        c.nodes_lost_at.pop(n, None)
    _renumber(c, moved, per_node)
    _new_world(c, left, gen)
    c.reshaped_from["ckpt"] = min(c.reshaped_from["ckpt"], step)
    c.send(None, M.Fence(gen=gen))  # the keepers first: the trainers join gen
    c.send(None, M.Reshape(gen=gen, step=step, nodes=left, lost_nodes=lost, snapshot=snapshot))


def _renumber(c: Coordinator, moved: dict[int, int], per_node: int) -> None:
    """What the coordinator keeps by node or by rank, renumbered for the new world
    (``moved``: each surviving node's new index); the lost nodes' entries go."""

    def rank(r: int) -> int | None:
        n = moved.get(r // per_node)
        return None if n is None else n * per_node + r % per_node

    c.nodes_up = {moved[n] for n in c.nodes_up if n in moved}
    c.finished_nodes = {moved[n] for n in c.finished_nodes if n in moved}
    c.nodes_lost_at = {moved[n]: t for n, t in c.nodes_lost_at.items() if n in moved}
    hosts = c.exclusions.hosts
    c.exclusions.hosts = {moved[n]: h for n, h in hosts.items() if n in moved}
    pids, degraded = dict(c.driver.pids), dict(c.degraded)
    c.driver.pids.clear()
    c.driver.pids.update({r2: v for r, v in pids.items() if (r2 := rank(r)) is not None})
    c.degraded = {r2: v for r, v in degraded.items() if (r2 := rank(r)) is not None}
    c.shadow_pending = [(r2, st) for r, st in c.shadow_pending if (r2 := rank(r)) is not None]


def _new_world(c: Coordinator, nodes: int, gen: int) -> None:
    """The world changes in place to ``nodes`` nodes at generation ``gen``: the recovery
    under way (if any) ends in it, the old world's model and what was gathered for it
    go, and the new world's model starts when its ranks are ready (``_on_ready``)."""
    s = c.state
    assert s is not None
    c.driver.world_changed()
    c.reshaped_from = {"gen": gen, "ckpt": min(s.ckpt, s.committed)}
    c.model = c.state = None
    per_node = c.W // c.topology.nodes
    c.topology = Topology.uniform(nodes, per_node)
    c.W = c.topology.world_size
    c.ready.clear()
    c.done.clear()
    c.forget_gathered()
    c.ckpts.clear()
    c.staged.clear()
    c.replicas = replica_checks(c)


def grow_in_place(c: Coordinator, spare: int, now: float) -> None:
    """The core grew the world (a spare in the pool, the world below MAX): the spare
    joins in place as the last node. The trainers stop their step (an abort); the
    spare is placed as node ``nodes`` (the pool's assignment, as for a lost node's
    replacement) and its trainers promoted (:meth:`on_node_up`); then every rank rolls
    to the committed step, forms the new world's groups and takes part in the copy of a
    live replica (rank 0's retained state and process state) into the new node's ranks
    (:class:`~.messages.Reshape` with ``grow``), with no process of the old world
    restarted and nothing read from disk."""
    s = c.state
    assert s is not None
    nodes, step = c.topology.nodes, s.committed
    gen = s.gen + 2  # s.gen + 1: the abort that stops the old world's step
    c.log.write(
        "world_grow", nodes=nodes + 1, spare=spare, was=nodes, in_place=True, step=step,
        generation=gen,
    )  # fmt: skip
    c.send(None, M.Abort(gen=s.gen + 1))
    _new_world(c, nodes + 1, gen)
    c.growing, c.growing_since = {"node": nodes, "step": step, "gen": gen}, now
    c.joined.clear()
    c.nodes_lost_at[nodes] = now  # the pool places the spare there (routing.assign_spares)


def on_node_up(c: Coordinator, node: int) -> None:
    """A node joined; the one a grow in place awaits: its ranks' trainers are promoted."""
    g = c.growing
    if g and node == g["node"]:
        per = c.W // c.topology.nodes
        for r in range(node * per, (node + 1) * per):
            c.send(node, M.PromoteRank(rank=r, gen=g["gen"], warm=False))


def on_joined(c: Coordinator, rank: int) -> bool:
    """A trainer of the node a grow in place awaits is up (promoted): once all are, the
    world changes (every rank's :class:`~.messages.Reshape`). False: not one of them."""
    g = c.growing
    per = c.W // c.topology.nodes if g else 0
    if not g or rank // per != g["node"]:
        return False
    c.joined.add(rank)
    if len(c.joined) == per:
        c.growing = {}
        c.send(None, M.Fence(gen=g["gen"]))  # the old nodes' keepers; the new one's are
        c.send(None, M.Reshape(gen=g["gen"], step=g["step"], nodes=c.topology.nodes, grow=True))
    return True


def _sharded_shrinks(c: Coordinator) -> bool:
    """Sharded state (``shard = true``) is resharded in place only from 2 nodes to 1, its
    node 1 lost: the survivors then hold the lost node's tier-2 bytes as their own
    shares of the code (no decode across nodes), and the new world grows back no more
    (a grow copies rank 0's state, a replica only without sharding)."""
    lost = c.nodes_lost_at.keys() - c.nodes_up
    return c.topology.nodes == 2 and lost == {1} and bool(c.info.get("tier2"))


def _world(c: Coordinator) -> world.World | None:
    """The core's elastic world as it stands (members, those lost and awaited, the
    pooled spares), or None: the world is fixed (no ``--nnodes MIN:MAX``), or the
    state is sharded (``shard = true``) and this loss is not one that reshards it in
    place (:func:`_sharded_shrinks`)."""
    lo, hi = c.opt.nodes_range
    nodes = c.topology.nodes
    if not lo or (c.info.get("shard") and not _sharded_shrinks(c)):
        return None
    s = world.start(min(lo, nodes), max(hi, nodes), tuple(map(str, range(nodes))), 0)
    for n in sorted(c.nodes_lost_at):
        if n not in c.nodes_up:
            s = world.step(s, world.LoseNode(str(n)))
    for sid in c.spares.ids:
        s = world.step(s, world.SpareJoins(f"spare{sid}"))
    return s


def no_shrink(c: Coordinator) -> str:
    """Why an elastic job (``--nnodes MIN:MAX``) did not shrink, for its one line."""
    lo, hi = c.opt.nodes_range
    if not lo:
        return ""
    if c.info.get("shard") and not _sharded_shrinks(c):
        return (
            f"; --nnodes {lo}:{hi} shrinks sharded state (shard = true) only from 2 nodes "
            "to 1, its node 1 lost, with tier 2"
        )
    left = c.topology.nodes - len(c.nodes_lost_at.keys() - c.nodes_up)
    return f"; {left} node(s) left, fewer than --nnodes {lo}:{hi} allows"


def resize(c: Coordinator, timed_out: bool, now: float) -> bool:
    """Does the core change the world (:func:`leto.core.world.decide`)? A shrink
    (the spare timeout passed with no replacement, at least MIN nodes left) or a
    grow (a spare in the pool while the world is below MAX, training running): the
    job goes on, on the nodes of the new world, in place (:func:`shrink_in_place`,
    the nodes after a lost one renumbered, node 0 too when it was lost and the
    coordinator runs elsewhere, elected with etcd; :func:`grow_in_place`): see
    docs/gloo.md, "Shrink and grow back"."""
    s = _world(c)
    e = world.decide(s, timed_out) if s is not None else None
    if s is None or c.state is None or not isinstance(e, (world.Shrink, world.Grow)):
        return False
    if isinstance(e, world.Grow) and c.info.get("shard"):
        return False  # sharded: no replica to copy to the new node
    if isinstance(e, world.Shrink):
        shrink_in_place(c, sorted(map(int, s.lost)), len(world.step(s, e).members))
    else:
        grow_in_place(c, int(e.spare[5:]), now)
    return True
