"""``leto bench overhead --batches``: the overhead against step time, its fit and the
step time at which leto costs 2%. The jobs are stubbed; the refusals are the CLI's."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from leto.bench import curve
from leto.bench.overhead import ci95
from leto.bench.plots import plot_curve
from leto.bench.report import curve_table
from leto.bench.workload import BenchError, Workload

# leto's extra time per step: 40 ms fixed plus 1% of the step
FIXED, SCALE = 0.040, 0.01


def test_fit_recovers_fixed_and_scaling_cost() -> None:
    plain = [0.1, 0.5, 2.5, 0.1, 0.5, 2.5]
    leto = [t + FIXED + SCALE * t for t in plain]
    c, b = curve.fit(plain, leto)
    assert c == pytest.approx(FIXED) and b == pytest.approx(SCALE)
    # 2% = c / t + b  ->  t = c / (0.02 - b) = 4 s
    assert curve.step_at(2.0, c, b) == pytest.approx(4.0)
    assert curve.step_at(2.0, c, 0.03) is None  # the scaling part alone is above 2%
    assert curve.step_at(2.0, -0.01, 0.0) is None  # no fixed cost: below 2% everywhere
    with pytest.raises(BenchError, match="two different step times"):
        curve.fit([0.5, 0.5], [0.6, 0.6])


def test_run_curve_measures_each_batch_and_fits_every_round(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[tuple[int, tuple[str, ...]]] = []

    def fake_overhead(wl: Workload, *, rounds: int, configs: Any, **_: Any) -> dict[str, Any]:
        seen.append((wl.batch, tuple(configs)))
        plain = [wl.batch / 8192 * (1 + 0.01 * r) for r in range(rounds)]
        leto = [t + FIXED + SCALE * t for t in plain]
        by_round = [100 * (b / a - 1) for a, b in zip(plain, leto, strict=True)]
        return {
            "step_s": {"plain": sum(plain) / rounds, "leto": sum(leto) / rounds},
            "step_s_runs": {"plain": plain, "leto": leto},
            "overhead_pct": 100 * (sum(leto) / sum(plain) - 1),
            "overhead_pct_by_round": {"leto": by_round},
            "overhead_pct_ci95": {"leto": ci95(by_round)},
            "overhead_pct_median_round": {"leto": statistics.median(by_round)},
            "elapsed_s": 1.0,
        }

    monkeypatch.setattr(curve, "run_overhead", fake_overhead)
    base = Workload.for_params(20_000, world=2, batch=8)
    wls = [Workload.for_params(20_000, world=2, batch=b) for b in (16384, 1024, 4096)]
    res = curve.run_curve(wls, rounds=3, progress=False)
    assert seen == [(b, ("plain", "leto")) for b in (1024, 4096, 16384)]
    assert res["batches"] == [1024, 4096, 16384]
    assert res["fit"]["fixed_s"] == pytest.approx(FIXED)
    assert res["fit"]["scaling"] == pytest.approx(SCALE)
    assert res["step_s_at_target"] == pytest.approx(4.0)
    assert res["overhead_pct_at_0_25_s"] == pytest.approx(100 * (FIXED / 0.25 + SCALE))
    small = res["points"][0]
    assert small["overhead_pct"] > res["points"][-1]["overhead_pct"]  # falls with step time
    lo, hi = small["overhead_pct_ci95"]
    assert lo <= small["overhead_pct"] <= hi
    table = curve_table(res)
    assert "leto costs 2% at 4.000 s steps" in table and "40.0 ms" in table
    assert plot_curve(res, tmp_path / "c.png").stat().st_size > 1000
    json.dumps(res)
    with pytest.raises(BenchError, match="two different batch sizes"):
        curve.run_curve([base, base], progress=False)


@pytest.mark.parametrize(
    ("batches", "why"),
    [
        ("1024", "at least two different batch sizes"),
        ("1024,1024", "at least two different batch sizes"),
        ("1024,many", "not a batch size: 'many'"),
        ("0,1024", "--batches: must be at least 1, got 0"),
        (",".join(str(b) for b in range(1, 18)), "more than the limit of 16"),
    ],
)
def test_bad_batches_are_refused(batches: str, why: str) -> None:
    from leto.bench.cli import _batches

    with pytest.raises(BenchError, match=why):
        _batches(batches)
    assert _batches("4096, 1024,4096") == [1024, 4096]


def test_bad_batches_are_one_line_and_exit_2_before_anything_starts(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "leto", "bench", "overhead", "--batches", "1024,many",
         "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines == ["leto bench: error: --batches: not a batch size: 'many'"]
    assert not (tmp_path / "o").exists()
