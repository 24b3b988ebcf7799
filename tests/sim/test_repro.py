"""Seeds make runs reproducible; several seeds give a confidence interval."""

from __future__ import annotations

import io

import attrs

from leto.sim import experiment, sweep
from leto.sim.params import SimParams


def test_same_seed_same_result() -> None:
    params = SimParams(gpus=16_384, seeds=2, seed=7)
    a = experiment.run(params).as_dict()
    b = experiment.run(params).as_dict()
    assert a == b
    c = experiment.run(attrs.evolve(params, seed=8)).as_dict()
    assert c["ettr"] != a["ettr"]
    # Seed k of a run starting at s is trace s + k: runs overlap where their seeds do.
    d = experiment.run(attrs.evolve(params, seed=8, seeds=1))
    assert d.strategies["leto"].ettr_by_seed[0] == a["ettr_by_seed"]["leto"][1]


def test_confidence_interval_narrows_with_seeds() -> None:
    few = experiment.run(SimParams(gpus=16_384, days=10.0, seeds=3))
    many = experiment.run(SimParams(gpus=16_384, days=10.0, seeds=12))
    for name, r in many.strategies.items():
        assert 0.0 < r.ettr_ci95 < few.strategies[name].ettr_ci95 * 1.5
        # the mean of 3 seeds lies within the 12-seed interval widened by its own
        assert (
            abs(few.strategies[name].ettr - r.ettr) < r.ettr_ci95 + few.strategies[name].ettr_ci95
        )
    assert experiment.run(SimParams(gpus=72, seeds=1)).strategies["leto"].ettr_ci95 == 0.0


def test_twenty_point_sweep() -> None:
    result = sweep.run_sweep(SimParams(), "gpus", progress=False)
    assert len(result.values) == 20
    assert result.values[0] == 6 and result.values[-1] == 131_072


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_on_a_terminal_only() -> None:
    term = _Terminal()
    bar = sweep.Progress(2, "sweep gpus", term)
    bar.advance("gpus=6")
    bar.advance("gpus=72")
    out = term.getvalue()
    assert "1/2" in out and "2/2" in out and out.endswith("\n") and "#" * 30 in out
    pipe = io.StringIO()
    quiet = sweep.Progress(2, "sweep gpus", pipe)
    quiet.advance()
    assert pipe.getvalue() == ""
