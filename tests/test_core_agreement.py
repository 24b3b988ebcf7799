"""The replica check's rule (leto.core.agreement): when replicas disagree, and how a split
with a majority is repaired in place (or why it is not)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from leto.core.agreement import Disagreement, ReplicaRepair, disagreement, repair_plan


def test_equal_digests_agree_and_a_split_is_grouped_largest_first() -> None:
    assert disagreement(3, {0: "a", 1: "a", 2: "a"}) is None
    split = disagreement(3, {0: "a", 1: "b", 2: "a", 3: "a"})
    assert split == Disagreement(3, ((0, 2, 3), (1,)))
    assert split.majority == (0, 2, 3) and split.minority == (1,)
    tie = disagreement(3, {0: "a", 1: "b"})
    assert tie is not None and tie.majority is None and tie.minority == (0, 1)
    assert "no majority" in tie.line() and "\n" not in tie.line()


def test_one_diverged_rank_is_copied_from_the_lowest_majority_rank_of_its_node() -> None:
    split = disagreement(5, {0: "a", 1: "a", 2: "b", 3: "a"})
    assert split is not None
    plan = repair_plan(split, [0, 0, 1, 1], tier1_replicas=True, repaired={})
    assert plan == ReplicaRepair(5, ((2, 3),))


def test_what_cannot_be_repaired_is_said() -> None:
    three = disagreement(5, {0: "a", 1: "b", 2: "a"})
    assert three is not None
    cases = [
        (disagreement(5, {0: "a", 1: "b"}), [0, 0], True, {}, "no majority"),
        (three, [0, 0, 0], False, {}, "tier 1 keeps parity"),
        (three, [0, 0, 0], True, {1: 2}, "rank 1 diverged again after its repair at step 2"),
        (three, [0, 1, 2], True, {}, "rank 1's node 1 holds no rank of the majority"),
    ]
    for split, nodes, replicas, repaired, why in cases:
        assert split is not None
        got = repair_plan(split, nodes, tier1_replicas=replicas, repaired=repaired)
        assert isinstance(got, str) and why in got, (got, why)
        line = split.line(got)
        assert why in line and "\n" not in line


@st.composite
def _jobs(draw: st.DrawFn) -> tuple[dict[int, str], list[int], dict[int, int]]:
    per = draw(st.integers(1, 4))
    nodes = draw(st.integers(1, 3))
    world = per * nodes
    digests = {r: draw(st.sampled_from("aab")) for r in range(world)}
    repaired = draw(st.dictionaries(st.integers(0, world - 1), st.integers(0, 9), max_size=2))
    return digests, [r // per for r in range(world)], repaired


@given(_jobs(), st.booleans())
def test_a_repair_copies_every_minority_rank_from_a_majority_rank_of_its_node(
    job: tuple[dict[int, str], list[int], dict[int, int]], replicas: bool
) -> None:
    digests, node_of, repaired = job
    split = disagreement(7, digests)
    if split is None:
        assert len(set(digests.values())) == 1
        return
    assert sorted(r for g in split.groups for r in g) == sorted(digests)
    plan = repair_plan(split, node_of, tier1_replicas=replicas, repaired=repaired)
    if isinstance(plan, ReplicaRepair):
        majority = split.majority
        assert majority is not None and 2 * len(majority) > len(digests)
        assert replicas and not set(plan.ranks) & set(repaired)
        assert sorted(plan.ranks) == sorted(set(digests) - set(majority))
        for rank, source in plan.sources:
            assert source in majority and node_of[source] == node_of[rank]
            assert digests[source] != digests[rank]
    else:  # refused: one of the reasons holds
        majority = split.majority
        assert (
            majority is None
            or not replicas
            or any(r in repaired for r in split.minority)
            or any(not any(node_of[m] == node_of[r] for m in majority) for r in split.minority)
        ), plan
