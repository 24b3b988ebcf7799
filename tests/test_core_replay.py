"""leto.core.replay: who computes which micro-batch of a lost share, and when not at all."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leto.core.replay import ReplayPlan, replay_plan


def test_one_fresh_rank_gets_its_micro_batches_computed_round_robin_from_itself() -> None:
    plan = replay_plan([False, True, False], True, 4)
    assert plan is not None
    assert (plan.owner, plan.computers) == (1, (1, 2, 0, 1))
    assert [plan.of(r) for r in range(3)] == [(2,), (0, 3), (1,)]
    assert plan.order == (0, 1, 2, 3)


def test_more_micro_batches_than_ranks_and_fewer() -> None:
    plan = replay_plan([True, False], True, 5)
    assert plan is not None and plan.computers == (0, 1, 0, 1, 0)
    plan = replay_plan([False, False, False, True], True, 2)
    assert plan is not None and plan.computers == (3, 0)
    assert plan.of(1) == plan.of(2) == ()


@pytest.mark.parametrize(
    ("fresh", "same", "k"),
    [
        ([False, False, False], True, 4),  # nobody computes afresh: nothing to replay
        ([True, True, False], True, 4),  # two shares lost: each computes its own
        ([True, True, True], True, 4),  # every compute lost (a death after the vote, say)
        ([False, True, False], False, 4),  # the ranks' parameters differ: not replicas
        ([False, True, False], True, 1),  # one micro-batch: nothing to split
        ([True], True, 4),  # one rank
    ],
)
def test_no_plan_where_the_replay_does_not_apply(fresh: list[bool], same: bool, k: int) -> None:
    assert replay_plan(fresh, same, k) is None


def test_a_plan_is_validated() -> None:
    with pytest.raises(ValueError, match="3 computers for 4 micro-batches"):
        ReplayPlan(owner=0, world=2, micro_batches=4, computers=(0, 1, 0))
    with pytest.raises(ValueError, match="outside ranks"):
        ReplayPlan(owner=0, world=2, micro_batches=2, computers=(0, 2))
    with pytest.raises(ValueError, match="owner 5"):
        ReplayPlan(owner=5, world=2, micro_batches=2, computers=(0, 1))


@given(
    world=st.integers(2, 64),
    k=st.integers(2, 256),
    data=st.data(),
)
def test_every_micro_batch_is_computed_once_and_the_work_is_balanced(
    world: int, k: int, data: st.DataObject
) -> None:
    owner = data.draw(st.integers(0, world - 1))
    plan = replay_plan([r == owner for r in range(world)], True, k)
    assert plan is not None
    mine = [plan.of(r) for r in range(world)]
    assert sorted(i for m in mine for i in m) == list(range(k))
    assert max(map(len, mine)) - min(map(len, mine)) <= 1
    assert plan.computers[0] == owner  # the owner, idle, takes the first
    assert len(mine[owner]) == max(map(len, mine))
