"""The one private torch method leto overwrites on the gloo path: ``GradScaler._unscale_grads_``
(:func:`leto.backends.gloo.step.install_unscale_grads`). A torch that renames it, changes
its arguments or stops calling it from ``unscale_`` fails here, by name."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from leto.backends.gloo.step import UserLoop, install_unscale_grads


def test_torch_s_grad_scaler_still_has_the_method_leto_replaces() -> None:
    mine = list(inspect.signature(UserLoop.unscale_grads).parameters)[1:]  # not self
    torch_s = list(inspect.signature(torch.amp.GradScaler._unscale_grads_).parameters)[1:]
    assert mine == torch_s == ["optimizer", "inv_scale", "found_inf", "allow_fp16"]
    assert "self._unscale_grads_(" in inspect.getsource(torch.amp.GradScaler.unscale_)


def test_the_installed_method_is_what_unscale_calls() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    calls: list[tuple[Any, ...]] = []

    def unscale(
        optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        calls.append((optimizer, float(inv_scale), allow_fp16))
        return {torch.device("cpu"): found_inf}

    install_unscale_grads(scaler, unscale)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    assert len(calls) == 1 and calls[0][0] is opt and calls[0][1] == 1 / scaler.get_scale()
    # another scaler is left alone (the method is set on the one object)
    assert torch.amp.GradScaler("cpu")._unscale_grads_ != unscale
