"""The parallel replay's arithmetic (gloo's replay.py), in one process: micro-batch
gradients computed apart with torch.autograd.grad and added in order are bitwise the
gradients that backward accumulates in .grad; added in another order they are not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leto.backends.gloo.replay import DrewRandom, Replayer, accumulate, micro
from leto.core.replay import ReplayPlan

K = 4


def _setup(dropout: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(3)
    layers: list[nn.Module] = [nn.Linear(16, 64), nn.Tanh()]
    if dropout:
        layers.append(nn.Dropout(0.5))
    model = nn.Sequential(*layers, nn.Linear(64, 4))
    idx = torch.arange(32)
    return model, idx


X = torch.randn(32, 16, generator=torch.Generator().manual_seed(1)) * 1e3
Y = torch.randn(32, 4, generator=torch.Generator().manual_seed(2))


def step_fn(m: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(m(X[idx]), Y[idx]) / K


def _replayed(model: nn.Module, idx: torch.Tensor, order: tuple[int, ...]) -> list[torch.Tensor]:
    params = list(model.parameters())
    offsets, off = [], 0
    for p in params:
        offsets.append((off, p.numel()))
        off += p.numel()
    width = off + len(params) + 1
    # every micro-batch computed by "rank 0" of a one-rank world, rows in micro-batch order
    plan = ReplayPlan(owner=0, world=1, micro_batches=K, computers=(0,) * K)
    rows = Replayer.compute(
        plan, 0, model, params, step_fn, micro(idx, K), width, torch.float32, offsets
    )
    # a plan whose order is another: the same rows, added as `order` says
    shuffled = [rows[i] for i in order]
    gathered = [torch.stack(shuffled)]
    Replayer.add_in_order(plan, gathered, params, offsets)
    return [p.grad.clone() for p in params]  # type: ignore[union-attr]


def test_in_order_is_bitwise_the_accumulated_backward_and_out_of_order_is_not() -> None:
    model, idx = _setup()
    for p in model.parameters():
        p.grad = None
    accumulate(model, step_fn, micro(idx, K), check_rng=True)
    reference = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    for p in model.parameters():
        p.grad = None
    in_order = _replayed(model, idx, (0, 1, 2, 3))
    assert all(torch.equal(a, b) for a, b in zip(in_order, reference, strict=True))
    reversed_ = _replayed(model, idx, (3, 2, 1, 0))
    assert not all(torch.equal(a, b) for a, b in zip(reversed_, reference, strict=True))
    # ... though it is the same sum up to rounding
    assert all(torch.allclose(a, b) for a, b in zip(reversed_, reference, strict=True))


def test_a_micro_batch_that_draws_random_numbers_is_refused() -> None:
    model, idx = _setup(dropout=True)
    with pytest.raises(DrewRandom, match="set parallel_replay = false"):
        accumulate(model, step_fn, micro(idx, K), check_rng=True)
    model, idx = _setup(dropout=True)
    accumulate(model, step_fn, micro(idx, K), check_rng=False)  # the replay off: allowed
