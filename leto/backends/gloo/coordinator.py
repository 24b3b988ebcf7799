"""The recovery coordinator of a gloo job: the core's ClusterModel, fed by real events.

It runs inside the agent of node 0 (no torch, no IO but the event log; time comes
in as an argument). Agents forward what their processes report; the coordinator
turns it into the core's events, steps :class:`~leto.core.cluster.ClusterModel`
(the same model the TLA+ spec and the explicit-state checker verify), and turns
the effects into commands for the agents (``outbox``: ``(node or None for every
node, message)``).

Training path, per step ``V``: every rank's ``vote`` (gradients sealed, gradient
parity written, prepare record in its node's memory) -> once all ``W`` are in, the
step's ``Compute``/``Reduce``/``Prepare`` of every rank and ``Decide`` are fed and
``commit(V)`` is broadcast (COMMIT lives here, outside every trainer), as one
aggregated ``CommitStep(V)``. Each rank's ``finished(V)`` is judged on arrival (the
model's guard of ``ApplyStep(V, [rank])``) and gathered; the step's ``ApplyStep(V,
ranks)`` (its ``BeginChunk``/``EndChunk``/``ParityChunk`` per chunk and ``Finish`` of
each rank, :mod:`leto.core.aggregate`) is fed once every rank finished, or before
anything else is fed: O(ranks) per step, not O(ranks x chunks). Every K steps the ranks' ``snapshot_done`` feed ``Tier2Snapshot``. So
between failures the model's state is exactly the job's at step boundaries.

Recovery: a failure report becomes ``Crash``/``Hang``/``LoseMemory``/``LoseNode``;
then, as the core allows: ``Detect`` (abort broadcast), ``Fence`` (agents kill the
stale processes and fence the keepers; promotion waits for their answer),
``Promote`` per failed rank (warm or cold shadow), ``EndPromote``, then every
trainer joins the communicator of the new generation and reports the *truth*
of its retained state (chunk versions, undo copies, sealed gradients, its node's
parity records), which the model adopts as its picture of memory (a trainer
that died between doing something and reporting it leaves the model one event
behind; the retained headers never are) before the core computes the reconcile
plan (:func:`leto.core.adopt.adopt`, which refuses a report the model cannot have
come to: another phase, another shape, memory the model lost found again).
``Reconcile`` (or ``GoFallback`` + ``RestoreCheckpoint``) is carried out by every
trainer, then ``Rebuild`` and ``Resume``. A failure during any of it feeds
``Detect`` again where the core allows it: recovery restarts at the next
generation.

The model judges. An event it refuses stops the job (``CoordinatorOptions.strict``,
on by default) with one line naming what was refused, the error and the model's
state; only messages of an old generation are dropped before it (the keeper's
fence), and votes wait while a recovery runs. What the coordinator feeds the
model and the retained state it adopts are written to the event log as ``core``
records (:mod:`leto.spec.trace`, O(ranks) per step), so that ``leto spec trace
RUN_DIR`` replays the run through the model and checks it against the log.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from leto.core import effects as fx
from leto.core import events as ev
from leto.core import schedule
from leto.core.adopt import Retained, adopt
from leto.core.cluster import ClusterModel, ClusterState, Effect
from leto.core.erasure import Topology
from leto.core.errors import ProtocolError
from leto.core.recovery import Kind, Phase
from leto.core.shadow import ShadowState
from leto.core.trainer import TrainerState
from leto.spec.trace import (
    CoreSetup,
    Item,
    Snapshot,
    describe,
    encode,
    run,
)

from . import messages as M
from .eventlog import EventLog

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


class ModelRefused(Exception):
    """The model refused what the coordinator fed it (judged by ``Coordinator._judge``)."""

    def __init__(self, what: str, source: str, error: ProtocolError, record: dict[str, Any]):
        super().__init__(f"{what} ({source}): {error}")
        self.what, self.source, self.error, self.record = what, source, error, record


@dataclass
class _Recovery:
    started: float
    from_step: int
    generation: int = 0
    restarts: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    phase_start: float = 0.0
    phase_name: str = "detect"
    phases: dict[str, float] = field(default_factory=dict)
    promoted: list[dict[str, Any]] = field(default_factory=list)
    plan: dict[str, Any] = field(default_factory=dict)
    summaries: dict[int, dict[str, Any]] = field(default_factory=dict)
    snapshot: dict[int, Any] = field(default_factory=dict)
    truth_notes: list[str] = field(default_factory=list)


@dataclass
class _Wait:
    what: str  # "fence" | "shadow" | "promote" | "report" | "reconcile" | "rebuild"
    generation: int
    pending: set[int]  # nodes (fence) or ranks
    since: float


def _failed_what(rec: _Recovery) -> str:
    """The failures a recovery is for, in words: "rank 1", "node 1", "rank 0, rank 2"."""
    names = []
    for f in rec.failures:
        name = f"node {f['node']}" if f.get("rank") is None else f"rank {f['rank']}"
        if name not in names:
            names.append(name)
    return ", ".join(names) or "a process"


class Coordinator:
    """See the module docstring. Drive it with :meth:`handle` and :meth:`tick`."""

    def __init__(
        self,
        nodes: int,
        per_node: int,
        *,
        log: EventLog,
        options: CoordinatorOptions | None = None,
    ) -> None:
        self.topology = Topology.uniform(nodes, per_node)
        self.W = nodes * per_node
        self.log = log
        self.opt = options or CoordinatorOptions()
        self.outbox: list[Out] = []
        self.model: ClusterModel | None = None
        self.state: ClusterState | None = None
        self.info: dict[str, Any] = {}  # from the trainers' ready reports
        self.ready: dict[int, dict[str, Any]] = {}  # the ranks' ready messages, as sent
        self.votes: dict[int, set[int]] = {}
        self.finished: dict[int, set[int]] = {}
        self.applied: tuple[int, list[int]] | None = None  # (step, ranks) not yet fed
        self.snaps: dict[int, dict[int, Any]] = {}
        self.ckpts: dict[int, set[int]] = {}  # step -> ranks that wrote their part
        self.t2_step = 0
        self.t2_meta: dict[int, Any] = {}  # rank -> {checksums, ps} of the confirmed snapshot
        self.nodes_up: set[int] = set()
        self.nodes_lost_at: dict[int, float] = {}
        self.node_back_at = 0.0  # when the last lost node's replacement joined
        self.degraded: dict[int, str] = {}  # ranks whose shadow could not be built: why
        self.shadow_pending: list[tuple[int, str]] = []
        self.asked_shadow: set[tuple[int, int]] = set()  # shadow reports before the model exists
        self.rec: _Recovery | None = None
        self.wait: _Wait | None = None
        self.reports: dict[int, dict[str, Any]] = {}
        self.stopped_at: dict[int, float] = {}
        self.done: dict[int, M.Done] = {}
        self.finished_nodes: set[int] = set()
        self.failed: str | None = None
        self.complete = False
        self.recoveries: list[dict[str, Any]] = []
        self.losses: dict[int, float] = {}

    # ------------------------------------------------------------------ plumbing

    def _send(self, node: int | None, msg: M.Message) -> None:
        self.outbox.append((node, msg))

    def _node_of(self, rank: int) -> int:
        return self.topology.node_of(rank)

    @property
    def generation(self) -> int:
        return self.state.gen if self.state is not None else 0

    def _feed(self, e: ev.Event) -> tuple[Effect, ...]:
        return self._run([e], "the recovery driver")

    def _run(self, items: list[Item], source: str) -> tuple[Effect, ...]:
        """Feed ``items`` to the model, all or nothing, and log them as one ``core`` record;
        a refusal raises :class:`ModelRefused` and leaves the state as it was."""
        assert self.model is not None and self.state is not None
        self._flush_applied()
        feed = [encode(i) for i in items]
        try:
            self.state, effects = run(self.model, self.state, items)
        except ProtocolError as err:
            what = ", ".join(repr(i) for i in items)
            raise ModelRefused(what, source, err, {"feed": feed}) from None
        self.log.write("core", feed=feed)
        return effects

    def _flush_applied(self) -> None:
        """Feed the finished ranks gathered for a step as one ``ApplyStep``."""
        if self.applied is not None:
            (step, ranks), self.applied = self.applied, None
            what = f"{len(ranks)} rank(s) finished step {step}"
            self._run([ev.ApplyStep(step, sorted(ranks))], what)

    @contextlib.contextmanager
    def _judging(self) -> Iterator[None]:
        try:
            yield
        except ModelRefused as refused:
            self._judge(refused)

    def _judge(self, refused: ModelRefused) -> None:
        """The model refused an input: stop the job, naming it (strict), or log it."""
        line = (
            f"the protocol model refused {refused.what} ({refused.source}): {refused.error}; "
            f"model: {describe(self.state)}"
        )
        if self.opt.strict:
            self.fail(line, **refused.record)
        else:
            self.log.write("model_mismatch", error=line, **refused.record)

    def _try(self, e: ev.Event) -> bool:
        assert self.model is not None and self.state is not None
        if self.model.why_not(self.state, e) is not None:
            return False
        self._feed(e)
        return True

    def fail(self, message: str, **fields: Any) -> None:
        if self.failed is not None:
            return
        self.failed = message
        self.log.write("job_failed", error=message, **fields)
        self._send(None, M.Fail(error=message))

    # ------------------------------------------------------------------ inputs

    def handle(self, node: int, msg: M.Message, now: float) -> None:
        """One message from the agent of ``node``."""
        with self._judging():
            match msg:
                case M.Ready():
                    self._on_ready(msg)
                case M.Vote():
                    self._on_vote(msg)
                case M.Finished():
                    self._on_finished(msg)
                case M.SnapshotDone():
                    self._on_snapshot_done(msg)
                case M.CheckpointWritten():
                    self._on_ckpt_written(msg)
                case M.Done():
                    self._on_done(msg)
                case M.NodeFinished():
                    self.finished_nodes.add(node)
                case M.Shadow():
                    self._on_shadow(msg)
                case M.Failure():
                    self._on_failure(msg, now)
                case M.Fatal():
                    self.fail(f"rank {msg.rank}: {msg.error}", rank=msg.rank)
                case M.Stopped():
                    self._on_stopped(msg, now)
                case M.Fenced():
                    self._ack("fence", node, msg.gen)
                case M.Promoted():
                    self._on_promoted(msg)
                case M.Report():
                    if self._ack("report", msg.rank, msg.gen):
                        self.reports[msg.rank] = msg.to_wire()
                case M.Reconciled():
                    self._on_reconciled(msg)
                case M.Rebuilt():
                    self._ack("rebuild", msg.rank, msg.gen)
                case _:
                    self.log.write("unknown_message", node=node, message=msg.to_wire())
                    return
            if self.model is not None and self.failed is None and not self.complete:
                self._advance(now)

    def node_up(self, node: int, *, spare: bool, now: float) -> None:
        self.nodes_up.add(node)
        if self.nodes_lost_at.pop(node, None) is not None:
            self.node_back_at = now
        self.log.write("node_joined", node=node, spare=spare)

    def node_down(self, node: int, now: float, why: str = "agent link closed") -> None:
        """The link to ``node``'s agent closed: the node is lost (unless the job is over)."""
        self.nodes_up.discard(node)
        if self.complete or self.failed is not None:
            self.finished_nodes.add(node)  # gone after the job completed: done too
            return
        if self.model is None:
            self.fail(f"node {node} was lost before training started ({why})")
            return
        self.nodes_lost_at[node] = now
        with self._judging():
            self._failure(
                {"kind": "node_lost", "node": node, "detected_by": why, "rank": None}, now
            )
            self._advance(now)

    def tick(self, now: float) -> None:
        """Timers: a spare that does not come, a recovery stuck waiting."""
        if self.failed is not None or self.complete or self.model is None:
            return
        for node, since in list(self.nodes_lost_at.items()):
            if now - since > self.opt.spare_timeout and node not in self.nodes_up:
                self.fail(
                    f"node {node} was lost and no replacement joined within "
                    f"{self.opt.spare_timeout:g} s: start `leto launch` with --node-rank {node} "
                    "on a spare node (same arguments) to recover in place"
                )
                return
        rec = self.rec
        if rec is not None and not self.nodes_lost_at:
            if now - max(rec.started, self.node_back_at) > self.opt.recovery_timeout:
                self.fail(
                    f"the recovery from the failure of {_failed_what(rec)} did not end within "
                    f"{self.opt.recovery_timeout:g} s: {self._waiting_for()}"
                )
                return
        s = self.state
        assert s is not None
        for rank, since in list(self.stopped_at.items()):
            if now - since > self.opt.stopped_grace:
                del self.stopped_at[rank]
                if s.phase is Phase.RUNNING and s.trainer[rank] is TrainerState.ALIVE:
                    with self._judging():
                        self._failure(
                            {
                                "kind": "collective_error",
                                "rank": rank,
                                "detected_by": "collective error with no failure reported",
                            },
                            now,
                        )
                        self._advance(now)

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
        )
        for k in keys:
            vals = {str(i.get(k)) for i in infos}
            if len(vals) > 1:
                self.fail(
                    f"ranks disagree on {k}: {sorted(vals)} (is every node running the same script and config?)"
                )
                return
        self.info = {k: infos[0].get(k) for k in keys}
        setup = CoreSetup(
            nodes=self.topology.node_sizes,
            chunks=int(self.info["n_chunks"]),
            k=int(self.info["tier2_interval"]) if self.info["tier2"] else None,
            tier1=bool(self.info.get("tier1", True)),
            tier2_parity=int(self.info.get("tier2_parity") or 1),
            # shadows are started with the trainers: spawning until they report warm
            shadows=ShadowState.SPAWNING,
            start=int(self.info.get("start") or 0),
        )
        self.t2_step = setup.start
        self.model = setup.model()
        self.state = setup.initial(self.model)
        self.log.write("core_init", **setup.to_record())
        for r, i in self.ready.items():
            self.t2_meta[r] = i.get("snapshot")
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
            self._shadow(r, st)
        self.shadow_pending.clear()
        self._send(None, M.Tier2(step=0, gen=0))  # the step-0 snapshot is current
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
        self._run([ev.CommitStep(step)], f"the votes for step {step}")
        del self.votes[step]
        self._send(None, M.Commit(step=step, gen=s.gen))

    def _on_finished(self, msg: M.Finished) -> None:
        if not self._current(msg.gen):
            return
        r, step = msg.rank, msg.step
        assert self.model is not None and self.state is not None
        one = ev.ApplyStep(step, (r,))
        pending = self.applied
        if pending is not None and (pending[0] != step or r in pending[1]):
            self._flush_applied()
            pending = None
        if self.model.why_not(self.state, one) is not None:
            self._run([one], f"rank {r} finished step {step}")  # refused: the job stops
        if pending is None:
            pending = self.applied = (step, [])
        pending[1].append(r)
        if len(pending[1]) == self.W:
            self._flush_applied()
        if msg.loss is not None:
            fin = self.finished.setdefault(step, set())
            fin.add(r)
            self.losses[step] = self.losses.get(step, 0.0) + float(msg.loss) / self.W
            if len(fin) == self.W:
                del self.finished[step]
                # the model first: a partial gather flushed earlier (before another event)
                # leaves the last ranks pending, and the record says every rank finished
                self._flush_applied()
                self.log.write("step", step=step, loss=round(self.losses[step], 6))

    def _on_snapshot_done(self, msg: M.SnapshotDone) -> None:
        if not self._current(msg.gen):
            return
        step = msg.step
        got = self.snaps.setdefault(step, {})
        got[msg.rank] = msg.meta
        if len(got) < self.W:
            return
        del self.snaps[step]
        self._run([Snapshot(step)], f"every rank took the tier-2 snapshot of step {step}")
        self.t2_step = step
        self.t2_meta = dict(got)
        self._send(None, M.Tier2(step=step, gen=self.generation))
        self.log.write("tier2_snapshot", step=step)

    def _on_ckpt_written(self, msg: M.CheckpointWritten) -> None:
        """Every rank wrote its part of the checkpoint of ``step``: BeginCheckpoint (they
        staged it idle at ``step``), each WriteShard, then CheckpointDurable: the
        fallback step moves. (The job's start is durable in the model from the start.)"""
        if not self._current(msg.gen):
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
        self._run(items, f"every rank wrote its part of the checkpoint of step {msg.step}")
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
        self.complete = True
        self.log.write(
            "training_done",
            step=steps.pop(),
            digests={str(r): m.digest for r, m in sorted(self.done.items())},
            recoveries=len(self.recoveries),
            degraded=sorted(self.degraded),
        )
        self._send(None, M.Complete())

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
        self._shadow(r, st)

    def _shadow(self, r: int, st: str) -> None:
        if st == "warm":
            if self._try(ev.ShadowWarm(r)) and self.wait is not None and self.wait.what == "shadow":
                self.wait.pending.discard(r)
        elif st == "cold":
            self._try(ev.ShadowReclaim(r))

    # --- failures ------------------------------------------------------------------

    def _on_failure(self, msg: M.Failure, now: float) -> None:
        if self.model is None:
            tb = (msg.traceback or "").strip()
            what = msg.detail or msg.kind
            last = tb.splitlines()[-1] if tb else ""
            self.fail(
                f"rank {msg.rank} failed before training started ({what})"
                + (f": {last}" if last else ""),
                rank=msg.rank,
                traceback=tb or None,
            )
            return
        record = msg.to_wire()
        del record["t"]
        self._failure(record, now)

    def _on_stopped(self, msg: M.Stopped, now: float) -> None:
        s = self.state
        if s is None:
            return
        if s.phase is Phase.RUNNING and msg.reason and self._current(msg.gen):
            self.stopped_at.setdefault(msg.rank, now)

    def _failure(self, msg: dict[str, Any], now: float) -> None:
        """A failure (``msg``: its record, as reported or as the coordinator saw it)."""
        s = self.state
        assert s is not None and self.model is not None
        kind = msg.get("kind")
        rank = msg.get("rank")
        fault: ev.Event
        if kind == "node_lost":
            fault = ev.LoseNode(int(msg["node"]))
        elif kind == "keeper_lost":
            fault = ev.LoseMemory(int(rank))  # type: ignore[arg-type]
        elif kind == "hang":
            fault = ev.Hang(int(rank))  # type: ignore[arg-type]
        else:
            fault = ev.Crash(int(rank))  # type: ignore[arg-type]
        why = self.model.why_not(s, fault)
        record = dict(msg)
        record["step"] = s.committed
        record["phase"] = s.phase.value
        if why is not None:
            # e.g. a crash of a rank already dead, or of a process of an old generation
            self.log.write("failure_ignored", **record, why=str(why), refused=encode(fault))
            return
        self._run([fault], "a failure report")
        self.log.write("failure", **record, generation=s.gen)
        if isinstance(fault, ev.LoseNode):
            self.nodes_lost_at.setdefault(fault.node, now)
        if self.rec is None:
            self.rec = _Recovery(started=now, from_step=s.committed, phase_start=now)
        self.rec.failures.append(record)
        if self.wait is not None and self.wait.what == "promote" and rank is not None:
            self.wait.pending.discard(int(rank))
        if self.wait is not None and kind == "node_lost" and self.wait.what == "fence":
            self.wait.pending.discard(int(msg["node"]))

    # --- recovery acknowledgements ----------------------------------------------------

    def _ack(self, what: str, key: int, gen: int) -> bool:
        w = self.wait
        if w is None or w.what != what or gen != w.generation:
            return False
        w.pending.discard(key)
        return True

    def _on_promoted(self, msg: M.Promoted) -> None:
        if self._ack("promote", msg.rank, msg.gen) and self.rec is not None:
            self.rec.promoted.append({"rank": msg.rank, "warm": bool(msg.warm), "ms": msg.ms})
            self.log.write(
                "promoted",
                rank=msg.rank,
                warm=bool(msg.warm),
                ms=msg.ms,
                generation=self.generation,
            )

    def _on_reconciled(self, msg: M.Reconciled) -> None:
        if self._ack("reconcile", msg.rank, msg.gen) and self.rec is not None:
            self.rec.summaries[msg.rank] = msg.summary
            self.rec.snapshot[msg.rank] = msg.snapshot

    # ------------------------------------------------------------------ the driver

    def _phase(self, name: str, now: float) -> None:
        rec = self.rec
        if rec is None:
            return
        rec.phases[rec.phase_name] = rec.phases.get(rec.phase_name, 0.0) + (now - rec.phase_start)
        rec.phase_name = name
        rec.phase_start = now

    def _wait(self, what: str, pending: set[int], now: float) -> None:
        self.wait = _Wait(what, self.generation, set(pending), now)

    def _advance(self, now: float) -> None:
        """Carry out the recovery the core schedules (:mod:`leto.core.schedule`).

        The core picks the next event; this driver only waits for what an event needs
        from the world (the trainers' acknowledgements, their reports, a warm shadow).
        """
        for _ in range(1000):
            if self.failed is not None or self.complete:
                return
            s = self.state
            assert s is not None and self.model is not None
            nxt = schedule.next_events(self.model, s)
            if not nxt:
                return
            first = nxt[0]
            if isinstance(first, ev.Detect):
                self._detect(now)
                continue
            if self.wait is not None and self.wait.pending:
                return
            if isinstance(first, ev.Fence):
                self._fence(now)
                return
            if isinstance(first, (ev.Promote, ev.ShadowWarm, ev.EndPromote)):
                if not self._promote(nxt, now):
                    return
                continue
            if isinstance(first, (ev.Reconcile, ev.GoFallback)):
                if not self._reconcile(now):
                    return
                continue
            if isinstance(first, ev.RestoreCheckpoint):
                self._restore_checkpoint(now)
                return
            if isinstance(first, ev.Rebuild):
                self._log_reconciled(now)
                self._phase("rebuild", now)
                self._feed(first)
                self._send(None, M.Rebuild(gen=s.gen))
                self._wait("rebuild", set(range(self.W)), now)
                return
            if isinstance(first, ev.Resume):
                self._resume(now)
                return
            raise AssertionError(f"no executor for the scheduled {first!r}")  # pragma: no cover
        raise RuntimeError("recovery driver did not settle")  # pragma: no cover

    def _detect(self, now: float) -> None:
        s = self.state
        assert s is not None
        during = s.phase is not Phase.RUNNING
        if self.rec is None:
            self.rec = _Recovery(started=now, from_step=s.committed, phase_start=now)
        rec = self.rec
        if len(self.recoveries) >= self.opt.max_recoveries:
            self.fail(f"more than {self.opt.max_recoveries} recoveries: giving up")
            return
        self._feed(ev.Detect())
        self.wait = None
        self.done.clear()
        self.stopped_at.clear()  # collective errors seen so far are explained by this failure
        if during:
            rec.restarts += 1
            self.log.write(
                "recovery_restart",
                generation=s.gen,
                phase=s.phase.value,
                cause=[f for f in rec.failures[-1:]],
            )
        else:
            self.log.write("recovery_start", generation=s.gen, from_step=s.committed)
        self._phase("fence", now)
        self._send(None, M.Abort(gen=s.gen))

    def _fence(self, now: float) -> None:
        s = self.state
        assert s is not None
        hung = [r for r, t in enumerate(s.trainer) if t is TrainerState.HUNG]
        self._feed(ev.Fence())
        gen = self.generation
        assert self.rec is not None
        self.rec.generation = gen
        self._send(None, M.Fence(gen=gen, kill=hung))
        self._wait("fence", set(self.nodes_up), now)
        self.log.write("fence", generation=gen, stale_killed=hung)

    def _promote(self, nxt: tuple[ev.Event, ...], now: float) -> bool:
        """Carry out the scheduled promotions; True once EndPromote was fed."""
        s = self.state
        assert s is not None and self.model is not None
        if self.wait is not None and self.wait.what == "fence":
            for r, stale in enumerate(s.stale):
                if stale:  # the fence killed it: its writes can no longer happen
                    self._try(ev.StaleWrite(r, 0))
            self.wait = None
            self._phase("promote", now)
            s = self.state
            assert s is not None
            nxt = schedule.next_events(self.model, s)
        if any(isinstance(e, ev.EndPromote) for e in nxt):
            self._feed(ev.EndPromote())
            self._phase("rejoin", now)  # the new generation's communicator + retained truth
            return True
        sent, needed = set(), set()
        for e in nxt:
            r = e.rank  # type: ignore[attr-defined]
            if self._node_of(r) not in self.nodes_up:
                continue  # its node is being replaced
            if isinstance(e, ev.ShadowWarm):
                # its replacement shadow must be warm first: make sure one is coming
                # (the shadow's warm report feeds ShadowWarm)
                if (r, s.gen) not in self.asked_shadow:
                    self.asked_shadow.add((r, s.gen))
                    self._send(self._node_of(r), M.NeedShadow(rank=r))
                needed.add(r)
                continue
            warm = s.shadow[r] is ShadowState.WARM
            self._feed(e)
            self._send(self._node_of(r), M.PromoteRank(rank=r, gen=s.gen, warm=warm))
            sent.add(r)
        if sent:
            pending = set(sent)
            if self.wait is not None and self.wait.what == "promote":
                pending |= self.wait.pending
            self._wait("promote", pending, now)
        elif needed:
            self._wait("shadow", needed, now)  # until their warm reports
        return False

    def _reconcile(self, now: float) -> bool:
        s = self.state
        assert s is not None and self.model is not None
        if self.wait is None or self.wait.what not in ("report",):
            self.reports = {}
            self._send(None, M.CallReports(gen=s.gen))
            self._wait("report", set(range(self.W)), now)
            return False
        # every trainer reported: the truth of the retained state replaces the model's
        self._phase("reconcile", now)
        self.state = self._truth(s)
        s = self.state
        plan = self.model.plan(s)
        fallback = isinstance(schedule.next_event(self.model, s), ev.GoFallback)
        self.wait = None
        if fallback and not self.info.get("checkpoint"):
            self.fail(
                "cannot recover in place: "
                + plan.reason
                + ". No checkpoint is configured (set checkpoint_dir in the leto config), "
                "so training stops here instead of resuming on wrong state",
                plan=plan.reason,
            )
            return False
        assert self.rec is not None
        if fallback:
            self._feed(ev.GoFallback())
            self.rec.plan = {
                "kind": "ckpt",
                "target": s.ckpt,  # the latest durable checkpoint
                "reason": plan.reason,
                "steps_lost": s.committed - s.ckpt,
                "repairs": [],
                "tier2_retaken": bool(self.info.get("tier2")),
            }
            return True
        effects = self._feed(ev.Reconcile())
        repairs = [
            {"what": x.what, "rank": x.rank, "chunk": x.chunk, "step": x.step}
            for x in effects
            if isinstance(x, fx.RunRepair)
        ]
        after = self.state
        assert after is not None
        self.rec.plan = {
            "kind": after.kind.value,
            "target": after.target,
            "reason": plan.reason,
            "steps_lost": after.loss,
            "repairs": repairs,
            # the tier-2 snapshot is retaken only if it lost blocks (the model's rule)
            "tier2_retaken": bool(s.t2lost) and bool(self.info.get("tier2")),
        }
        cmd = self._reconcile_cmd(after.kind, after.target, repairs, retake_t2=bool(s.t2lost))
        self._send(None, cmd)
        self._wait("reconcile", set(range(self.W)), now)
        return False

    def _reconcile_cmd(
        self, kind: Kind, target: int, repairs: list[dict[str, Any]], *, retake_t2: bool = True
    ) -> M.Reconcile:
        snapshot = None
        if kind is Kind.TIER2:
            snapshot = {
                "step": self.t2_step,
                "meta": {str(r): m for r, m in self.t2_meta.items()},
            }
        return M.Reconcile(
            gen=self.generation,
            kind=kind.value,
            target=target,
            repairs=repairs,
            retake_t2=retake_t2,
            snapshot=snapshot,
        )

    def _restore_checkpoint(self, now: float) -> None:
        assert self.state is not None
        step = self.state.ckpt  # the latest durable checkpoint
        self._feed(ev.RestoreCheckpoint())
        self._send(None, self._reconcile_cmd(Kind.CKPT, step, []))
        self._wait("reconcile", set(range(self.W)), now)

    def _truth(self, s: ClusterState) -> ClusterState:
        """The model's state with the retained state as the trainers found it: adopted
        through :func:`leto.core.adopt.adopt` (which refuses what the model cannot have
        come to) and logged as a ``core`` record, so the trace replays it."""
        assert self.model is not None
        data, undo, grad = [], [], []
        notes = []
        for r in range(self.W):
            rep = self.reports[r]
            d = tuple(int(x) for x in rep["data"])
            u = tuple(int(x) for x in rep["undo"])
            g = int(rep["grad"])
            if (d, u, g) != (s.data[r], s.undo[r], s.grad[r]):
                notes.append(
                    f"rank {r}: model data={list(s.data[r])} undo={list(s.undo[r])} grad={s.grad[r]}, retained data={list(d)} undo={list(u)} grad={g}"
                )
            data.append(d)
            undo.append(u)
            grad.append(g)
        par, gpar = [], []
        for n in range(self.topology.nodes):
            head = self.reports[self.topology.ranks_of(n)[0]]
            p = head.get("node_par")
            gp = head.get("node_gpar")
            newp = None if p is None else tuple(tuple(int(v) for v in row) for row in p)
            newg = None if gp is None else tuple(int(v) for v in gp)
            if newp != s.par[n] or newg != s.gpar[n]:
                notes.append(
                    f"node {n}: model par={s.par[n]} gpar={s.gpar[n]}, retained par={newp} gpar={newg}"
                )
            par.append(newp)
            gpar.append(newg)
        t2lost = s.t2lost if self.info.get("tier2") else frozenset(range(self.topology.nodes))
        retained = Retained(
            data=tuple(data),
            undo=tuple(undo),
            grad=tuple(grad),
            par=tuple(par),
            gpar=tuple(gpar),
            t2=self.t2_step,
            t2lost=t2lost,
        )
        try:
            after = adopt(self.model, s, retained)
        except ProtocolError as err:
            what = "the retained state the trainers reported"
            source = f"generation {s.gen}"
            raise ModelRefused(what, source, err, {"adopt": retained.to_record()}) from None
        self.log.write("core", adopt=retained.to_record())
        if self.rec is not None:
            self.rec.truth_notes.extend(notes)
        if notes:
            self.log.write("retained_truth", generation=s.gen, differences=notes)
        return after

    def _log_reconciled(self, now: float) -> None:
        rec = self.rec
        if rec is None:
            return
        # every rank took the snapshot of the target step: it becomes the tier-2 snapshot
        s = self.state
        assert s is not None
        snaps = rec.snapshot
        if (
            self.info.get("tier2")
            and len(snaps) == self.W
            and all(m is not None for m in snaps.values())
        ):
            self.t2_step = s.target
            self.t2_meta = dict(rec.snapshot)
            self._send(None, M.Tier2(step=s.target, gen=s.gen))
        sums = rec.summaries
        total = {
            k: sum(int(x.get(k, 0)) for x in sums.values())
            for k in (
                "chunks_repaired_tier1",
                "grads_repaired_tier1",
                "chunks_rolled_forward",
                "chunks_rolled_back",
                "chunks_restored",
                "tier1_from_replicas",
                "parity_reencoded",
                "parity_checked",
            )
        }
        slowest = {
            k: max((float(x.get(k, 0.0)) for x in sums.values()), default=0.0)
            for k in ("repair_ms", "redundancy_ms")
        }
        pg = [float(r.get("pg_ms", 0.0)) for r in self.reports.values()]
        slowest["communicator_ms"] = max(pg, default=0.0)
        self.log.write("reconciled", generation=self.generation, **rec.plan, **total, **slowest)
        rec.plan.update(total)
        rec.plan["slowest_rank_ms"] = slowest

    def _resume(self, now: float) -> None:
        s = self.state
        assert s is not None
        target = s.target
        self._phase("resume", now)
        self._feed(ev.Resume())
        self.wait = None
        self._send(None, M.Resume(gen=s.gen, step=target, t2=self.t2_step))
        rec = self.rec
        self.rec = None
        self.votes.clear()
        self.finished.clear()
        self.snaps.clear()
        if rec is None:
            return
        self._phase("done", now)
        total = now - rec.started
        entry = {
            "generation": s.gen,
            "from_step": rec.from_step,
            "resumed_at": target,
            "failures": rec.failures,
            "promoted": rec.promoted,
            "restarts": rec.restarts,
            "phases_ms": {k: round(v * 1e3, 3) for k, v in rec.phases.items() if k != "done"},
            "seconds": round(total, 6),
            **rec.plan,
        }
        if rec.truth_notes:
            entry["truth_notes"] = rec.truth_notes
        self.recoveries.append(entry)
        self.log.write("recovery_end", **entry)

    def _waiting_for(self) -> str:
        """What a recovery is waiting for, in words (its timeout's message)."""
        s = self.state
        assert s is not None
        w = self.wait
        where = f"phase {s.phase.value}, generation {s.gen}"
        if w is None or not w.pending:
            return f"it made no progress ({where})"
        who = {
            "fence": "the fence of node(s)",
            "shadow": "a shadow of rank(s)",
            "promote": "the promotion of rank(s)",
            "report": "the retained-state report of rank(s)",
            "reconcile": "the reconcile of rank(s)",
            "rebuild": "the rebuild of rank(s)",
        }.get(w.what, w.what + " of")
        return f"still waiting for {who} {sorted(w.pending)} ({where})"

    # ------------------------------------------------------------------ queries

    def summary(self) -> dict[str, Any]:
        s = self.state
        return {
            "phase": None if s is None else s.phase.value,
            "committed": None if s is None else s.committed,
            "generation": self.generation,
            "recoveries": len(self.recoveries),
            "failed": self.failed,
            "complete": self.complete,
        }
