"""A real client: examples/hf_gpt2.py (a Hugging Face `transformers` GPT-2 built from a
config in code, its own loop: accumulation under no_sync, session.clip_grad_norm_,
AdamW with weight-decay groups, a warm-up + cosine schedule, a StatefulDataLoader)
under `leto launch` on gloo, in bf16 with float32 master weights and sharded state
together, SIGKILLed at every phase of a step: bitwise its failure-free run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from jobs import LOOP_POINTS, digests_equal, explain, kills, script_job

from leto.backends.gloo.harness import JobResult

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "hf_gpt2.py")
STEPS = len(LOOP_POINTS) + 3
SETTINGS = (
    "chunk_size = 8192\ntier2_interval = 4\nmaster_weights = true\nshard = true\n"
    'tier1_code = "parity"\n'
)


def _run(run_dir: Path, faults: list[dict[str, Any]] | None) -> JobResult:
    args = ["--steps", str(STEPS), "--bf16"]
    return script_job(EXAMPLE, run_dir, SETTINGS, args, faults, hang_timeout=5, timeout=300)


@pytest.mark.soak  # test_masters.py's sharded bf16-with-masters path, on a transformers model
def test_hf_gpt2_bf16_masters_sharded_killed_at_every_phase_is_bitwise(
    session_dir: Path,
) -> None:
    ref = _run(session_dir / "hf-ref", None)
    assert ref.ok and ref.digests, explain(ref)
    assert ref.digests["0"]["param"] != ref.digests["1"]["param"]  # each rank its shard
    faults = kills(LOOP_POINTS)
    res = _run(session_dir / "hf-kills", faults)
    assert res.ok, explain(res)
    assert len(res.recoveries) == len(LOOP_POINTS), res.recoveries
    assert "forward" in {r["kind"] for r in res.recoveries}  # a death after COMMIT
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"
    steps = res.of("step")
    assert steps and all(r["loss"] is None for r in steps)  # the user's loop gives no loss


def test_help_answers_before_the_heavy_imports() -> None:
    """`--help` is parsed before torch and transformers are imported (12 s before)."""
    t = time.monotonic()
    out = subprocess.run(
        [sys.executable, EXAMPLE, "--help"], capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - t
    assert out.returncode == 0 and "--bf16" in out.stdout, out.stderr
    assert took < 3.0, f"--help took {took:.1f} s"
