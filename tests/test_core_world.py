"""The core's elastic world (:mod:`leto.core.world`, ``spec/Elastic.tla``) checked the
two ways the protocol core is: an explicit-state search over its own ``step`` on
MCElastic.cfg's constants (invariants in every state, the interesting states reached,
an end reachable from every state, ``decide`` never stuck), with a broken shrink it must
reject; and a Hypothesis machine against a plain model. Plus the batch plan of a shrunk
world (:mod:`leto.core.accumulation`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

import attrs
import networkx as nx
import pytest
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from leto.core import world as w
from leto.core.accumulation import Plan, plan
from leto.core.errors import ProtocolError

NODES = ("n1", "n2", "n3", "n4")
MAX_FAULTS, MAX_JOINS = 2, 2


@attrs.frozen
class Node:
    """A state of the search: the core's world, the spec's counters and replicas."""

    world: w.World
    faults: int = 0
    joins: int = 0
    # the world sizes each node's replica was trained with (the spec's hist)
    hist: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def replica(self, n: str) -> tuple[int, ...] | None:
        return dict(self.hist).get(n)


def candidates(s: w.World) -> Iterator[w.WorldEvent]:
    yield w.Train()
    yield w.Shrink()
    yield w.Stop()
    yield w.Finish()
    for n in NODES:
        yield w.LoseNode(n)
        yield w.SpareJoins(n)
        yield w.Grow(n)
        for m in NODES:
            yield w.Replace(n, m)


def successor(node: Node, e: w.WorldEvent) -> Node | None:
    s = node.world
    if isinstance(e, w.LoseNode) and node.faults >= MAX_FAULTS:
        return None
    if isinstance(e, w.SpareJoins) and (node.joins >= MAX_JOINS or e.node in _up(node)):
        return None
    try:
        t = w.step(s, e)
    except ProtocolError:
        return None
    hist = dict(node.hist)
    if isinstance(e, w.Train):
        for m in s.members:
            hist[m] = (*hist[m], len(s.members))
    elif isinstance(e, w.LoseNode):
        hist.pop(e.node)
    elif isinstance(e, (w.Replace, w.Grow)):
        source = next(m for m in s.members if m not in s.lost)
        hist[e.spare] = hist[source]  # decoded / copied from a survivor's replica
    return Node(
        world=t,
        faults=node.faults + isinstance(e, w.LoseNode),
        joins=node.joins + isinstance(e, w.SpareJoins),
        hist=tuple(sorted(hist.items())),
    )


def _up(node: Node) -> set[str]:
    s = node.world
    return (set(s.members) - s.lost) | set(s.pool) | s.lost  # a lost member keeps its name


INVARIANTS: dict[str, Callable[[Node], bool]] = {
    "InRange": lambda n: (
        (
            n.world.phase is not w.WorldPhase.RUNNING
            or n.world.lo <= len(n.world.members) <= n.world.hi
        )
        and all(n.world.lo <= x <= n.world.hi for x in n.world.schedule)
    ),
    "Roles": lambda n: (
        len(set(n.world.members)) == len(n.world.members)
        and not set(n.world.members) & set(n.world.pool)
        and n.world.lost <= set(n.world.members)
    ),
    "Equivalence": lambda n: all(
        n.replica(m) == n.world.schedule for m in n.world.members if m not in n.world.lost
    ),
}


def _regrown(n: Node) -> bool:
    s = n.world.schedule
    return any(
        s[i] > s[j] < s[k]
        for i in range(len(s))
        for j in range(i, len(s))
        for k in range(j, len(s))
    )


SOMETIMES: dict[str, Callable[[Node], bool]] = {
    "shrunk and grown back": _regrown,
    "stopped below MIN": lambda n: n.world.phase is w.WorldPhase.STOPPED,
    "replaced from the pool": lambda n: (
        n.world.phase is w.WorldPhase.DONE and "n4" in n.world.members
    ),
    "done on a shrunk world": lambda n: (
        n.world.phase is w.WorldPhase.DONE and len(n.world.members) == 2
    ),
}


def explore() -> tuple[nx.DiGraph, Node, dict[str, Node]]:
    init = Node(
        world=w.start(2, 3, ("n1", "n2", "n3"), 3), hist=tuple((m, ()) for m in ("n1", "n2", "n3"))
    )
    g: nx.DiGraph = nx.DiGraph()
    g.add_node(init)
    bad: dict[str, Node] = {}
    todo = deque([init])
    while todo:
        node = todo.popleft()
        for name, holds in INVARIANTS.items():
            if not holds(node):
                bad.setdefault(name, node)
        for e in candidates(node.world):
            nxt = successor(node, e)
            if nxt is None:
                continue
            if nxt not in g:
                todo.append(nxt)
            g.add_edge(node, nxt, event=e)
    return g, init, bad


def test_every_reachable_world_keeps_the_invariants_and_can_end() -> None:
    g, init, bad = explore()
    assert not bad, {k: v.world for k, v in bad.items()}
    assert g.number_of_nodes() > 1000
    ends = {n for n in g if n.world.phase in (w.WorldPhase.DONE, w.WorldPhase.STOPPED)}
    can_end = set(ends)
    for e in ends:
        can_end |= nx.ancestors(g, e)
    assert can_end == set(g.nodes), "a state from which the job can never end"
    for name, pred in SOMETIMES.items():
        assert any(pred(n) for n in g), f"never reached: {name}"


def test_decide_always_names_an_accepted_event_once_the_spare_timeout_passed() -> None:
    g, _, _ = explore()
    for node in g:
        s = node.world
        e = w.decide(s, timed_out=True)
        if s.phase is w.WorldPhase.AWAITING:
            assert e is not None, s
        if e is not None:
            t = w.step(s, e)  # accepted: raises otherwise
            assert t.phase is not w.WorldPhase.AWAITING or len(t.lost) < len(s.lost), (s, e)
        if s.phase is w.WorldPhase.AWAITING and not s.pool and s.left:
            assert w.decide(s, timed_out=False) is None  # waits for a spare until the timeout


def test_the_search_rejects_a_shrink_that_ignores_min(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(s: w.World, e: w.WorldEvent) -> w.World:
        kept = tuple(m for m in s.members if m not in s.lost)
        return attrs.evolve(s, members=kept, lost=frozenset(), gen=s.gen + 1)

    monkeypatch.setitem(w._HANDLERS, w.Shrink, broken)
    _, _, bad = explore()
    assert "InRange" in bad and len(bad["InRange"].world.members) == 1


def test_a_shrink_renumbers_densely_and_a_grow_appends() -> None:
    s = w.start(1, 3, ("a", "b", "c"), 5)
    s = w.step(s, w.Train())
    s = w.step(s, w.LoseNode("b"))
    assert w.decide(s, timed_out=False) is None
    assert w.decide(s, timed_out=True) == w.Shrink()
    s = w.step(s, w.Shrink())
    assert (s.members, s.gen, s.phase) == (("a", "c"), 1, w.WorldPhase.RUNNING)
    s = w.step(s, w.Train())
    s = w.step(s, w.SpareJoins("d"))
    assert w.decide(s, timed_out=False) == w.Grow("d")
    s = w.step(s, w.Grow("d"))
    s = w.step(s, w.Train())
    assert (s.members, s.gen, s.schedule) == (("a", "c", "d"), 2, (3, 2, 3))
    assert s.schedule == w.schedule_at({2: 2, 3: 3}, 3, 3)


def test_illegal_world_events_are_refused_and_leave_the_state() -> None:
    s = w.start(2, 2, ("a", "b"), 2)
    with pytest.raises(ProtocolError, match="world: event Shrink.. is illegal in state RUNNING"):
        w.step(s, w.Shrink())
    lost = w.step(s, w.LoseNode("b"))
    with pytest.raises(ProtocolError, match="fewer than MIN 2"):
        w.step(lost, w.Shrink())
    assert w.decide(lost, timed_out=True) == w.Stop()
    assert w.step(lost, w.Stop()).phase is w.WorldPhase.STOPPED
    with pytest.raises(ProtocolError, match="at MAX 2"):
        w.step(w.step(s, w.SpareJoins("c")), w.Grow("c"))
    with pytest.raises(ValueError, match="node name"):
        w.LoseNode("")
    with pytest.raises(ValueError, match="need 1 <= MIN <= nodes <= MAX"):
        w.start(3, 4, ("a", "b"), 1)


class WorldMachine(RuleBasedStateMachine):
    """Random world events against a plain model: a list of members, a pool, a set."""

    def __init__(self) -> None:
        super().__init__()
        self.s = w.start(2, 4, ("n0", "n1", "n2"), 10_000)
        self.members = ["n0", "n1", "n2"]
        self.pool: list[str] = []
        self.lost: set[str] = set()
        self.sizes: list[int] = []
        self.fresh = 3

    def _refused(self, e: w.WorldEvent) -> None:
        before = self.s
        with pytest.raises(ProtocolError):
            w.step(self.s, e)
        assert self.s == before

    @precondition(lambda self: self.s.phase is not w.WorldPhase.STOPPED)
    @rule()
    def train(self) -> None:
        note("train")
        if self.lost:
            return self._refused(w.Train())
        self.s = w.step(self.s, w.Train())
        self.sizes.append(len(self.members))

    @precondition(lambda self: self.s.phase is not w.WorldPhase.STOPPED)
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        n = data.draw(st.sampled_from(sorted(self.members)))
        note(f"lose {n}")
        if n in self.lost:
            return self._refused(w.LoseNode(n))
        self.s = w.step(self.s, w.LoseNode(n))
        self.lost.add(n)

    @precondition(lambda self: self.s.phase is not w.WorldPhase.STOPPED)
    @rule()
    def join(self) -> None:
        n = f"n{self.fresh}"
        self.fresh += 1
        note(f"join {n}")
        self.s = w.step(self.s, w.SpareJoins(n))
        self.pool.append(n)

    @precondition(lambda self: self.s.phase is not w.WorldPhase.STOPPED)
    @rule(timed_out=st.booleans())
    def decide(self, timed_out: bool) -> None:
        e = w.decide(self.s, timed_out)
        note(f"decide {timed_out} -> {e}")
        if e is None:
            return
        self.s = w.step(self.s, e)
        if isinstance(e, w.Replace):
            self.members[self.members.index(e.node)] = e.spare
            self.pool.remove(e.spare)
            self.lost.remove(e.node)
        elif isinstance(e, w.Shrink):
            self.members = [m for m in self.members if m not in self.lost]
            self.lost.clear()
        elif isinstance(e, w.Grow):
            self.members.append(e.spare)
            self.pool.remove(e.spare)

    @precondition(lambda self: self.s.phase is w.WorldPhase.RUNNING)
    @rule()
    def refused_shrink(self) -> None:
        self._refused(w.Shrink())

    @precondition(lambda self: self.s.phase is w.WorldPhase.STOPPED)
    @rule()
    def stopped_is_sticky(self) -> None:
        for e in (w.Train(), w.SpareJoins("late"), w.Shrink(), w.Grow("late")):
            self._refused(e)

    @invariant()
    def agrees(self) -> None:
        if self.s.phase is w.WorldPhase.STOPPED:
            assert len(self.members) - len(self.lost) < 2
            return
        assert list(self.s.members) == self.members
        assert list(self.s.pool) == self.pool and self.s.lost == self.lost
        assert list(self.s.schedule) == self.sizes
        assert all(2 <= x <= 4 for x in self.sizes)

    def teardown(self) -> None:
        pass


WorldMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_world_machine = WorldMachine.TestCase


@pytest.mark.parametrize("full", [1, 2, 3, 4, 5])
def test_keeping_the_global_batch_computes_every_part_exactly_once(full: int) -> None:
    for world in range(1, full + 3):
        plans = [plan(r, world, full, keep_global_batch=True) for r in range(world)]
        parts = sorted(p for pl in plans for p in pl.parts)
        assert parts == list(range(max(world, full)))
        assert {pl.divisor for pl in plans} == {max(world, full)}
        per_rank = [plan(r, world, full, keep_global_batch=False) for r in range(world)]
        assert sorted(p for pl in per_rank for p in pl.parts) == list(range(world))
        assert {pl.divisor for pl in per_rank} == {world}


def test_a_batch_plan_is_the_documented_one_and_bad_input_is_refused() -> None:
    assert plan(0, 2, 3, True) == Plan(parts=(0, 2), cut=3, divisor=3)
    assert plan(1, 2, 3, True) == Plan(parts=(1,), cut=3, divisor=3)
    assert plan(1, 2, 3, False) == Plan(parts=(1,), cut=3, divisor=2)
    assert plan(3, 4, 3, True) == Plan(parts=(3,), cut=4, divisor=4)  # grown past the start
    assert plan(1, 3, 0, True) == Plan(parts=(1,), cut=3, divisor=3)  # 0: the world's ranks
    with pytest.raises(ValueError, match="0 <= rank < world"):
        plan(2, 2, 3, True)
    with pytest.raises(ValueError, match="full >= 0"):
        plan(0, 2, -1, True)
    with pytest.raises(TypeError, match="are ints"):
        plan(True, 2, 3, True)  # type: ignore[arg-type]
