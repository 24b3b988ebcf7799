"""Sharded retained state in one process: W ranks' shards stepped alone are, bit for
bit, the unsharded step; each rank retains about 1/W of the bytes; moved to a world of
another size (a shrink), each new shard is bitwise the unsharded state's slice."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from leto.backends.gloo.reshard import reshard
from leto.retained.checkpoint import CheckpointError
from leto.retained.dcp_shard import (
    check_same_plan,
    flat_boxes,
    has_optimizer_state,
    load_shard_state,
    shard_training_state,
)
from leto.retained.dcp_state import read_checkpoint
from leto.retained.layout import LayoutError, RetainedLayout
from leto.retained.optim import UnsupportedOptimizerError, retain
from leto.retained.shard import FullParams, ShardPlan, retain_shard, retained_nbytes


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
        lambda ps: torch.optim.Adam(
            [{"params": ps[:2], "lr": 1e-2}, {"params": ps[2:], "lr": 3e-3, "amsgrad": True}]
        ),
    ],
    ids=["adamw", "sgd-nesterov", "adam-groups"],
)
def test_shards_step_bitwise_as_the_whole_model(
    make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
) -> None:
    W, C = 3, 16
    ref = _model()
    ref_opt = make(list(ref.parameters()))
    ranks = []
    for r in range(W):
        m = _model()
        opt = make(list(m.parameters()))
        plan = ShardPlan(list(m.named_parameters()), W, C)
        full = FullParams(plan, list(m.named_parameters()), values=True)
        ranks.append((m, retain_shard(m, opt, plan, r, alloc=None, attach=False), plan, full))
    for step in range(1, 6):
        for p, g in zip(ref.parameters(), _grads(ref, step), strict=True):
            p.grad = g
        if step == 3:  # a parameter without a gradient is skipped, as torch does
            ref[2].bias.grad = None
        ref_opt.step()
        shards = []
        for r, (m, ropt, plan, _full) in enumerate(ranks):
            for p, g in zip(m.parameters(), _grads(m, step), strict=True):
                p.grad = g
            if step == 3:
                m[2].bias.grad = None
            rows = torch.empty(W * (plan.shard_numel + len(plan.names)))
            plan.pack_grads(list(m.parameters()), rows)
            mine = rows.view(W, -1)[r]
            lay = ropt.layout
            lay.grad_buffer.copy_(mine[: plan.shard_numel])
            present = plan.present_pieces(r, mine[plan.shard_numel :].tolist())
            lay.seal_grads(step, present)
            ropt.begin(step)
            ropt._apply_pending(step, None)
            ropt.end()
            shards.append(lay.param_buffer.clone())
        gathered = torch.cat(shards)
        for m, _, _, full in ranks:
            full.flat.copy_(gathered)  # what the all-gather writes
            for p, q in zip(m.parameters(), ref.parameters(), strict=True):
                assert torch.equal(p, q), step


@pytest.mark.parametrize("mixed", [False, True], ids=["bf16", "bf16-fp32"])
def test_shards_with_float32_masters_step_bitwise_as_the_whole_fp32_master_recipe(
    mixed: bool,
) -> None:
    """A bf16 model (or one mixing bf16 and fp32) with master weights: each rank retains
    float32 pieces; the gathered model is the cast of torch's AdamW on float32 masters."""
    W, C = 3, 16

    def model() -> nn.Sequential:
        m = _model().to(torch.bfloat16)
        if mixed:
            m[2].float()
        return m

    ref = model()
    masters = [nn.Parameter(p.detach().float()) for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    ranks = []
    for r in range(W):
        m = model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        named = list(m.named_parameters())
        plan = ShardPlan(named, W, C, master_weights=True)
        full = FullParams(plan, named, values=True)
        ranks.append((m, retain_shard(m, opt, plan, r, alloc=None, attach=False), plan, full))
    # the gather moves the parameters' dtype when they share one (cast, then gathered)
    assert ranks[0][3].dtype == (torch.float32 if mixed else torch.bfloat16)
    assert ranks[0][1].layout.dtype == torch.float32
    for step in range(1, 5):
        grads = [g.to(p.dtype) for p, g in zip(ref.parameters(), _grads(ref, step), strict=True)]
        for q, g in zip(masters, grads, strict=True):
            q.grad = g.float()
        ref_opt.step()
        shards = []
        for r, (m, ropt, plan, full) in enumerate(ranks):
            for p, g in zip(m.parameters(), grads, strict=True):
                p.grad = g.clone()
            rows = torch.empty(W * (plan.shard_numel + len(plan.names)))  # float32
            plan.pack_grads(list(m.parameters()), rows)
            mine = rows.view(W, -1)[r]
            lay = ropt.layout
            lay.grad_buffer.copy_(mine[: plan.shard_numel])
            lay.seal_grads(step, plan.present_pieces(r, mine[plan.shard_numel :].tolist()))
            ropt.begin(step)
            ropt._apply_pending(step, None)
            ropt.end()
            shards.append(full.gather_input(lay))
        gathered = torch.cat(shards)
        for m, _, _, full in ranks:
            full.flat.copy_(gathered)  # what the all-gather writes
            full.derive()
            for p, q in zip(m.parameters(), masters, strict=True):
                assert torch.equal(
                    p.detach().view(-1).view(torch.uint8),
                    q.detach().to(p.dtype).view(-1).view(torch.uint8),
                ), step
        # the masters themselves: rank r's float32 pieces are its part of the fp32 masters
        flat = torch.cat([q.detach().reshape(-1) for q in masters])
        for r, (_, ropt, plan, _) in enumerate(ranks):
            for pc, piece in zip(plan.pieces[r], ropt.layout.params, strict=False):
                o, oo = plan.offsets[pc.param], sum(plan.numels[: pc.param])
                a, b = pc.start - o + oo, pc.stop - o + oo
                assert piece.dtype == torch.float32 and torch.equal(piece.detach(), flat[a:b])


def test_pieces_tile_the_flat_space_in_whole_chunks() -> None:
    m = _model()
    plan = ShardPlan(list(m.named_parameters()), 4, 16)
    assert plan.numel == 4 * plan.shard_numel and plan.shard_numel % 16 == 0
    covered = sorted((pc.start, pc.stop) for r in range(4) for pc in plan.pieces[r])
    want = sorted((o, o + n) for o, n in zip(plan.offsets, plan.numels, strict=True))
    merged: list[list[int]] = []
    for a, b in covered:
        if merged and merged[-1][1] == a and any(o < a < o + n for o, n in want):
            merged[-1][1] = b
        else:
            merged.append([a, b])
    assert [tuple(x) for x in merged] == want
    for r in range(4):
        lo, hi = plan.shard_range(r)
        assert all(lo <= pc.start < pc.stop <= hi for pc in plan.pieces[r])


def test_retained_bytes_are_about_one_over_world() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64))
    C = 256
    whole = retain(m, torch.optim.AdamW(m.parameters()), chunk_numel=C).layout
    for W in (2, 4):
        m2 = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64))
        plan = ShardPlan(list(m2.named_parameters()), W, C)
        sizes = [
            retained_nbytes(
                retain_shard(
                    m2, torch.optim.AdamW(m2.parameters()), plan, r, alloc=None, attach=False
                ).layout
            )
            for r in range(W)
        ]
        ratio = max(sizes) / retained_nbytes(whole)
        assert 1 / W <= ratio < 1 / W * 1.1, (W, sizes, retained_nbytes(whole))


def test_refusals_are_one_line() -> None:
    m = _model()
    plan = ShardPlan(list(m.named_parameters()), 2, 16)
    with pytest.raises(UnsupportedOptimizerError, match="has no chunked step"):
        retain_shard(m, torch.optim.Adagrad(m.parameters()), plan, 0, alloc=None, attach=False)
    with pytest.raises(LayoutError, match="offsets for"):  # a shard plan made for another model
        RetainedLayout.create(list(m.named_parameters()), chunk_numel=16, offsets=[0])


def test_a_rank_of_padding_only_holds_one_element_and_steps_nothing() -> None:
    m = _model()  # 259 elements: 5 chunks of 64 over 8 ranks, ranks 5..7 padding only
    plan = ShardPlan(list(m.named_parameters()), 8, 64)
    assert [len(plan.pieces[r]) > 0 for r in range(8)] == [True] * 5 + [False] * 3
    ropt = retain_shard(m, torch.optim.AdamW(m.parameters()), plan, 7, alloc=None, attach=False)
    lay = ropt.layout
    assert [s.name for s in lay.slots] == ["(padding)"] and lay.n_chunks == 1
    lay.grad_buffer.fill_(1.0)
    lay.seal_grads(1, plan.present_pieces(7, [1.0] * len(plan.names)))
    ropt.begin(1)
    ropt._apply_pending(1, None)
    ropt.end()
    assert torch.equal(lay.param_buffer, torch.zeros(64)) and ropt.version == 1


@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
@settings(max_examples=200, deadline=None)
def test_flat_boxes_tile_a_flat_range_in_order(shape: list[int], cut: tuple[float, float]) -> None:
    """A sharded checkpoint's boxes (leto.retained.dcp_shard): a rank's flat range of a
    parameter as rectangles, each a contiguous part of the range, in order."""
    n = math.prod(shape)
    a, b = sorted(round(c * n) for c in cut)
    full = torch.arange(n).view(shape)
    at = a
    for offs, sizes, first in flat_boxes(a, b, shape):
        assert first == at
        box = full[tuple(slice(o, o + z) for o, z in zip(offs, sizes, strict=True))]
        assert box.reshape(-1).tolist() == list(range(first, first + box.numel()))
        at += box.numel()
    assert at == b
    assert len(flat_boxes(a, b, shape)) <= 2 * len(shape) - 1


def test_flat_boxes_refuses_a_range_outside_the_tensor() -> None:
    with pytest.raises(ValueError, match=r"\[3, 13\) is not a range of a \(3, 4\) tensor"):
        flat_boxes(3, 13, (3, 4))


def test_a_sharded_checkpoint_loads_at_its_own_world_and_chunk_size_only() -> None:
    meta = {"world_size": 2, "chunk_numel": 128}
    check_same_plan(meta, 2, 128, "ckpt")  # its own: accepted
    with pytest.raises(CheckpointError, match="written by 2 ranks; this job has 4"):
        check_same_plan(meta, 4, 128, "ckpt")
    with pytest.raises(
        CheckpointError, match="chunks of 128 elements; this job's chunk_size is 64"
    ):
        check_same_plan(meta, 2, 64, "ckpt")


def _stepped_shard(seed: int) -> tuple[nn.Module, Any, ShardPlan]:
    """A bf16 model's float32 master shard (one rank of one) after one AdamW step."""
    m = _model().to(torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    named = list(m.named_parameters())
    plan = ShardPlan(named, 1, 16, master_weights=True)
    FullParams(plan, named, values=True)
    ropt = retain_shard(m, opt, plan, 0, alloc=None, attach=False)
    lay = ropt.layout
    g = torch.Generator().manual_seed(seed)
    lay.grad_buffer.copy_(torch.randn(lay.grad_buffer.shape, generator=g))
    lay.seal_grads(1, [True] * len(lay.params))
    ropt.begin(1)
    ropt._apply_pending(1, None)
    ropt.end()
    return m, ropt, plan


def test_a_sharded_checkpoint_is_read_whole_and_loads_back_bitwise(tmp_path: Path) -> None:
    """leto.retained.dcp_shard on a process group of one: the float32 masters and AdamW
    state go out as the parameters' full shapes (any DCP user reads them whole) and come
    back into a fresh shard bitwise; a model-only checkpoint starts the masters from the
    model; one of another shape is refused in one line."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        m, ropt, plan = _stepped_shard(0)
        lay = ropt.layout
        names = [[n for n, _ in m.named_parameters()]]
        dcp.save(shard_training_state(m, ropt, plan, 0, names), checkpoint_id=str(tmp_path / "c"))
        whole, _ = read_checkpoint(tmp_path / "c")
        for i, (n, p) in enumerate(m.named_parameters()):
            assert whole["master_weights"][n].shape == p.shape
            assert torch.equal(whole["master_weights"][n].reshape(-1), lay.param_view(i))
            assert torch.equal(
                whole["optim"]["state"][n]["exp_avg"].reshape(-1), lay.state_view("exp_avg", i)
            )
        assert has_optimizer_state(tmp_path / "c")
        m2, ropt2, plan2 = _stepped_shard(1)  # other values, to be overwritten
        lay2 = ropt2.layout
        assert not torch.equal(lay2.param_buffer, lay.param_buffer)
        load_shard_state(tmp_path / "c", m2, lay2, plan2, 0, "c")
        for a, b in zip(lay.data_buffers(), lay2.data_buffers(), strict=True):
            assert torch.equal(a, b)
        # a DCP checkpoint of the bf16 model alone: the masters are its cast up
        dcp.save({"model": m.state_dict()}, checkpoint_id=str(tmp_path / "m"))
        assert not has_optimizer_state(tmp_path / "m")
        load_shard_state(tmp_path / "m", m2, lay2, plan2, 0, "m", optimizer=False)
        for i, (_, p) in enumerate(m.named_parameters()):
            assert torch.equal(lay2.param_view(i), p.detach().reshape(-1).float())
        other = nn.Sequential(nn.Linear(8, 15), nn.Tanh(), nn.Linear(15, 3))
        dcp.save({"model": other.state_dict()}, checkpoint_id=str(tmp_path / "o"))
        with pytest.raises(
            CheckpointError,
            match=r"not a checkpoint of this model: it has \(15, 8\) for '0.weight', the model's \(16, 8\)$",
        ):
            load_shard_state(tmp_path / "o", m2, lay2, plan2, 0, "o")
    finally:
        dist.destroy_process_group()


# --- sharded state moved to a world of another size (leto.backends.gloo.reshard)

RC = 16


def _stepped(W: int, steps: int) -> tuple[list[RetainedLayout], ShardPlan]:
    """W ranks' retained shards (AdamW) after ``steps`` steps of the same gradients."""
    lays = []
    for r in range(W):
        m = _model()
        plan = ShardPlan(list(m.named_parameters()), W, RC)
        ropt = retain_shard(
            m, torch.optim.AdamW(m.parameters(), lr=1e-2), plan, r, alloc=None, attach=False
        )
        for step in range(1, steps + 1):
            for p, g in zip(m.parameters(), _grads(m, step), strict=True):
                p.grad = g
            rows = torch.empty(W * (plan.shard_numel + len(plan.names)))
            plan.pack_grads(list(m.parameters()), rows)
            mine = rows.view(W, -1)[r]
            ropt.layout.grad_buffer.copy_(mine[: plan.shard_numel])
            ropt.layout.seal_grads(step, plan.present_pieces(r, mine[plan.shard_numel :].tolist()))
            ropt.begin(step)
            ropt._apply_pending(step, None)
            ropt.end()
        lays.append(ropt.layout)
    return lays, plan


def _whole(steps: int) -> RetainedLayout:
    """The unsharded retained state after the same steps: the reference."""
    m = _model()
    ropt = retain(m, torch.optim.AdamW(m.parameters(), lr=1e-2), chunk_numel=RC)
    for step in range(1, steps + 1):
        for p, g in zip(m.parameters(), _grads(m, step), strict=True):
            p.grad = g
        ropt.step()
    return ropt.layout


@pytest.mark.parametrize("old_w,new_w", [(2, 1), (3, 2), (2, 3), (8, 3)])
def test_resharded_state_is_the_whole_state_s_slice_of_each_new_shard(
    old_w: int, new_w: int
) -> None:
    lays, old = _stepped(old_w, 3)
    ref = _whole(3)
    new = ShardPlan(list(_model().named_parameters()), new_w, RC)
    bufs = [(ref.param_buffer, [lay.param_buffer for lay in lays])]
    bufs += [(ref.state_buffer(s), [lay.state_buffer(s) for lay in lays]) for s in ref.states]
    assert len(bufs) == 3  # the parameters and AdamW's two states
    for whole, shards in bufs:
        flat = torch.zeros(new.numel)
        flat[: new.used] = whole[: new.used]
        assert whole[: new.used].abs().sum() > 0  # not vacuous: stepped values
        for r in range(new_w):
            got = reshard(shards, old, new, r)
            lo, hi = new.shard_range(r)
            assert torch.equal(got, flat[lo:hi]), (old_w, new_w, r)


def test_reshard_refuses_shards_of_another_layout_in_one_line() -> None:
    lays, old = _stepped(2, 1)
    shards = [lay.param_buffer for lay in lays]
    other = nn.Sequential(nn.Linear(8, 16))
    for args, why in [
        ((shards[:1], old, ShardPlan(list(_model().named_parameters()), 1, RC), 0), "1 shard"),
        ((shards, old, ShardPlan(list(other.named_parameters()), 1, RC), 0), "same flat space"),
        (
            ([s[1:] for s in shards], old, ShardPlan(list(_model().named_parameters()), 1, RC), 0),
            "ranks \\[0, 1\\]",
        ),
    ]:
        with pytest.raises(LayoutError, match=why) as e:
            reshard(*args)
        assert "\n" not in str(e.value)
