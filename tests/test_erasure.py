"""Unit tests of leto.core.erasure: placement, lost blocks, decode tiers and orders."""

from __future__ import annotations

import itertools

import pytest

from leto.core.erasure import (
    Block,
    BlockRepair,
    DataBlock,
    DecodePlan,
    Failure,
    Group,
    NodeLoss,
    Placement,
    RankMemory,
    SnapshotBlock,
    Tier1Parity,
    Tier2Parity,
    Topology,
    coverage,
    decode,
    lost_blocks,
    place,
    placement_graph,
    replay,
)


def plan(placement: Placement, *failures: Failure) -> DecodePlan:
    """Decode the failures, and check the plan's order runs and brings back exactly the
    lost blocks not declared unrecoverable."""
    lost = lost_blocks(placement, failures)
    result = decode(placement, lost)
    whole = replay(placement, lost, result.order)
    assert whole == frozenset(placement.blocks()) - result.unrecoverable
    assert result.unrecoverable <= lost
    return result


def tier(placement: Placement, *failures: Failure) -> int:
    return plan(placement, *failures).tier


# ----------------------------------------------------------------------------- topology


def test_topology_uniform_and_lookups() -> None:
    topo = Topology.uniform(3, 2)
    assert topo.node_sizes == (2, 2, 2)
    assert topo.world_size == 6
    assert topo.nodes == 3
    assert [topo.node_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert topo.ranks_of(1) == (2, 3)


def test_topology_uneven_is_node_major() -> None:
    topo = Topology([2, 1, 3])
    assert topo.node_sizes == (2, 1, 3)
    assert [topo.node_of(r) for r in range(6)] == [0, 0, 1, 2, 2, 2]
    assert topo.ranks_of(2) == (3, 4, 5)


@pytest.mark.parametrize("sizes", [(), (2, 0), (2, -1), (1.5,), (True,)])
def test_topology_rejects_bad_sizes(sizes: tuple[object, ...]) -> None:
    with pytest.raises(ValueError, match="node_sizes"):
        Topology(sizes)  # type: ignore[arg-type]


@pytest.mark.parametrize(("nodes", "per"), [(0, 2), (2, 0), (-1, 1)])
def test_uniform_rejects_bad_counts(nodes: int, per: int) -> None:
    with pytest.raises(ValueError, match="nodes|ranks_per_node"):
        Topology.uniform(nodes, per)


def test_unknown_rank_and_node() -> None:
    topo = Topology.uniform(2, 2)
    with pytest.raises(ValueError, match="unknown rank 4"):
        topo.node_of(4)
    with pytest.raises(ValueError, match="unknown node 2"):
        topo.ranks_of(2)
    p = place(topo)
    with pytest.raises(ValueError, match="unknown rank 7"):
        lost_blocks(p, [RankMemory(7)])
    with pytest.raises(ValueError, match="unknown node 5"):
        lost_blocks(p, [NodeLoss(5)])


def test_blocks_validate_fields() -> None:
    with pytest.raises(ValueError, match="DataBlock.rank"):
        DataBlock(-1)
    with pytest.raises(ValueError, match="Tier2Parity.holder"):
        Tier2Parity(0, -2)
    with pytest.raises(ValueError, match="RankMemory.rank"):
        RankMemory(-1)


def test_blocks_sort_across_kinds() -> None:
    blocks = [Tier2Parity(0, 1), SnapshotBlock(0), DataBlock(2), Tier1Parity(1), DataBlock(0)]
    assert sorted(blocks) == [
        DataBlock(0),
        DataBlock(2),
        Tier1Parity(1),
        SnapshotBlock(0),
        Tier2Parity(0, 1),
    ]
    assert DataBlock(1) == DataBlock(1) and hash(DataBlock(1)) == hash(DataBlock(1))
    other: Block = Tier1Parity(0)
    assert DataBlock(0) != other
    assert sorted([NodeLoss(0), RankMemory(3), RankMemory(1)]) == [
        RankMemory(1),
        RankMemory(3),
        NodeLoss(0),
    ]
    with pytest.raises(TypeError):
        _ = RankMemory(0) < DataBlock(0)  # failures and blocks do not compare


# ---------------------------------------------------------------------------- placement


def test_place_two_by_two() -> None:
    p = place(Topology.uniform(2, 2))
    assert [(g.name, g.tier, g.members, g.parity, g.tolerance) for g in p.groups] == [
        ("t1/n0", 1, (DataBlock(0), DataBlock(1)), (Tier1Parity(0),), 1),
        ("t1/n1", 1, (DataBlock(2), DataBlock(3)), (Tier1Parity(1),), 1),
        # two nodes, one parity: each node holds a copy of the other's snapshot
        ("t2/s0", 2, (SnapshotBlock(1),), (Tier2Parity(0, 0),), 1),
        ("t2/s1", 2, (SnapshotBlock(0),), (Tier2Parity(1, 1),), 1),
    ]
    assert p.holder(DataBlock(3)) == 1
    assert p.holder(Tier1Parity(0)) == 0
    assert p.holder(SnapshotBlock(1)) == 1
    assert p.holder(Tier2Parity(0, 0)) == 0


def test_place_single_rank_node_gets_a_mirror() -> None:
    p = place(Topology((2, 1)))
    assert p.groups[1].members == (DataBlock(2),)
    assert p.groups[1].parity == (Tier1Parity(1),)


def test_tier2_parity_never_on_a_protected_node() -> None:
    for nodes, parity in [(3, 1), (4, 2), (5, 3), (4, 1)]:
        p = place(Topology.uniform(nodes, 2), tier2_parity=parity)
        t2 = [g for g in p.groups if g.tier == 2]
        assert len(t2) == nodes
        for g in t2:
            held = sorted(p.holder(b) for b in g.blocks)
            assert held == list(range(nodes)), "every node holds exactly one block of a stripe"
            assert g.tolerance == parity
        # balanced: every node holds `parity` parity blocks and is in nodes-parity stripes
        for n in range(nodes):
            assert sum(1 for g in t2 for b in g.parity if p.holder(b) == n) == parity
            assert len(p.groups_of(SnapshotBlock(n))) == nodes - parity


def test_place_validation() -> None:
    with pytest.raises(ValueError, match="tier2_parity"):
        place(Topology.uniform(2, 2), tier2_parity=2)
    with pytest.raises(ValueError, match="tier2_parity"):
        place(Topology.uniform(1, 2))  # one node: its snapshot cannot be protected
    with pytest.raises(ValueError, match="tier2_parity"):
        place(Topology.uniform(2, 2), tier2_parity=-1)
    # without tier 2, the parity count does not matter
    assert place(Topology.uniform(1, 2), tier2=False).groups[0].name == "t1/n0"
    # a single node may keep unprotected snapshots
    assert place(Topology.uniform(1, 2), tier2_parity=0).snapshots
    with pytest.raises(TypeError):
        place((2, 2))  # type: ignore[arg-type]


def test_group_and_placement_validation() -> None:
    with pytest.raises(ValueError, match="tier"):
        Group("g", 3, (DataBlock(0),), (Tier1Parity(0),))
    with pytest.raises(ValueError, match="members"):
        Group("g", 1, (), (Tier1Parity(0),))
    with pytest.raises(ValueError, match="members must be DataBlock"):
        Group("g", 1, (SnapshotBlock(0),), (Tier1Parity(0),))
    with pytest.raises(ValueError, match="twice"):
        Group("g", 1, (DataBlock(0), DataBlock(0)), (Tier1Parity(0),))
    topo = Topology.uniform(2, 1)
    g = Group("g", 1, (DataBlock(0),), (Tier1Parity(0),))
    with pytest.raises(ValueError, match="unique"):
        Placement(topo, (g, g))
    with pytest.raises(ValueError, match="unknown rank"):
        Placement(topo, (Group("g", 1, (DataBlock(5),), (Tier1Parity(0),)),))
    with pytest.raises(ValueError, match="snapshots"):
        Placement(topo, (Group("s", 2, (SnapshotBlock(0),), (Tier2Parity(0, 1),)),))


def test_placement_graph_is_bipartite_with_holders() -> None:
    p = place(Topology.uniform(2, 2))
    graph = placement_graph(p)
    blocks = [n for n, d in graph.nodes(data=True) if d["kind"] == "block"]
    groups = [n for n, d in graph.nodes(data=True) if d["kind"] == "group"]
    assert sorted(blocks) == list(p.blocks())
    assert groups == ["t1/n0", "t1/n1", "t2/s0", "t2/s1"]
    assert graph.nodes[DataBlock(2)]["holder"] == 1
    assert graph.nodes[Tier2Parity(1, 1)]["holder"] == 1
    assert graph.nodes["t2/s0"]["tolerance"] == 1
    assert graph.edges[Tier1Parity(0), "t1/n0"]["role"] == "parity"
    assert graph.number_of_edges() == sum(len(g.blocks) for g in p.groups)
    for u, v in graph.edges:
        assert graph.nodes[u]["bipartite"] != graph.nodes[v]["bipartite"]


def test_lost_blocks() -> None:
    p = place(Topology.uniform(2, 2))
    assert lost_blocks(p, [RankMemory(1)]) == {DataBlock(1)}
    assert lost_blocks(p, [NodeLoss(1)]) == {
        DataBlock(2),
        DataBlock(3),
        Tier1Parity(1),
        SnapshotBlock(1),
        Tier2Parity(1, 1),
    }
    assert lost_blocks(p, []) == frozenset()


# ------------------------------------------------------------------------------- decode

TWO_BY_TWO = place(Topology.uniform(2, 2))


def test_nothing_lost_is_tier_0() -> None:
    result = plan(TWO_BY_TWO)
    assert (result.tier, result.recoverable, result.order) == (0, True, ())


def test_one_rank_memory_is_tier_1() -> None:
    result = plan(TWO_BY_TWO, RankMemory(0))
    assert result.tier == 1 and result.recoverable
    assert result.order == (BlockRepair(DataBlock(0), 1, "t1/n0", (DataBlock(1), Tier1Parity(0))),)


def test_two_rank_memories_in_one_node_is_tier_2() -> None:
    result = plan(TWO_BY_TWO, RankMemory(0), RankMemory(1))
    assert result.tier == 2 and result.recoverable
    assert result.order == (
        BlockRepair(DataBlock(0), 2, "restore/n0", (SnapshotBlock(0),)),
        BlockRepair(DataBlock(1), 2, "restore/n0", (SnapshotBlock(0),)),
    )
    assert all(r.is_restore for r in result.order)


def test_one_rank_memory_on_each_node_is_tier_1() -> None:
    assert tier(TWO_BY_TWO, RankMemory(1), RankMemory(2)) == 1


def test_node_loss_is_tier_2_and_rebuilds_everything() -> None:
    result = plan(TWO_BY_TWO, NodeLoss(0))
    assert result.tier == 2 and result.recoverable and not result.unrecoverable
    assert [r.block for r in result.order] == [
        Tier2Parity(0, 0),  # re-encoded from node 1's snapshot
        SnapshotBlock(0),  # from node 1's copy
        DataBlock(0),
        DataBlock(1),
        Tier1Parity(0),  # re-encoded from the restored data
    ]


def test_two_node_losses_are_tier_3() -> None:
    result = plan(TWO_BY_TWO, NodeLoss(0), NodeLoss(1))
    assert result.tier == 3 and not result.recoverable
    assert DataBlock(0) in result.unrecoverable


def test_tier2_off_node_loss_is_tier_3() -> None:
    p = place(Topology.uniform(2, 2), tier2=False)
    assert tier(p, RankMemory(0)) == 1
    assert tier(p, NodeLoss(0)) == 3
    assert tier(p, RankMemory(0), RankMemory(1)) == 3


def test_tier1_off_rank_memory_is_tier_2() -> None:
    p = place(Topology.uniform(2, 2), tier1=False)
    assert tier(p, RankMemory(0)) == 2
    assert tier(p, NodeLoss(1)) == 2


def test_both_tiers_off_any_loss_is_tier_3() -> None:
    p = place(Topology.uniform(2, 2), tier1=False, tier2=False)
    assert p.groups == ()
    assert tier(p, RankMemory(3)) == 3


def test_three_ranks_on_two_nodes() -> None:
    p = place(Topology((2, 1)))
    assert tier(p, RankMemory(2)) == 1  # from the host-memory mirror
    assert tier(p, RankMemory(0), RankMemory(2)) == 1
    assert tier(p, RankMemory(0), RankMemory(1)) == 2
    assert tier(p, NodeLoss(1)) == 2
    assert tier(p, NodeLoss(0)) == 2
    # rank 2's snapshot is in node 1's host memory, node 0's snapshot has a copy there
    assert tier(p, NodeLoss(0), RankMemory(2)) == 2
    assert tier(p, NodeLoss(0), NodeLoss(1)) == 3


def test_three_nodes_two_parity_survive_two_node_losses() -> None:
    p = place(Topology.uniform(3, 2), tier2_parity=2)
    for a, b in itertools.combinations(range(3), 2):
        result = plan(p, NodeLoss(a), NodeLoss(b))
        assert result.tier == 2 and not result.unrecoverable
    assert tier(p, NodeLoss(0), NodeLoss(1), NodeLoss(2)) == 3
    # with one parity, two node losses are too many
    p1 = place(Topology.uniform(3, 2), tier2_parity=1)
    assert tier(p1, NodeLoss(0), NodeLoss(2)) == 3


def test_single_node_job_with_local_snapshots() -> None:
    p = place(Topology.uniform(1, 3), tier2_parity=0)
    assert tier(p, RankMemory(0)) == 1
    assert tier(p, RankMemory(0), RankMemory(2)) == 2
    assert tier(p, NodeLoss(0)) == 3


def test_lost_redundancy_only_is_tier_1() -> None:
    # checksum failures can take a single parity or snapshot block
    result = decode(TWO_BY_TWO, frozenset({Tier1Parity(1)}))
    assert result.tier == 1
    assert result.order == (BlockRepair(Tier1Parity(1), 1, "t1/n1", (DataBlock(2), DataBlock(3))),)
    result = decode(TWO_BY_TWO, frozenset({SnapshotBlock(0), Tier2Parity(1, 1)}))
    assert result.tier == 1 and result.recoverable
    assert result.unrecoverable == {SnapshotBlock(0), Tier2Parity(1, 1)}
    assert result.order == ()


def test_rollback_needs_every_snapshot() -> None:
    # node 0 needs its snapshot; node 1's snapshot is corrupt and its copy too: every
    # rank must restore, so node 1 cannot follow node 0 back -> disk checkpoint
    lost: frozenset[Block] = frozenset(
        {DataBlock(0), DataBlock(1), SnapshotBlock(1), Tier2Parity(0, 0)}
    )
    result = decode(TWO_BY_TWO, lost)
    assert result.tier == 3 and not result.recoverable
    assert {DataBlock(0), DataBlock(1)} <= result.unrecoverable
    # the same with node 1's snapshot rebuildable from its copy is tier 2
    result = decode(TWO_BY_TWO, lost - {Tier2Parity(0, 0)})
    assert result.tier == 2
    assert replay(TWO_BY_TWO, lost - {Tier2Parity(0, 0)}, result.order) == set(TWO_BY_TWO.blocks())


def test_decode_rejects_foreign_blocks() -> None:
    with pytest.raises(ValueError, match="not part of this placement"):
        decode(TWO_BY_TWO, frozenset({DataBlock(9)}))
    p = place(Topology.uniform(2, 2), tier1=False)
    with pytest.raises(ValueError, match="not part of this placement"):
        decode(p, frozenset({Tier1Parity(0)}))


def test_replay_rejects_bad_orders() -> None:
    lost: frozenset[Block] = frozenset({DataBlock(0), Tier1Parity(0)})
    # a source that is itself missing
    with pytest.raises(ValueError, match="source"):
        replay(
            TWO_BY_TWO,
            lost,
            [BlockRepair(DataBlock(0), 1, "t1/n0", (DataBlock(1), Tier1Parity(0)))],
        )
    # parity before the data it encodes
    with pytest.raises(ValueError, match="source"):
        replay(
            TWO_BY_TWO,
            lost,
            [BlockRepair(Tier1Parity(0), 1, "t1/n0", (DataBlock(0), DataBlock(1)))],
        )
    # too few sources for the code
    with pytest.raises(ValueError, match="needs 2"):
        replay(TWO_BY_TWO, {DataBlock(0)}, [BlockRepair(DataBlock(0), 1, "t1/n0", (DataBlock(1),))])
    # a block that is not missing
    with pytest.raises(ValueError, match="not missing"):
        replay(
            TWO_BY_TWO,
            frozenset(),
            [BlockRepair(DataBlock(0), 1, "t1/n0", (DataBlock(1), Tier1Parity(0)))],
        )
    # a restore from a snapshot that is gone
    with pytest.raises(ValueError, match="snapshot"):
        replay(
            TWO_BY_TWO,
            lost_blocks(TWO_BY_TWO, [NodeLoss(0)]),
            [BlockRepair(DataBlock(0), 2, "restore/n0", (SnapshotBlock(0),))],
        )
    # a group that does not hold the block
    with pytest.raises(ValueError, match="group"):
        replay(
            TWO_BY_TWO,
            {DataBlock(0)},
            [BlockRepair(DataBlock(0), 1, "t1/n1", (DataBlock(2), Tier1Parity(1)))],
        )


# ----------------------------------------------------------------------------- coverage


def test_coverage_two_by_two() -> None:
    report = coverage(TWO_BY_TWO)
    # 6 elements (4 ranks, 2 nodes): 6 singles + 15 pairs - 4 subsumed pairs
    assert len(report.patterns) == 17
    assert report.by_tier() == {1: 8, 2: 8, 3: 1}
    singles = {next(iter(p.failures)): p.tier for p in report.patterns if len(p.failures) == 1}
    assert singles == {
        RankMemory(0): 1,
        RankMemory(1): 1,
        RankMemory(2): 1,
        RankMemory(3): 1,
        NodeLoss(0): 2,
        NodeLoss(1): 2,
    }
    (fallback,) = [p for p in report.patterns if p.tier == 3]
    assert fallback.failures == {NodeLoss(0), NodeLoss(1)}
    assert len(report.survived(1)) == 8
    assert len(report.survived(2)) == 16
    for pattern in report.patterns:
        assert not any(
            isinstance(f, RankMemory)
            and NodeLoss(TWO_BY_TWO.topology.node_of(f.rank)) in pattern.failures
            for f in pattern.failures
        )
        assert pattern.lost == lost_blocks(TWO_BY_TWO, pattern.failures)


def test_coverage_order_is_deterministic() -> None:
    a = coverage(place(Topology((2, 1, 3))), 3)
    b = coverage(place(Topology((2, 1, 3))), 3)
    assert a == b
    sizes = [len(p.failures) for p in a.patterns]
    assert sizes == sorted(sizes)
    assert a.patterns[0].failures == {RankMemory(0)}


def test_coverage_summary() -> None:
    text = coverage(TWO_BY_TWO).summary()
    assert "2 node(s) (2+2 ranks)" in text
    assert "tier 2 on (1 parity)" in text
    assert "node n0 + node n1" in text
    lines = text.splitlines()
    assert lines[1].split() == ["failures", "patterns", "tier", "1", "tier", "2", "tier", "3"]
    assert lines[4].split() == ["all", "17", "8", "8", "1"]


def test_coverage_rejects_bad_max() -> None:
    with pytest.raises(ValueError, match="max_failures"):
        coverage(TWO_BY_TWO, 0)
