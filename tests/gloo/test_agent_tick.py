"""The agent's timer period: slow in steady training, fast while something is settling."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from leto.backends.gloo.agent import Agent


def _agent(hang_timeout: float, *, recovering: bool = False, dead: bool = False) -> object:
    procs = {1: SimpleNamespace(dead_at=None), 2: SimpleNamespace(dead_at=5.0 if dead else None)}
    return SimpleNamespace(
        recovering=recovering, by_pid=procs, o=SimpleNamespace(hang_timeout=hang_timeout)
    )


@pytest.mark.parametrize(("hang", "period"), [(10.0, 0.25), (3.0, 0.15), (0.5, 0.05)])
def test_steady_training_ticks_a_twentieth_of_the_hang_timeout(hang: float, period: float) -> None:
    assert Agent._tick_period(_agent(hang)) == pytest.approx(period)  # type: ignore[arg-type]


def test_an_exit_being_settled_or_a_recovery_ticks_every_50_ms() -> None:
    assert Agent._tick_period(_agent(10.0, dead=True)) == 0.05  # type: ignore[arg-type]
    assert Agent._tick_period(_agent(10.0, recovering=True)) == 0.05  # type: ignore[arg-type]
