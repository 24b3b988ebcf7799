"""Protection by the mesh (leto.core.mesh): hand-checked meshes, the rule against an
independent brute-force model over random meshes, and the inputs it refuses."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leto.core.erasure import (
    REPLICA,
    BlockRepair,
    DataBlock,
    Failure,
    Group,
    NodeLoss,
    Placement,
    RankMemory,
    Tier1Parity,
    Topology,
    coverage,
    decode,
    lost_blocks,
    place,
    replay,
)
from leto.core.mesh import Mesh, place_mesh

D = DataBlock


def tier(pl: Placement, *failures: Failure) -> int:
    lost = lost_blocks(pl, failures)
    plan = decode(pl, lost)
    if plan.tier <= 2:  # every plan the rule makes can be carried out
        whole = replay(pl, lost, plan.order)
        assert {b for b in lost if isinstance(b, DataBlock)} <= whole
    return plan.tier


def t1_members(pl: Placement) -> dict[str, tuple[int, ...]]:
    return {
        g.name: tuple(b.rank for b in g.members if isinstance(b, DataBlock))
        for g in pl.groups
        if g.tier == 1
    }


# ------------------------------------------------------------------ hand-checked meshes


def test_hsdp_replicas_across_nodes_survive_a_node_loss_at_the_current_step() -> None:
    # ("replicate", "shard") 2 x 2, nodes of 2: node 0 = (r0,s0) (r0,s1), node 1 = (r1,*)
    mesh = Mesh(("replicate", "shard"), (2, 2), replicate=("replicate",), ranks_per_node=2)
    assert [mesh.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert mesh.replicas_of(0) == (2,) and mesh.replicas_of(3) == (1,)
    pl = place_mesh(mesh)
    assert pl.replicas == ((0, 2), (1, 3))
    assert t1_members(pl) == {"t1/n0": (0, 1), "t1/n1": (2, 3)}  # shards differ: parity
    assert decode(pl, lost_blocks(pl, [RankMemory(0)])).order == (
        BlockRepair(D(0), 1, REPLICA, (D(2),)),
    )
    assert tier(pl, NodeLoss(0)) == 1  # copied from node 1, parity re-encoded
    plan = decode(pl, lost_blocks(pl, [NodeLoss(0)]))
    assert [(r.block, r.group) for r in plan.order[:3]] == [
        (D(0), REPLICA),
        (D(1), REPLICA),
        (Tier1Parity(0), "t1/n0"),
    ]
    # both replicas of rank 0's state lost: each node's parity rebuilds its own
    assert tier(pl, RankMemory(0), RankMemory(2)) == 1
    assert tier(pl, NodeLoss(0), RankMemory(2)) == 1  # D2 by parity, then D0 copied
    assert tier(pl, NodeLoss(0), NodeLoss(1)) == 3
    assert coverage(pl, max_failures=1).by_tier() == {1: 6, 2: 0, 3: 0}


def test_data_parallel_inside_a_node_needs_no_parity_and_a_node_loss_rolls_back() -> None:
    # ("tp", "dp") 2 x 2, nodes of 2: each node holds two replicas of one tp shard
    mesh = Mesh(("tp", "dp"), (2, 2), replicate=("dp",), ranks_per_node=2)
    pl = place_mesh(mesh)
    assert pl.replicas == ((0, 1), (2, 3))
    assert t1_members(pl) == {}
    assert decode(pl, lost_blocks(pl, [RankMemory(1)])).order == (
        BlockRepair(D(1), 1, REPLICA, (D(0),)),
    )
    assert tier(pl, NodeLoss(1)) == 2  # tp shard 1 is on node 1 only: tier-2 snapshot
    assert tier(pl, RankMemory(0), RankMemory(1)) == 2
    assert coverage(pl, max_failures=1).by_tier() == {1: 4, 2: 2, 3: 0}


def test_dp_by_tp_with_tp_inside_nodes_is_parity_plus_cross_node_replicas() -> None:
    # ("dp", "tp", "shard") 2 x 2 x 2, nodes of 4: a node is one dp replica
    mesh = Mesh(("dp", "tp", "shard"), (2, 2, 2), replicate="dp", ranks_per_node=4)
    pl = place_mesh(mesh, world_size=8)
    assert mesh.coords(6) == (1, 1, 0) and mesh.state_of(6) == (1, 0)
    assert pl.replicas == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert t1_members(pl) == {"t1/n0": (0, 1, 2, 3), "t1/n1": (4, 5, 6, 7)}
    assert tier(pl, NodeLoss(1)) == 1
    assert tier(pl, RankMemory(1), RankMemory(2)) == 1  # two of a node: copied across
    assert tier(pl, RankMemory(1), RankMemory(2), RankMemory(5)) == 1  # 5 by parity first
    assert tier(pl, RankMemory(1), RankMemory(2), RankMemory(5), RankMemory(6)) == 2


def test_mixed_node_parity_is_over_the_states_not_the_ranks() -> None:
    # ("tp", "dp") 2 x 2 on one node of 4: states {0,1} and {2,3}; parity over 0 and 2
    mesh = Mesh(("tp", "dp"), (2, 2), replicate=("dp",), ranks_per_node=4)
    pl = place_mesh(mesh, tier2_parity=0)
    assert t1_members(pl) == {"t1/n0": (0, 2)}
    # both replicas of one state: parity rebuilds rank 0 from rank 2, rank 1 copies it
    plan = decode(pl, lost_blocks(pl, [RankMemory(0), RankMemory(1)]))
    assert plan.tier == 1
    assert [(r.block, r.group) for r in plan.order] == [(D(0), "t1/n0"), (D(1), REPLICA)]
    assert tier(pl, RankMemory(0), RankMemory(1), RankMemory(2)) == 1  # 2 copies 3 first
    assert tier(pl, *(RankMemory(r) for r in range(4))) == 2


def test_pure_dp_is_all_replicas() -> None:
    mesh = Mesh("dp", 4, replicate="dp", ranks_per_node=2)
    assert mesh == Mesh(("dp",), (4,), replicate=("dp",), ranks_per_node=2)
    pl = place_mesh(mesh)
    assert pl.replicas == ((0, 1, 2, 3),) and t1_members(pl) == {}
    assert decode(pl, lost_blocks(pl, [RankMemory(2)])).order == (
        BlockRepair(D(2), 1, REPLICA, (D(3),)),  # its node peer before another node
    )
    assert tier(pl, NodeLoss(0)) == 1 and tier(pl, NodeLoss(0), RankMemory(2)) == 1
    assert tier(pl, NodeLoss(0), NodeLoss(1)) == 3


def test_pure_tp_in_one_node_is_parity_and_the_standard_placement() -> None:
    mesh = Mesh(("tp",), (4,), ranks_per_node=4)
    pl = place_mesh(mesh, tier2_parity=0)
    assert pl == place(Topology((4,)), tier2_parity=0)
    assert pl.replicas == () and t1_members(pl) == {"t1/n0": (0, 1, 2, 3)}
    assert [tier(pl, RankMemory(r)) for r in range(4)] == [1, 1, 1, 1]
    assert tier(pl, RankMemory(0), RankMemory(3)) == 2
    assert tier(pl, NodeLoss(0)) == 3
    # no replicas anywhere: the rule is the standard placement, mirrors included
    one_rank_nodes = Mesh(("shard", "tp"), (2, 2), ranks_per_node=1)
    assert place_mesh(one_rank_nodes, tier2_parity=2) == place(
        Topology.uniform(4, 1), tier2_parity=2
    )


# ------------------------------------------------------------- against a brute-force model


class Model:
    """The rule stated independently of leto.core.mesh: states by enumerating the mesh's
    coordinates, which states are known after a failure by solving the nodes' parities."""

    def __init__(self, dims: list[str], shape: list[int], rep: set[str], k: int, p: int):
        self.k, self.p = k, p
        coords = list(itertools.product(*(range(s) for s in shape)))  # row-major
        self.state = [
            tuple(c for d, c in zip(dims, xs, strict=True) if d not in rep) for xs in coords
        ]
        self.n = len(coords)
        self.nodes = self.n // k

    def ranks(self, node: int) -> range:
        return range(node * self.k, node * self.k + self.k)

    def parity_states(self, node: int) -> set[tuple[int, ...]]:
        held = {self.state[r] for r in self.ranks(node)}
        if len(held) == 1 and self.state.count(next(iter(held))) > 1:
            return set()  # one state, replicated elsewhere or here: no parity
        return held

    def tier(self, failures: tuple[Failure, ...]) -> int:
        dead_nodes = {f.node for f in failures if isinstance(f, NodeLoss)}
        dead = {f.rank for f in failures if isinstance(f, RankMemory)}
        dead |= {r for n in dead_nodes for r in self.ranks(n)}
        known = {self.state[r] for r in range(self.n) if r not in dead}
        changed = True
        while changed:
            changed = False
            for node in set(range(self.nodes)) - dead_nodes:
                unknown = self.parity_states(node) - known
                if len(unknown) == 1:
                    known |= unknown
                    changed = True
        if all(self.state[r] in known for r in dead):
            return 1
        return 2 if len(dead_nodes) <= self.p else 3


@st.composite
def meshes(draw: st.DrawFn) -> tuple[Mesh, Model, int]:
    ndims = draw(st.integers(1, 3))
    dims = [f"d{i}" for i in range(ndims)]
    shape = draw(st.lists(st.integers(1, 3), min_size=ndims, max_size=ndims))
    world = math.prod(shape)
    rep = draw(st.sets(st.sampled_from(dims)))
    k = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    p = draw(st.integers(0, world // k - 1))
    mesh = Mesh(tuple(dims), tuple(shape), replicate=tuple(sorted(rep)), ranks_per_node=k)
    return mesh, Model(dims, shape, rep, k, p), p


@settings(max_examples=60, deadline=None)
@given(meshes())
def test_every_single_failure_costs_what_the_brute_force_model_says(
    case: tuple[Mesh, Model, int],
) -> None:
    mesh, model, p = case
    pl = place_mesh(mesh, tier2_parity=p)
    for r in range(mesh.world_size):
        assert mesh.replicas_of(r) == tuple(
            q for q in range(model.n) if q != r and model.state[q] == model.state[r]
        )
        assert tier(pl, RankMemory(r)) == 1  # every single rank failure: no lost work
    for n in range(mesh.nodes):
        off_node = all(
            any(
                model.state[q] == model.state[r]
                for q in range(model.n)
                if q // mesh.ranks_per_node != n
            )
            for r in model.ranks(n)
        )
        want = 1 if off_node else (2 if p >= 1 else 3)
        assert tier(pl, NodeLoss(n)) == want == model.tier((NodeLoss(n),))
    report = coverage(pl, max_failures=1)
    counts = {1: 0, 2: 0, 3: 0}
    for pattern in report.patterns:
        counts[model.tier(tuple(pattern.failures))] += 1
    assert report.by_tier() == counts
    assert counts[1] >= mesh.world_size


@settings(max_examples=25, deadline=None)
@given(meshes().filter(lambda c: c[0].world_size + c[0].nodes <= 14))
def test_every_double_failure_costs_what_the_brute_force_model_says(
    case: tuple[Mesh, Model, int],
) -> None:
    mesh, model, p = case
    pl = place_mesh(mesh, tier2_parity=p)
    for pattern in coverage(pl, max_failures=2).patterns:
        failures = tuple(sorted(pattern.failures))
        assert pattern.tier == model.tier(failures), pattern.label()


# ------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("build", "why"),
    [
        (lambda: Mesh((), ()), "dims must name at least one dimension"),
        (lambda: Mesh(("a", "a"), (2, 2)), "dimension names must be unique"),
        (lambda: Mesh(("a", ""), (2, 2)), "non-empty str"),
        (lambda: Mesh(("a", "b"), (4,)), r"shape \(4,\) has 1 sizes for 2 dimensions"),
        (lambda: Mesh(("a",), (0,)), "size of dimension 'a' must be an int >= 1"),
        (lambda: Mesh(("a",), (True,)), "size of dimension 'a'"),
        (lambda: Mesh(("a",), (2,), replicate=("dp",)), "replicate dimension 'dp' is not one of"),
        (lambda: Mesh(("a",), (2,), replicate=("a", "a")), "named twice"),
        (lambda: Mesh(("a",), (6,), ranks_per_node=4), "ranks_per_node=4 does not divide"),
        (lambda: Mesh(("a",), (6,), ranks_per_node=0), "ranks_per_node must be an int >= 1"),
        (
            lambda: place_mesh(Mesh(("a",), (8,), (), 4), world_size=6),
            "holds 8 ranks, the world has 6",
        ),
        (
            lambda: place_mesh(Mesh(("a",), (8,), (), 4), tier2_parity=2),
            "tier2_parity=2 must be smaller",
        ),
        (lambda: Mesh(("a",), (4,)).coords(4), r"unknown rank 4: this mesh has ranks 0..3"),
        (lambda: Mesh(("a",), (4,), (), 2).parity_members(2), "unknown node 2"),
        (lambda: Placement(Topology((2,)), (), replicas=((0,),)), "needs two ranks or more"),
        (lambda: Placement(Topology((3,)), (), replicas=((0, 1), (1, 2))), "rank 1 is in two"),
        (lambda: Placement(Topology((2,)), (), replicas=((0, 5),)), "unknown rank 5"),
    ],
)
def test_bad_input_is_refused_in_one_line(build: object, why: str) -> None:
    with pytest.raises(ValueError, match=why) as exc:
        build()  # type: ignore[operator]
    assert "\n" not in str(exc.value)


def test_replay_refuses_a_copy_that_cannot_run() -> None:
    pl = place_mesh(Mesh(("r", "s"), (2, 2), replicate="r", ranks_per_node=2))
    lost = lost_blocks(pl, [RankMemory(0), RankMemory(2)])
    with pytest.raises(ValueError, match="source DataBlock.*rank=2.* is not available"):
        replay(pl, lost, [BlockRepair(D(0), 1, REPLICA, (D(2),))])
    with pytest.raises(ValueError, match="a copy reads one replica"):
        replay(pl, lost, [BlockRepair(D(0), 1, REPLICA, (D(1),))])  # 1 is not 0's replica
    with pytest.raises(ValueError, match="block is not missing"):
        replay(pl, lost, [BlockRepair(D(1), 1, REPLICA, (D(3),))])
    assert D(0) in replay(
        pl, lost_blocks(pl, [RankMemory(0)]), [BlockRepair(D(0), 1, REPLICA, (D(2),))]
    )
    with pytest.raises(ValueError, match="names the copies"):
        Placement(Topology((1,)), (Group(REPLICA, 1, (D(0),), (Tier1Parity(0),)),))
