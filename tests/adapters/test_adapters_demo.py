"""``leto demo``: the fake (in-process) demo with fewer steps than its default to keep it
fast, and the CLI of the gloo demo (the default backend) with its runs stubbed."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from leto.adapters import gloo_demo
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
    argv = ["--backend", "fake", "--no-checkpoint", "--steps", "40", "--chunk-size", "16384"]
    assert main(["demo", *argv]) == 1
    text = capsys.readouterr().out
    assert "RECOVERED" in text  # the earlier failures were recovered in place
    assert "STOPPED: leto: cannot recover in place" in text
    assert "node(s) [0, 1]" in text and "No checkpoint is configured" in text


def test_demo_rejects_bad_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["demo", "--backend", "mpi"]) == 2
    assert "backend: unknown backend 'mpi'" in capsys.readouterr().err
    for backend in ("fake", "gloo"):  # refused before anything starts
        assert main(["demo", "--backend", backend, "--chunk-size", "-5"]) == 2
        assert "chunk_size: must be positive, got -5" in capsys.readouterr().err
    # (the gloo demo itself runs in tests/test_readme.py, `leto demo --json`.)
    assert main(["demo", "--backend", "nccl"]) == 2
    assert "nccl" in capsys.readouterr().err
    assert main(["demo", "--backend", "fake", "--steps", "10"]) == 2
    assert "steps: 10 is too few" in capsys.readouterr().err
    assert main(["demo", "--steps", "10"]) == 2  # gloo
    assert "the fault plan needs at least 34 steps, got 10" in capsys.readouterr().err
    cfg = tmp_path / "gloo.toml"
    cfg.write_text('[leto]\nbackend = "gloo"\ntopology = "2x2"\n')
    assert main(["demo", "--backend", "fake", "--config", str(cfg)]) == 2
    assert "not both" in capsys.readouterr().err


def _fake_gloo_demo(calls: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    calls.append(kw)
    failed = kw["seed"] == 7
    return {
        "bitwise_equal": not failed,
        "trace_ok": True,
        "every_failure_recovered": True,
        "recovery_seconds": [0.25, 0.5],
        "faults": [{"kind": "crash"}, {"kind": "hang"}],
    }


def test_demo_runs_on_gloo_by_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(gloo_demo, "demo", functools.partial(_fake_gloo_demo, calls))
    assert main(["demo", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recovery_seconds"] == [0.25, 0.5]
    assert calls.pop() == {
        "steps": gloo_demo.STEPS,
        "nodes": 2,
        "ranks_per_node": 2,
        "chunk_size": 4096,
        "tier2_interval": 10,
        "checkpoint_dir": None,
        "tier1_code": "auto",
        "verify_chunks": True,
        "tier1": True,
        "tier2": True,
        "seed": 0,
        "faults": True,
        "out": None,
    }
    # a gloo config file, overridden by flags; not bitwise equal: exit status 1
    cfg = tmp_path / "gloo.toml"
    cfg.write_text('[leto]\nbackend = "gloo"\ntopology = "3x2"\nchunk_size = 512\n')
    assert main(["demo", "--config", str(cfg), "--chunk-size", "1024", "--seed", "7"]) == 1
    kw = calls.pop()
    assert (kw["nodes"], kw["ranks_per_node"], kw["chunk_size"], kw["seed"]) == (3, 2, 1024, 7)
    assert kw["out"] is sys.stdout
    # the file's tier-1 settings reach the demo; a tier the faults need, off: refused
    head = '[leto]\nbackend = "gloo"\ntopology = "2x2"\n'
    cfg.write_text(head + 'tier1_code = "parity"\nverify_chunks = false\n')
    assert main(["demo", "--config", str(cfg), "--json"]) == 0
    kw = calls.pop()
    assert (kw["tier1_code"], kw["verify_chunks"], kw["tier1"], kw["tier2"]) == (
        "parity",
        False,
        True,
        True,
    )
    capsys.readouterr()
    for tier in ("tier1", "tier2"):
        cfg.write_text(head + f"{tier} = false\n")
        assert main(["demo", "--config", str(cfg)]) == 2
        assert f"{tier}: the demo's faults need {tier} on" in capsys.readouterr().err
        assert not calls
        # without faults nothing needs the tier: it reaches the demo as the file says
        assert main(["demo", "--config", str(cfg), "--no-faults", "--json"]) == 0
        kw = calls.pop()
        assert (kw[tier], kw["faults"]) == (False, False)
        capsys.readouterr()
    # one node: no node to lose, so tier 2 may be off
    cfg.write_text('[leto]\nbackend = "gloo"\ntopology = "1x2"\ntier2 = false\n')
    assert main(["demo", "--config", str(cfg), "--json"]) == 0
    assert calls.pop()["tier2"] is False


def test_failure_seconds_is_one_entry_per_failure() -> None:
    events = [
        {"event": "failure", "t": 10.0},
        {"event": "recovery_end", "t": 10.5},
        {"event": "failure", "t": 20.0},
        {"event": "failure", "t": 20.25},  # during the recovery: it restarts
        {"event": "recovery_end", "t": 21.0},
        {"event": "failure", "t": 30.0},  # never recovered
    ]
    assert gloo_demo.failure_seconds(events) == [0.5, 1.0, 0.75, None]
