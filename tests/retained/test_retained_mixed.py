"""Mixed precision in the tensor layer: float32 master weights for bf16/fp16 parameters
(and models that mix dtypes), the model's parameters derived from them, and module
buffers as process state.

The reference for master weights is the field's recipe written by hand: a float32
copy of every parameter, torch's optimizer on the copies with the low-precision
gradients cast up, the model's parameters the copies cast down after each step.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leto.retained.layout import (
    InMemorySegments,
    LayoutError,
    RetainedLayout,
    ShapeMismatchError,
    master_dtype,
)
from leto.retained.optim import retain
from leto.retained.process_state import ProcessStateError, capture_buffers, restore_buffers

X = torch.randn(16, 3, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(2))


def model(first: torch.dtype = torch.bfloat16, second: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    m[0].to(first)
    m[2].to(second)
    return m


def loss(m: nn.Module) -> torch.Tensor:
    h = torch.tanh(m[0](X.to(m[0].weight.dtype)))
    return F.cross_entropy(m[2](h.to(m[2].weight.dtype)).float(), Y)


OPTS: dict[str, Any] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01),  # the generic path
}


def by_hand(m: nn.Module, make: Any, steps: int) -> list[torch.Tensor]:
    """The recipe by hand; returns the float32 master weights."""
    master = [p.detach().float().clone().requires_grad_() for p in m.parameters()]
    opt = make(master)
    for _ in range(steps):
        for p in m.parameters():
            p.grad = None
        loss(m).backward()
        for mp, p in zip(master, m.parameters(), strict=True):
            mp.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for mp, p in zip(master, m.parameters(), strict=True):
                p.copy_(mp)
    return [mp.detach() for mp in master]


@pytest.mark.parametrize("opt", sorted(OPTS))
@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
    ],
    ids=["bf16", "bf16+fp32", "fp16+fp32"],
)
def test_master_weights_are_the_recipe_by_hand_bitwise(
    opt: str, dtypes: tuple[torch.dtype, torch.dtype]
) -> None:
    ref = model(*dtypes)
    master = by_hand(ref, OPTS[opt], 4)
    m = model(*dtypes)
    ro = retain(
        m, OPTS[opt](list(m.parameters())), chunk_numel=8, master_weights=True, align_bytes=4
    )
    lay = ro.layout
    assert lay.dtype == torch.float32
    assert [p.dtype for p in m.parameters()] == [dtypes[0]] * 2 + [dtypes[1]] * 2
    for _ in range(4):
        ro.zero_grad()
        loss(m).backward()
        ro.step()
    for i, (p, q, mp) in enumerate(zip(m.parameters(), ref.parameters(), master, strict=True)):
        assert p.dtype == q.dtype and torch.equal(p, q), f"parameter {i}"
        assert torch.equal(lay.param_view(i), mp), f"master {i}"
    for i, p in enumerate(lay.params):  # fp32 parameters are views; the others derived
        assert (p.data_ptr() == lay.param_view(i).data_ptr()) == (i not in lay.derived)


def test_an_fp32_model_is_as_without_master_weights() -> None:
    """No derived parameter, the same meta bytes and the same bytes after training."""
    outs = []
    for mw in (False, True):
        m = model(torch.float32)
        store = InMemorySegments()
        ro = retain(
            m, OPTS["adamw"](list(m.parameters())), chunk_numel=8, alloc=store, master_weights=mw
        )
        assert ro.layout.derived == ()
        for _ in range(3):
            ro.zero_grad()
            loss(m).backward()
            ro.step()
        outs.append((store.segments["leto.meta"].clone(), ro.layout.param_buffer.clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_master_dtype_and_bad_arguments() -> None:
    assert master_dtype([torch.bfloat16, torch.float16]) == torch.float32
    assert master_dtype([torch.bfloat16, torch.float64]) == torch.float64
    with pytest.raises(
        LayoutError, match=r"^parameter '2\.weight' has dtype torch\.float32.*master_weights=True"
    ):
        RetainedLayout.create(model(), chunk_numel=8)
    with pytest.raises(LayoutError, match="^master_weights must be true or false, got 'yes'$"):
        RetainedLayout.create(model(), chunk_numel=8, master_weights="yes")  # type: ignore[arg-type]
    plain = RetainedLayout.create(model(torch.bfloat16, torch.bfloat16), chunk_numel=8)
    assert plain.dtype == torch.bfloat16 and plain.derived == ()  # as before: bf16 buffers


def test_attach_derives_and_checks_dtypes() -> None:
    m = model()
    store = InMemorySegments()
    ro = retain(
        m, OPTS["adamw"](list(m.parameters())), chunk_numel=8, alloc=store, master_weights=True
    )
    for _ in range(2):
        ro.zero_grad()
        loss(m).backward()
        ro.step()
    skel = model().to("meta")
    RetainedLayout.attach(skel, alloc=store)
    for p, q in zip(skel.parameters(), m.parameters(), strict=True):
        assert p.device.type == "cpu" and p.dtype == q.dtype and torch.equal(p, q)
    wrong = model(torch.float32).to("meta")
    with pytest.raises(ShapeMismatchError, match=r"'0\.weight'.*torch\.float32.*bfloat16"):
        RetainedLayout.attach(wrong, alloc=store)


def test_a_rolled_back_step_leaves_the_derived_parameters_committed() -> None:
    m = model()
    ro = retain(m, OPTS["adamw"](list(m.parameters())), chunk_numel=8, master_weights=True)
    lay = ro.layout
    ro.zero_grad()
    loss(m).backward()
    ro.step()
    before = [p.detach().clone() for p in m.parameters()]
    master = lay.param_buffer.clone()
    ro.zero_grad()
    loss(m).backward()
    ro.prepare(2)
    ro.begin(2)
    ro.save_undo(0)
    ro.apply_chunk(0)  # chunk 0 holds new bytes: APPLIED, its undo copy kept
    assert not torch.equal(lay.param_buffer, master)
    ro.roll_back()
    assert torch.equal(lay.param_buffer, master)
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before, strict=True))
    ps = json.loads(json.dumps(ro.process_state()))
    lay.param_view(0).add_(1.0)  # the master moves (a repair), then the state is loaded
    lay.seal_all(1)
    ro.load_process_state(ps)
    assert torch.equal(m[0].weight, lay.param_view(0).to(torch.bfloat16))


def test_derived_gradients_follow_torch_s_none_rule() -> None:
    m = model()
    ro = retain(m, OPTS["sgd"](list(m.parameters())), chunk_numel=8, master_weights=True)
    lay = ro.layout
    loss(m).backward()
    g = m[0].weight.grad
    assert g is not None and g.dtype == torch.bfloat16
    assert lay.grads.collect() == [True] * 4
    assert torch.equal(lay.grad_view(0), g.float())  # cast up exactly
    ro.zero_grad(set_to_none=False)
    assert m[0].weight.grad is not None and not m[0].weight.grad.any()
    assert lay.grads.collect()[:2] == [True, True]
    ro.zero_grad()
    assert m[0].weight.grad is None and lay.grads.collect() == [False] * 4


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def test_buffers_round_trip_exactly_through_json() -> None:
    a, b = bn_model(), bn_model()
    a(X)
    a(X * 2)
    state = json.loads(json.dumps(capture_buffers(a)))
    assert sorted(state) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    restore_buffers(b, state)
    for (n, x), (_, y) in zip(a.named_buffers(), b.named_buffers(), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), n
    assert capture_buffers(model()) == {}


def test_buffers_refuse_another_model_in_one_line() -> None:
    state = capture_buffers(bn_model())
    other = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(5), nn.Linear(5, 2))
    with pytest.raises(
        ProcessStateError, match=r"^buffer '1\.running_mean': retained torch\.float32 \(4,\)"
    ):
        restore_buffers(other, state)
    with pytest.raises(ProcessStateError, match="^the retained buffers .*first difference"):
        restore_buffers(model(), state)
