"""Closed forms for checkpoint/restart: the optimal interval and the ETTR it gives.

* Young (1974): ``T* = sqrt(2 C M)`` for checkpoint cost ``C`` and MTBF ``M``.
* Daly (2006): ``T* = sqrt(2 C M) [1 + sqrt(C/(2M))/3 + C/(18 M)] - C`` for ``C < 2M``,
  else ``T* = M``.
* First-order ETTR (Young's model): a fraction ``C/(T+C)`` of running time goes to
  checkpoints, and each failure (one per ``M`` of wall-clock time) costs the restart
  ``R`` plus, on average, half a checkpoint cycle of lost work:
  ``ETTR ~ T/(T+C) * (1 - (R + (T+C)/2) / M)``. It holds while ``C, R, T << M``.
* Exact ETTR for Poisson failures that also strike during restarts (Daly's complete
  model): a cycle of ``T + C`` survives with probability ``e^{-(T+C)/M}``, and the
  expected wall time to complete it is ``M e^{R/M} (e^{(T+C)/M} - 1)``.

The simulator's checkpoint/restart strategies are tested against both.
"""

from __future__ import annotations

import math


def young_interval(cost_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum of the compute time between checkpoints."""
    if cost_s <= 0.0:
        return 0.0
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s


def ettr_first_order(interval_s: float, cost_s: float, restart_s: float, mtbf_s: float) -> float:
    cycle = interval_s + cost_s
    return interval_s / cycle * (1.0 - (restart_s + cycle / 2.0) / mtbf_s)


def ettr_exact(interval_s: float, cost_s: float, restart_s: float, mtbf_s: float) -> float:
    cycle = interval_s + cost_s
    wall = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1(cycle / mtbf_s)
    return interval_s / wall
