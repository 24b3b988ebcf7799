"""One experiment: every strategy on the same traces, over several seeds.

Seed ``k`` of a run with ``seed = s`` draws trace ``s + k``; every strategy sees the
same traces. With more than one seed the ETTR comes with a 95% confidence interval
(Student's t over the per-seed ETTRs).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import attrs

from leto.sim import engine, strategies, trace
from leto.sim.params import SimParams

# Two-sided 95% Student t quantiles by degrees of freedom (1..30); 1.96 beyond.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
        2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
        2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def ci95(values: Sequence[float]) -> float:
    """Half-width of the 95% confidence interval of the mean (0 for one value)."""
    if len(values) < 2:
        return 0.0
    dof = len(values) - 1
    t = _T95[dof - 1] if dof <= len(_T95) else 1.96
    return t * statistics.stdev(values) / math.sqrt(len(values))


@attrs.frozen
class StrategyResult:
    name: str
    ettr: float  # mean over seeds
    ettr_ci95: float
    ettr_by_seed: tuple[float, ...]
    lost_hours: dict[str, float]  # mean over seeds, by cause
    tiers: tuple[int, ...]  # failures handled at each tier, summed over seeds
    ckpt_interval_s: float


@attrs.frozen
class Result:
    params: SimParams
    strategies: dict[str, StrategyResult]
    failures: tuple[int, ...]  # per seed

    def ettr(self) -> dict[str, float]:
        return {name: r.ettr for name, r in self.strategies.items()}

    def as_dict(self) -> dict[str, Any]:
        return {
            "ettr": self.ettr(),
            "ettr_ci95": {name: r.ettr_ci95 for name, r in self.strategies.items()},
            "ettr_by_seed": {name: list(r.ettr_by_seed) for name, r in self.strategies.items()},
            "lost_hours": {name: r.lost_hours for name, r in self.strategies.items()},
            "tiers": {name: list(r.tiers) for name, r in self.strategies.items()},
            "ckpt_interval_s": {name: r.ckpt_interval_s for name, r in self.strategies.items()},
            "failures": list(self.failures),
            "params": self.params.as_dict(),
        }


def run(params: SimParams, names: Sequence[str] = strategies.STRATEGIES) -> Result:
    outcomes: dict[str, list[engine.Outcome]] = {name: [] for name in names}
    failures = []
    for k in range(params.seeds):
        tr = trace.generate(params, params.seed + k)
        failures.append(len(tr))
        for name in names:
            outcomes[name].append(engine.simulate(strategies.plan(name, params, tr), tr))
    results = {}
    for name, outs in outcomes.items():
        ettrs = tuple(o.ettr for o in outs)
        causes = sorted({c for o in outs for c in o.lost_s})
        lost = {c: sum(o.lost_s.get(c, 0.0) for o in outs) / len(outs) / 3600.0 for c in causes}
        tiers = tuple(sum(o.tiers[i] for o in outs) for i in range(strategies.TIERS))
        results[name] = StrategyResult(
            name=name,
            ettr=statistics.fmean(ettrs),
            ettr_ci95=ci95(ettrs),
            ettr_by_seed=ettrs,
            lost_hours=lost,
            tiers=tiers,
            ckpt_interval_s=outs[0].interval_s,
        )
    return Result(params=params, strategies=results, failures=tuple(failures))
