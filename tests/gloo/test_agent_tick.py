"""The agent's timer period: slow in steady training, fast while something is settling."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from leto.backends.gloo.supervisor import Supervisor


def _supervisor(hang_timeout: float, *, recovering: bool = False, dead: bool = False) -> Supervisor:
    procs = {1: SimpleNamespace(dead_at=None), 2: SimpleNamespace(dead_at=5.0 if dead else None)}
    agent = SimpleNamespace(
        recovering=recovering, by_pid=procs, o=SimpleNamespace(hang_timeout=hang_timeout)
    )
    return Supervisor(agent)  # type: ignore[arg-type]


@pytest.mark.parametrize(("hang", "period"), [(10.0, 0.25), (3.0, 0.15), (0.5, 0.05)])
def test_steady_training_ticks_a_twentieth_of_the_hang_timeout(hang: float, period: float) -> None:
    assert _supervisor(hang).tick_period() == pytest.approx(period)


def test_an_exit_being_settled_or_a_recovery_ticks_every_50_ms() -> None:
    assert _supervisor(10.0, dead=True).tick_period() == 0.05
    assert _supervisor(10.0, recovering=True).tick_period() == 0.05
