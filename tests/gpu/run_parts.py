"""The parts ``run_device.sh`` runs, each in its own interpreter with a time limit, and
a JSON summary of them (``$OUT/gpu_summary.json`` when ``$OUT`` is set).

Each part is a pytest run (``--noconftest``: the lent machine has no torchdata and no
etcd3gw, and these files need no fixture of a conftest) whose junit XML gives what
passed, failed and was skipped, with the reasons. Without pytest the same files run
under :mod:`plain_runner` (a few lines standing in for the parts of pytest they use;
``LETO_GPU_RUNNER=plain`` picks it where pytest exists).
Parts that cannot run yet are listed with the reason, so the summary says what was
*not* checked as plainly as what was. Exit status: 1 if a part failed, else 0.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

PARTS: list[tuple[str, list[str], int]] = [
    # name, test files, seconds allowed (all together well under 6 minutes)
    ("tensor layer on CUDA", ["tests/retained/test_retained_cuda.py"], 40),
    ("memory provider contract", ["tests/gloo/test_memory_provider.py"], 25),
    ("retained layout in provider memory", ["tests/gloo/test_provider_layout.py"], 35),
    ("gloo jobs on the GPU", ["tests/gpu/test_gpu_memory.py", "tests/gpu/test_gpu_job.py"], 110),
    ("leto bench recovery on the GPU", ["tests/gpu/test_gpu_bench.py"], 140),
]

NOT_YET = [
    (
        "NCCL",
        "NCCL refuses two ranks on one device, and the lent machines have one GPU: the nccl "
        "backend (cpu:gloo,cuda:nccl groups, abort on recovery) has never run",
    ),
]


def device_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda": torch.cuda.is_available(),
        "device": None,
        "pytest": importlib.util.find_spec("pytest") is not None,
    }
    if info["cuda"]:
        info["device"] = torch.cuda.get_device_name(0)
        info["device_count"] = torch.cuda.device_count()
    return info


def parse_junit(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "skip_reasons": []}
    out["failures"] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            out["failed"] += 1
            out["failures"].append(f"{name}: {(bad.get('message') or '')[:300]}")
        elif skip is not None:
            out["skipped"] += 1
            reason = (skip.get("message") or "").removeprefix("Skipped: ")
            if reason not in out["skip_reasons"]:
                out["skip_reasons"].append(reason)
        else:
            out["passed"] += 1
    return out


def run_part(name: str, files: list[str], limit: int, use_pytest: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="leto-gpu-") as tmp:
        junit = Path(tmp) / "junit.xml"
        if use_pytest:
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            cmd += ["--noconftest", "--basetemp", str(Path(tmp) / "pt")]
            cmd += ["-o", "junit_family=xunit1", f"--junitxml={junit}", *files]
        else:
            cmd = [sys.executable, str(ROOT / "tests/gpu/plain_runner.py"), str(junit), *files]
        part: dict[str, Any] = {"name": name, "files": files}
        part["runner"] = "pytest" if use_pytest else "plain"
        try:
            done = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit
            )
            part["exit"] = done.returncode
            tail = (done.stdout + done.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            part["exit"] = "timeout"
            tail = f"timed out after {limit} s: {str(e.stdout or '')[-2000:]}"
        if junit.exists():
            part.update(parse_junit(junit))
        else:
            part.update(passed=0, failed=1, skipped=0, skip_reasons=[], failures=[tail[-500:]])
    part["seconds"] = round(time.monotonic() - t0, 2)
    part["ok"] = part["failed"] == 0 and part["exit"] in (0, 5)
    print(
        f"== {name}: {part['passed']} passed, {part['failed']} failed, "
        f"{part['skipped']} skipped in {part['seconds']} s"
    )
    for reason in part["skip_reasons"]:
        print(f"   skipped: {reason}")
    if not part["ok"]:
        print(tail)
    return part


def main() -> int:
    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    info = device_info()
    print(f"python {info['python']}, torch {info['torch']} (CUDA build {info['torch_cuda']})")
    print(f"CUDA available: {info['cuda']}; device: {info['device'] or 'none'}")
    use_pytest = info["pytest"] and os.environ.get("LETO_GPU_RUNNER") != "plain"
    parts = [run_part(n, f, lim, use_pytest) for n, f, lim in PARTS]
    summary = {
        **info,
        "started": started,
        "parts": parts,
        "not_yet_possible": [{"name": n, "why": w} for n, w in NOT_YET],
        "ok": all(p["ok"] for p in parts),
        # what ran on a GPU at all: "ok" alone also holds where every CUDA test skipped
        "gpu_tests_passed": sum(p["passed"] for p in parts) if info["cuda"] else 0,
        "seconds": round(time.monotonic() - t0, 2),
    }
    for n, w in NOT_YET:
        print(f"== not yet possible: {n}: {w}")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"summary: {Path(out) / 'gpu_summary.json'}")
    if not info["cuda"]:
        print("nothing ran on a GPU: this machine has no CUDA (the CUDA parts skipped)")
    print(f"all parts ok: {summary['ok']} ({summary['seconds']} s)")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
