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
"""

from __future__ import annotations

from collections import deque

import attrs

from leto.core import events as ev
from leto.core.cluster import Aggregation, ClusterModel, ClusterState

__all__ = ["RefinementResult", "check_refinement", "expand", "refinement_failure"]


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


@attrs.frozen
class RefinementResult:
    states: int  # states of the aggregated model reached
    aggregated: int  # aggregated transitions checked (accepted ones)
    refused: int  # aggregated candidates refused, each checked against its expansion
    failure: str | None  # the first disagreement, with the shortest path to it
    complete: bool

    @property
    def ok(self) -> bool:
        return self.failure is None and self.complete


def check_refinement(model: ClusterModel, *, max_states: int | None = None) -> RefinementResult:
    """Breadth-first over every state the aggregated model reaches (chunk-level and
    aggregated events, ``model.aggregation`` not OFF); every aggregated candidate in
    every state is compared with its expansion (:func:`refinement_failure`). Stops at
    the first disagreement, with the shortest event path that reaches it."""
    if model.aggregation is Aggregation.OFF:
        model = attrs.evolve(model, aggregation=Aggregation.ON)
    init = model.initial()
    parent: dict[ClusterState, tuple[ClusterState | None, ev.Event | None]] = {init: (None, None)}
    queue = deque([init])
    accepted = refused = 0

    def path(s: ClusterState) -> str:
        out: list[str] = []
        cur: ClusterState | None = s
        while cur is not None:
            prev, e = parent[cur]
            if e is not None:
                out.append(repr(e))
            cur = prev
        return " -> ".join(reversed(out)) or "init"

    while queue:
        if max_states is not None and len(parent) >= max_states:
            return RefinementResult(len(parent), accepted, refused, None, False)
        s = queue.popleft()
        for e in model.candidates(s):
            if isinstance(e, ev.Aggregated):
                why = refinement_failure(model, s, e)
                if why is not None:
                    return RefinementResult(
                        len(parent), accepted, refused, f"{why}; after {path(s)}", False
                    )
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
    return RefinementResult(len(parent), accepted, refused, None, True)
