"""``tests/gpu/run_device.sh`` runs on CPU too: it exits 0, its summary says CUDA is
absent, the CUDA parts skip with their reasons while the host parts pass, and the
plain runner (for a machine without pytest) counts the same as pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from run_parts import parse_junit  # noqa: E402

sys.path.remove(str(ROOT / "tests" / "gpu"))

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU is here: run_device.sh runs its CUDA parts for real"
)


def run_script(out: Path, **env: str) -> tuple[int, dict[str, object], str]:
    done = subprocess.run(
        ["bash", "tests/gpu/run_device.sh"],
        cwd=ROOT,
        env={**os.environ, "OUT": str(out), "LETO_PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = json.loads((out / "gpu_summary.json").read_text())
    return done.returncode, summary, done.stdout + done.stderr


@pytest.mark.slow
def test_run_device_script_on_cpu_skips_cuda_parts_with_reasons(tmp_path: Path) -> None:
    rc, s, log = run_script(tmp_path)
    assert rc == 0, log
    assert s["cuda"] is False and s["device"] is None and s["ok"] is True
    assert s["torch"] == torch.__version__
    parts = {p["name"]: p for p in s["parts"]}  # type: ignore[attr-defined]
    assert list(parts) == [
        "tensor layer on CUDA",
        "memory provider contract",
        "retained layout in provider memory",
        "gloo jobs on the GPU",
        "leto bench recovery on the GPU",
    ]
    assert all(p["runner"] == "pytest" and p["failed"] == 0 for p in parts.values())
    gpu = parts["gloo jobs on the GPU"], parts["leto bench recovery on the GPU"]
    assert all(p["passed"] == 0 and p["skipped"] > 0 for p in (parts["tensor layer on CUDA"], *gpu))
    for p in gpu:
        assert p["skip_reasons"] == [
            "no CUDA here: tests/gpu needs a GPU (bash tests/gpu/run_device.sh on one)"
        ]
    # the host half of each contract runs here; its CUDA half skips, one for one
    for name in ("memory provider contract", "retained layout in provider memory"):
        p = parts[name]
        assert p["passed"] >= p["skipped"] > 0, p
        assert [r.split(":")[0] for r in p["skip_reasons"]] == ["no CUDA here"]
    not_yet = [n["name"] for n in s["not_yet_possible"]]  # type: ignore[attr-defined]
    assert not_yet == ["NCCL"]
    assert "CUDA available: False" in log
    assert s["gpu_tests_passed"] == 0 and "nothing ran on a GPU: this machine has no CUDA" in log


def counts(runner: list[str], junit: Path, files: list[str]) -> dict[str, Any]:
    done = subprocess.run(
        [*runner, *files],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    got = parse_junit(junit)
    return {k: got[k] for k in ("passed", "failed", "skipped")} | {
        "reasons": sorted(got["skip_reasons"])
    }


def test_plain_runner_counts_as_pytest_does(tmp_path: Path) -> None:
    files = ["tests/gloo/test_memory_provider.py", "tests/gpu"]
    plain = counts(
        [sys.executable, "tests/gpu/plain_runner.py", str(tmp_path / "plain.xml")],
        tmp_path / "plain.xml",
        files,
    )
    real = counts(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest"]
        + ["--basetemp", str(tmp_path / "pt"), f"--junitxml={tmp_path / 'real.xml'}"],
        tmp_path / "real.xml",
        files,
    )
    assert plain == real
    assert plain["passed"] > 0 and plain["skipped"] > 0 and plain["failed"] == 0


def test_plain_runner_reports_a_failing_test(tmp_path: Path) -> None:
    bad = tmp_path / "test_bad.py"
    bad.write_text(
        "import pytest\n\n"
        "@pytest.mark.parametrize('x', [1, 2])\n"
        "def test_one(x):\n    assert x == 1\n\n"
        "def test_raises():\n"
        "    with pytest.raises(ValueError, match='no'):\n        raise ValueError('yes')\n"
    )
    junit = tmp_path / "j.xml"
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/gpu/plain_runner.py"), str(junit), str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    got = parse_junit(junit)
    assert (got["passed"], got["failed"], got["skipped"]) == (1, 2, 0)
