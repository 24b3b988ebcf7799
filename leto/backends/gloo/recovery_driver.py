"""The gloo coordinator's recovery driver: from a failure report to ``Resume``.

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

The core picks every next event (:mod:`leto.core.schedule`) and its effects say what
is sent (:mod:`.commands`, through :meth:`.coordinator.Coordinator.carry_out`); the
driver only decides when, and waits for what an event needs from the world. Its state (the recovery
under way, ``rec``; what it waits for, ``wait``; the trainers' reports; the recoveries
that ended) is its own; of its coordinator it uses what :class:`RecoveryHost` names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from leto.core import effects as fx
from leto.core import events as ev
from leto.core import restart, schedule
from leto.core.adopt import Retained, adopt
from leto.core.cluster import ClusterModel, ClusterState
from leto.core.erasure import Topology
from leto.core.errors import ProtocolError
from leto.core.recovery import Phase
from leto.core.runs import records_from_runs, row_from_runs
from leto.spec.trace import encode

from . import messages as M
from .commit_record import CommitRecord
from .eventlog import EventLog
from .exclusion import Exclusions
from .model_feed import Fed, ModelFeeder, ModelRefused
from .tier2_record import Tier2Record

__all__ = ["Recovery", "RecoveryDriver", "RecoveryHost", "Wait", "failed_what"]


@dataclass
class Recovery:
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
class Wait:
    what: str  # "fence" | "shadow" | "promote" | "report" | "reconcile" | "rebuild"
    generation: int
    pending: set[int]  # nodes (fence) or ranks
    since: float


def failed_what(rec: Recovery) -> str:
    """The failures a recovery is for, in words: "rank 1", "node 1", "rank 0, rank 2"."""
    names = []
    for f in rec.failures:
        name = f"node {f['node']}" if f.get("rank") is None else f"rank {f['rank']}"
        if name not in names:
            names.append(name)
    return ", ".join(names) or "a process"


class RecoveryHost(Protocol):
    """What the recovery driver uses of its coordinator: the model and its state (the
    retained truth replaces it), the job's shape and settings, the nodes up, and how
    commands are sent, the job ends and the training path's gathers are voided."""

    @property
    def model(self) -> ClusterModel | None: ...

    state: ClusterState | None

    @property
    def generation(self) -> int: ...

    @property
    def W(self) -> int: ...

    @property
    def topology(self) -> Topology: ...

    @property
    def info(self) -> dict[str, Any]: ...

    @property
    def tier2(self) -> Tier2Record: ...

    @property
    def nodes_up(self) -> set[int]: ...

    @property
    def failed(self) -> str | None: ...

    @property
    def record(self) -> CommitRecord: ...

    @property
    def complete(self) -> bool: ...

    def send(self, node: int | None, msg: M.Message) -> None: ...

    def carry_out(self, fed: Fed) -> list[M.Message]: ...

    def fail(
        self, message: str, *, ending: restart.Ending = restart.Ending.FATAL, **fields: Any
    ) -> None: ...

    def durable(self, write: Callable[[], None]) -> bool: ...

    def model_record(self, name: str, **fields: Any) -> None: ...

    def lost_node(self, node: int, now: float) -> None: ...

    @property
    def exclusions(self) -> Exclusions: ...

    @property
    def reshaped_from(self) -> dict[str, int]: ...

    def forget_done(self) -> None: ...

    def forget_gathered(self) -> None: ...


# What each kind of failure is to the core: the event fed for it, and whether it
# struck a node (``node``) or a rank (``rank``)
FAULT_OF: dict[str, tuple[Callable[[int], ev.Event], str]] = {
    "crash": (ev.Crash, "rank"),  # the process exited (killed, or a signal)
    "exception": (ev.Crash, "rank"),  # the script raised: its process ends
    "collective_error": (ev.Crash, "rank"),  # its communicator broke, no failure reported
    "hang": (ev.Hang, "rank"),  # no heartbeat within the hang timeout
    "keeper_lost": (ev.LoseMemory, "rank"),  # its keeper died: its retained memory is gone
    "diverged": (ev.LoseMemory, "rank"),  # a replica check found it apart: discarded
    "node_lost": (ev.LoseNode, "node"),  # its agent is gone
}


def fault_of(record: dict[str, Any]) -> ev.Event:
    """The core's event for a failure ``record`` (its ``kind`` and subject)."""
    kind = record.get("kind")
    if kind not in FAULT_OF:
        raise ValueError(f"a failure of unknown kind {kind!r} (known: {', '.join(FAULT_OF)})")
    event, subject = FAULT_OF[str(kind)]
    who = record.get(subject)
    if not isinstance(who, int) or isinstance(who, bool):
        raise ValueError(f"a failure of kind {kind!r} without its {subject}: {record}")
    return event(who)


class RecoveryDriver:
    """Carries out a gloo job's recoveries for its coordinator (see the module docstring)."""

    def __init__(
        self,
        host: RecoveryHost,
        *,
        log: EventLog,
        feeder: ModelFeeder,
        max_recoveries: int,
    ) -> None:
        self.host = host
        self.log = log
        self.feeder = feeder
        self.max_recoveries = max_recoveries
        self.rec: Recovery | None = None  # the recovery under way
        self.wait: Wait | None = None  # what it waits for from the world
        self.reports: dict[int, dict[str, Any]] = {}  # the trainers' retained state, by rank
        self.stopped_at: dict[int, float] = {}  # ranks stopped with no failure reported: since
        self.asked_shadow: set[tuple[int, int]] = set()  # (rank, generation) shadows asked for
        self.pids: dict[int, int] = {}  # rank -> its trainer's pid (a promotion's old pid)
        self.recoveries: list[dict[str, Any]] = []  # those that ended, one record each

    def failure(self, msg: dict[str, Any], now: float) -> None:
        """A failure (``msg``: its record, as reported or as the coordinator saw it: its
        ``kind``, one of :data:`FAULT_OF`, and the rank, or the node, it struck)."""
        s = self.host.state
        assert s is not None and self.host.model is not None
        kind = msg.get("kind")
        rank = msg.get("rank")
        fault = fault_of(msg)
        why = self.host.model.why_not(s, fault)
        record = dict(msg)
        record["step"] = s.committed
        record["phase"] = s.phase.value
        if why is not None:
            # e.g. a crash of a rank already dead, or of a process of an old generation
            self.log.write("failure_ignored", **record, why=str(why), refused=encode(fault))
            return
        self.feeder.run([fault], "a failure report")
        self.log.write("failure", **record, generation=s.gen)
        node = msg.get("node") if kind == "node_lost" else None
        if node is None and isinstance(rank, int) and 0 <= rank < self.host.W:
            node = self.host.topology.node_of(rank)
        if isinstance(node, int):
            self.host.exclusions.failed(node, now)
        if isinstance(fault, ev.LoseNode):
            self.host.lost_node(fault.node, now)
        if self.rec is None:
            self.rec = Recovery(started=now, from_step=s.committed, phase_start=now)
        self.rec.failures.append(record)
        if self.wait is not None and self.wait.what == "promote" and rank is not None:
            self.wait.pending.discard(int(rank))
        if self.wait is not None and kind == "node_lost" and self.wait.what == "fence":
            self.wait.pending.discard(int(msg["node"]))

    def on_failure(self, msg: M.Failure, now: float) -> None:
        if self.host.model is None:
            tb = (msg.traceback or "").strip()
            what = msg.detail or msg.kind
            last = tb.splitlines()[-1] if tb else ""
            when = "while the world changed in place" if self.host.reshaped_from else ""
            self.host.fail(
                f"rank {msg.rank} failed {when or 'before training started'} ({what})"
                + (f": {last}" if last else ""),
                # a process lost (killed, crashed) may succeed when the job starts again
                # (--max-restarts); the script's own exception would only repeat
                ending=restart.Ending.GAVE_UP if msg.kind == "crash" else restart.Ending.FATAL,
                rank=msg.rank,
                traceback=tb or None,
            )
            return
        if self.host.complete:
            self._after_training(msg)
            return
        record = msg.to_wire()
        del record["t"]
        self.failure(record, now)

    def _after_training(self, msg: M.Failure) -> None:
        """A trainer that ended other than by exit code 0 after the whole job completed
        training: the script's own code after its loop failed, or was killed, on that
        rank. Nothing of training is lost (every rank reported the final step), but that
        code did not finish, and the job must not say it succeeded: it stops with one
        line (no restart: training is done, and the script's exception would repeat)."""
        tb = (msg.traceback or "").strip()
        last = tb.splitlines()[-1] if tb else ""
        how = "raised an exception" if msg.kind == "exception" else "died"
        self.host.fail(
            f"rank {msg.rank} {how} ({msg.detail or msg.kind}) after training completed, in "
            "the script's code after its loop: "
            + (last or f"that code did not finish on rank {msg.rank}"),
            rank=msg.rank,
            traceback=tb or None,
        )

    def on_stopped(self, msg: M.Stopped, now: float) -> None:
        s = self.host.state
        if s is None:
            return
        if (
            msg.reason
            and msg.gen == s.gen
            and (s.phase is Phase.RUNNING or self.waits_on(msg.rank, msg.gen))
        ):
            self.stopped_at.setdefault(msg.rank, now)

    def waits_on(self, rank: int, gen: int) -> bool:
        """The recovery waits for ``rank``'s report, reconcile or rebuild in ``gen``: a
        step of it that failed there with no failure to explain it (a communicator that
        could not form) leaves the recovery waiting for nothing, unless it restarts."""
        w = self.wait
        return (
            w is not None
            and w.generation == gen
            and w.what in ("report", "reconcile", "rebuild")
            and rank in w.pending
        )

    def ack(self, what: str, key: int, gen: int) -> bool:
        w = self.wait
        if w is None or w.what != what or gen != w.generation:
            return False
        w.pending.discard(key)
        return True

    def on_report(self, msg: M.Report) -> None:
        """A trainer's report of its retained state (kept if the recovery waits for it)."""
        if self.ack("report", msg.rank, msg.gen):
            self.reports[msg.rank] = msg.to_wire()

    def shadow_state(self, rank: int, state: str) -> None:
        """``rank``'s shadow is ``state`` (its agent says): fed to the model; one it took
        as warm lets a promotion waiting for it go on."""
        if state == "warm":
            if self.feeder.try_event(ev.ShadowWarm(rank)):
                if self.wait is not None and self.wait.what == "shadow":
                    self.wait.pending.discard(rank)
        elif state == "cold":
            self.feeder.try_event(ev.ShadowReclaim(rank))

    def on_promoted(self, msg: M.Promoted) -> None:
        """A shadow is its rank's trainer now: the new process replaces the old one (their
        pids in the log: the old one is the trainer that failed)."""
        if self.ack("promote", msg.rank, msg.gen) and self.rec is not None:
            pids = {"pid": msg.pid, "old_pid": self.pids.get(msg.rank)}
            pids = {k: v for k, v in pids.items() if v is not None}
            if msg.pid is not None:
                self.pids[msg.rank] = msg.pid
            self.rec.promoted.append(
                {"rank": msg.rank, "warm": bool(msg.warm), "ms": msg.ms, **pids}
            )
            self.log.write(
                "promoted",
                rank=msg.rank,
                warm=bool(msg.warm),
                ms=msg.ms,
                generation=self.host.generation,
                **pids,
            )

    def on_reconciled(self, msg: M.Reconciled) -> None:
        if self.ack("reconcile", msg.rank, msg.gen) and self.rec is not None:
            self.rec.summaries[msg.rank] = msg.summary
            self.rec.snapshot[msg.rank] = msg.snapshot

    def _phase(self, name: str, now: float) -> None:
        rec = self.rec
        if rec is None:
            return
        rec.phases[rec.phase_name] = rec.phases.get(rec.phase_name, 0.0) + (now - rec.phase_start)
        rec.phase_name = name
        rec.phase_start = now

    def _wait(self, what: str, pending: set[int], now: float) -> None:
        self.wait = Wait(what, self.host.generation, set(pending), now)

    def advance(self, now: float) -> None:
        """Carry out the recovery the core schedules (:mod:`leto.core.schedule`).

        The core picks the next event; this driver only waits for what an event needs
        from the world (the trainers' acknowledgements, their reports, a warm shadow).
        """
        for _ in range(1000):
            if self.host.failed is not None or self.host.complete:
                return
            s = self.host.state
            assert s is not None and self.host.model is not None
            nxt = schedule.next_events(self.host.model, s)
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
                self.host.carry_out(self.feeder.feed_event(first))  # Rebuild
                self._wait("rebuild", set(range(self.host.W)), now)
                return
            if isinstance(first, ev.Resume):
                self._resume(now)
                return
            raise AssertionError(f"no executor for the scheduled {first!r}")  # pragma: no cover
        raise RuntimeError("recovery driver did not settle")  # pragma: no cover

    def world_changed(self) -> None:
        """The recovery under way ended in an in-place change of the world
        (:mod:`leto.core.reshape`): it waits for nothing more."""
        self.rec = self.wait = None
        self.stopped_at.clear()
        self.reports.clear()

    def give_up(self, message: str, ending: restart.Ending = restart.Ending.GAVE_UP) -> None:
        """A deadline passed (the clock is the coordinator's): the core decides what ends
        the recovery under way (``GiveUp``: phase FAILED, effect ``JobFailed``), then the
        job stops with ``message``, one line naming what the recovery still waited for."""
        s, model = self.host.state, self.host.model
        assert s is not None and model is not None
        fields: dict[str, Any] = {}
        e = schedule.next_event(model, s, overdue=True)
        if isinstance(e, ev.GiveUp):
            with self.feeder.judging():
                for effect in self.feeder.feed_event(e).effects:
                    if isinstance(effect, fx.JobFailed):
                        fields = {"phase": effect.phase, "generation": effect.generation}
        self.host.fail(message, ending=ending, **fields)

    def _detect(self, now: float) -> None:
        s = self.host.state
        assert s is not None
        during = s.phase is not Phase.RUNNING
        if self.rec is None:
            self.rec = Recovery(started=now, from_step=s.committed, phase_start=now)
        rec = self.rec
        fed = self.feeder.feed_event(ev.Detect())
        hopeless = self._hopeless()
        if hopeless is not None:  # the core ends the recovery it has just begun
            self.give_up(*hopeless)
            return
        self.wait = None
        self.host.forget_done()
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
        self.host.carry_out(fed)  # Abort

    def _hopeless(self) -> tuple[str, restart.Ending] | None:
        """Why recovering again cannot help, and how the job ends, or None: too many
        recoveries, or the same exception of the script at the same step in ``REPEATS``
        incarnations in a row (an error of the script, not of the hardware)."""
        if len(self.recoveries) >= self.max_recoveries:
            return (
                f"more than {self.max_recoveries} recoveries: giving up",
                restart.Ending.GAVE_UP,
            )
        rec = self.rec
        assert rec is not None
        last = [rec.failures] + [r.get("failures", []) for r in reversed(self.recoveries)]
        seen = [_exception_of(fs) for fs in last[:REPEATS]]
        first = seen[0]
        if len(seen) == REPEATS and first is not None and all(x == first for x in seen):
            step, line = first
            ranks = sorted({int(f.get("rank", -1)) for fs in last[:REPEATS] for f in fs})
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
            return (
                f"{who} raised the same exception at step {step + 1} {REPEATS} times in "
                f"a row ({line}): an error of the script, not of the hardware; giving up",
                restart.Ending.SCRIPT_ERROR,
            )
        hangs = [_hang_of(fs) for fs in last[:REPEATS]]
        if len(hangs) == REPEATS and hangs[0] is not None and all(h == hangs[0] for h in hangs):
            rank, step, phase = hangs[0]
            return (
                f"rank {rank} made no progress in {phase} of step {step + 1} for "
                f"--hang-timeout {REPEATS} times in a row: a step slower than the hang "
                "timeout rather than a hang of the hardware (raise --hang-timeout); giving up",
                restart.Ending.SCRIPT_ERROR,
            )
        return None

    def _fence(self, now: float) -> None:
        s = self.host.state
        assert s is not None
        fed = self.feeder.feed_event(ev.Fence())
        gen = self.host.generation
        if not self.host.durable(lambda: self.host.record.fence(gen)):
            return  # the new generation is not recorded: no agent may act on it
        assert self.rec is not None
        self.rec.generation = gen
        # Fence, with the hung trainers it made stale processes to kill
        killed = [m.kill for m in self.host.carry_out(fed) if isinstance(m, M.Fence)]
        self._wait("fence", set(self.host.nodes_up), now)
        self.log.write("fence", generation=gen, stale_killed=killed[0])

    def _promote(self, nxt: tuple[ev.Event, ...], now: float) -> bool:
        """Carry out the scheduled promotions; True once EndPromote was fed."""
        s = self.host.state
        assert s is not None and self.host.model is not None
        if self.wait is not None and self.wait.what == "fence":
            for r, stale in enumerate(s.stale):
                if stale:  # the fence killed it: its writes can no longer happen
                    self.feeder.try_event(ev.StaleWrite(r, 0))
            self.wait = None
            self._phase("promote", now)
            s = self.host.state
            assert s is not None
            nxt = schedule.next_events(self.host.model, s)
        if any(isinstance(e, ev.EndPromote) for e in nxt):
            self.feeder.feed_event(ev.EndPromote())
            self._phase("rejoin", now)  # the new generation's communicator + retained truth
            return True
        sent, needed = set(), set()
        for e in nxt:
            r = e.rank  # type: ignore[attr-defined]
            if self.host.topology.node_of(r) not in self.host.nodes_up:
                continue  # its node is being replaced
            if isinstance(e, ev.ShadowWarm):
                # its replacement shadow must be warm first: make sure one is coming
                # (the shadow's warm report feeds ShadowWarm)
                if (r, s.gen) not in self.asked_shadow:
                    self.asked_shadow.add((r, s.gen))
                    self.host.send(self.host.topology.node_of(r), M.NeedShadow(rank=r))
                needed.add(r)
                continue
            self.host.carry_out(self.feeder.feed_event(e))  # PromoteRank
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
        s = self.host.state
        assert s is not None and self.host.model is not None
        if self.wait is None or self.wait.what not in ("report",):
            self.reports = {}
            self.host.send(None, M.CallReports(gen=s.gen))
            self._wait("report", set(range(self.host.W)), now)
            return False
        # every trainer reported: the truth of the retained state replaces the model's
        self._phase("reconcile", now)
        self.host.state = self._truth(s)
        s = self.host.state
        plan = self.host.model.plan(s)
        fallback = isinstance(schedule.next_event(self.host.model, s), ev.GoFallback)
        self.wait = None
        if fallback and not self.host.info.get("checkpoint"):
            self.host.fail(
                "cannot recover in place: "
                + plan.reason
                + ". No checkpoint is configured (set checkpoint_dir in the leto config), "
                "so training stops here instead of resuming on wrong state",
                plan=plan.reason,
            )
            return False
        assert self.rec is not None
        if fallback:
            self.feeder.feed_event(ev.GoFallback())
            self.rec.plan = {
                "kind": "ckpt",
                "target": s.ckpt,  # the latest durable checkpoint
                "reason": plan.reason,
                "steps_lost": s.committed - s.ckpt,
                "repairs": [],
                "tier2_retaken": bool(self.host.info.get("tier2")),
            }
            return True
        fed = self.feeder.feed_event(ev.Reconcile())
        after = self.host.state
        assert after is not None
        # Reconcile, with the plan's repairs (RunRepair)
        sent = [m for m in self.host.carry_out(fed) if isinstance(m, M.Reconcile)][0]
        self.rec.plan = {
            "kind": after.kind.value,
            "target": after.target,
            "reason": plan.reason,
            "steps_lost": after.loss,
            "repairs": sent.repairs,
            # the tier-2 snapshot is retaken only if it lost blocks (the model's rule)
            "tier2_retaken": sent.retake_t2 and bool(self.host.info.get("tier2")),
        }
        self._wait("reconcile", set(range(self.host.W)), now)
        return False

    def _restore_checkpoint(self, now: float) -> None:
        self.host.carry_out(self.feeder.feed_event(ev.RestoreCheckpoint()))  # Reconcile, ckpt
        self._wait("reconcile", set(range(self.host.W)), now)

    def _truth(self, s: ClusterState) -> ClusterState:
        """The model's state with the retained state as the trainers found it: adopted
        through :func:`leto.core.adopt.adopt` (which refuses what the model cannot have
        come to) and logged as a ``core`` record, so the trace replays it."""
        assert self.host.model is not None
        data, undo, grad = [], [], []
        notes = []
        for r in range(self.host.W):
            rep = self.reports[r]
            # rows alike decode to one shared tuple; a row of the wrong length is
            # refused by the adoption, naming the rank
            d, u = row_from_runs(rep["data"]), row_from_runs(rep["undo"])
            g = int(rep["grad"])
            if (d, u, g) != (s.data[r], s.undo[r], s.grad[r]):
                notes.append(
                    f"rank {r}: model data={list(s.data[r])} undo={list(s.undo[r])} grad={s.grad[r]}, retained data={list(d)} undo={list(u)} grad={g}"
                )
            data.append(d)
            undo.append(u)
            grad.append(g)
        par, gpar = [], []
        for n in range(self.host.topology.nodes):
            head = self.reports[self.host.topology.ranks_of(n)[0]]
            p = head.get("node_par")
            gp = head.get("node_gpar")
            newp = None if p is None else records_from_runs(p)
            newg = None if gp is None else tuple(int(v) for v in gp)
            if newp != s.par[n] or newg != s.gpar[n]:
                notes.append(
                    f"node {n}: model par={s.par[n]} gpar={s.gpar[n]}, retained par={newp} gpar={newg}"
                )
            par.append(newp)
            gpar.append(newg)
        t2lost = (
            s.t2lost if self.host.info.get("tier2") else frozenset(range(self.host.topology.nodes))
        )
        retained = Retained(
            data=tuple(data),
            undo=tuple(undo),
            grad=tuple(grad),
            par=tuple(par),
            gpar=tuple(gpar),
            t2=self.host.tier2.step,
            t2lost=t2lost,
        )
        try:
            after = adopt(self.host.model, s, retained)
        except ProtocolError as err:
            what = "the retained state the trainers reported"
            source = f"generation {s.gen}"
            raise ModelRefused(what, source, err, {"adopt": retained.to_record()}) from None
        self.host.model_record("core", adopt=retained.to_record())
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
        s = self.host.state
        assert s is not None
        snaps = rec.snapshot
        if (
            self.host.info.get("tier2")
            and len(snaps) == self.host.W
            and all(m is not None for m in snaps.values())
        ):
            self.host.tier2.set(s.target, rec.snapshot)
            self.host.send(None, M.Tier2(step=s.target, gen=s.gen))
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
                "parity_chunks_reencoded",
                "parity_checked",
            )
        }
        slowest = {
            k: max((float(x.get(k, 0.0)) for x in sums.values()), default=0.0)
            for k in ("repair_ms", "redundancy_ms")
        }
        pg = [float(r.get("pg_ms", 0.0)) for r in self.reports.values()]
        slowest["communicator_ms"] = max(pg, default=0.0)
        self.log.write(
            "reconciled", generation=self.host.generation, **rec.plan, **total, **slowest
        )
        rec.plan.update(total)
        rec.plan["slowest_rank_ms"] = slowest

    def _resume(self, now: float) -> None:
        s = self.host.state
        assert s is not None
        target = s.target
        self._phase("resume", now)
        fed = self.feeder.feed_event(ev.Resume())
        self.wait = None
        self.host.carry_out(fed)  # Resume
        rec = self.rec
        self.rec = None
        self.host.forget_gathered()
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

    def waiting_for(self) -> str:
        """What a recovery is waiting for, in words (its timeout's message)."""
        s = self.host.state
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


# a script's exception repeated in this many incarnations in a row at the same step ends
# the job (RecoveryDriver._hopeless)
REPEATS = 3


def _hang_of(failures: list[dict[str, Any]]) -> tuple[int, int, str] | None:
    """(rank, committed step, phase) of a recovery whose one failure was a rank found
    hung (no progress for --hang-timeout), else None."""
    if len(failures) != 1 or failures[0].get("kind") != "hang":
        return None
    f = failures[0]
    return int(f.get("rank", -1)), int(f.get("step", -1)), str(f.get("in_phase", "?"))


def _exception_of(failures: list[dict[str, Any]]) -> tuple[int, str] | None:
    """(committed step, last line of the traceback) of a recovery whose failures were all
    one exception of the script (one rank's, or every rank that ran the same line, as a
    script's error does), else None."""
    if not failures or any(f.get("kind") != "exception" for f in failures):
        return None
    seen = set()
    for f in failures:
        tb = str(f.get("traceback", "")).strip().splitlines()
        seen.add((int(f.get("step", -1)), tb[-1] if tb else ""))
    return seen.pop() if len(seen) == 1 else None
