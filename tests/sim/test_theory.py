"""The checkpoint/restart strategies against closed-form theory, where it holds."""

from __future__ import annotations

import pytest

from leto.sim import experiment, strategies, theory, trace
from leto.sim.params import SimParams

# Every failure costs the same restart (all in place: no GPU reset, no spare wait), the
# MTBF (10 h) is far above the checkpoint cost (~2 s) and the restart (~5 min), and a
# year of failures keeps the noise well under the tolerance: Young's regime.
REGIME = SimParams(gpus=1024, hof_fraction=1.0, mtbf_hours=10.0, days=365.0, seeds=4)


@pytest.fixture(scope="module")
def result() -> experiment.Result:
    return experiment.run(REGIME, ["ckpt-sync", "ckpt-async"])


def _plan(name: str) -> strategies.Plan:
    return strategies.plan(name, REGIME, trace.generate(REGIME, 0))


def restart_s(p: SimParams) -> float:
    return p.detect_s + p.restart_s + p.ckpt_read_s


def test_sync_matches_first_order_model(result: experiment.Result) -> None:
    plan = _plan("ckpt-sync")
    predicted = theory.ettr_first_order(
        plan.interval_s, plan.block_s, restart_s(REGIME), REGIME.mtbf_s
    )
    simulated = result.strategies["ckpt-sync"].ettr
    assert abs(simulated - predicted) < 0.01
    assert 0.95 < simulated < 0.995  # the regime is not trivial: failures do cost


def test_sync_matches_exact_model_closely(result: experiment.Result) -> None:
    plan = _plan("ckpt-sync")
    exact = theory.ettr_exact(plan.interval_s, plan.block_s, restart_s(REGIME), REGIME.mtbf_s)
    r = result.strategies["ckpt-sync"]
    assert abs(r.ettr - exact) < max(0.001, 3 * r.ettr_ci95)


def test_async_matches_first_order_model(result: experiment.Result) -> None:
    # Async: only the snapshot blocks, but a failure also loses the write in flight.
    plan = _plan("ckpt-async")
    predicted = theory.ettr_first_order(
        plan.interval_s, plan.block_s, restart_s(REGIME) + plan.commit_lag_s, REGIME.mtbf_s
    )
    assert abs(result.strategies["ckpt-async"].ettr - predicted) < 0.01


def test_interval_is_daly_optimum() -> None:
    plan = _plan("ckpt-sync")
    assert plan.interval_s == pytest.approx(theory.daly_interval(plan.block_s, REGIME.mtbf_s))
    best = theory.ettr_exact(plan.interval_s, plan.block_s, restart_s(REGIME), REGIME.mtbf_s)
    for factor in (0.5, 2.0):
        other = theory.ettr_exact(
            plan.interval_s * factor, plan.block_s, restart_s(REGIME), REGIME.mtbf_s
        )
        assert other < best


def test_daly_formulas() -> None:
    assert theory.young_interval(2.0, 3600.0) == pytest.approx(120.0)
    # Daly's correction is small when C << M and caps the interval at M beyond C >= 2M.
    assert theory.daly_interval(2.0, 3600.0) == pytest.approx(
        120.0 * (1 + (2.0 / 7200.0) ** 0.5 / 3 + 2.0 / 7200.0 / 9) - 2.0
    )
    assert theory.daly_interval(10.0, 4.0) == 4.0


def test_first_order_breaks_down_outside_its_regime() -> None:
    # With a restart as long as the MTBF the first-order model is far off the exact one:
    # the tests above rely on being inside the regime.
    exact = theory.ettr_exact(600.0, 60.0, 3600.0, 3600.0)
    first = theory.ettr_first_order(600.0, 60.0, 3600.0, 3600.0)
    assert abs(exact - first) > 0.1
