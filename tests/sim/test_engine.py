"""The event loop: accounting, escalation of overlapping failures, the spare pool."""

from __future__ import annotations

import numpy as np
import pytest

from leto.sim import engine, strategies, trace
from leto.sim.calibration import FailureClass
from leto.sim.params import SimParams
from leto.sim.spares import spare_waits


def make_trace(times: list[float], cls: list[int], nodes: list[int], horizon: float) -> trace.Trace:
    n = len(times)
    return trace.Trace(
        horizon_s=horizon,
        times=np.asarray(times, dtype=float),
        cls=np.asarray(cls, dtype=np.int8),
        node=np.asarray(nodes, dtype=np.int64),
        rank=np.zeros(n, dtype=np.int64),
        phase=np.full(n, 0.5),
        lag=np.full(n, 0.5),
        spare_wait_s=np.zeros(n),
    )


@pytest.mark.parametrize("gpus", [6, 1024, 131_072])
def test_every_second_is_accounted_for(gpus: int) -> None:
    params = SimParams(gpus=gpus, days=10.0)
    tr = trace.generate(params, 1)
    for name in strategies.STRATEGIES:
        out = engine.simulate(strategies.plan(name, params, tr), tr)
        assert out.productive_s + sum(out.lost_s.values()) == pytest.approx(tr.horizon_s, rel=1e-9)
        assert 0.0 < out.ettr < 1.0
        assert sum(out.tiers) == len(tr)


def test_without_failures_only_checkpoints_cost() -> None:
    params = SimParams(gpus=1024, days=1.0)
    tr = make_trace([], [], [], params.horizon_s)
    for name in strategies.STRATEGIES:
        plan = strategies.plan(name, params, tr)
        out = engine.simulate(plan, tr)
        if plan.periodic:
            cycle = plan.interval_s + plan.block_s
            full = params.horizon_s // cycle
            expected = (
                params.horizon_s
                - full * plan.block_s
                - max(0.0, params.horizon_s - full * cycle - plan.interval_s)
            )
        else:
            expected = params.horizon_s * plan.rate
        assert out.productive_s == pytest.approx(expected)


def test_second_node_loss_during_recovery_falls_to_disk() -> None:
    # Two nodes lost 5 s apart: with single tier-2 parity the core's coverage says
    # tier 3; the same two failures a day apart are each a tier-2 recovery.
    params = SimParams(gpus=64, days=2.0)
    loss = FailureClass.REPLACEMENT
    close = make_trace([3600.0, 3605.0], [loss, loss], [1, 5], params.horizon_s)
    out = engine.simulate(strategies.plan("leto", params, close), close)
    assert out.tiers == (0, 0, 1, 1)
    assert out.lost_s["restart"] > 0.0
    apart = make_trace([3600.0, 90000.0], [loss, loss], [1, 5], params.horizon_s)
    out = engine.simulate(strategies.plan("leto", params, apart), apart)
    assert out.tiers == (0, 0, 2, 0)
    # With two parity nodes, tier 2 survives both.
    two = SimParams(gpus=64, days=2.0, tier2_parity=2)
    out = engine.simulate(strategies.plan("leto", two, close), close)
    assert out.tiers == (0, 0, 2, 0)


def test_memory_losses_in_one_node_escalate_to_tier_2() -> None:
    params = SimParams(gpus=64, days=1.0)
    mem = FailureClass.DEVICE_MEMORY
    tr = make_trace([1000.0, 1010.0], [mem, mem], [3, 3], params.horizon_s)
    tr.rank[:] = [0, 1]
    out = engine.simulate(strategies.plan("leto", params, tr), tr)
    assert out.tiers == (0, 1, 1, 0)
    tr.node[:] = [3, 4]  # different nodes: tier 1 rebuilds each
    out = engine.simulate(strategies.plan("leto", params, tr), tr)
    assert out.tiers == (0, 2, 0, 0)


def test_a_failure_during_recovery_restarts_it() -> None:
    params = SimParams(gpus=1024, days=1.0)
    hof = FailureClass.IN_PLACE
    tr = make_trace([1000.0, 1100.0], [hof, hof], [0, 1], params.horizon_s)
    plan = strategies.plan("ckpt-sync", params, tr)
    restart = params.detect_s + params.restart_s + params.ckpt_read_s
    out = engine.simulate(plan, tr)
    # The first restart ran 100 s before the second failure cut it short.
    assert out.lost_s["restart"] == pytest.approx(
        100.0 * params.restart_s / restart + params.restart_s
    )


def test_spare_pool_waits() -> None:
    times = np.asarray([0.0, 10.0, 20.0, 30.0])
    takes = np.asarray([True, True, False, True])
    back = np.asarray([100.0, 100.0, 100.0, 5.0])
    # One spare: the first failure takes it; the second waits for the first node to come
    # back (t=100); the fourth waits for itself (a 5 s reboot) since none is free.
    waits = spare_waits(times, takes, back, 1)
    assert waits.tolist() == [0.0, 90.0, 0.0, 5.0]
    assert spare_waits(times, takes, back, 3).tolist() == [0.0, 0.0, 0.0, 0.0]
