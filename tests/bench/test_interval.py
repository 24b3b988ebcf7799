"""Young/Daly checkpoint interval and the failure schedule of ``leto bench recovery``."""

from __future__ import annotations

import math
import statistics

import pytest

from leto.bench.interval import checkpoint_interval_steps, failure_schedule
from leto.bench.workload import BenchError
from leto.sim.theory import daly_interval, young_interval


def test_young_first_order() -> None:
    # sqrt(2 C M): 0.5 s saves, 1 h MTBF -> 60 s
    assert young_interval(0.5, 3600.0) == pytest.approx(60.0)


def test_daly_refines_young() -> None:
    c, m = 0.5, 3600.0
    x = c / (2 * m)
    want = math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c
    assert daly_interval(c, m) == pytest.approx(want)
    assert daly_interval(c, m) < young_interval(c, m)  # the save itself is not compute
    assert daly_interval(10.0, 4.0) == 4.0  # C >= 2M: checkpoint every MTBF


@pytest.mark.parametrize(
    ("save_s", "mtbf_s", "step_s", "want"),
    [
        (0.5, 3600.0, 1.0, round(daly_interval(0.5, 3600.0))),  # ~59.5 s of 1 s steps
        (0.12, 60.0, 0.2, round(daly_interval(0.12, 60.0) / 0.2)),
        (0.0, 60.0, 0.2, 1),  # free checkpoints: every step
        (1e-6, 1e-3, 10.0, 1),  # never fewer than one step
    ],
)
def test_interval_in_steps(save_s: float, mtbf_s: float, step_s: float, want: int) -> None:
    assert checkpoint_interval_steps(save_s, mtbf_s, step_s) == want


def test_async_interval_covers_the_background_write() -> None:
    # a cheap staging copy alone would checkpoint every ~3 steps; the write takes 5 s
    assert checkpoint_interval_steps(0.01, 60.0, 0.2) < 25
    assert checkpoint_interval_steps(0.01, 60.0, 0.2, write_s=5.0) == 25


def test_interval_grows_with_save_cost_and_mtbf() -> None:
    base = checkpoint_interval_steps(0.1, 60.0, 0.05)
    assert checkpoint_interval_steps(0.4, 60.0, 0.05) > base
    assert checkpoint_interval_steps(0.1, 240.0, 0.05) > base
    # Young: 4x the cost or 4x the MTBF doubles the interval (to first order)
    assert checkpoint_interval_steps(0.4, 60.0, 0.05) == pytest.approx(2 * base, rel=0.05)


@pytest.mark.parametrize("mtbf", [0.0, -1.0])
def test_interval_refuses_bad_mtbf(mtbf: float) -> None:
    with pytest.raises(BenchError, match="MTBF"):
        checkpoint_interval_steps(0.1, mtbf, 0.1)


def test_schedule_spreads_failures_over_the_interval() -> None:
    k, n = 20, 5
    sched = failure_schedule(n, k, step_s=0.1, world=4, after_step=5, gap_s=3.0)
    assert len(sched) == n
    offsets = [f["step"] % k for f in sched]  # steps completed since the checkpoint
    assert offsets == sorted(offsets) and len(set(offsets)) == n
    assert all(1 <= f["step"] - (f["step"] - 1) // k * k <= k for f in sched)
    # the median loss is half an interval: the expectation for failures uniform in time
    assert statistics.median(offsets) == pytest.approx(k / 2, abs=1)
    assert [f["rank"] for f in sched] == [1, 2, 3, 0, 1]  # rotating: shadows re-warm
    assert sched[0]["step"] > 5
    gaps = [b["step"] - a["step"] for a, b in zip(sched, sched[1:], strict=False)]
    assert min(gaps) >= 30 - k  # 3 s of 0.1 s steps between failures, less one interval


def test_schedule_same_for_the_same_inputs_and_checked() -> None:
    a = failure_schedule(3, 7, step_s=0.2, world=2, after_step=5, gap_s=1.0)
    assert a == failure_schedule(3, 7, step_s=0.2, world=2, after_step=5, gap_s=1.0)
    with pytest.raises(BenchError):
        failure_schedule(0, 7, step_s=0.2, world=2, after_step=5, gap_s=1.0)


def test_schedule_says_where_a_failure_strikes() -> None:
    fwd = failure_schedule(3, 7, step_s=0.2, world=2, after_step=5, gap_s=1.0)
    upd = failure_schedule(3, 7, step_s=0.2, world=2, after_step=5, gap_s=1.0, at="update")
    assert all("at" not in f for f in fwd)  # the default: after the forward pass
    assert [f["at"] for f in upd] == ["update"] * 3
    assert [(f["rank"], f["step"]) for f in upd] == [(f["rank"], f["step"]) for f in fwd]
    with pytest.raises(BenchError, match="forward, update, not 'backward'"):
        failure_schedule(3, 7, step_s=0.2, world=2, after_step=5, gap_s=1.0, at="backward")
