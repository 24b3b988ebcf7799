"""ETTR falls as the failure rate rises, for every strategy."""

from __future__ import annotations

from leto.sim import experiment
from leto.sim.params import SimParams
from leto.sim.strategies import STRATEGIES


def test_ettr_falls_as_failure_rate_rises() -> None:
    mtbfs = [50.0, 10.0, 2.0, 0.5, 0.1]  # hours, falling: the failure rate rises
    runs = [experiment.run(SimParams(gpus=16_384, mtbf_hours=m, days=30.0, seeds=2)) for m in mtbfs]
    for name in STRATEGIES:
        ettrs = [r.strategies[name].ettr for r in runs]
        assert all(a > b for a, b in zip(ettrs, ettrs[1:], strict=False)), (name, ettrs)
    # ... and falls a lot for checkpoint/restart at 6-minute MTBF, much less for leto.
    last = runs[-1].strategies
    assert last["ckpt-sync"].ettr < 0.5
    assert last["leto"].ettr > last["ckpt-sync"].ettr + 0.3


def test_ettr_rises_with_the_hof_fraction_for_leto_only() -> None:
    runs = [
        experiment.run(SimParams(gpus=131_072, hof_fraction=h, seeds=2)) for h in (0.2, 0.5, 0.8)
    ]
    leto = [r.strategies["leto"].ettr for r in runs]
    assert leto[0] < leto[1] < leto[2]
    # Checkpoint/restart pays the same restart whatever the failure destroyed; only the
    # GPU-reset and spare waits differ, so its ETTR barely moves.
    sync = [r.strategies["ckpt-sync"].ettr for r in runs]
    assert max(sync) - min(sync) < 0.01
