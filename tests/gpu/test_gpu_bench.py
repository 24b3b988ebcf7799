"""On a GPU only: ``leto bench recovery --device cuda`` with several GiB of state per rank
against the disk-checkpoint baselines (every system's model and state on the GPU; leto's
keepers holding its retained state there). Its JSON result is copied to ``$OUT`` when
``OUT`` is set (``docs/benchmarks.md`` takes its figures from there). Skipped with a
reason without CUDA; no conftest fixture is used (``--noconftest``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA here: tests/gpu needs a GPU (bash tests/gpu/run_device.sh on one)",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
# 200M parameters: 3.2 GB of parameters, gradients and AdamW state per rank (2.4 GB in
# a checkpoint), 4 ranks sharing the GPU
PARAMS = os.environ.get("LETO_GPU_BENCH_PARAMS", "200M")


def test_leto_bench_recovery_on_the_gpu_beats_the_checkpoint_baselines() -> None:
    out = Path(tempfile.mkdtemp(prefix="leto-gpu-bench-"))
    argv = [sys.executable, "-m", "leto", "bench", "recovery", "--device", "cuda"]
    argv += ["--params", PARAMS, "--world", "4", "--repeats", "1", "--no-progress"]
    argv += ["--systems", "leto,ckpt-disk,ckpt-disk-async", "--out", str(out), "--json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=130)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(done.stdout)
    if os.environ.get("OUT"):
        shutil.copy(next(out.glob("*.json")), Path(os.environ["OUT"]) / "gpu_bench_recovery.json")
    assert res["workload"]["device"] == "cuda"
    totals = {s: r["total_s"] for s, r in res["systems"].items()}
    assert set(totals) == {"leto", "ckpt-disk", "ckpt-disk-async"}, totals
    assert totals["leto"] < min(totals["ckpt-disk"], totals["ckpt-disk-async"]), totals
