"""``leto bench overhead --batches B1,B2,...``: failure-free overhead against step time.

The overhead benchmark (:mod:`leto.bench.overhead`) at several batch sizes, plain DDP
against leto with its defaults, each size its own interleaved rounds. The batch sets
the step time (the forward and backward passes grow with it); leto's per-step work
(undo copy, checksums, tier-1 bookkeeping, the COMMIT round trip) grows with the state,
which every size shares. So leto's extra time per step is modelled as

    leto step - plain step = c + b * plain step

fitted by least squares over every round of every size: ``c`` (seconds) is leto's
fixed cost per step, ``b`` the part that scales with the step (work leto adds to the
passes themselves, or contention for the cores). The overhead at step time ``t`` is
then ``c / t + b``, and it is 2% at ``t = c / (0.02 - b)`` (never, if ``b >= 2%``).
Each size's own measured overhead and interval stay beside the fit.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from .overhead import run_overhead
from .workload import BenchError, Workload

__all__ = ["fit", "run_curve", "step_at"]

CURVE_CONFIGS = ("plain", "leto")
TARGET_PCT = 2.0


def fit(plain: Sequence[float], leto: Sequence[float]) -> tuple[float, float]:
    """``(c, b)`` of ``leto - plain = c + b * plain`` by least squares."""
    if len(plain) != len(leto) or len(set(plain)) < 2:
        raise BenchError("the fit needs paired step times at two different step times at least")
    slope, intercept = statistics.linear_regression(
        list(plain), [y - x for x, y in zip(plain, leto, strict=True)]
    )
    return intercept, slope


def step_at(pct: float, c: float, b: float) -> float | None:
    """The step time at which the fitted overhead ``c / t + b`` is ``pct`` percent;
    None where no step time gives it (the scaling part alone is already above it, or
    leto has no fixed cost and the scaling part is below it at every step time)."""
    room = pct / 100.0 - b
    if room <= 0 or c <= 0:
        return None
    return c / room


def run_curve(
    wls: Sequence[Workload],
    *,
    rounds: int = 3,
    periods: int = 2,
    tier2_interval: int = 10,
    warmup: int = 5,
    progress: bool = True,
) -> dict[str, Any]:
    """The overhead at each workload (the same model, different batches)."""
    if len({w.batch for w in wls}) < 2:
        raise BenchError("the overhead curve needs at least two different batch sizes")
    points: list[dict[str, Any]] = []
    plain_all: list[float] = []
    leto_all: list[float] = []
    for wl in sorted(wls, key=lambda w: w.batch):
        res = run_overhead(
            wl,
            rounds=rounds,
            periods=periods,
            tier2_interval=tier2_interval,
            warmup=warmup,
            configs=CURVE_CONFIGS,
            progress=progress,
        )
        runs = res["step_s_runs"]
        plain_all += runs["plain"]
        leto_all += runs["leto"]
        by_round = res["overhead_pct_by_round"]["leto"]
        points.append(
            {
                "batch": wl.batch,
                "plain_step_s": res["step_s"]["plain"],
                "leto_step_s": res["step_s"]["leto"],
                "overhead_pct": res["overhead_pct"],
                "overhead_pct_by_round": by_round,
                "overhead_pct_ci95": res["overhead_pct_ci95"]["leto"],
                "overhead_pct_median_round": res["overhead_pct_median_round"]["leto"],
                "step_s_runs": runs,
                "elapsed_s": res["elapsed_s"],
            }
        )
    c, b = fit(plain_all, leto_all)
    first = wls[0]
    return {
        "benchmark": "overhead-curve",
        "workload": {**first.as_dict(), "params": first.params, "label": first.label},
        "batches": [p["batch"] for p in points],
        "rounds": rounds,
        "steps_per_job": periods * tier2_interval,
        "warmup_steps": warmup,
        "tier2_interval": tier2_interval,
        "points": points,
        "fit": {"fixed_s": c, "scaling": b},
        "target_pct": TARGET_PCT,
        "step_s_at_target": step_at(TARGET_PCT, c, b),
        "overhead_pct_at_0_25_s": 100.0 * (c / 0.25 + b),
        "elapsed_s": sum(p["elapsed_s"] for p in points),
    }
