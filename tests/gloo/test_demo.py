"""``leto demo`` on gloo: examples/gpt.py, 4 ranks as 2 nodes x 2, faults at every phase."""

from __future__ import annotations

from pathlib import Path

from leto.adapters import gloo_demo


def test_gloo_demo_recovers_every_fault_bitwise(tag: str) -> None:
    plan = gloo_demo.fault_plan(steps=36, n_chunks=gloo_demo.n_chunks_of(4096), nodes=2, per_node=2)
    result = gloo_demo.demo(steps=36, workdir=str(Path(tag) / "demo"))
    assert result["error"] is None
    assert result["failures_planned"] == len(plan) >= 16
    assert result["failures_injected"] == result["failures_planned"]
    assert result["bitwise_equal"] and result["params_equal"] and result["optimizer_state_equal"]
    assert result["every_failure_recovered"] is True
    # one entry per failure; the two failures of the restarted recovery share its end
    secs = result["recovery_seconds"]
    assert len(secs) == result["failures_injected"] > result["recoveries"]
    assert all(isinstance(x, float) and 0 < x < 60 for x in secs)
    assert result["recovery_restarts"] >= 1
    assert {"forward", "tier1", "tier2"} <= set(result["recoveries_by_kind"])
    assert result["topology"] == "2x2" and result["backend"] == "gloo"
    # gloo's default tier 1 (tier1_code "auto"): replicas; the lost keeper's chunks copied
    assert result["tier1_kind"] == "replica", result["tier1_kind"]
    assert result["copied_from_replicas"] >= result["chunks_repaired_tier1"] >= 1
    assert result["chunks_repaired_from_parity"] == 0
