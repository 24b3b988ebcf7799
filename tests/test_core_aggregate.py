"""The commit path's aggregated events refine the chunk-level protocol; broken ones are caught."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from leto.core import effects as fx
from leto.core import events as ev
from leto.core.aggregate import check_refinement, expand, plan_failure, refinement_failure
from leto.core.checker import check
from leto.core.chunk import LOST, NONE, TORN, repeated, uniform_row
from leto.core.cluster import Aggregation, ClusterConfig, ClusterModel
from leto.core.erasure import Topology
from leto.core.reconcile import Plan, Repair, Survivors, expand_repairs, plan
from leto.core.recovery import Kind, Phase
from leto.core.verify import CHECK_CONFIGS


def test_aggregated_events_refine_on_every_reachable_state() -> None:
    cfg = CHECK_CONFIGS["reclaim"]
    res = check_refinement(ClusterModel(cfg, aggregation=Aggregation.ON))
    assert res.ok, res.failure
    assert res.aggregated > 0 and res.refused > 0  # both sides of the check exercised
    # no state the chunk-level model cannot reach: the same state space
    assert res.states == check(ClusterModel(cfg), progress=False, scheduled=False).states


def test_refinement_over_two_steps() -> None:
    cfg = ClusterConfig(
        topology=Topology((2,)), chunks=2, max_step=2, max_faults=1, reclaim=False,
        faults=frozenset({"crash", "lose_memory"}),
    )  # fmt: skip
    res = check_refinement(ClusterModel(cfg, aggregation=Aggregation.ON))
    assert res.ok, res.failure
    assert res.aggregated > 0
    # plans in runs checked against the chunk-by-chunk plan, some with a run of 2 chunks
    assert res.plans > 0 and res.runs > 0


def test_refinement_check_rejects_a_broken_plan_aggregation() -> None:
    """ROW_HEAD reads a rank's roll forward from its first chunk: a rank that died after
    writing chunk 0 of the committed step gets no run, and its chunk 1 is not planned."""
    res = check_refinement(ClusterModel(CHECK_CONFIGS["three-ranks"], aggregation="row_head"))
    assert not res.ok and res.failure is not None
    assert res.failure.startswith("Refines: the plan's runs expand to other repairs")
    assert "chunk by chunk Repair(what='forward', rank=0, chunk=1" in res.failure
    assert "Crash(rank=0)" in res.failure


@pytest.mark.parametrize(
    ("broken", "why"),
    [
        (Aggregation.NO_PARITY_FOLD, "differs in ['par']"),
        (Aggregation.UNCOMMITTED, "BeginChunk(rank=0, chunk=0) refused"),
        (Aggregation.OPEN_TAIL, "differs in ['tail']"),
    ],
)
def test_refinement_check_rejects_a_broken_aggregation(broken: Aggregation, why: str) -> None:
    res = check_refinement(ClusterModel(CHECK_CONFIGS["three-ranks"], aggregation=broken))
    assert not res.ok
    assert res.failure is not None and res.failure.startswith("Refines:") and why in res.failure


def test_expansion_is_the_old_feed() -> None:
    m = ClusterModel(ClusterConfig(topology=Topology((2,)), chunks=2))
    assert expand(m, ev.ApplyStep(1, (1,))) == (
        ev.BeginChunk(1, 0), ev.EndChunk(1, 0), ev.ParityChunk(1, 0),
        ev.BeginChunk(1, 1), ev.EndChunk(1, 1), ev.ParityChunk(1, 1),
        ev.Finish(1),
    )  # fmt: skip
    assert expand(m, ev.CommitStep(1))[-1] == ev.Decide()
    assert expand(m, ev.CloseRanks([0, 1])) == (ev.Close(0), ev.Close(1))


def test_close_ranks_is_every_close_in_one_state_change_and_refuses_as_they_do() -> None:
    m = ClusterModel(ClusterConfig(topology=Topology((2,)), chunks=2), aggregation=Aggregation.ON)
    s = m.initial()
    for e in (ev.CommitStep(1), ev.ApplyStep(1, (0, 1))):
        s, _ = m.step(s, e)
    one, eff = m.step(s, ev.CloseRanks((0, 1)))
    each = s
    for r in (0, 1):
        each, _ = m.step(each, ev.Close(r))
    assert one == each and one.tail == (1, 1)
    assert eff == (fx.KeepProcessState(0, 1), fx.KeepProcessState(1, 1))
    half, _ = m.step(s, ev.Close(0))
    err = m.why_not(half, ev.CloseRanks((0, 1)))  # rank 0 closed already
    assert err is not None and "rank 0 is not in its loop tail" in str(err)
    assert m.why_not(s, ev.CloseRanks((0, 2))) is not None  # no rank 2
    with pytest.raises(ValueError):
        ev.CloseRanks((1, 0))


def test_apply_step_validates() -> None:
    with pytest.raises(ValueError):
        ev.ApplyStep(1, ())
    with pytest.raises(ValueError):
        ev.ApplyStep(1, (2, 1))
    assert ev.ApplyStep(1, [0, 3]).ranks == (0, 3)


BIG = ClusterConfig(
    topology=Topology((2, 3)), chunks=3, max_step=4, max_faults=2, k=2, reclaim=True
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_runs_refine(data: st.DataObject) -> None:
    """Random runs of the aggregated model, faults at random points: every aggregated
    event offered on the way agrees with its expansion, and the run's states are the
    chunk-level model's."""
    m = ClusterModel(BIG, aggregation=Aggregation.ON)
    s = m.initial()
    for _ in range(data.draw(st.integers(5, 60))):
        for e in m.candidates(s):
            if isinstance(e, ev.Aggregated):
                assert refinement_failure(m, s, e) is None
        if s.phase is Phase.RECONCILING:
            assert plan_failure(m, s) is None
        enabled = m.enabled(s)
        if not enabled:
            break
        agg = [e for e in enabled if isinstance(e, ev.Aggregated)]
        pool = agg if agg and data.draw(st.booleans()) else enabled
        e = data.draw(st.sampled_from(sorted(pool, key=repr)))
        note(repr(e))
        s, _ = m.step(s, e)


def test_aggregated_step_shares_rows() -> None:
    """A whole step of every rank writes the shared rows: no ranks x chunks copy."""
    m = ClusterModel(ClusterConfig(topology=Topology((2, 2)), chunks=64, max_step=3))
    s = m.initial()
    s, _ = m.step(s, ev.CommitStep(1))
    s, effects = m.step(s, ev.ApplyStep(1, (0, 1, 2, 3)))
    assert len({id(row) for row in s.data}) == 1
    assert effects == ()
    assert all(p is not None and len({id(row) for row in p}) == 1 for p in s.par)


# --- the compressed reconcile plan is the chunk-by-chunk one ---------------------------


def _reachable(m: ClusterModel, limit: int) -> list[Any]:
    seen = {m.initial(): None}
    queue = [m.initial()]
    while queue and len(seen) < limit:
        s = queue.pop()
        for _, nxt in m.successors(s):
            if nxt not in seen:
                seen[nxt] = None
                queue.append(nxt)
    return list(seen)


@pytest.mark.parametrize("name", ["three-ranks", "two-faults", "tier1-off"])
def test_compressed_plan_is_the_reference_on_reachable_states(name: str) -> None:
    m = ClusterModel(CHECK_CONFIGS[name])
    states = _reachable(m, 6000)
    kinds = set()
    for s in states:
        surv = m.survivors(s)
        got = plan(surv)
        assert _expanded(got) == plan(surv, compress=False), s
        kinds.add(got.kind)
    assert len(kinds) >= 4  # not vacuous: several kinds of plan compared


def _expanded(p: Plan) -> Plan:
    return attrs.evolve(p, repairs=expand_repairs(p.repairs))


def test_plan_rolls_a_rank_forward_in_one_run() -> None:
    """COMMIT(1) recorded, no rank applied it, a rank crashed: every rank rolls its 64
    chunks forward, one repair each, that expand to the chunk-by-chunk plan; the
    Reconcile effects are the same runs."""
    m = ClusterModel(ClusterConfig(topology=Topology((2, 2)), chunks=64, max_step=3))
    s, _ = m.step(m.initial(), ev.CommitStep(1))
    s, _ = m.step(s, ev.ApplyStep(1, (3,)))  # rank 3 finished: no repair
    for e in (ev.Crash(0), ev.Detect(), ev.Fence(), ev.Promote(0), ev.EndPromote()):
        s, _ = m.step(s, e)
    p = m.plan(s)
    assert p.kind is Kind.FORWARD and p.target == 1
    assert p.repairs == tuple(Repair("forward", r, 0, 1, 64) for r in range(3))
    assert _expanded(p) == plan(m.survivors(s), compress=False)
    assert len(expand_repairs(p.repairs)) == 3 * 64
    assert plan_failure(m, s) is None
    _, effects = m.step(s, ev.Reconcile())
    assert [x for x in effects if isinstance(x, fx.RunRepair)] == [
        fx.RunRepair("forward", r, 0, 1, 64) for r in range(3)
    ]


def test_partial_rows_plan_runs_of_the_chunks_behind() -> None:
    """Rank 0 applied chunks 0..2 of 8 and died writing chunk 3 (torn: only its undo
    copy of step 0 is usable): one run of chunks 3..7; rank 1, untouched, one of all 8."""
    m = ClusterModel(ClusterConfig(topology=Topology((2,)), chunks=8, max_step=3))
    s, _ = m.step(m.initial(), ev.CommitStep(1))
    for c in range(3):
        for e in (ev.BeginChunk(0, c), ev.EndChunk(0, c), ev.ParityChunk(0, c)):
            s, _ = m.step(s, e)
    s, _ = m.step(s, ev.BeginChunk(0, 3))
    for e in (ev.Crash(0), ev.Detect(), ev.Fence(), ev.Promote(0), ev.EndPromote()):
        s, _ = m.step(s, e)
    p = m.plan(s)
    assert p.repairs == (Repair("forward", 0, 3, 1, 5), Repair("forward", 1, 0, 1, 8))
    assert _expanded(p) == plan(m.survivors(s), compress=False)
    assert plan_failure(m, s) is None


def test_repair_runs_validate_and_expand() -> None:
    assert Repair("tier1", 2, 4, 7, 3).expand() == tuple(
        Repair("tier1", 2, c, 7) for c in (4, 5, 6)
    )
    assert Repair("grad-tier1", 2, -1, 7).expand() == (Repair("grad-tier1", 2, -1, 7),)
    assert fx.RunRepair("forward", 1, 0, 2, 2).expand() == (
        fx.RunRepair("forward", 1, 0, 2), fx.RunRepair("forward", 1, 1, 2),
    )  # fmt: skip
    with pytest.raises(ValueError, match="count must be >= 1"):
        Repair("forward", 0, 0, 1, 0)
    with pytest.raises(ValueError, match="count must be >= 1"):
        fx.RunRepair("forward", 0, 0, 1, 0)


_VAL = st.sampled_from([0, 1, 2, TORN, LOST])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_compressed_plan_is_the_reference_on_random_survivors(data: st.DataObject) -> None:
    groups = ((0, 1, 2), (3, 4))
    C = data.draw(st.integers(1, 6))

    def row(vals: Any) -> tuple[int, ...]:
        if data.draw(st.booleans()):  # a shared uniform row, as the model writes them
            return uniform_row(data.draw(vals), C)
        return tuple(data.draw(st.lists(vals, min_size=C, max_size=C)))

    def par() -> Any:
        if data.draw(st.integers(0, 4)) == 0:
            return None
        if data.draw(st.booleans()):
            return repeated(uniform_row(data.draw(st.sampled_from([0, 1, 2])), 3), C)
        return tuple(
            tuple(data.draw(st.lists(st.sampled_from([0, 1, 2]), min_size=3, max_size=3)))
            for _ in range(C)
        )

    surv = Survivors(
        groups=groups,
        data=tuple(row(_VAL) for _ in range(5)),
        undo=tuple(row(st.sampled_from([NONE, 0, 1])) for _ in range(5)),
        grad=tuple(data.draw(st.sampled_from([NONE, LOST, 1, 2])) for _ in range(5)),
        par=(
            par(),
            None
            if data.draw(st.booleans())
            else tuple((x[0], x[1]) for x in (par() or ((0, 0, 0),) * C)),
        ),
        gpar=((1, 1, 1), (1, 1)),
        committed=data.draw(st.sampled_from([0, 1, 2])),
        t2=0,
        t2_intact=data.draw(st.booleans()),
    )
    assert _expanded(plan(surv)) == plan(surv, compress=False)


def test_a_repair_goes_on_the_wire_in_one_shape_and_comes_back() -> None:
    from leto.core.reconcile import Repair

    for r in (Repair("forward", 1, 0, 2, 64), Repair("grad-tier1", 3, -1, 5)):
        assert Repair.from_wire(r.wire()) == r
        run = fx.RunRepair(r.what, r.rank, r.chunk, r.version, r.count)
        assert run.repair() == r and run.repair().wire() == r.wire()
    with pytest.raises(ValueError, match="has the fields"):
        Repair.from_wire({"what": "forward", "rank": 1, "chunk": 0, "step": 2, "count": 1})
    with pytest.raises(ValueError, match="version is an integer"):
        Repair.from_wire({"what": "forward", "rank": 1, "chunk": 0, "version": True, "count": 1})
