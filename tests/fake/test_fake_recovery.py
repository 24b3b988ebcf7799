"""Real-tensor recovery on the fake backend: a failure at every point of a step.

Each test trains the tiny job with a planned fault, checks that the fault fired and
was recovered the way the protocol says, that the real state refines the core's
after recovery (versions, parity records, parity bytes), and that the final state
is bitwise the state of a failure-free run of the same seed.
"""

from __future__ import annotations

import json

import pytest
import torch
from fakejob import make_engine, same_state

from leto.backends.fake.engine import Engine, IntegrityError, UnrecoverableError
from leto.core.erasure import Topology
from leto.core.recovery import Phase
from leto.retained.checkpoint import DCPCheckpointer

STEPS = 7
_ref: dict[tuple[object, ...], Engine] = {}


def reference(**kw: object) -> Engine:
    key = tuple(sorted(kw.items()))
    if key not in _ref:
        eng = make_engine(**kw)  # type: ignore[arg-type]
        eng.train(STEPS)
        _ref[key] = eng
    return _ref[key]


def run(plan: list[tuple[str, dict[str, object]]], **kw: object) -> Engine:
    eng = make_engine(**kw)  # type: ignore[arg-type]
    inj = eng.injector
    for method, args in plan:
        getattr(inj, method)(**args)
    eng.train(STEPS)
    assert inj.unfired() == [], [f.label for f in inj.unfired()]
    assert inj.unrecovered() == [], [f.label for f in inj.unrecovered()]
    assert eng.mismatches() == []
    assert eng.parity_exact() == []
    diff = same_state(eng, reference(**kw))
    assert not diff, f"not bitwise equal to the failure-free run: {diff}"
    return eng


CASES = [
    # (fault, expected recovery kind)
    (dict(rank=1, step=3, phase="forward"), "inplace"),
    (dict(rank=2, step=3, phase="backward"), "inplace"),
    (dict(rank=3, step=3, phase="allreduce"), "back"),  # ranks 0-2 hold reduced gradients
    (dict(rank=0, step=3, phase="prepare"), "back"),
    (dict(rank=1, step=3, phase="decide", where="before"), "back"),
    (dict(rank=2, step=3, phase="decide", where="after"), "forward"),
    (dict(rank=3, step=3, phase="apply", chunk=0, where="undo_saved"), "forward"),
    (dict(rank=0, step=3, phase="apply", chunk=1, where="mid_write"), "forward"),
    (dict(rank=1, step=3, phase="apply", chunk=2, where="written"), "forward"),
    (dict(rank=2, step=3, phase="apply", chunk=3, where="mid_write"), "forward"),
    (dict(rank=3, step=3, phase="parity", chunk=0), "forward"),
    (dict(rank=0, step=3, phase="parity", chunk=3), "forward"),
    (dict(rank=1, step=3, phase="finish"), "inplace"),
]


@pytest.mark.parametrize("fault,kind", CASES, ids=lambda x: x if isinstance(x, str) else None)
def test_crash_at_every_point_of_a_step(fault: dict[str, object], kind: str) -> None:
    eng = run([("fail_at", fault)])
    assert [r["kind"] for r in eng.recoveries] == [kind]
    rec = eng.recoveries[0]
    assert rec["promoted"] == [fault["rank"]]
    committed = fault["phase"] in ("apply", "parity", "finish") or fault.get("where") == "after"
    assert rec["resumed_at"] == (3 if committed else 2)
    if kind == "forward":
        assert eng.stats["rolled_forward"] == 1 and rec["chunks_rolled_forward"] > 0
    if kind == "back":
        assert eng.stats["rolled_back"] == 1


def test_a_torn_chunk_is_restored_from_its_undo_copy_not_trusted() -> None:
    eng = run([("fail_at", dict(rank=0, step=2, phase="apply", chunk=0, where="mid_write"))])
    assert eng.recoveries[0]["chunks_rolled_forward"] >= 1


def test_lost_memory_is_rebuilt_from_tier1_parity_chunks_and_gradients() -> None:
    eng = run([("lose_memory", dict(rank=1, step=4, phase="apply", chunk=2, where="mid_write"))])
    rec = eng.recoveries[0]
    assert rec["kind"] == "tier1"
    assert rec["chunks_repaired_from_parity"] == eng.n_chunks
    assert rec["grad_blocks_repaired_from_parity"] == 1  # rank 1 still had chunks to apply
    assert rec["steps_lost"] == 0 and rec["resumed_at"] == 4


def test_lost_node_restores_the_tier2_snapshot_and_recomputes() -> None:
    eng = run([("lose_node", dict(node=1, step=5, phase="apply", chunk=1, where="written"))], k=3)
    rec = eng.recoveries[0]
    assert rec["kind"] == "tier2"
    assert rec["resumed_at"] == 3  # the snapshot of step 3 (K = 3); steps 4-5 recomputed
    assert rec["steps_lost"] == 2
    assert eng.stats["snapshot_restores"] == 1


def test_hang_is_fenced_and_the_stale_write_refused() -> None:
    eng = run([("fail_at", dict(rank=2, step=3, phase="forward", kind="hang"))])
    assert eng.stats["stale_writes_refused"] == 1
    assert eng.backend.stats["refused_writes"] == 1


def test_failure_during_recovery_restarts_it_at_the_next_generation() -> None:
    eng = run(
        [
            ("fail_at", dict(rank=0, step=3, phase="apply", chunk=0, where="written")),
            ("fail_at", dict(rank=1, step=3, phase="recovery", where="Reconcile")),
            ("lose_memory", dict(rank=2, step=3, phase="recovery", where="Rebuild")),
        ]
    )
    rec = eng.recoveries[0]
    assert rec["restarts"] == 2
    assert sorted(rec["promoted"]) == [0, 1, 2]


def test_corrupted_chunk_is_caught_by_its_checksum_and_repaired() -> None:
    eng = run([("corrupt", dict(rank=2, step=3, chunk=1, bit=5))])
    f = eng.injector.faults[0]
    assert f.fired == 1 and f.detected == 1
    assert eng.stats["integrity_failures"] == 1
    rec = eng.recoveries[0]
    assert rec["kind"] == "tier1" and "fail their checksums" in rec["integrity_failures"][0]
    # caught at PREPARE of step 4, before its vote: step 4 was not committed
    assert rec["resumed_at"] == 3


def test_corruption_found_during_recovery_is_repaired_too() -> None:
    eng = make_engine()
    eng.injector.fail_at(rank=0, step=3, phase="decide", where="after")
    eng.train(2)
    b = eng.procs[1].layout.param_buffer.view(torch.uint8)
    b[3] = int(b[3]) ^ 0x10  # rank 1 is not the one that fails
    eng.train(STEPS)
    assert eng.stats["integrity_failures"] == 1
    assert eng.recoveries[0]["kind"] == "tier1"
    assert not same_state(eng, reference())


def test_beyond_both_tiers_falls_back_to_the_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plan = [
        ("lose_node", dict(node=0, step=4, phase="prepare")),
        ("lose_node", dict(node=1, step=4, phase="recovery", where="Promote", rank=0)),
    ]
    eng = run(plan, checkpointer=DCPCheckpointer(tmp_path / "ckpt"))
    rec = eng.recoveries[0]
    assert rec["kind"] == "ckpt" and rec["resumed_at"] == 0
    assert eng.stats["checkpoint_restores"] == 1
    assert (tmp_path / "ckpt" / "step-0" / "leto.json").is_file()
    meta = json.loads((tmp_path / "ckpt" / "step-0" / "leto.json").read_text())
    assert sorted(meta["process_states"]) == ["0", "1", "2", "3"]


TWO_NODES = [
    ("lose_node", dict(node=0, step=4, phase="prepare")),
    ("lose_node", dict(node=2, step=4, phase="recovery", where="Promote", rank=0)),
]


def test_two_lost_nodes_are_restored_from_tier2_with_two_parities(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Four nodes, tier2_parity = 2 (Reed-Solomon across the nodes' snapshots): two
    nodes lost in one recovery are decoded from the other two, bitwise."""
    topo = Topology((1, 2, 1, 2))
    eng = run(TWO_NODES, topology=topo, tier2_parity=2)
    (rec,) = eng.recoveries
    assert rec["kind"] == "tier2" and rec["resumed_at"] == 3  # k = 3: the step-3 snapshot
    assert eng.stats["snapshot_restores"] == 1 and eng.stats["checkpoint_restores"] == 0
    # the same losses with one parity are beyond tier 2: the checkpoint
    eng1 = run(TWO_NODES, topology=topo, checkpointer=DCPCheckpointer(tmp_path / "ckpt"))
    assert [r["kind"] for r in eng1.recoveries] == ["ckpt"]


def test_more_parities_than_nodes_allow_is_refused() -> None:
    with pytest.raises(ValueError, match="tier2_parity=2 needs more than that many nodes, not 2"):
        make_engine(tier2_parity=2)


def test_beyond_both_tiers_without_checkpoint_stops_and_names_the_loss() -> None:
    eng = make_engine(checkpointer=None)
    eng.injector.lose_node(node=0, step=3, phase="finish").lose_node(
        node=1, step=3, phase="recovery", where="Promote", rank=0
    )
    with pytest.raises(UnrecoverableError) as err:
        eng.train(STEPS)
    msg = str(err.value)
    assert "node(s) [0, 1]" in msg and "No checkpoint is configured" in msg
    assert "tier-2" in msg and "instead of resuming on wrong state" in msg
    # it never resumes: the job stays in recovery, and asking again stops again
    before = eng.backend.retained_bytes()
    assert eng.state.phase is Phase.RECONCILING
    with pytest.raises(UnrecoverableError):
        eng.run_step()
    assert eng.backend.retained_bytes() == before
    assert eng.state.phase is Phase.RECONCILING


def test_a_bad_parity_decode_is_caught_not_resumed() -> None:
    eng = make_engine()
    eng.injector.lose_memory(rank=0, step=3, phase="forward")
    eng.train(2)
    eng.backend.node_store(0).parity[1][0] ^= 1  # type: ignore[index]  # flip a parity bit
    with pytest.raises(IntegrityError, match="fail the checksum"):
        eng.train(STEPS)


def test_tier1_off_uses_tier2_for_a_lost_memory() -> None:
    eng = run([("lose_memory", dict(rank=1, step=5, phase="finish"))], tier1=False)
    assert eng.recoveries[0]["kind"] == "tier2"
    assert eng.backend.node_store(0).parity is None


def test_tier2_off_still_recovers_a_node_loss_from_the_step_0_snapshot() -> None:
    # with tier 2 off there are no periodic snapshots: only the one the core assumes at
    # step 0; the crash at step 3 loses no snapshot block, so it is not retaken
    plan = [
        ("fail_at", dict(rank=0, step=3, phase="finish")),
        ("lose_node", dict(node=1, step=6, phase="finish")),
    ]
    eng = run(plan, tier2=False)
    assert [r["kind"] for r in eng.recoveries] == ["inplace", "tier2"]
    assert eng.recoveries[0]["resumed_at"] == 3
    assert eng.recoveries[1]["resumed_at"] == 0


def test_an_intact_snapshot_is_kept_and_a_damaged_one_retaken() -> None:
    # tier 2 every 3 steps (snapshots at 0, 3, 6). The crash in step 5 loses no
    # snapshot block: the snapshot of step 3 stays (it is not retaken at 5), so the
    # next one is due at 6. The node loss in step 7 restores that one (step 6), and
    # retakes it, since node 1's blocks of it are gone.
    plan = [
        ("fail_at", dict(rank=0, step=5, phase="finish")),
        ("lose_node", dict(node=1, step=7, phase="finish")),
    ]
    eng = run(plan)
    assert [(r["kind"], r["resumed_at"]) for r in eng.recoveries] == [
        ("inplace", 5),
        ("tier2", 6),
    ]
    assert eng.stats["snapshots_taken"] == 4  # 0, 3, 6, and 6 again after the node loss
    assert eng.state.t2 == 6
    assert all(eng.backend.node_store(n).snapshot.step == 6 for n in range(2))


def test_a_snapshot_due_when_the_failure_struck_is_taken_before_the_next_step() -> None:
    # the crash strikes in step 6, before its snapshot (due: 6 - 3 >= K): recovery keeps
    # the snapshot of step 3, so the engine takes step 6's before computing step 7
    # (the core refuses a Compute with tier 2 K steps behind)
    eng = run([("fail_at", dict(rank=1, step=6, phase="finish"))])
    assert [r["resumed_at"] for r in eng.recoveries] == [6]
    assert eng.stats["snapshots_taken"] == 3  # 0, 3, 6
    assert eng.state.t2 == 6


def test_several_faults_in_one_run_across_a_three_node_topology() -> None:
    topo = Topology((2, 1, 2))
    plan = [
        ("fail_at", dict(rank=2, step=2, phase="apply", chunk=1, where="mid_write")),
        ("lose_memory", dict(rank=4, step=3, phase="parity", chunk=2)),
        ("lose_node", dict(node=1, step=5, phase="decide", where="after")),
        ("fail_at", dict(rank=0, step=6, phase="allreduce")),
    ]
    eng = run(plan, topology=topo)
    # rank 0 fails before any rank has its reduced gradients: nothing to roll back
    assert [r["kind"] for r in eng.recoveries] == ["forward", "tier1", "tier2", "inplace"]


def test_a_shadow_whose_model_does_not_fit_is_refused_and_modifies_nothing() -> None:
    from torch import nn

    from leto.backends.fake.engine import copy_replica
    from leto.retained.layout import ShapeMismatchError

    eng = make_engine()
    eng.train(2)
    wrong = copy_replica(eng.template)
    wrong.model[0] = nn.Linear(3, 5)  # the shadow was built from another model
    eng.template = wrong
    for r in range(eng.W):
        eng.backend.spawn_shadow(r, eng._shadow_factory)
    eng.injector.fail_at(rank=1, step=3, phase="finish")
    with pytest.raises(ShapeMismatchError, match=r"parameter '0.weight'"):
        eng.train(4)
    assert eng.state.phase is Phase.RECONCILING  # it does not resume
    before = eng.backend.retained_bytes()
    with pytest.raises(ShapeMismatchError):  # and trying again changes nothing retained
        eng.run_step()
    assert eng.backend.retained_bytes() == before
    assert eng.state.phase is Phase.RECONCILING


def test_a_snapshot_never_captures_bytes_damaged_after_prepare() -> None:
    # The flip strikes after PREPARE's pass of step 3, the step whose snapshot is due
    # (K = 3). Were the damaged bytes captured under their good checksum, the node
    # loss of step 5 would restore them and find them bad with no tier left (the
    # README's fake demo crashed so). The capture checks them: rank 1's memory is
    # discarded and rebuilt from tier 1, then the snapshot of step 3 is taken.
    plan = [
        ("corrupt", dict(rank=1, step=3, chunk=0, phase="finish", bit=3)),
        ("lose_node", dict(node=0, step=5, phase="finish")),
    ]
    eng = run(plan)
    f = eng.injector.faults[0]
    assert f.fired == 1 and f.detected == 1
    assert "at the tier-2 snapshot" in eng.recoveries[0]["integrity_failures"][0]
    assert [(r["kind"], r["resumed_at"]) for r in eng.recoveries] == [
        ("tier1", 3),
        ("tier2", 3),
    ]
