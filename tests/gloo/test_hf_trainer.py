"""A Hugging Face `transformers.Trainer` under `leto launch` (examples/hf_trainer.py:
`leto.hf.Trainer`, gradient accumulation, clipping, a warm-up + cosine schedule,
evaluation and `save_steps` checkpoints every 4 steps, an epoch boundary crossed), SIGKILLed at every phase of a
step: bitwise its failure-free run, and so are the Trainer's own checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from jobs import LOOP_POINTS, digests_equal, explain, kills, script_job

from leto.backends.gloo.harness import JobResult

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py")
STEPS = len(LOOP_POINTS) + 6  # 13 steps an epoch: the kills run into the second
SAVE = 4  # an evaluation and a checkpoint every SAVE steps, in the loop's tail


def _run(run_dir: Path, faults: list[dict[str, Any]] | None) -> JobResult:
    args = ["--steps", str(STEPS), "--save-steps", str(SAVE), "--eval-steps", str(SAVE)]
    args += ["--output-dir", str(run_dir / "hf")]
    settings = "chunk_size = 8192\ntier2_interval = 4\n"
    return script_job(EXAMPLE, run_dir, settings, args, faults, hang_timeout=5, timeout=300)


def _checkpoints(res: JobResult) -> dict[int, bytes]:
    out = {}
    for d in (res.run_dir / "hf").glob("checkpoint-*"):
        state = json.loads((d / "trainer_state.json").read_text())
        assert state["global_step"] == int(d.name.split("-")[1])
        out[state["global_step"]] = (d / "model.safetensors").read_bytes()
    return out


def test_hf_trainer_killed_at_every_phase_is_bitwise(session_dir: Path) -> None:
    ref = _run(session_dir / "hft-ref", None)
    assert ref.ok and ref.digests, explain(ref)
    faults = kills(LOOP_POINTS)
    res = _run(session_dir / "hft-kills", faults)
    assert res.ok, explain(res)
    assert len(res.recoveries) == len(LOOP_POINTS), res.recoveries
    assert "forward" in {r["kind"] for r in res.recoveries}  # a death after COMMIT
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"
    ref_ckpts = _checkpoints(ref)
    assert sorted(ref_ckpts) == list(range(SAVE, STEPS + 1, SAVE))
    assert _checkpoints(res) == ref_ckpts  # written by rank 0 at committed steps only


def test_help_answers_before_the_heavy_imports() -> None:
    t = time.monotonic()
    out = subprocess.run(
        [sys.executable, EXAMPLE, "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "--save-steps" in out.stdout, out.stderr
    assert time.monotonic() - t < 3.0
