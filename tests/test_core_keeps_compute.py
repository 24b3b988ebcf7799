"""The core's rule for a compute paused by a recovery: kept, or computed again."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence

import pytest

from leto.core import events as ev
from leto.core.cluster import ClusterModel, ClusterState, TrainerState
from leto.core.reconcile import Plan, Repair, keeps_compute, writes_no_chunk
from leto.core.recovery import Kind, Phase
from leto.core.verify import CHECK_CONFIGS


def _plan(target: int | None, kind: Kind, *repairs: Repair) -> Plan:
    return Plan(target, kind, tuple(repairs), "")


def test_a_recovery_in_place_at_the_step_the_compute_began_from_keeps_it() -> None:
    assert keeps_compute([_plan(4, Kind.INPLACE)], rank=0, begun_at=4)
    # another rank's repairs write nothing of rank 0's
    other = _plan(4, Kind.TIER1, Repair("tier1", 1, 0, 4, 3), Repair("forward", 2, 0, 4))
    assert keeps_compute([other], rank=0, begun_at=4)
    # rank 0's gradients rebuilt: the compute neither reads nor writes them
    grads = _plan(4, Kind.TIER1, Repair("grad-tier1", 0, -1, 4))
    assert keeps_compute([grads, _plan(4, Kind.INPLACE)], rank=0, begun_at=4)


@pytest.mark.parametrize(
    ("plans", "why"),
    [
        ([], "no plan carried out: nothing says what the recovery wrote"),
        ([_plan(3, Kind.BACK)], "resumed a step back: the compute read newer bytes"),
        ([_plan(5, Kind.FORWARD)], "resumed a step on: the compute read older bytes"),
        ([_plan(4, Kind.TIER1, Repair("tier1", 0, 2, 4))], "a chunk of the rank rebuilt"),
        ([_plan(4, Kind.FORWARD, Repair("forward", 0, 0, 4, 8))], "its chunks rolled forward"),
        ([_plan(4, Kind.TIER2, Repair("snapshot", 1, -1, 4))], "a tier-2 restore writes all"),
        ([_plan(4, Kind.CKPT)], "a checkpoint restore writes every chunk"),
        (
            [_plan(4, Kind.TIER1, Repair("tier1", 0, 1, 4)), _plan(4, Kind.INPLACE)],
            "rebuilt by an earlier generation of the same recovery",
        ),
    ],
)
def test_a_compute_that_may_have_read_other_bytes_is_not_kept(plans: list[Plan], why: str) -> None:
    assert not keeps_compute(plans, rank=0, begun_at=4), why


def _reconciles(cfg_name: str, limit: int) -> Iterator[tuple[ClusterModel, ClusterState, Plan]]:
    """Every reconcile (not a fallback) among the first ``limit`` states, breadth first,
    of a configuration the checker explores: (model, state, its plan)."""
    model = ClusterModel(CHECK_CONFIGS[cfg_name])
    seen = {model.initial()}
    queue = deque(seen)
    while queue and len(seen) < limit:
        s = queue.popleft()
        if s.phase is Phase.RECONCILING:
            p = model.plan(s)
            if not p.fallback:
                yield model, s, p
        for _, nxt in model.successors(s):
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)


Rule = Callable[[Sequence[Plan], int, int], bool]


def _wrongly_kept(rule: Rule, cfg_name: str) -> tuple[int, int, list[str]]:
    """(computes kept, computes run again, the kept ones whose chunks Reconcile wrote)."""
    kept = again = 0
    wrong: list[str] = []
    for model, s, p in _reconciles(cfg_name, 30_000):
        post, _ = model.step(s, ev.Reconcile())
        for r in range(model.config.ranks):
            if s.trainer[r] is not TrainerState.ALIVE or r in s.promoted:
                continue  # a survivor's compute only (a promoted rank starts afresh)
            if rule([p], r, s.step[r]):
                kept += 1
                # what the compute read is what Compute after Resume reads
                if not (post.data[r] == s.data[r] == (p.target,) * model.config.chunks):
                    wrong.append(f"rank {r}: {s.data[r]} -> {post.data[r]}, plan {p}")
            else:
                again += 1
    return kept, again, wrong


@pytest.mark.parametrize("cfg_name", ["three-ranks", "two-faults"])
def test_a_kept_compute_read_what_the_reconcile_leaves_in_every_reachable_recovery(
    cfg_name: str,
) -> None:
    kept, again, wrong = _wrongly_kept(keeps_compute, cfg_name)
    assert wrong == []
    assert kept > 0 and again > 0, (kept, again)  # both outcomes are reached


def test_the_check_rejects_a_rule_that_ignores_the_repairs() -> None:
    def by_target_only(plans: Sequence[Plan], rank: int, begun_at: int) -> bool:
        return bool(plans) and all(p.target == begun_at for p in plans)

    _, _, wrong = _wrongly_kept(by_target_only, "three-ranks")
    assert wrong, "a survivor whose chunk the plan rebuilds must not keep its compute"


# ---- a plan that writes no chunk (the executor gathers checksums before its settle)

Writes = Callable[[Plan], bool]


def _written_unexpectedly(rule: Writes, cfg_name: str) -> tuple[int, int, list[str]]:
    """(plans said to write no chunk, other plans, those of the first whose Reconcile
    changed a chunk of some rank)."""
    none = some = 0
    wrong: list[str] = []
    for model, s, p in _reconciles(cfg_name, 30_000):
        if not rule(p):
            some += 1
            continue
        none += 1
        post, _ = model.step(s, ev.Reconcile())
        if post.data != s.data:
            wrong.append(f"{s.data} -> {post.data}, plan {p}")
    return none, some, wrong


@pytest.mark.parametrize("cfg_name", ["three-ranks", "two-faults"])
def test_a_plan_said_to_write_no_chunk_leaves_every_chunk_in_every_reachable_recovery(
    cfg_name: str,
) -> None:
    none, some, wrong = _written_unexpectedly(writes_no_chunk, cfg_name)
    assert wrong == []
    assert none > 0 and some > 0, (none, some)  # both outcomes are reached


def test_writes_no_chunk_by_kind() -> None:
    assert writes_no_chunk(_plan(4, Kind.INPLACE))
    assert not writes_no_chunk(_plan(4, Kind.FORWARD, Repair("forward", 0, 0, 4, 8)))
    assert not writes_no_chunk(_plan(4, Kind.TIER1, Repair("grad-tier1", 0, -1, 4)))
    assert not writes_no_chunk(_plan(3, Kind.BACK))
    assert not writes_no_chunk(_plan(4, Kind.TIER2, Repair("snapshot", 1, -1, 4)))


def test_the_check_rejects_a_rule_that_counts_only_rebuilds_as_writing() -> None:
    def no_rebuild(p: Plan) -> bool:
        return p.kind is not Kind.CKPT and all(x.what != "tier1" for x in p.repairs)

    _, _, wrong = _written_unexpectedly(no_rebuild, "three-ranks")
    assert wrong, "a plan that rolls chunks forward or restores them writes them"
