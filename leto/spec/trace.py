"""The core's trace: what a backend fed the protocol model, written down and replayed.

Trace validation, as CCF does for its Raft (``tla/consensus/Traceccfraft.tla`` replays
the implementation's logs against the spec). A backend's coordinator drives
:class:`~leto.core.cluster.ClusterModel` with the events of a real run; it writes what
it feeds into the run's event log, and :func:`check` (``leto spec trace RUN_DIR``)
rebuilds the model from that log, replays every event, and after each record the log
holds checks that the replayed state agrees with what the log says happened. The
coordinator and the replay share this module's vocabulary, so what is replayed is
exactly what was fed.

Records (one JSON object per line of ``RUN_DIR/events.jsonl``; other records pass by,
and so do other jobs' records: a run directory used again holds several jobs, and one
job is replayed, the latest or ``--job ID``'s, :mod:`leto.jobs`):

* ``core_init``: the model's constants and initial state (:class:`CoreSetup`).
* ``core`` with ``feed``: events fed, in order, as one batch. An item is an event of
  :mod:`leto.core.events` by class name and fields (``["Crash", 1]``, ``["Detect"]``)
  including the commit path's aggregated events (:mod:`leto.core.aggregate`), which keep
  the log at O(ranks) per step: ``["CommitStep", s]`` (every rank voted for step ``s``),
  ``["ApplyStep", s, [r, ...]]`` (ranks ``r, ...`` finished step ``s``); or an
  abbreviation of what one message of the run means: ``["Commit", s]`` and
  ``["Apply", r, s]`` (the aggregated events of logs written before them),
  ``["Snapshot", s]`` (every rank took the tier-2 snapshot of step ``s``). An
  abbreviation is refused unless its step is the one the model expects.
  A rank's ``["Close", r]`` (its loop tail over, the step closed) is no message of
  the run: the coordinator infers it when a message shows the rank acting in its next
  step (:func:`leto.backends.gloo.model_feed.closes`) and logs it, in a record of its
  own, before that message's events; a step whose votes come before every rank's close
  is refused.
* ``core`` with ``adopt``: the retained state the trainers reported during a recovery
  replaces the model's (:func:`adopt`, which refuses what the model cannot have come to).
* ``command``: a command the coordinator sent (``message``: as on the wire, ``to``: its
  node or null for every node), carrying out effects of the events fed in the ``core``
  record just before it (gloo's table, ``leto.backends.gloo.commands``). Its protocol
  fields must be what those effects call for (:func:`expected_commands`), each command
  once: a ``commit`` of the step the model committed, a ``fence`` of the new generation
  killing the trainers the fence made stale, a ``promote_rank`` of a promoted rank (warm
  as its shadow was), a ``reconcile`` of the plan's kind, target and repairs (or of the
  checkpoint), a ``rebuild``, a ``resume`` at the target, an ``abort`` after a
  detection, a ``t2`` of the snapshot taken. Logs written before these records hold
  none, and replay as before.
* ``job_failed`` with ``feed`` or ``adopt``: what the coordinator refused, stopping the
  job; replayed, it is refused again, so such a trace never passes. With ``phase``: the
  recovery deadline passed, and the ``GiveUp`` fed before it left the model FAILED.

What is checked after each record, against the replayed state: ``step`` (every rank
finished the step, and it is the committed one), ``tier2_snapshot``, ``failure`` (a
fault was just fed, in the phase, generation and committed step the record names),
``failure_ignored`` (the model refuses that fault), ``recovery_start``,
``recovery_restart``, ``fence``, ``promoted``, ``reconciled`` (kind, target, steps
lost), ``recovery_end`` (every rank resumed at the step the record names),
``training_done``, ``coordinator_took_over`` (a successor rebuilt from the commit
record starts from a state the replay passed through lately, and the replay goes on
from its state); a ``model_mismatch`` record (a coordinator not in strict mode let a
refusal pass) is a divergence. Not checked: the bytes (the digests are the tests'
business), timings, and the shadows' and the trainers' records that feed nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeGuard, cast

import attrs

from leto.core import effects as fx
from leto.core import events as ev
from leto.core import reshape
from leto.core.adopt import Retained, adopt
from leto.core.cluster import ClusterConfig, ClusterModel, ClusterState, Effect
from leto.core.erasure import Topology
from leto.core.errors import ProtocolError
from leto.core.recovery import Phase
from leto.core.shadow import ShadowState
from leto.jobs import Choice, NoSuchJob, choose

from .state_record import StateRecordError, state_from_record

__all__ = [
    "UNBOUNDED",
    "Apply",
    "Commit",
    "CoreSetup",
    "InputError",
    "Item",
    "Retained",
    "Snapshot",
    "TraceError",
    "TraceReport",
    "adopt",
    "check",
    "decode",
    "describe",
    "encode",
    "expected_commands",
    "rebuild",
    "replay",
    "run",
]

UNBOUNDED = 10**12  # max_step / max_faults / k of a real run: no bound


class TraceError(ValueError):
    """A record of the trace that does not say anything the model can replay."""


class InputError(Exception):
    """What was given to :func:`check` is not a readable event log with a trace."""


def _index(_inst: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name} must be an int >= 0, got {value!r}")


# --- abbreviations: one message of a run, as the events it means ----------------------


@attrs.frozen
class Commit:
    """Every rank voted for ``step``: each rank's Compute, Reduce, Prepare; then Decide."""

    step: int = attrs.field(validator=_index)

    def refusal(self, model: ClusterModel, s: ClusterState) -> ProtocolError | None:
        if s.committed + 1 != self.step:
            why = f"the model's next step is {s.committed + 1}"
            return ProtocolError("commit", s.commit, self, why)
        return None

    def events(self, model: ClusterModel) -> list[ev.Event]:
        return [ev.CommitStep(self.step)]


@attrs.frozen
class Apply:
    """Rank ``rank`` finished ``step``: every chunk begun, written, folded into parity, in
    order; then Finish."""

    rank: int = attrs.field(validator=_index)
    step: int = attrs.field(validator=_index)

    def refusal(self, model: ClusterModel, s: ClusterState) -> ProtocolError | None:
        r = self.rank
        if r >= model.config.ranks:
            return ProtocolError("cluster", s.phase, self, f"rank {r} out of range")
        if s.step[r] + 1 != self.step:
            why = f"rank {r} is at step {s.step[r]}: it can finish step {s.step[r] + 1} only"
            return ProtocolError("txn", s.pc[r], self, why)
        return None

    def events(self, model: ClusterModel) -> list[ev.Event]:
        return [ev.ApplyStep(self.step, (self.rank,))]


@attrs.frozen
class Snapshot:
    """Every rank took the tier-2 snapshot of ``step``: Tier2Snapshot."""

    step: int = attrs.field(validator=_index)

    def refusal(self, model: ClusterModel, s: ClusterState) -> ProtocolError | None:
        if s.step[0] != self.step:
            why = f"the ranks are at step {s.step[0]}"
            return ProtocolError("recovery", s.phase, self, why)
        return None

    def events(self, model: ClusterModel) -> list[ev.Event]:
        return [ev.Tier2Snapshot()]


Abbreviation = Commit | Apply | Snapshot
Item = ev.Event | Abbreviation

_ITEMS: dict[str, type[Any]] = {
    c.__name__: c for c in (*ev.ALL, *ev.AGGREGATED, Commit, Apply, Snapshot)
}


def encode(item: Item) -> list[Any]:
    """``item`` as a JSON list: its class name, then its fields in order."""
    fields = attrs.astuple(cast(attrs.AttrsInstance, item))
    return [type(item).__name__, *(list(f) if isinstance(f, tuple) else f for f in fields)]


def decode(raw: Any) -> Item:
    """The item a JSON list names; :class:`TraceError` if it names none."""
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise TraceError(f"a feed item is [NAME, int, ...], got {raw!r}")
    name, args = raw[0], raw[1:]
    cls = _ITEMS.get(name)
    if cls is None:
        raise TraceError(f"{name!r} is no event of the protocol nor an abbreviation")
    n = len(attrs.fields(cls))
    if len(args) != n:
        raise TraceError(f"{name} takes {n} argument(s), got {len(args)}: {raw!r}")
    try:
        item: Item = cls(*args)
    except (TypeError, ValueError) as e:
        raise TraceError(f"{raw!r}: {e}") from None
    return item


def expand(model: ClusterModel, s: ClusterState, item: Item) -> list[ev.Event]:
    """The events ``item`` stands for in ``s``; ProtocolError if its step is not ``s``'s."""
    if isinstance(item, ev.Event):
        return [item]
    err = item.refusal(model, s)
    if err is not None:
        raise err
    return item.events(model)


def run(
    model: ClusterModel, s: ClusterState, items: Sequence[Item]
) -> tuple[ClusterState, tuple[Effect, ...]]:
    """Feed ``items`` in order, all or nothing: the state after them and their effects,
    or the :class:`ProtocolError` of the first refused event (``s`` is a value: the
    caller still holds it unchanged)."""
    effects: tuple[Effect, ...] = ()
    for item in items:
        for e in expand(model, s, item):
            s, eff = model.step(s, e)
            effects += eff
    return s, effects


# --- the commands a coordinator sends for the effects of what it fed ----------------------


def expected_commands(
    before: ClusterState, after: ClusterState, effects: Sequence[Effect]
) -> list[dict[str, Any]]:
    """The commands that the effects of events fed from ``before`` to ``after`` call
    for, each as the fields of its wire message the protocol decides (``t``, its tag;
    the rest of a message, such as the tier-2 snapshot's metadata, is the backend's)."""
    out: list[dict[str, Any]] = []
    repairs = [x.repair().wire() for x in effects if isinstance(x, fx.RunRepair)]
    for e in effects:
        match e:
            case fx.RecordCommit(step=step):
                out.append({"t": "commit", "step": step, "gen": after.gen})
            case fx.TakeSnapshot(step=step):
                out.append({"t": "t2", "step": step, "gen": after.gen})
            case fx.Detected():
                out.append({"t": "abort", "gen": after.gen})
            case fx.Fence(generation=gen):
                # the hung trainers it made stale processes (TRAINER: hung -> dead)
                kill = [r for r, t in enumerate(after.trainer) if before.trainer[r] is not t]
                out.append({"t": "fence", "gen": gen, "kill": kill})
            case fx.Promote(rank=rank, warm=warm, generation=gen):
                out.append({"t": "promote_rank", "rank": rank, "gen": gen, "warm": warm})
            case fx.Reconciled(target=target, kind=kind):
                retake = bool(before.t2lost)
                out.append(
                    {"t": "reconcile", "gen": after.gen, "kind": kind, "target": target}
                    | {"repairs": repairs, "retake_t2": retake}
                )
            case fx.LoadCheckpoint(step=step):
                out.append(
                    {"t": "reconcile", "gen": after.gen, "kind": "ckpt", "target": step}
                    | {"repairs": [], "retake_t2": True}
                )
            case fx.RebuildCommunicator(generation=gen):
                out.append({"t": "rebuild", "gen": gen})
            case fx.Resume(step=step, generation=gen):
                out.append({"t": "resume", "gen": gen, "step": step})
    return out


# --- the model's constants and initial state -----------------------------------------


@attrs.frozen
class CoreSetup:
    """How a backend instantiates the model for a run: constants and initial state."""

    nodes: tuple[int, ...]  # ranks per node
    chunks: int
    k: int | None  # tier 2 lags at most k steps; None: tier 2 off (no bound)
    tier1: bool = True  # off: no node keeps parity (the core's ClusterConfig.tier1)
    shadows: ShadowState = ShadowState.WARM  # every shadow at the start (gloo: spawning)
    tier2_parity: int = 1  # the core's ClusterConfig.tier2_parity
    start: int = 0  # > 0: a job resumed from the durable checkpoint of this step
    # a world changed in place (leto.core.reshape): its generation, and the old world's
    # durable checkpoint (None: a new job, or one resumed from its checkpoint at start)
    gen: int = 0
    ckpt: int | None = None

    def model(self) -> ClusterModel:
        return ClusterModel(
            ClusterConfig(
                topology=Topology(self.nodes),
                chunks=self.chunks,
                max_step=UNBOUNDED,
                max_faults=UNBOUNDED,
                k=UNBOUNDED if self.k is None else self.k,
                tier1=self.tier1,
                tier2_parity=self.tier2_parity,
            )
        )

    def initial(self, model: ClusterModel) -> ClusterState:
        if self.ckpt is None:
            s = model.initial(self.start)
        else:
            s = reshape.in_place(model, self.start, self.gen, self.ckpt)
        if self.shadows is not ShadowState.WARM:
            s = attrs.evolve(s, shadow=(self.shadows,) * model.config.ranks)
        return s

    def to_record(self) -> dict[str, Any]:
        return {
            "nodes": list(self.nodes),
            "chunks": self.chunks,
            "k": self.k,
            "tier1": self.tier1,
            "shadows": self.shadows.value,
            "tier2_parity": self.tier2_parity,
            "start": self.start,
            **({"gen": self.gen, "ckpt": self.ckpt} if self.ckpt is not None else {}),
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> CoreSetup:
        nodes, chunks, k = rec.get("nodes"), rec.get("chunks"), rec.get("k")
        if not isinstance(nodes, list) or not nodes or not all(_nat(n) and n > 0 for n in nodes):
            raise TraceError(f"nodes must be a list of rank counts >= 1, got {nodes!r}")
        if not _nat(chunks) or chunks < 1:
            raise TraceError(f"chunks must be an int >= 1, got {chunks!r}")
        if k is not None and not (_nat(k) and k >= 1):
            raise TraceError(f"k must be an int >= 1 or null, got {k!r}")
        tier1 = rec.get("tier1", True)
        if not isinstance(tier1, bool):
            raise TraceError(f"tier1 must be true or false, got {tier1!r}")
        try:
            shadows = ShadowState(rec.get("shadows", "warm"))
        except ValueError:
            raise TraceError(f"shadows: no shadow state {rec.get('shadows')!r}") from None
        m = rec.get("tier2_parity", 1)
        if not (_nat(m) and m >= 1):
            raise TraceError(f"tier2_parity must be an int >= 1, got {m!r}")
        start = rec.get("start", 0)
        if not _nat(start):
            raise TraceError(f"start must be an int >= 0, got {start!r}")
        gen, ckpt = rec.get("gen", 0), rec.get("ckpt")
        if not _nat(gen) or not (ckpt is None or (_nat(ckpt) and ckpt <= start)):
            raise TraceError(
                f"gen and ckpt must be ints >= 0, ckpt <= start, got {gen!r}, {ckpt!r}"
            )
        return cls(tuple(nodes), chunks, k, tier1, shadows, m, start, gen, ckpt)


def _nat(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# --- adopting the retained state the trainers report: a rule of the core ----------------


def describe(s: ClusterState | None) -> str:
    """The model's state in one line: phase, generation, steps, the ranks' machines."""
    if s is None:
        return "no model yet"
    return (
        f"phase {s.phase.value}, generation {s.gen}, committed {s.committed}, t2 {s.t2}; "
        f"ranks at steps {list(s.step)}, txn {[p.value for p in s.pc]}, "
        f"trainers {[t.value for t in s.trainer]}"
    )


# --- replay ------------------------------------------------------------------------------


@attrs.frozen
class Divergence:
    line: int
    event: str
    why: str
    state: str


@attrs.frozen
class TraceReport:
    path: str
    lines: int
    core_records: int
    events: int  # events replayed (abbreviations expanded)
    checked: int  # records checked against the replayed state
    divergence: Divergence | None
    job: str = ""  # the job replayed, where the log holds several (leto.jobs)
    jobs: int = 1

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def line(self) -> str:
        d = self.divergence
        where = self.path
        if self.jobs > 1:
            where += f" (job {self.job}, of the {self.jobs} jobs it holds)"
        if d is None:
            return (
                f"trace OK: {where}: {self.events} events replayed from "
                f"{self.core_records} core records, {self.checked} records checked"
            )
        return f"trace DIVERGES at {where}:{d.line} ({d.event}): {d.why} [model: {d.state}]"

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self) | {"ok": self.ok}


class _Diverged(Exception):
    pass


@attrs.define
class _Replay:
    setup: CoreSetup | None = None
    model: ClusterModel | None = None
    state: ClusterState | None = None
    last: ev.Event | None = None
    core_records: int = 0
    events: int = 0
    checked: int = 0
    # the states after the last core records (a coordinator that took over starts from one)
    seen: list[ClusterState] = attrs.Factory(list)
    # the commands the last core record's effects call for, not yet logged as sent
    commands: list[dict[str, Any]] = attrs.Factory(list)
    effects: tuple[Effect, ...] = ()

    def live(self) -> tuple[ClusterModel, ClusterState]:
        if self.model is None or self.state is None:
            raise _Diverged("no core_init record before this one")
        return self.model, self.state

    def feed(self, raw: Any) -> None:
        model, s = self.live()
        if not isinstance(raw, list) or not raw:
            raise _Diverged(f"feed must be a non-empty list of items, got {raw!r}")
        before, effects = s, cast(tuple[Effect, ...], ())
        self.commands, self.effects = [], ()
        for x in raw:
            try:
                item = decode(x)
            except TraceError as bad:
                raise _Diverged(str(bad)) from None
            try:
                for e in expand(model, s, item):
                    s, eff = model.step(s, e)
                    effects += eff
                    self.last = e
                    self.events += 1
            except ProtocolError as err:
                self.state = s
                raise _Diverged(f"the model refuses {item!r}: {err}") from None
        self.state = s
        self.commands, self.effects = expected_commands(before, s, effects), effects

    def adopt(self, raw: Any) -> None:
        model, s = self.live()
        try:
            self.state = adopt(model, s, Retained.from_record(raw))
        except (ValueError, ProtocolError) as e:  # TraceError, a malformed retained state
            raise _Diverged(f"the model refuses the adoption: {e}") from None
        self.last = None
        self.commands, self.effects = [], ()


def _get_int(rec: dict[str, Any], key: str) -> int:
    v = rec.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise _Diverged(f"the record has no integer {key!r} (got {v!r})")
    return v


def _expect(ok: bool, why: str) -> None:
    if not ok:
        raise _Diverged(why)


def _last_is(r: _Replay, kinds: type | tuple[type, ...], record: str) -> None:
    name = type(r.last).__name__ if r.last is not None else "no event"
    _expect(isinstance(r.last, kinds), f"{record} follows {name}, not the event it reports")


def _all_at(s: ClusterState, step: int, what: str) -> None:
    _expect(s.committed == step, f"{what} {step}; the model has committed step {s.committed}")
    _expect(
        all(x == step for x in s.step), f"{what} {step}; the model's ranks are at {list(s.step)}"
    )


def _c_init(r: _Replay, rec: dict[str, Any]) -> None:
    try:
        setup = CoreSetup.from_record(rec)
    except TraceError as e:
        raise _Diverged(f"core_init: {e}") from None
    r.setup, r.model = setup, setup.model()
    r.state, r.last = setup.initial(r.model), None
    r.seen = [r.state]


def _c_core(r: _Replay, rec: dict[str, Any]) -> None:
    r.core_records += 1
    if "feed" in rec:
        r.feed(rec["feed"])
        r.seen = [*r.seen[-(SEEN - 1) :], r.live()[1]]
    elif "adopt" in rec:
        r.adopt(rec["adopt"])
        r.seen = [*r.seen[-(SEEN - 1) :], r.live()[1]]
    else:
        raise _Diverged("a core record holds a feed or an adopt")


def _c_step(r: _Replay, rec: dict[str, Any]) -> None:
    _all_at(r.live()[1], _get_int(rec, "step"), "the log says every rank finished step")


def _c_done(r: _Replay, rec: dict[str, Any]) -> None:
    _all_at(r.live()[1], _get_int(rec, "step"), "the log says training is done at step")


def _c_t2(r: _Replay, rec: dict[str, Any]) -> None:
    s = r.live()[1]
    _last_is(r, ev.Tier2Snapshot, "tier2_snapshot")
    step = _get_int(rec, "step")
    _expect(s.t2 == step, f"the log says snapshot of step {step}; the model's is of {s.t2}")


def _c_failure(r: _Replay, rec: dict[str, Any]) -> None:
    s = r.live()[1]
    _last_is(r, ev.Fault, "failure")
    phase, gen, step = rec.get("phase"), _get_int(rec, "generation"), _get_int(rec, "step")
    _expect(
        (phase, gen, step) == (s.phase.value, s.gen, s.committed),
        f"the log says a failure in phase {phase}, generation {gen}, committed step {step}",
    )


def _c_ignored(r: _Replay, rec: dict[str, Any]) -> None:
    model, s = r.live()
    if "refused" not in rec:
        return
    try:
        item = decode(rec["refused"])
    except TraceError as e:
        raise _Diverged(str(e)) from None
    _expect(isinstance(item, ev.Event), f"refused must be an event, got {rec['refused']!r}")
    assert isinstance(item, ev.Event)
    _expect(
        model.why_not(s, item) is not None,
        f"the log says the model refused {item!r}; it accepts it",
    )


def _c_recovery_start(r: _Replay, rec: dict[str, Any]) -> None:
    s = r.live()[1]
    _last_is(r, ev.Detect, rec["event"])
    gen = _get_int(rec, "generation")
    _expect(s.phase is Phase.FENCING, f"the model is {s.phase.value}, not fencing")
    _expect(s.gen == gen, f"the log says generation {gen}")
    if rec["event"] == "recovery_start":
        step = _get_int(rec, "from_step")
        _expect(s.committed == step, f"the log says recovery from committed step {step}")


def _c_fence(r: _Replay, rec: dict[str, Any]) -> None:
    s = r.live()[1]
    _last_is(r, ev.Fence, "fence")
    gen = _get_int(rec, "generation")
    _expect(s.phase is Phase.PROMOTING and s.gen == gen, f"the log says fenced at generation {gen}")
    killed = rec.get("stale_killed") or []
    stale = {q for q, x in enumerate(s.stale) if x}
    _expect(
        isinstance(killed, list) and set(killed) <= stale,
        f"the log says stale processes {killed} were killed; the model's are {sorted(stale)}",
    )


def _c_promoted(r: _Replay, rec: dict[str, Any]) -> None:
    s = r.live()[1]
    rank = _get_int(rec, "rank")
    _expect(rank in s.promoted, f"the log says rank {rank} was promoted; the model has not")


def _c_reconciled(r: _Replay, rec: dict[str, Any]) -> None:
    s = r.live()[1]
    kind, target, lost = rec.get("kind"), _get_int(rec, "target"), rec.get("steps_lost")
    _expect(s.phase is Phase.REBUILDING, f"the model is {s.phase.value}, not rebuilding")
    _expect(
        (kind, target, lost) == (s.kind.value, s.target, s.loss),
        f"the log says {kind} to step {target} losing {lost} step(s); the model did "
        f"{s.kind.value} to step {s.target} losing {s.loss}",
    )


def _c_recovery_end(r: _Replay, rec: dict[str, Any]) -> None:
    s = r.live()[1]
    _last_is(r, ev.Resume, "recovery_end")
    step, gen = _get_int(rec, "resumed_at"), _get_int(rec, "generation")
    _expect(s.phase is Phase.RUNNING, f"the model is {s.phase.value}, not running")
    _expect(s.gen == gen, f"the log says generation {gen}")
    _expect(rec.get("kind") == s.kind.value, f"the log says {rec.get('kind')!r}")
    _all_at(s, step, "the log says every rank resumed at step")


def _c_failed(r: _Replay, rec: dict[str, Any]) -> None:
    if "feed" not in rec and "adopt" not in rec:
        if "phase" in rec and r.state is not None:  # the deadline: GiveUp was fed
            s = r.state
            _expect(s.phase is Phase.FAILED, f"the model is {s.phase.value}, not failed")
            _expect(s.gen == _get_int(rec, "generation"), "the log names another generation")
        return
    try:
        if "feed" in rec:
            r.feed(rec["feed"])
        else:
            r.adopt(rec["adopt"])
    except _Diverged as d:
        raise _Diverged(f"the coordinator stopped the job: {d}") from None
    raise _Diverged("the log says the model refused this, but it replays")


def _c_took_over(r: _Replay, rec: dict[str, Any]) -> None:
    """Another coordinator took over: it rebuilt the model from the commit record, which
    holds every input its predecessor fed save the last few that no message followed
    (``commit_record``); its state must be one the replay passed through, and the replay
    goes on from there, so the trace stays one behaviour of the model. A log that starts
    here (the successor's, in a run directory of its own) starts from the record's
    constants and state."""
    fresh = r.model is None  # the successor's own log: a run directory of its own
    if fresh:
        _c_init(r, rec.get("core_init") or {})
    try:
        state = state_from_record(rec.get("state"))
    except StateRecordError as e:
        raise _Diverged(f"coordinator_took_over: {e}") from None
    _expect(
        fresh or any(state == x for x in r.seen),
        "the coordinator that took over starts from a state the log's coordinator was not "
        f"in lately ({describe(state)})",
    )
    r.state, r.last = state, None
    r.commands, r.effects = [], ()


def _c_command(r: _Replay, rec: dict[str, Any]) -> None:
    """A command sent: what the effects of the events fed just before it call for."""
    r.live()
    msg = rec.get("message")
    _expect(isinstance(msg, dict) and "t" in msg, f"a command names its message, got {msg!r}")
    assert isinstance(msg, dict)
    for i, want in enumerate(r.commands):
        if all(msg.get(k) == v for k, v in want.items()):
            del r.commands[i]
            return
    names = ", ".join(repr(e) for e in r.effects) or "none"
    wants = "; ".join(repr(w) for w in r.commands) or "no (further) command"
    raise _Diverged(
        f"the coordinator sent {msg!r}; the effects of the events fed before it ({names}) "
        f"call for {wants}"
    )


def _c_mismatch(r: _Replay, rec: dict[str, Any]) -> None:
    raise _Diverged(f"the coordinator let a refusal pass: {rec.get('error')}")


_TOOK_OVER = "coordinator_took_over"
_CHECKS: dict[str, Callable[[_Replay, dict[str, Any]], None]] = {
    "core_init": _c_init,
    "core": _c_core,
    "step": _c_step,
    "training_done": _c_done,
    "tier2_snapshot": _c_t2,
    "failure": _c_failure,
    "failure_ignored": _c_ignored,
    "recovery_start": _c_recovery_start,
    "recovery_restart": _c_recovery_start,
    "fence": _c_fence,
    "promoted": _c_promoted,
    "reconciled": _c_reconciled,
    "recovery_end": _c_recovery_end,
    "command": _c_command,
    "job_failed": _c_failed,
    "model_mismatch": _c_mismatch,
    _TOOK_OVER: _c_took_over,
}
_CHECKED = frozenset(_CHECKS) - {"core_init", "core", "job_failed"}
SEEN = 64  # states kept for a take-over to start from (it lags by the records not flushed)


def replay(records: Iterable[tuple[int, dict[str, Any]]], path: str = "<records>") -> TraceReport:
    """Replay numbered records (line, record); stops at the first divergence."""
    r = _Replay()
    lines = 0
    for n, rec in records:
        lines = n
        name = str(rec.get("event"))
        check_record = _CHECKS.get(name)
        if check_record is None:
            continue
        if r.model is None and name not in ("core_init", "core", "job_failed", _TOOK_OVER):
            continue  # a record before the model exists (a job that stopped early)
        before = r.state
        try:
            check_record(r, rec)
        except _Diverged as d:
            state = r.state if name in ("core", "job_failed") else before
            return TraceReport(
                path,
                lines,
                r.core_records,
                r.events,
                r.checked,
                Divergence(n, name, str(d), describe(state if state is not None else before)),
            )
        if name in _CHECKED:
            r.checked += 1
    return TraceReport(path, lines, r.core_records, r.events, r.checked, None)


def rebuild(records: Iterable[dict[str, Any]]) -> tuple[ClusterModel, ClusterState]:
    """The model and its state after the ``core_init`` and ``core`` records, replayed as
    they were fed, from the last ``core_state`` on (a state written down: the log before
    it was compacted away); other records pass by. How a coordinator that takes over
    rebuilds its predecessor's model. :class:`TraceError` if they do not replay."""
    r = _Replay()
    for n, rec in enumerate(records):
        name = rec.get("event")
        if name == "core_state":  # a compacted log starts from a state written down
            try:
                r.live()
                r.state, r.last = state_from_record(rec.get("state")), None
            except (_Diverged, StateRecordError) as e:
                raise TraceError(f"record {n} (core_state): {e}") from None
            continue
        if name not in ("core_init", "core"):
            continue
        try:
            _CHECKS[str(name)](r, rec)
        except _Diverged as d:
            raise TraceError(f"record {n} ({name}) does not replay: {d}") from None
    try:
        return r.live()
    except _Diverged:
        raise TraceError("no core_init record: nothing to rebuild") from None


def read(path: str | Path, job: str | None = None) -> tuple[Path, list[tuple[int, dict[str, Any]]]]:
    """The numbered records of a run directory's ``events.jsonl`` (or of the file): of
    job ``job`` (an id or a prefix of one), or of the latest job the log holds
    (:mod:`leto.jobs`).

    A line that is not a JSON object naming its ``event`` is bad input, except a last
    line with no newline (a writer killed half way through it), which is skipped."""
    f, out, _ = _read(path, job)
    return f, out


def _read(
    path: str | Path, job: str | None
) -> tuple[Path, list[tuple[int, dict[str, Any]]], Choice]:
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file or directory")
    f = p / "events.jsonl" if p.is_dir() else p
    if not f.is_file():
        raise InputError(f"no event log at {f} (a run directory of `leto launch` holds one)")
    try:
        text = f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{f}: unreadable ({e})") from None
    lines = text.split("\n")
    torn = lines[-1] != ""
    out: list[tuple[int, dict[str, Any]]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if torn and n == len(lines):
                continue
            raise InputError(f"{f}:{n}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("event"), str):
            raise InputError(f'{f}:{n}: not a JSON object naming its "event"')
        out.append((n, rec))
    try:
        choice = choose((rec for _, rec in out), job)
    except NoSuchJob as e:
        raise InputError(f"{f}: {e}") from None
    out = [(n, rec) for n, rec in out if choice.holds(rec)]
    if not any(rec["event"] in ("core_init", "core") for _, rec in out):
        which = f" of job {choice.job}" if len(choice.jobs) > 1 else ""
        raise InputError(
            f"{f} has no core records{which}: nothing to replay (a job that stopped before "
            "training started, or a log written without trace records)"
        )
    return f, out, choice


def check(path: str | Path, job: str | None = None) -> TraceReport:
    """``leto spec trace``: replay a run's log (job ``job``'s records, or the latest
    job's); :class:`InputError` for bad input."""
    f, records, choice = _read(path, job)
    report = replay(records, str(f))
    return attrs.evolve(report, job=choice.job, jobs=len(choice.jobs))
