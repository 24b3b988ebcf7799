"""The mesh-aware layout (leto.retained.dtensor_layout) on one rank, in this process: its
shape, attaching, and what it cannot bind refused in one line naming the part. The
bitwise comparison with plain FSDP2 on 4 ranks is test_dtensor_layout_ranks.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dtensor_cases import build, one_rank_group
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from leto.retained import dtensor_layout as dl
from leto.retained import torch_private as private
from leto.retained.alloc import InMemorySegments
from leto.retained.errors import LayoutError, ShapeMismatchError

# --- one rank, in this process ---------------------------------------------------------


@pytest.fixture
def mesh() -> Any:
    with one_rank_group() as m:
        yield m


def test_the_layout_is_deterministic_aligned_and_in_fsdp_params_order(mesh: Any) -> None:
    a, b = dl.plan_layout(build("fsdp", mesh)), dl.plan_layout(build("fsdp", mesh))
    assert a == b
    assert [g.module for g in a.groups] == ["", "layers.0", "layers.1"]
    assert [s.fqn for s in a.groups[1].slots] == [
        "layers.0.w1.weight",
        "layers.0.w1.bias",
        "layers.0.w2.weight",
        "layers.0.w2.bias",
    ]
    step = dl.ALIGN_BYTES // a.dtype.itemsize
    assert all(g.offset % step == 0 for g in a.groups)
    ends = [s.offset + s.numel for s in a.slots()]
    starts = [s.offset for s in a.slots()]
    assert all(start >= end for start, end in zip(starts[1:], ends[:-1], strict=True))
    assert a.numel >= ends[-1] and a.numel % step == 0


def test_attach_rebinds_a_new_model_to_the_bytes_already_there(mesh: Any) -> None:
    segs = InMemorySegments()
    m0 = build("fsdp", mesh)
    opt0 = torch.optim.Adam(m0.parameters(), lr=0.1)
    dl.bind(m0, opt0, segs)
    m0(torch.ones(2, 8)).sum().backward()
    opt0.step()
    m1 = build("fsdp", mesh)  # fresh weights, then attached to the trained bytes
    opt1 = torch.optim.Adam(m1.parameters(), lr=0.1)
    dl.bind(m1, opt1, segs, fresh=False)
    for (n, p0), p1 in zip(m0.named_parameters(), m1.parameters(), strict=True):
        assert torch.equal(p0.to_local(), p1.to_local()), n
        assert p0.to_local().data_ptr() == p1.to_local().data_ptr(), n
        assert torch.equal(
            opt0.state[p0]["exp_avg"].to_local(), opt1.state[p1]["exp_avg"].to_local()
        )


def test_a_buffer_of_the_wrong_size_or_a_different_model_is_refused(mesh: Any) -> None:
    model = build("fsdp", mesh)
    layout = dl.plan_layout(model)
    with pytest.raises(LayoutError, match=r"^the parameter buffer has 8 bytes, \d+ needed$"):
        dl.bind_params(model, layout, torch.zeros(8, dtype=torch.uint8))
    other = dl.DTensorLayout(layout.dtype, layout.numel, layout.groups[:2])
    with pytest.raises(ShapeMismatchError, match="the model has 3 FSDP param groups, the layout 2"):
        dl.bind_params(model, other, torch.zeros(layout.numel))


def refusal(model: torch.nn.Module) -> str:
    with pytest.raises(dl.UnsupportedParallelismError) as e:
        dl.plan_layout(model)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_what_cannot_be_bound_without_a_copy_is_refused_naming_the_part(
    mesh: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # reduces in bf16
    assert refusal(build("fsdp", mesh, mp=bf16)) == (
        "the root module reduces gradients in torch.bfloat16 unlike its parameters'"
        " torch.float32: FSDP2 casts them into a new tensor (a copy);"
        " set MixedPrecisionPolicy(reduce_dtype=torch.float32)"
    )
    assert refusal(build("fsdp", mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))) == (
        "the root module has a CPUOffloadPolicy: FSDP2 computes on host copies of its"
        " shards, which cannot be bound"
    )
    loose = build("fsdp", mesh)
    loose.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))
    assert refusal(loose) == "parameter 'extra' is not managed by fully_shard"
    assert refusal(torch.nn.Linear(2, 2)) == "no parameter of the model is managed by fully_shard"
    mixed = build("fsdp", mesh)
    mixed.layers[1].double()  # FSDP2 re-pads the cast shards (its _apply hook)
    assert refusal(mixed) == (
        "parameters of two dtypes: 'inp.weight' is torch.float32, 'layers.1.w1.weight'"
        " is torch.float64"
    )
    real = private.fsdp_param_groups
    monkeypatch.setattr(private, "fsdp_param_groups", lambda m: real(m) * 2)
    assert refusal(build("fsdp", mesh)) == (
        "the root module has 2 FSDP param groups (a per-parameter mesh):"
        " set_custom_reduce_scatter refuses them, gradients cannot be bound"
    )


def test_optimizers_whose_state_is_unknown_or_differs_are_refused(mesh: Any) -> None:
    model = build("fsdp", mesh)
    assert dl.optimizer_states(torch.optim.Adam(model.parameters())) == ("exp_avg", "exp_avg_sq")
    assert dl.optimizer_states(torch.optim.SGD(model.parameters(), lr=1)) == ()
    with pytest.raises(dl.UnsupportedParallelismError, match="^SGD with dampening"):
        dl.optimizer_states(torch.optim.SGD(model.parameters(), lr=1, momentum=0.9, dampening=0.1))
    with pytest.raises(dl.UnsupportedParallelismError, match="^optimizer Adagrad: its state"):
        dl.optimizer_states(torch.optim.Adagrad(model.parameters()))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    with pytest.raises(LayoutError, match="before its first step"):
        dl.bind(model, opt, InMemorySegments())
