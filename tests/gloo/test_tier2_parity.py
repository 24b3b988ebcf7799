"""Tier 2 with two parities on real processes: three nodes, two of them lost in one
recovery, restored from the third's snapshot and the Reed-Solomon parities (issue
"The last tiers", part 3), bitwise the failure-free run."""

from __future__ import annotations

from pathlib import Path

from jobs import digests_equal, explain, job

STEPS = 8
ENV = {"T2_PARITY": "2", "TIER1_CODE": "parity"}


def test_two_lost_nodes_restored_from_tier2_with_two_parities(session_dir: Path) -> None:
    ref = job(session_dir / "ref-3x1-m2", nnodes=3, nproc=1, steps=STEPS, env=ENV)
    assert ref.ok and ref.digests, explain(ref)
    faults = [
        {"kind": "lose_node", "rank": 1, "step": 5, "phase": "prepare"},
        {"kind": "lose_node", "rank": 2, "step": 5, "phase": "prepare"},
    ]
    res = job(
        session_dir / "two-nodes-m2",
        nnodes=3,
        nproc=1,
        steps=STEPS,
        faults=faults,
        env=ENV,
        extra=["--spare-timeout", "60"],
        timeout=240.0,
    )
    assert res.ok, explain(res)
    kinds = [f["kind"] for f in res.of("failure")]
    assert kinds.count("node_lost") == 2, kinds
    # one recovery with both nodes lost (both die at the same point of step 5): one
    # parity would fall back to the checkpoint here; two restore the step-4 snapshot
    (rec,) = res.recoveries
    assert rec["kind"] == "tier2" and rec["resumed_at"] == 4, rec
    assert sorted(f["node"] for f in rec["failures"]) == [1, 2], rec["failures"]
    (start,) = res.of("core_init")
    assert start["tier2_parity"] == 2
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"
