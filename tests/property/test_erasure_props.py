"""Hypothesis properties of leto.core.erasure over random topologies and failures."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from leto.core.erasure import (
    DataBlock,
    Failure,
    NodeLoss,
    Placement,
    RankMemory,
    Topology,
    coverage,
    decode,
    lost_blocks,
    place,
    replay,
)

SETTINGS = settings(max_examples=150, deadline=None)


@st.composite
def placements(draw: st.DrawFn) -> Placement:
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    topology = Topology(sizes)
    tier1 = draw(st.booleans())
    tier2 = draw(st.booleans())
    parity = draw(st.integers(0, topology.nodes - 1)) if tier2 else draw(st.integers(0, 5))
    return place(topology, tier1=tier1, tier2=tier2, tier2_parity=parity)


def elements(placement: Placement) -> list[Failure]:
    topo = placement.topology
    out: list[Failure] = [RankMemory(r) for r in range(topo.world_size)]
    out.extend(NodeLoss(n) for n in range(topo.nodes))
    return out


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Placement, list[Failure]]:
    placement = draw(placements())
    failures = draw(st.lists(st.sampled_from(elements(placement)), max_size=5))
    return placement, failures


def tier2_parity(placement: Placement) -> int:
    return next((g.tolerance for g in placement.groups if g.tier == 2), 0)


def expected_tier(placement: Placement, failures: list[Failure]) -> int:
    """The closed form the standard placement promises (PROTOCOL.md's Tier1Covered and
    Tier2Covered, generalised to `tier2_parity` nodes)."""
    if not failures:
        return 0
    topo = placement.topology
    nodes_lost = {f.node for f in failures if isinstance(f, NodeLoss)}
    ranks = {f.rank for f in failures if isinstance(f, RankMemory)}
    per_node = Counter(topo.node_of(r) for r in ranks)
    if placement.tier1 and not nodes_lost and max(per_node.values(), default=0) <= 1:
        return 1
    if placement.snapshots and len(nodes_lost) <= tier2_parity(placement):
        return 2
    return 3


@SETTINGS
@given(scenarios())
def test_decode_order_is_executable(scenario: tuple[Placement, list[Failure]]) -> None:
    placement, failures = scenario
    lost = lost_blocks(placement, failures)
    result = decode(placement, lost)
    whole = replay(placement, lost, result.order)
    assert whole == frozenset(placement.blocks()) - result.unrecoverable
    assert result.unrecoverable <= lost


@SETTINGS
@given(placements(), st.data())
def test_decode_order_is_executable_for_any_lost_set(
    placement: Placement, data: st.DataObject
) -> None:
    # lost sets no failure produces too: checksum failures can take any block
    lost = frozenset(data.draw(st.sets(st.sampled_from(placement.blocks()))))
    result = decode(placement, lost)
    whole = replay(placement, lost, result.order)
    assert whole == frozenset(placement.blocks()) - result.unrecoverable
    lost_data_back = not any(isinstance(b, DataBlock) for b in result.unrecoverable)
    assert result.recoverable == lost_data_back == (result.tier <= 2)
    assert (result.tier == 0) == (not lost)


@SETTINGS
@given(scenarios())
def test_recoverable_iff_no_lost_data_unrecoverable(
    scenario: tuple[Placement, list[Failure]],
) -> None:
    placement, failures = scenario
    lost = lost_blocks(placement, failures)
    result = decode(placement, lost)
    lost_data = {b for b in lost if isinstance(b, DataBlock)}
    assert result.recoverable == (not lost_data & result.unrecoverable)
    assert result.recoverable == (result.tier <= 2)


@SETTINGS
@given(scenarios())
def test_tier_matches_the_closed_form(scenario: tuple[Placement, list[Failure]]) -> None:
    placement, failures = scenario
    assert decode(placement, lost_blocks(placement, failures)).tier == expected_tier(
        placement, failures
    )


@SETTINGS
@given(scenarios(), st.data())
def test_adding_a_failure_never_lowers_the_tier(
    scenario: tuple[Placement, list[Failure]], data: st.DataObject
) -> None:
    placement, failures = scenario
    extra = data.draw(st.sampled_from(elements(placement)))
    before = decode(placement, lost_blocks(placement, failures)).tier
    after = decode(placement, lost_blocks(placement, [*failures, extra])).tier
    assert after >= before


@SETTINGS
@given(placements(), st.data())
def test_losing_more_blocks_never_lowers_the_tier(
    placement: Placement, data: st.DataObject
) -> None:
    blocks = st.sampled_from(placement.blocks())
    small = frozenset(data.draw(st.sets(blocks)))
    big = small | frozenset(data.draw(st.sets(blocks)))
    assert decode(placement, big).tier >= decode(placement, small).tier


@SETTINGS
@given(placements(), st.data())
def test_single_rank_memory_is_tier_1_with_tier1(placement: Placement, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, placement.topology.world_size - 1))
    result = decode(placement, lost_blocks(placement, [RankMemory(rank)]))
    if placement.tier1:
        assert result.tier <= 1 and result.recoverable


@SETTINGS
@given(placements(), st.data())
def test_node_losses_within_tier2_parity_are_tier_2(
    placement: Placement, data: st.DataObject
) -> None:
    topo = placement.topology
    parity = tier2_parity(placement)
    if not placement.snapshots or topo.nodes < 2 or parity < 1:
        return
    nodes = data.draw(st.sets(st.integers(0, topo.nodes - 1), min_size=1, max_size=parity))
    ranks = data.draw(st.sets(st.integers(0, topo.world_size - 1)))
    failures: list[Failure] = [NodeLoss(n) for n in sorted(nodes)]
    failures.extend(RankMemory(r) for r in sorted(ranks))
    result = decode(placement, lost_blocks(placement, failures))
    assert result.tier == 2 and result.recoverable
    assert not result.unrecoverable  # every lost block, redundancy included, comes back
    if len(nodes) == 1:
        single = decode(placement, lost_blocks(placement, failures[:1]))
        assert single.tier <= 2


@settings(max_examples=40, deadline=None)
@given(placements())
def test_coverage_agrees_with_decode(placement: Placement) -> None:
    report = coverage(placement, max_failures=2)
    seen = set()
    for pattern in report.patterns:
        assert 1 <= len(pattern.failures) <= 2
        assert pattern.lost == lost_blocks(placement, pattern.failures)
        assert pattern.tier == decode(placement, pattern.lost).tier
        seen.add(pattern.failures)
    assert len(seen) == len(report.patterns)  # no pattern twice
    assert sum(report.by_tier().values()) == len(report.patterns)
    assert report.survived(1) == tuple(p for p in report.patterns if p.tier <= 1)
