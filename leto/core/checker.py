"""An explicit-state model checker over the core's own tables.

Breadth-first search over every state the :class:`ClusterModel` can reach from its
initial state (so the first violation found has a shortest counterexample), every
invariant checked in every state, every "sometimes" property required to be reached,
and progress checked on the state graph (networkx): from every reachable state some
RUNNING state is reachable. "Scheduled" checks the recovery order every backend
takes (:mod:`leto.core.schedule`): from every reachable state, feeding the scheduled
events alone (no further fault) reaches RUNNING with every trainer alive, each of
them enabled where it is scheduled. "Bounded" (with ``ClusterConfig.deadline``): in
every state of a recovery, the deadline's scheduled event (GiveUp) is enabled, so no
recovery outlives it (TLA+: ``Liveness`` on ``BoundedSpec``). It checks the Python protocol itself, not a copy
of it: the transitions are the same ``step`` the backends drive.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import attrs
import networkx as nx

from leto.core import events as ev
from leto.core.cluster import ClusterModel, ClusterState
from leto.core.properties import INVARIANTS, SOMETIMES, Invariant, Sometimes
from leto.core.recovery import Phase
from leto.core.schedule import in_recovery, next_event


@attrs.frozen
class Violation:
    name: str  # an invariant, or "Progress" / "Deadlock"
    trace: tuple[tuple[ev.Event | None, ClusterState], ...]  # shortest path from init

    def describe(self) -> str:
        lines = [f"violation of {self.name} after {len(self.trace) - 1} steps:"]
        for i, (event, state) in enumerate(self.trace):
            label = "init" if event is None else repr(event)
            lines.append(f"  {i:3d}. {label:<34} {summarize(state)}")
        return "\n".join(lines)


@attrs.frozen
class CheckResult:
    states: int
    transitions: int
    violations: tuple[Violation, ...]
    reached: dict[str, int]  # sometimes-property -> depth of first witness
    unreached: tuple[str, ...]
    complete: bool  # False when stopped early (first violation, or max_states)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.unreached and self.complete


def summarize(s: ClusterState) -> str:
    """One line: phase, generation, committed step, per-rank trainer/step/chunks."""

    def val(d: int) -> str:
        return {-1: "T", -2: "L", -3: "G"}.get(d, str(d))

    ranks = " ".join(
        f"r{r}:{s.trainer[r].name[0]}{s.pc[r].name[:3].lower()}@{s.step[r]}"
        f"[{''.join(val(d) for d in s.data[r])}]"
        for r in range(len(s.data))
    )
    return f"{s.phase.name:<11} g{s.gen} c{s.committed} t2={s.t2} {ranks}"


def check(
    model: ClusterModel,
    *,
    invariants: Sequence[Invariant] = INVARIANTS,
    sometimes: Sequence[Sometimes] = SOMETIMES,
    stop_at_first: bool = False,
    progress: bool = True,
    scheduled: bool = True,
    max_states: int | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> CheckResult:
    init = model.initial()
    index: dict[ClusterState, int] = {init: 0}
    states: list[ClusterState] = [init]
    parent: list[tuple[int, ev.Event | None]] = [(-1, None)]
    depth: list[int] = [0]
    graph = nx.DiGraph()
    graph.add_node(0)
    violations: list[Violation] = []
    broken: set[str] = set()
    reached: dict[str, int] = {}
    transitions = 0
    complete = True

    def trace(i: int) -> tuple[tuple[ev.Event | None, ClusterState], ...]:
        out: list[tuple[ev.Event | None, ClusterState]] = []
        while i >= 0:
            p, e = parent[i]
            out.append((e, states[i]))
            i = p
        return tuple(reversed(out))

    def visit(i: int) -> None:
        s = states[i]
        for inv in invariants:
            if inv.name not in broken and not inv.holds(model, s):
                broken.add(inv.name)
                violations.append(Violation(inv.name, trace(i)))
        for prop in sometimes:
            if prop.state is not None and prop.name not in reached and prop.state(model, s):
                reached[prop.name] = depth[i]

    visit(0)
    queue = deque([0])
    while queue:
        if stop_at_first and violations:
            complete = False
            break
        if max_states is not None and len(states) >= max_states:
            complete = False
            break
        i = queue.popleft()
        s = states[i]
        for e, nxt in model.successors(s):
            transitions += 1
            j = index.get(nxt)
            if j is None:
                j = len(states)
                index[nxt] = j
                states.append(nxt)
                parent.append((i, e))
                depth.append(depth[i] + 1)
                queue.append(j)
                visit(j)
                if on_progress is not None and j % 10000 == 0:
                    on_progress(j)
            graph.add_edge(i, j)
            for prop in sometimes:
                if (
                    prop.edge is not None
                    and prop.name not in reached
                    and prop.edge(model, s, e, nxt)
                ):
                    reached[prop.name] = depth[i] + 1

    if progress and complete:
        # a job ends RUNNING or, past its recovery deadline, FAILED
        running = [i for i, s in enumerate(states) if s.phase in (Phase.RUNNING, Phase.FAILED)]
        sink = -1
        graph.add_edges_from((i, sink) for i in running)
        can_run = nx.ancestors(graph, sink)
        stuck = [i for i in range(len(states)) if i not in can_run and i not in set(running)]
        if stuck:
            worst = min(stuck, key=lambda i: depth[i])
            violations.append(Violation("Progress", trace(worst)))
    if scheduled and complete:
        for i, s in enumerate(states):
            run = scheduled_run(model, s, limit=4 * len(s.trainer) + 16)
            if run is not None:
                violations.append(Violation("Scheduled", trace(i) + run))
                break
    if scheduled and complete and model.config.deadline:
        for i, s in enumerate(states):
            if s.phase in (Phase.RUNNING, Phase.FAILED):
                continue
            give = next_event(model, s, overdue=True)
            if give is None or model.why_not(s, give) is not None:
                violations.append(Violation("Bounded", trace(i) + ((give, s),)))
                break
    unreached = tuple(p.name for p in sometimes if p.name not in reached)
    return CheckResult(
        states=len(states),
        transitions=transitions,
        violations=tuple(violations),
        reached=reached,
        unreached=unreached if complete else (),
        complete=complete,
    )


def scheduled_run(
    model: ClusterModel, s: ClusterState, *, limit: int
) -> tuple[tuple[ev.Event | None, ClusterState], ...] | None:
    """None if feeding :func:`~leto.core.schedule.next_event` from ``s`` ends RUNNING
    with every trainer alive within ``limit`` events, each enabled; else the run that
    did not (ending at the refused or last event)."""
    run: list[tuple[ev.Event | None, ClusterState]] = []
    for _ in range(limit):
        if not in_recovery(s):
            return None
        e = next_event(model, s)
        assert e is not None
        if model.why_not(s, e) is not None:
            run.append((e, s))
            return tuple(run)
        s, _ = model.step(s, e)
        run.append((e, s))
    return tuple(run) if in_recovery(s) else None
