"""The commit path's aggregated events, what they stand for, and the check that they
refine the chunk-level protocol.

Theory of operation: between failures a coordinator learns a step as a handful of
facts (every rank voted; these ranks finished), not as ranks x chunks x 3 chunk
transitions. :class:`~leto.core.events.CommitStep` and
:class:`~leto.core.events.ApplyStep` carry those facts; each *means* a fixed sequence
of the protocol's own events (:func:`expand`), and the chunk-level model stays the
reference semantics. The model handles an aggregated event directly, at
O(ranks + nodes), and :func:`check_refinement` proves the two agree on every state the
checker reaches:

* Refines: each aggregated transition ``s -e-> t`` is the chunk-level run of
  ``expand(e)`` from ``s`` (every event enabled in turn, ending in ``t`` exactly). So
  every behaviour of the aggregated model is one of the chunk-level model's.
* Covers: where ``expand(e)`` runs in the chunk-level model, ``e`` is accepted: the
  aggregated path never refuses a legal run (a coordinator that switched to it stops no
  job the chunk-level feed would have let through).

A broken aggregation (:class:`~leto.core.cluster.Aggregation` ``NO_PARITY_FOLD``,
``UNCOMMITTED``) must be rejected by this check. The effects of an aggregated event are
a summary (``CommitStep``: ``RecordCommit``; ``ApplyStep``: none), not its
expansion's per-chunk effects: a coordinator feeds it once the ranks did the work.
``CloseRanks`` (every rank's ``Close`` of its loop tail, O(ranks) in one state change
rather than O(ranks) changes of O(ranks) each) returns its expansion's effects, one
``KeepProcessState`` per rank.

The recovery path is aggregated the same way: the reconcile plan writes consecutive
chunks' repairs as one run (:class:`~leto.core.reconcile.Repair` and
:class:`~leto.core.effects.RunRepair` ``count``: "roll rank r's chunks 0..4095 forward
to V" is one repair), so a plan that rolls every rank forward costs O(ranks), not
O(ranks x chunks). The run means its expansion (``Repair.expand``), and the
chunk-by-chunk plan (``plan(..., compress=False)``) stays the reference:
:func:`plan_failure` checks, in every reconciling state the checker reaches, that the
model's plan has the reference's target, kind and reason (so ``Reconcile`` and
``GoFallback`` are enabled exactly where they are chunk by chunk, and ``Reconcile``
reaches the same state) and that its runs, and the ``RunRepair`` effects of
``Reconcile``, expand to the reference's repairs in order. ``Reconcile`` stays one
action of the spec (``spec/Leto.tla`` has no per-chunk repair action): a run is only a
summary of its effects, so the spec needs no change. ``Aggregation.ROW_HEAD`` (a
rank's roll forward read from its first chunk) must be rejected.
"""

from __future__ import annotations

from collections import deque

import attrs

from leto.core import effects as fx
from leto.core import events as ev
from leto.core.cluster import Aggregation, ClusterModel, ClusterState
from leto.core.reconcile import Repair, expand_repairs, plan
from leto.core.recovery import Phase

__all__ = [
    "RefinementResult",
    "check_refinement",
    "expand",
    "plan_failure",
    "refinement_failure",
]


def expand(model: ClusterModel, e: ev.Aggregated) -> tuple[ev.Event, ...]:
    """The chunk-level events ``e`` stands for, in order."""
    if isinstance(e, ev.CommitStep):
        ranks = range(model.config.ranks)
        return (
            *(ev.Compute(r) for r in ranks),
            *(ev.Reduce(r) for r in ranks),
            *(ev.Prepare(r) for r in ranks),
            ev.Decide(),
        )
    if isinstance(e, ev.ApplyStep):
        out: list[ev.Event] = []
        for r in e.ranks:
            for c in range(model.config.chunks):
                out += [ev.BeginChunk(r, c), ev.EndChunk(r, c), ev.ParityChunk(r, c)]
            out.append(ev.Finish(r))
        return tuple(out)
    if isinstance(e, ev.CloseRanks):
        return tuple(ev.Close(r) for r in e.ranks)
    raise TypeError(f"{e!r} is not an aggregated event")


def _reference(model: ClusterModel) -> ClusterModel:
    return attrs.evolve(model, aggregation=Aggregation.OFF)


def _run_expansion(
    reference: ClusterModel, s: ClusterState, e: ev.Aggregated
) -> tuple[ClusterState | None, str]:
    """The chunk-level state after ``expand(e)`` from ``s``, or None and the refused event."""
    for x in expand(reference, e):
        err = reference.why_not(s, x)
        if err is not None:
            return None, f"{x!r} refused: {err}"
        s, _ = reference.step(s, x)
    return s, ""


def refinement_failure(model: ClusterModel, s: ClusterState, e: ev.Aggregated) -> str | None:
    """None if ``e`` in ``s`` agrees with its expansion in the chunk-level model (both
    refuse, or both reach the same state); else why not."""
    ref = _reference(model)
    after, why = _run_expansion(ref, s, e)
    refused = model.why_not(s, e)
    if refused is not None:
        if after is not None:
            return f"Covers: {e!r} refused ({refused}) where its expansion runs"
        return None
    if after is None:
        return f"Refines: {e!r} accepted where its expansion is not: {why}"
    got, _ = model.step(s, e)
    if got != after:
        diff = [
            f.name
            for f in attrs.fields(ClusterState)
            if getattr(got, f.name) != getattr(after, f.name)
        ]
        return f"Refines: {e!r} reaches another state than its expansion (differs in {diff})"
    return None


def _first_difference(got: tuple[object, ...], want: tuple[object, ...]) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"repair {i}: {a!r}, chunk by chunk {b!r}"
    return f"{len(got)} repairs, chunk by chunk {len(want)}"


def plan_failure(model: ClusterModel, s: ClusterState) -> str | None:
    """None if the model's plan of ``s`` (its repairs in runs) is the chunk-by-chunk
    plan, and the ``RunRepair`` effects of ``Reconcile`` (where enabled) expand to its
    repairs; else why not."""
    ref = plan(model.survivors(s), compress=False)
    got = model.plan(s)
    if (got.target, got.kind, got.reason) != (ref.target, ref.kind, ref.reason):
        return (
            f"Refines: the plan in runs is {got.kind.value} to {got.target} ({got.reason}), "
            f"chunk by chunk {ref.kind.value} to {ref.target} ({ref.reason})"
        )
    if expand_repairs(got.repairs) != ref.repairs:
        diff = _first_difference(expand_repairs(got.repairs), ref.repairs)
        return f"Refines: the plan's runs expand to other repairs than the reference ({diff})"
    if model.why_not(s, ev.Reconcile()) is None:
        _, effects = model.step(s, ev.Reconcile())
        runs = tuple(x for e in effects if isinstance(e, fx.RunRepair) for x in e.expand())
        want = tuple(fx.RunRepair(x.what, x.rank, x.chunk, x.version) for x in ref.repairs)
        if runs != want:
            return (
                "Refines: Reconcile's RunRepair effects expand to other repairs than the "
                f"reference ({_first_difference(runs, want)})"
            )
    return None


def _has_run(repairs: tuple[Repair, ...]) -> bool:
    return any(x.count > 1 for x in repairs)


@attrs.frozen
class RefinementResult:
    states: int  # states of the aggregated model reached
    aggregated: int  # aggregated transitions checked (accepted ones)
    refused: int  # aggregated candidates refused, each checked against its expansion
    failure: str | None  # the first disagreement, with the shortest path to it
    complete: bool
    plans: int = 0  # reconciling states whose plan was checked against the reference
    runs: int = 0  # of those, plans with a run of more than one chunk

    @property
    def ok(self) -> bool:
        return self.failure is None and self.complete


def check_refinement(model: ClusterModel, *, max_states: int | None = None) -> RefinementResult:
    """Breadth-first over every state the aggregated model reaches (chunk-level and
    aggregated events, ``model.aggregation`` not OFF); every aggregated candidate in
    every state is compared with its expansion (:func:`refinement_failure`), and in
    every reconciling state the plan with the chunk-by-chunk one (:func:`plan_failure`).
    Stops at the first disagreement, with the shortest event path that reaches it."""
    if model.aggregation is Aggregation.OFF:
        model = attrs.evolve(model, aggregation=Aggregation.ON)
    init = model.initial()
    parent: dict[ClusterState, tuple[ClusterState | None, ev.Event | None]] = {init: (None, None)}
    queue = deque([init])
    accepted = refused = plans = runs = 0

    def path(s: ClusterState) -> str:
        out: list[str] = []
        cur: ClusterState | None = s
        while cur is not None:
            prev, e = parent[cur]
            if e is not None:
                out.append(repr(e))
            cur = prev
        return " -> ".join(reversed(out)) or "init"

    def result(failure: str | None, complete: bool) -> RefinementResult:
        return RefinementResult(len(parent), accepted, refused, failure, complete, plans, runs)

    while queue:
        if max_states is not None and len(parent) >= max_states:
            return result(None, False)
        s = queue.popleft()
        if s.phase is Phase.RECONCILING:
            why = plan_failure(model, s)
            if why is not None:
                return result(f"{why}; after {path(s)}", False)
            plans += 1
            runs += _has_run(model.plan(s).repairs)
        for e in model.candidates(s):
            if isinstance(e, ev.Aggregated):
                why = refinement_failure(model, s, e)
                if why is not None:
                    return result(f"{why}; after {path(s)}", False)
                if model.why_not(s, e) is not None:
                    refused += 1
                    continue
                accepted += 1
            elif model.why_not(s, e) is not None:
                continue
            nxt, _ = model.step(s, e)
            if nxt not in parent:
                parent[nxt] = (s, e)
                queue.append(nxt)
    return result(None, True)
