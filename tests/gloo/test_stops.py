"""Stop points: a recovery stops the step's forward or backward at the next layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leto.backends.gloo.stops import StopPoints


class Stop(Exception):
    pass


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _after(model: nn.Module, n: int, flag: list[bool], where: str) -> list[int]:
    """Raise ``flag`` after the n-th layer's forward (or backward) ran; count the layers run."""
    ran: list[int] = []
    layers = [m for m in model if isinstance(m, nn.Linear)]
    for i, m in enumerate(layers):
        if where == "forward":

            def hook(mod: nn.Module, args: object, out: object, i: int = i) -> None:
                ran.append(i)
                if len(ran) == n:
                    flag[0] = True

            m.register_forward_hook(hook)
        else:

            def bhook(g: torch.Tensor, i: int = i) -> None:
                ran.append(i)
                if len(ran) == n:
                    flag[0] = True

            m.weight.register_post_accumulate_grad_hook(lambda p, i=i: bhook(p, i))
    return ran


def test_a_recovery_stops_the_forward_at_the_next_layer() -> None:
    model, flag = _model(), [False]
    stops = StopPoints(model, lambda: flag[0], Stop)
    ran = _after(model, 1, flag, "forward")
    with pytest.raises(Stop), stops.armed():
        model(torch.randn(4, 8)).sum().backward()
    assert ran == [0]  # the second and third layers never ran


def test_a_recovery_stops_the_backward_at_the_next_layer() -> None:
    model, flag = _model(), [False]
    stops = StopPoints(model, lambda: flag[0], Stop)
    ran = _after(model, 1, flag, "backward")
    with pytest.raises(Stop), stops.armed():
        model(torch.randn(4, 8)).sum().backward()
    assert ran == [2]  # the last layer's gradient only: the first two were never computed
    assert model[0].weight.grad is None and model[2].weight.grad is None


def test_nothing_stops_outside_the_armed_compute_or_without_a_recovery() -> None:
    model, flag = _model(), [True]
    stops = StopPoints(model, lambda: flag[0], Stop)
    model(torch.randn(4, 8)).sum().backward()  # not armed: an evaluation, the user's loop
    flag[0] = False
    with stops.armed():
        model(torch.randn(4, 8)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert not stops.on


def test_the_step_runs_alike_with_stop_points() -> None:
    """The hooks change no value: the same gradients with and without them."""
    x = torch.randn(4, 8)
    plain, hooked = _model(), _model()
    stops = StopPoints(hooked, lambda: False, Stop)
    plain(x).sum().backward()
    with stops.armed():
        hooked(x).sum().backward()
    for a, b in zip(plain.parameters(), hooked.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_a_pause_that_returns_lets_the_compute_go_on_unchanged() -> None:
    """The recovery carried out inside the backward; the compute goes on, and its
    gradients are those of a compute never paused. Nothing the pause runs is stopped."""
    x = torch.randn(4, 8)
    plain, paused = _model(), _model()
    plain(x).sum().backward()
    flag = [False]
    stops = StopPoints(paused, lambda: flag[0], Stop)
    seen: list[bool] = []

    def pause() -> None:
        seen.append(stops.on)  # disarmed: a forward run here is not stopped
        paused(torch.randn(2, 8))
        flag[0] = False  # the recovery is over

    stops.pause = pause
    ran = _after(paused, 1, flag, "backward")
    with stops.armed():
        paused(x).sum().backward()
    assert seen == [False] and ran == [2, 1, 0] and stops.on is False
    for a, b in zip(plain.parameters(), paused.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_a_pause_that_raises_voids_the_compute() -> None:
    model, flag = _model(), [False]
    stops = StopPoints(model, lambda: flag[0], Stop)

    def pause() -> None:
        raise Stop("the core did not keep it")

    stops.pause = pause
    ran = _after(model, 1, flag, "forward")
    with pytest.raises(Stop, match="did not keep"), stops.armed():
        model(torch.randn(4, 8)).sum().backward()
    assert ran == [0] and not stops.on


def test_every_layer_passed_ticks_while_armed() -> None:
    """Progress for the agent's hang check at every layer of the forward and backward
    (six: three layers' forwards, then their three backwards), none outside the armed
    compute."""
    model, ticks = _model(), [0]
    stops = StopPoints(model, lambda: False, Stop)

    def tick() -> None:
        ticks[0] += 1

    stops.tick = tick
    model(torch.randn(4, 8)).sum().backward()
    assert ticks == [0]
    with stops.armed():
        model(torch.randn(4, 8)).sum().backward()
    assert ticks == [6]
