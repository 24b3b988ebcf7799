"""`leto simulate` end to end: JSON, tables, sweeps, plots, bad input, the 131,072-GPU run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from leto.cli import main
from leto.sim.strategies import STRATEGIES


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "leto.cli", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_131072_gpus_json() -> None:
    proc = run_cli("--gpus", "131072", "--days", "30", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out["ettr"]) == set(STRATEGIES)
    assert all(0.0 < v < 1.0 for v in out["ettr"].values())
    assert out["params"]["gpus"] == 131_072 and out["params"]["days"] == 30
    # Under the default assumptions leto clears 95%; checkpoint/restart does not.
    assert out["ettr"]["leto"] > 0.95
    assert out["ettr"]["ckpt-async"] < 0.9
    # Its speed is measured by benchmarks/simulate_speed.py, not asserted in a test.


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--gpus", "0"], "gpus"),
        (["--gpus", "-8"], "gpus"),
        (["--hof-fraction", "1.5"], "hof_fraction"),
        (["--hof-fraction", "-0.1"], "hof_fraction"),
        (["--days", "0"], "days"),
        (["--strategies", "leto,magic"], "magic"),
        (["--set", "nonsense=1"], "nonsense"),
    ],
)
def test_bad_input_is_one_line_and_non_zero(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("leto simulate: error:") and needle in err


def test_bench_json_missing_a_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"phases": {"detect_s": 0.05, "restart_s": 40.0, "promote_s": 1}}))
    assert main(["simulate", "--bench", str(bench)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing field 'rebuild_comm_s'" in err
    bench.write_text("{not json")
    assert main(["simulate", "--bench", str(bench)]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert main(["simulate", "--bench", str(tmp_path / "absent.json")]) == 2
    assert "absent.json" in capsys.readouterr().err


def test_bench_json_sets_the_phase_costs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = tmp_path / "bench.json"
    phases = {"detect_s": 0.05, "restart_s": 42.0, "promote_s": 0.5, "rebuild_comm_s": 0.04}
    bench.write_text(json.dumps(phases))
    # A flag still wins over the bench file.
    assert (
        main(["simulate", "--bench", str(bench), "--set", "promote_s=3", "--seeds", "1", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["params"]["restart_s"] == 42.0 and out["params"]["rebuild_comm_s"] == 0.04
    assert out["params"]["promote_s"] == 3.0


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--gpus", "1024", "--seeds", "2"]) == 0
    text = capsys.readouterr().out
    for name in STRATEGIES:
        assert name in text
    assert "1,024 GPUs (128 nodes x 8)" in text and "leto tiers:" in text


def test_sweep_with_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "simulate",
            "--sweep",
            "hof",
            "--values",
            "0.2,0.5,0.8",
            "--seeds",
            "1",
            "--gpus",
            "4096",
            "--plot",
            str(tmp_path),
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["values"] == [0.2, 0.5, 0.8] and out["param"] == "hof_fraction"
    leto = out["ettr"]["leto"]
    assert leto[0] < leto[1] < leto[2]
    png = tmp_path / "ettr_vs_hof.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
