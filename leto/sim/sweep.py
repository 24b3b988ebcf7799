"""Sweeps: one parameter varied, everything else held, every point on coupled traces.

Three sweeps have names and default ranges (20 points each): ``gpus`` (cluster size,
6 to 131,072 GPUs, geometric), ``hof`` (the fraction of failures recoverable in place,
0 to 0.95), and ``mtbf`` (the job's MTBF, 0.1 h to 100 h, geometric). Points use the
same seeds, so neighbouring points see coupled traces (see :mod:`leto.sim.trace`) and
the curves are smooth rather than noisy.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import attrs

from leto.sim import experiment
from leto.sim.params import SimInputError, SimParams
from leto.sim.strategies import STRATEGIES

# name -> (SimParams field, axis label, log axis)
SWEEPS: dict[str, tuple[str, str, bool]] = {
    "gpus": ("gpus", "GPUs in the job", True),
    "hof": ("hof_fraction", "fraction of failures recoverable in place (HOF)", False),
    "mtbf": ("mtbf_hours", "job MTBF (hours)", True),
}


def default_values(name: str) -> list[float]:
    import numpy as np

    if name == "gpus":
        pts = np.geomspace(6, 131_072, 20)
        return [float(int(round(x / 8.0) * 8)) if x > 64 else float(int(round(x))) for x in pts]
    if name == "hof":
        return [round(0.05 * i, 2) for i in range(20)]
    if name == "mtbf":
        return [float(x) for x in np.geomspace(0.1, 100.0, 20)]
    raise SimInputError(f"unknown sweep {name!r}; choose from {', '.join(SWEEPS)}")


class Progress:
    """A one-line progress bar on a terminal; silent when the stream is not one."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.total, self.label = total, label
        self.stream = sys.stderr if stream is None else stream
        self.live = self.stream.isatty()
        self.start = time.perf_counter()
        self.done = 0

    def advance(self, note: str = "") -> None:
        self.done += 1
        if not self.live:
            return
        width = 30
        filled = width * self.done // max(1, self.total)
        elapsed = time.perf_counter() - self.start
        bar = "#" * filled + "-" * (width - filled)
        self.stream.write(
            f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {note:<24}"
        )
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


@attrs.frozen
class SweepResult:
    name: str
    field: str
    values: tuple[float, ...]
    results: tuple[experiment.Result, ...]
    elapsed_s: float

    def series(self, strategy: str) -> tuple[list[float], list[float]]:
        """ETTR means and 95% half-widths of one strategy along the sweep."""
        rs = [r.strategies[strategy] for r in self.results]
        return [r.ettr for r in rs], [r.ettr_ci95 for r in rs]

    def as_dict(self) -> dict[str, Any]:
        names = list(self.results[0].strategies) if self.results else []
        return {
            "sweep": self.name,
            "param": self.field,
            "values": list(self.values),
            "ettr": {n: self.series(n)[0] for n in names},
            "ettr_ci95": {n: self.series(n)[1] for n in names},
            "elapsed_s": self.elapsed_s,
            "params": self.results[0].params.as_dict() if self.results else {},
        }


def run_sweep(
    base: SimParams,
    name: str,
    values: Sequence[float] | None = None,
    names: Sequence[str] = STRATEGIES,
    progress: bool = True,
) -> SweepResult:
    field = SWEEPS[name][0] if name in SWEEPS else None
    if field is None:
        raise SimInputError(f"unknown sweep {name!r}; choose from {', '.join(SWEEPS)}")
    vals = list(default_values(name) if values is None else values)
    if not vals:
        raise SimInputError("a sweep needs at least one value")
    bar = Progress(len(vals), f"sweep {name}") if progress else None
    start = time.perf_counter()
    results = []
    for v in vals:
        value: Any = int(v) if field == "gpus" else float(v)
        if field == "gpus" and value != v:
            raise SimInputError(f"gpus must be an integer, got {v}")
        params = attrs.evolve(base, **{field: value})
        results.append(experiment.run(params, names))
        if bar is not None:
            bar.advance(f"{name}={v:g}")
    return SweepResult(name, field, tuple(vals), tuple(results), time.perf_counter() - start)
