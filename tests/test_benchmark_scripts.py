"""The scripts in ``benchmarks/`` run: each is run here briefly, as a user runs it from a
checkout (``python benchmarks/<name>.py``), so that a change of an API they use breaks
a test, not the next benchmark run. What they measure is not asserted (they are not
tests); what they print is checked for the values they compute."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

# the scripts that are `leto bench <name>` run from a checkout
WRAPPERS = ["control", "goodput", "overhead", "recovery", "scaling", "tier2"]


def run(script: str, *args: str, timeout: float = 300.0) -> str:
    out = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, f"{script} {args}: exit {out.returncode}\n{out.stderr[-3000:]}"
    return out.stdout


def test_every_script_here_is_run_by_this_file() -> None:
    scripts = sorted(p.stem for p in BENCH.glob("*.py"))
    assert scripts == sorted(
        [
            *WRAPPERS,
            "checkpoint_stall",
            "reduce_wait",
            "replica_check",
            "retained_step",
            "shard_bytes",
            "simulate_speed",
        ]
    )


@pytest.mark.parametrize("name", WRAPPERS)
def test_a_wrapper_is_its_leto_bench_command(name: str) -> None:
    text = run(f"{name}.py", "--help", timeout=60)
    assert text.startswith(f"usage: leto bench {name}"), text[:200]


def test_retained_step_prints_every_configuration_and_its_extra() -> None:
    text = run("retained_step.py", "--steps", "2", "--warmup", "0")
    totals = dict(re.findall(r"^(plain|leto/\w+)\s+([\d.]+)\s{3}", text, re.M))
    assert sorted(totals) == sorted(
        ["plain", "leto/fletcher", "leto/xxh3", "leto/replica", "leto/generic"]
    ), text
    assert all(float(v) > 0 for v in totals.values()), totals
    extras = dict(re.findall(r"^(leto/\w+)\s+extra over plain: (-?[\d.]+) ms", text, re.M))
    for name, extra in extras.items():  # each extra is its total less plain's
        assert float(extra) == pytest.approx(float(totals[name]) - float(totals["plain"]), abs=0.02)
    assert len(extras) == 4, text


def test_replica_check_prints_the_digest_beside_the_step() -> None:
    got = json.loads(run("replica_check.py", "--steps", "3", "--params", "200K", "--json"))
    assert got["params"] >= 150_000 and got["steps"] == 3
    assert got["step_ms_median"] > 0 and got["digest_ms_median"] > 0
    ratio = 100.0 * got["digest_ms_median"] / got["step_ms_median"]
    assert abs(got["digest_over_step_pct"] - ratio) < 1e-9
    assert got["distinct_digests"] == 3  # each step's state has a digest of its own


def test_reduce_wait_times_both_waits_of_one_reduce() -> None:
    got = json.loads(run("reduce_wait.py", "--rounds", "3", "--numel", "10K", "--json"))
    assert got["numel"] == 10_000 and got["rounds"] == 3
    assert got["blocking_ms_median"] > 0 and got["abortable_ms_median"] > 0
    ratio = got["abortable_ms_median"] / got["blocking_ms_median"]
    assert got["abortable_over_blocking"] == pytest.approx(ratio, rel=1e-12)


def test_shard_bytes_per_rank_fall_with_the_world() -> None:
    got = json.loads(run("shard_bytes.py", "--json"))
    assert [m["chunk_numel"] for m in got] == [65536, 4096]
    for m in got:
        rows = m["sharded"]
        assert [r["world"] for r in rows] == [2, 4, 8]
        sizes = [r["per_rank_bytes"] for r in rows]
        assert sizes[0] < m["unsharded_bytes"] and sizes[0] > sizes[1] > sizes[2], m
        # a shard is never below 1/W of the whole (padding only adds)
        assert all(r["ratio_x_world"] >= 1.0 for r in rows), rows


def test_simulate_speed_prints_each_time_against_its_target() -> None:
    text = run("simulate_speed.py")
    got = re.findall(r"([\d.]+) s  \(([\d.]+) of the (\d+) s target\)", text)
    assert [int(target) for _, _, target in got] == [5, 60], text
    for seconds, ratio, target in got:
        assert float(seconds) > 0
        assert float(ratio) == pytest.approx(float(seconds) / int(target), abs=0.006), text


def test_checkpoint_stall_reports_both_stalls_and_their_ratio() -> None:
    got = json.loads(
        run("checkpoint_stall.py", "--params", "200K", "--checkpoints", "2", "--every", "1",
            "--json")
    )  # fmt: skip
    assert got["checkpoints"] == 2 and got["every"] == 1 and got["params"] >= 150_000
    assert got["sync_stall_ms_median"] > 0 and got["async_stall_ms_median"] > 0
    ratio = got["sync_stall_ms_median"] / got["async_stall_ms_median"]
    assert abs(got["sync_over_async"] - ratio) < 1e-9
    # the copy is part of the async stall; the write itself ran on its thread
    assert 0 < got["async_staging_ms_median"] <= got["async_stall_ms_median"]
    assert got["async_write_ms_median"] > 0
