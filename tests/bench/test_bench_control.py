"""``leto bench control`` at a tiny size: its figures are sane (not timed)."""

from __future__ import annotations

import json

import pytest

from leto.cli import main


def test_bench_control_reports_both_paths_that_agree(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "control", "--ranks", "6", "--chunks", "8", "--per-node", "3"]
    assert main([*argv, "--steps", "3", "--reference-sizes", "4x4,5x2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [(r["ranks"], r["chunks"]) for r in res["rows"]] == [(4, 4), (5, 2), (6, 8)]
    for row in res["rows"]:
        agg = row["aggregated"]
        assert len(agg["step_ms_all"]) == 3 and all(t >= 0 for t in agg["step_ms_all"])
        # one rank's memory lost: tier 1 rebuilds its chunks; a node lost: the snapshot
        assert agg["plan"]["lose_memory"] == {
            **agg["plan"]["lose_memory"], "kind": "tier1", "target": 3,
        }  # fmt: skip
        assert agg["plan"]["lose_memory"]["repairs"] == row["chunks"] + 1  # + its gradients
        assert agg["plan"]["lose_node"]["kind"] == "tier2"
        assert agg["plan"]["lose_node"]["repairs"] == row["ranks"]
        # COMMIT of the next step, no rank applied it: every chunk rolls forward, in
        # one run per rank; the adopted reports plan the same
        fwd = agg["plan"]["roll_forward"]
        assert (fwd["kind"], fwd["target"], fwd["runs"]) == ("forward", 4, row["ranks"])
        assert fwd["repairs"] == row["ranks"] * row["chunks"]
        assert agg["adopt"]["runs"] == row["ranks"] and agg["adopt"]["ms"] >= 0
        # the reports as runs adopt to what the reports listing every chunk adopt to, and
        # their record smaller from a few chunks on: one run per row against every value
        assert agg["same_adoption"] and agg["adopt_listed"]["runs"] == row["ranks"]
        if row["chunks"] >= 8:
            assert agg["adopt"]["record_bytes"] < agg["adopt_listed"]["record_bytes"] / 2
    for row in res["rows"][:2]:
        assert row["same_state"] and row["same_plans"]
        ref = row["chunk_level"]["plan"]["roll_forward"]
        assert ref["runs"] == ref["repairs"] == row["ranks"] * row["chunks"]  # per chunk
        assert "adopt" not in row["chunk_level"]
        assert row["step_ratio"] > 0 and all(x > 0 for x in row["plan_ratio"].values())
    assert "chunk_level" not in res["rows"][2]
    assert set(res["met"]) == {"step", "plan", "adopt", "record"}


def test_bench_control_table_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "control", "--ranks", "4", "--chunks", "4", "--per-node", "2",
                 "--steps", "2", "--reference-sizes", "2x2", "--no-progress"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "chunk-level" in out and "aggregated" in out and "same model state" in out
    assert "same adoption" in out and "its record <= 1.0 MiB" in out
    assert main(["bench", "control", "--reference-sizes", "8by4"]) == 2
    assert "--reference-sizes" in capsys.readouterr().err
    assert main(["bench", "control", "--ranks", "0"]) == 2
