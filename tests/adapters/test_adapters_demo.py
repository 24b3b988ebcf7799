"""``leto demo``: in-process, with fewer steps than the default to keep it fast."""

from __future__ import annotations

import json

import pytest

from leto.cli import main


def test_demo_json_is_bitwise_equal_with_a_failure_at_every_phase(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--backend", "fake", "--json", "--steps", "32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bitwise_equal"] is True
    assert out["params_equal"] and out["optimizer_state_equal"]
    assert out["failures_injected"] == out["failures_planned"] >= 20
    assert out["every_failure_recovered"] is True
    assert all(f["fired"] == 1 and f["recovered"] == 1 for f in out["faults"])
    assert out["all_phases_covered"] is True
    phases = set(out["phases_covered"])
    for p in (
        "forward",
        "backward",
        "allreduce",
        "prepare",
        "decide/before",
        "decide/after",
        "finish",
    ):
        assert p in phases
    for c in range(out["n_chunks"]):
        assert any(p.startswith(f"apply[{c}]/") for p in phases)
    for w in ("undo_saved", "mid_write", "written"):
        assert any(p.endswith(f"/{w}") for p in phases)
    assert {"lose_memory", "lose_node", "corrupt", "hang"} <= phases
    assert any(p.startswith("parity[") for p in phases)
    assert out["recoveries"] >= 20
    assert out["rolled_forward"] > 0 and out["rolled_back"] > 0
    assert out["chunks_repaired_from_parity"] > 0 and out["grad_blocks_repaired_from_parity"] > 0
    assert out["snapshot_restores"] >= 1 and out["checkpoint_restores"] == 1
    assert out["checksum_failures_caught"] == 1 and out["stale_writes_refused"] == 1
    assert out["recovery_restarts"] >= 1  # the crash while a recovery reconciles
    assert set(out["recoveries_by_kind"]) == {
        "inplace",
        "back",
        "forward",
        "tier1",
        "tier2",
        "ckpt",
    }
    assert out["final_loss"] == out["reference_final_loss"]
    assert out["real_state_matches_core"] is True


def test_demo_without_checkpoint_stops_on_a_loss_beyond_both_tiers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--no-checkpoint", "--steps", "40", "--chunk-size", "16384"]) == 1
    text = capsys.readouterr().out
    assert "RECOVERED" in text  # the earlier failures were recovered in place
    assert "STOPPED: leto: cannot recover in place" in text
    assert "node(s) [0, 1]" in text and "No checkpoint is configured" in text


def test_demo_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--backend", "mpi"]) == 2
    assert "backend: unknown backend 'mpi'" in capsys.readouterr().err
    assert main(["demo", "--chunk-size", "-5"]) == 2
    assert "chunk_size: must be positive" in capsys.readouterr().err
    # (--backend gloo runs the real-process demo: tests/gloo/test_demo.py covers it.)
    assert main(["demo", "--backend", "nccl"]) == 2
    assert "nccl" in capsys.readouterr().err
    assert main(["demo", "--steps", "10"]) == 2
    assert "steps: 10 is too few" in capsys.readouterr().err
