"""What the gloo coordinator feeds the core's model, and how it judges a refusal.

The model judges. An event it refuses stops the job (``CoordinatorOptions.strict``,
on by default) with one line naming what was refused, the error and the model's
state; only messages of an old generation are dropped before it (the keeper's
fence), and votes wait while a recovery runs. What the coordinator feeds the
model and the retained state it adopts are written to the event log as ``core``
records (:mod:`leto.spec.trace`, O(ranks) per step), so that ``leto spec trace
RUN_DIR`` replays the run through the model and checks it against the log.

A rank's ``Close`` (its loop tail over, the process state after it kept by its agent)
is not a message the coordinator hears: the agent keeps it. It is inferred, a rank
that acts in step ``s + 1`` has closed ``s`` (:func:`closes`): before the votes of a
step, a finish of the step after a rank's tail, or a tier-2 snapshot or checkpoint
(taken at the step boundary, after the close), every rank they show past its tail
closes, fed as a record of its own. So a rank that dies in its tail is one the model
has in its tail (the step-function form, whose scheduler steps inside the
transaction, has a tail with nothing in it; the model is not told so, and needs not
be: what a recovery restores is the agent's, the closed state where it kept one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import attrs

from leto.core import events as ev
from leto.core.cluster import ClusterModel, ClusterState, Effect
from leto.core.errors import ProtocolError
from leto.core.txn import TxnState
from leto.spec.trace import Apply, Commit, Item, Snapshot, describe, encode, run

from .eventlog import EventLog

__all__ = ["Fed", "FeedHost", "ModelFeeder", "ModelRefused", "closes"]


@attrs.frozen
class Fed:
    """Events fed as one ``core`` record: the model's state before and after them, and
    the effects they returned (what the coordinator's commands carry out, :mod:`.commands`)."""

    before: ClusterState
    after: ClusterState
    effects: tuple[Effect, ...]


def closes(model: ClusterModel, s: ClusterState, items: list[Item]) -> list[ev.Close]:
    """The ``Close`` of every rank in its loop tail in ``s`` that ``items`` show in its
    next step: a vote set for it (``CommitStep``), its finish of it (``ApplyStep``), a
    snapshot or checkpoint of the step boundary (taken after the close)."""
    past: set[int] = set()
    every = range(model.config.ranks)
    for i in items:
        if isinstance(i, (ev.CommitStep, Commit)):
            past |= {r for r in every if s.step[r] + 1 == i.step}
        elif isinstance(i, ev.ApplyStep):
            past |= {r for r in i.ranks if r in every and s.step[r] + 1 == i.step}
        elif isinstance(i, Apply):
            past |= {i.rank} if i.rank in every and s.step[i.rank] + 1 == i.step else set()
        elif isinstance(i, Snapshot):
            past |= {r for r in every if s.step[r] == i.step}
        elif isinstance(i, (ev.Tier2Snapshot, ev.BeginCheckpoint)):
            past |= set(every)
    due = [ev.Close(r) for r in sorted(past) if s.pc[r] is TxnState.TAIL]
    return [c for c in due if model.why_not(s, c) is None]


class ModelRefused(Exception):
    """The model refused what the coordinator fed it (judged by :meth:`ModelFeeder.judge`)."""

    def __init__(self, what: str, source: str, error: ProtocolError, record: dict[str, Any]):
        super().__init__(f"{what} ({source}): {error}")
        self.what, self.source, self.error, self.record = what, source, error, record


class FeedHost(Protocol):
    """What the feeder uses of its coordinator: the model, its state (which each feed
    replaces), where a feed is recorded, and how the job stops on a refusal."""

    @property
    def model(self) -> ClusterModel | None: ...

    state: ClusterState | None

    def model_record(self, name: str, **fields: Any) -> None: ...

    def fail(self, message: str, **fields: Any) -> None: ...


class ModelFeeder:
    """Feeds the coordinator's model (``host.model``, ``host.state``), all or nothing, and
    logs each feed as one ``core`` record (see the module docstring). It gathers the
    ranks' finishes of a step (``applied``) and feeds them as one ``ApplyStep``."""

    def __init__(self, host: FeedHost, *, log: EventLog, strict: bool) -> None:
        self.host = host
        self.log = log
        self.strict = strict  # a refusal stops the job (CoordinatorOptions.strict)
        self.applied: tuple[int, list[int]] | None = None  # (step, ranks) not yet fed

    def feed_event(self, e: ev.Event) -> Fed:
        return self.run([e], "the recovery driver")

    def run(self, items: list[Item], source: str) -> Fed:
        """Feed ``items`` to the model, all or nothing, and log them as one ``core`` record;
        a refusal raises :class:`ModelRefused` and leaves the state as it was. The ranks
        they show past their loop tail close first, in a record of their own."""
        assert self.host.model is not None and self.host.state is not None
        self.flush_applied()
        due = closes(self.host.model, self.host.state, items)
        if due:  # one aggregated CloseRanks: O(ranks), not O(ranks) state changes
            ranks = [c.rank for c in due]
            self._feed([ev.CloseRanks(ranks)], f"rank(s) {ranks} acted past their loop tail")
        return self._feed(items, source)

    def _feed(self, items: list[Item], source: str) -> Fed:
        assert self.host.model is not None and self.host.state is not None
        feed = [encode(i) for i in items]
        before = self.host.state
        try:
            self.host.state, effects = run(self.host.model, before, items)
        except ProtocolError as err:
            what = ", ".join(repr(i) for i in items)
            raise ModelRefused(what, source, err, {"feed": feed}) from None
        self.host.model_record("core", feed=feed)
        return Fed(before, self.host.state, effects)

    def flush_applied(self) -> None:
        """Feed the finished ranks gathered for a step as one ``ApplyStep``."""
        if self.applied is not None:
            (step, ranks), self.applied = self.applied, None
            what = f"{len(ranks)} rank(s) finished step {step}"
            self.run([ev.ApplyStep(step, sorted(ranks))], what)

    def gather_applied(self, step: int, rank: int, world: int) -> None:
        """``rank`` finished ``step``: judged at once (the model's guard of its own
        ``ApplyStep``; a refusal raises), gathered, and fed with the others once all
        ``world`` ranks finished (or before anything else is fed)."""
        assert self.host.model is not None and self.host.state is not None
        one = ev.ApplyStep(step, (rank,))
        pending = self.applied
        if pending is not None and (pending[0] != step or rank in pending[1]):
            self.flush_applied()
            pending = None
        if self.host.model.why_not(self.host.state, one) is not None:
            self.run([one], f"rank {rank} finished step {step}")  # refused: the job stops
        if pending is None:
            pending = self.applied = (step, [])
        pending[1].append(rank)
        if len(pending[1]) == world:
            self.flush_applied()

    @contextlib.contextmanager
    def judging(self) -> Iterator[None]:
        try:
            yield
        except ModelRefused as refused:
            self.judge(refused)

    def judge(self, refused: ModelRefused) -> None:
        """The model refused an input: stop the job, naming it (strict), or log it."""
        line = (
            f"the protocol model refused {refused.what} ({refused.source}): {refused.error}; "
            f"model: {describe(self.host.state)}"
        )
        if self.strict:
            self.host.fail(line, **refused.record)
        else:
            self.log.write("model_mismatch", error=line, **refused.record)

    def try_event(self, e: ev.Event) -> bool:
        assert self.host.model is not None and self.host.state is not None
        if self.host.model.why_not(self.host.state, e) is not None:
            return False
        self.feed_event(e)
        return True
