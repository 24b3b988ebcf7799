"""The one plan interpreter (:func:`leto.retained.recovery.carry_out`): the order in which
it calls a backend's operations, for tier 1 as parity and as replicas, and its summary."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from leto.core.reconcile import Plan, Repair, RepairKind, expand_repairs
from leto.core.recovery import Kind
from leto.retained.recovery import IntegrityError, ReconcileSummary, Settled, carry_out

T1, G, FWD = RepairKind.TIER1, RepairKind.GRAD_TIER1, RepairKind.FORWARD


class Recorder:
    """Records every call; rank 1 lost its chunks, every settle rolls one chunk forward."""

    def __init__(self, *, replicas: bool) -> None:
        self.copies_from_settled = replicas
        self.calls: list[tuple[object, ...]] = []

    def ranks(self) -> Sequence[int]:
        return (0, 1, 2)

    def repairs(self, plan: Plan) -> Sequence[Repair]:
        return expand_repairs(plan.repairs)

    def check_sources(self, repairs: Sequence[Repair]) -> None:
        self.calls.append(("check", len(repairs)))

    def restore_snapshot(self, target: int) -> int:
        self.calls.append(("snapshot", target))
        return 4

    def restore_checkpoint(self, target: int) -> int:
        self.calls.append(("checkpoint", target))
        return 4

    def rebuild_chunks(self, repairs: Sequence[Repair], target: int) -> int:
        self.calls.append(("chunks", tuple((x.rank, x.chunk) for x in repairs)))
        return len(repairs)

    def rebuild_grads(self, repairs: Sequence[Repair]) -> int:
        self.calls.append(("grads", tuple(x.rank for x in repairs)))
        return len(repairs)

    def forget_grad_parity(self) -> None:
        self.calls.append(("forget",))

    def settle(self, rank: int, target: int) -> Settled:
        self.calls.append(("settle", rank))
        return Settled(1, 0, rank == 2)

    def finish(self) -> None:
        self.calls.append(("finish",))


PLAN = Plan(
    5,
    Kind.TIER1,
    (Repair(T1, 1, 0, 5, 2), Repair(G, 1, -1, 5), Repair(FWD, 0, 0, 5, 2)),
    "",
)


def test_parity_decodes_in_the_plans_order_before_any_settle() -> None:
    ops = Recorder(replicas=False)
    done = carry_out(PLAN, ops)
    assert ops.calls == [
        ("check", 5),
        ("chunks", ((1, 0),)),
        ("chunks", ((1, 1),)),
        ("grads", (1,)),
        ("forget",),
        ("settle", 0),
        ("settle", 1),
        ("settle", 2),
        ("finish",),
    ]
    assert done == ReconcileSummary(
        chunks_repaired_tier1=2, grads_repaired_tier1=1, chunks_rolled_forward=3, dropped=True
    )


def test_replicas_copy_lost_chunks_from_members_settled_first() -> None:
    ops = Recorder(replicas=True)
    done = carry_out(PLAN, ops)
    assert ops.calls == [
        ("check", 5),
        ("grads", (1,)),
        ("forget",),
        ("settle", 0),
        ("settle", 2),
        ("chunks", ((1, 0), (1, 1))),
        ("settle", 1),
        ("finish",),
    ]
    assert done.tier1_from_replicas == 3 and done.chunks_repaired_tier1 == 2


@pytest.mark.parametrize(("kind", "call"), [(Kind.TIER2, "snapshot"), (Kind.CKPT, "checkpoint")])
def test_a_restore_forgets_the_gradient_parity_and_restores_only(kind: Kind, call: str) -> None:
    ops = Recorder(replicas=False)
    done = carry_out(Plan(3, kind, (), ""), ops)
    assert ops.calls == [("forget",), (call, 3)]
    assert done == ReconcileSummary(chunks_restored=4)
    assert done.counts()["chunks_restored"] == 4


def test_a_plan_without_a_target_is_refused() -> None:
    with pytest.raises(IntegrityError):
        carry_out(Plan(None, Kind.CKPT, (), ""), Recorder(replicas=False))


def test_repair_kinds_keep_their_names() -> None:
    assert Repair("grad-tier1", 0, -1, 1).what is G
    assert f"{G}" == str(G) == "grad-tier1" and repr(G) == "'grad-tier1'"
    with pytest.raises(ValueError):
        Repair("bogus", 0, 0, 1)
