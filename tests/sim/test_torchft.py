"""torchft in the simulator: a group heals from a live peer while the others train on."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from leto.sim import engine, strategies, trace
from leto.sim.params import SimParams

BASE = SimParams(gpus=1024, days=10, mtbf_hours=2.0, seeds=1)


def _run(p: SimParams, seed: int = 0) -> tuple[engine.Outcome, trace.Trace]:
    tr = trace.generate(p, seed)
    return engine.simulate(strategies.torchft(p, tr), tr), tr


def test_a_free_heal_loses_only_the_step_in_flight() -> None:
    p = attrs.evolve(
        BASE,
        detect_s=0.0,
        gpu_reset_s=0.0,
        spare_join_s=0.0,
        spares=10_000,
        torchft_restart_s=0.0,
        torchft_quorum_s=0.0,
        torchft_heal_gb_s=1e9,
        ckpt_fixed_s=0.0,
        host_gb_s=1e9,
    )
    out, tr = _run(p)
    assert len(tr) > 50
    assert out.tiers[0] == len(tr)
    recovery = {k: v for k, v in out.lost_s.items() if k not in ("rework", "checkpoint")}
    assert sum(recovery.values()) == pytest.approx(0.0, abs=1e-3)
    assert out.lost_s["rework"] == pytest.approx(float(np.sum(tr.phase)) * p.step_time_s, rel=1e-9)
    lost = out.lost_s["rework"] + out.lost_s.get("checkpoint", 0.0)
    assert out.ettr == pytest.approx(1.0 - lost / tr.horizon_s, abs=1e-9)


def test_more_groups_lose_less() -> None:
    ettr = [_run(attrs.evolve(BASE, torchft_groups=g))[0].ettr for g in (2, 4, 16, 64)]
    assert ettr == sorted(ettr) and ettr[0] < ettr[-1] - 0.005, ettr


def test_a_heal_is_charged_at_the_share_the_survivors_do_not_train() -> None:
    p = attrs.evolve(BASE, torchft_groups=4)
    tr = trace.generate(p, 0)
    plan = strategies.torchft(p, tr)
    stopped = strategies.torchft(attrs.evolve(p, torchft_survivors=0.0), tr)
    for phase in ("detect", "group restart", "quorum", "heal"):
        assert np.allclose(plan.phases[phase][0], 0.25 * stopped.phases[phase][0]), phase
    assert stopped.phases["quorum"][0][0] == p.torchft_quorum_s
    assert plan.phases["heal"][0][0] == pytest.approx(0.25 * p.torchft_heal_s)
    # measured survivors at 2% of steady: nearly the whole heal is lost
    slow = strategies.torchft(attrs.evolve(p, torchft_survivors=0.02), tr)
    assert slow.phases["heal"][0][0] == pytest.approx(0.98 * p.torchft_heal_s)


@pytest.mark.parametrize("job", [{"torchft_groups": 1}, {"gpus": 8, "mtbf_hours": 0.5}])
def test_one_group_has_no_peer_to_heal_from(job: dict[str, int]) -> None:
    p = attrs.evolve(BASE, **job)
    assert p.torchft_replicas == 1  # a one-node job holds one group, whatever is asked
    out, tr = _run(p)
    assert len(tr) > 10
    assert out.tiers[strategies.FALLBACK] == len(tr) and out.tiers[0] == 0
    assert "restart" in out.lost_s and "heal" not in out.lost_s


def test_the_accounting_adds_up() -> None:
    out, tr = _run(BASE)
    assert out.productive_s + sum(out.lost_s.values()) == pytest.approx(tr.horizon_s, rel=1e-9)
