"""Tier 3 of sharded state (``shard = true``): each rank writes its own shard, in DCP.

A sharded checkpoint has the keys of an unsharded one (:mod:`leto.retained.dcp_state`)
and the same full shapes, so any DCP user reads it as the whole model and optimizer:

* ``model``: the model's own state dict. Every rank holds the whole gathered
  parameters and the buffers; DCP's planner writes each such tensor once.
* ``optim``: ``{"state": {name: {k: tensor}}, "param_groups": [...]}`` by parameter
  name. Each retained state tensor (``exp_avg``, ``momentum_buffer``...) is a
  ``ShardedTensor`` of the parameter's full shape whose local shards are *views of
  this rank's retained pieces*: each rank writes its shard and nothing else, with no
  copy and no collective beyond DCP's own plan exchange.
* ``master_weights``: with float32 masters of bf16/fp16 parameters, the masters, by
  name, sharded the same way (the ``model`` entry holds the bf16 casts).

**Why ShardedTensor, and boxes.** A rank's piece of a parameter is a contiguous range
of its flat elements (:class:`~leto.retained.shard.ShardPlan`), which is not a
rectangle of the parameter's shape; DTensor places only even splits of one dimension.
A ``ShardedTensor`` takes any rectangular shards, several per rank, so a range is cut
into the fewest boxes (:func:`flat_boxes`: at most ``2 x ndim - 1``, each contiguous
in the range, so each is a view). Every rank computes every rank's boxes from the
plan, so the global metadata needs no collective.

Loading reads each rank's own boxes into its retained pieces in place
(:func:`load_shard_state`); DCP would reshard them for another plan, but the process
state (the optimizer's per-piece scalars, the checksums) is per rank and per plan, so a
leto checkpoint of sharded state loads at the world size and chunk size it was written
at, and another is refused in one line (:func:`check_same_plan`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leto.private import InsecurePathError, check_tree
from leto.retained.checkpoint import CheckpointError, quiet
from leto.retained.layout import RetainedLayout
from leto.retained.optim import RetainedOptimizer
from leto.retained.shard import ShardPlan

__all__ = [
    "check_same_plan",
    "flat_boxes",
    "has_optimizer_state",
    "load_shard_state",
    "shard_training_state",
]

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, flat start


def flat_boxes(start: int, stop: int, shape: Sequence[int]) -> list[Box]:
    """Flat elements ``[start, stop)`` of a row-major tensor of ``shape`` as rectangles:
    each ``(offsets, sizes, first)``, ``first`` its first flat element; in order, each
    contiguous, together exactly the range."""
    shape = tuple(shape) or (1,)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"flat_boxes: [{start}, {stop}) is not a range of a {shape} tensor")
    out: list[Box] = []

    def rec(a: int, b: int, dims: tuple[int, ...], prefix: tuple[int, ...], base: int) -> None:
        if a >= b:
            return
        ones = (1,) * len(prefix)
        if len(dims) == 1:
            out.append(((*prefix, a), (*ones, b - a), base + a))
            return
        inner = math.prod(dims[1:])
        i0, i1 = a // inner, b // inner
        if i0 == i1:  # inside one row
            rec(a - i0 * inner, b - i0 * inner, dims[1:], (*prefix, i0), base + i0 * inner)
            return
        if a % inner:  # the first row's tail
            rec(a % inner, inner, dims[1:], (*prefix, i0), base + i0 * inner)
            i0 += 1
        if i1 > i0:  # whole rows
            zeros = (0,) * (len(dims) - 1)
            out.append(((*prefix, i0, *zeros), (*ones, i1 - i0, *dims[1:]), base + i0 * inner))
        if b % inner:  # the last row's head
            rec(0, b % inner, dims[1:], (*prefix, i1), base + i1 * inner)

    rec(start, stop, shape, (), 0)
    return out


def _sharded(
    plan: ShardPlan, i: int, rank: int, local: torch.Tensor | None, dtype: torch.dtype
) -> Any:
    """Parameter ``i`` of ``plan`` as a ShardedTensor of its full shape: every rank's
    boxes in the metadata, this rank's as views of ``local`` (its piece, flat)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )
    from torch.distributed._shard.sharded_tensor.shard import Shard

    shape, o = plan.shapes[i], plan.offsets[i]
    mds, mine = [], []
    for r in range(plan.world):
        for pc in plan.pieces[r]:
            if pc.param != i:
                continue
            a, b = pc.start - o, pc.stop - o
            for offs, sizes, first in flat_boxes(a, b, shape):
                md = ShardMetadata(
                    shard_offsets=list(offs), shard_sizes=list(sizes), placement=f"rank:{r}/cpu"
                )
                mds.append(md)
                if r == rank:
                    assert local is not None
                    n = math.prod(sizes)
                    mine.append(Shard(local.reshape(-1)[first - a : first - a + n].view(sizes), md))
    meta = ShardedTensorMetadata(mds, torch.Size(shape), TensorProperties(dtype=dtype))
    with quiet():
        return ShardedTensor._init_from_local_shards_and_global_metadata(mine, meta)


def _local(plan: ShardPlan, rank: int) -> dict[int, int]:
    """Parameter index -> this rank's layout slot holding its piece."""
    return {pc.param: j for j, pc in enumerate(plan.pieces[rank])}


def shard_training_state(
    model: nn.Module,
    ropt: RetainedOptimizer,
    plan: ShardPlan,
    rank: int,
    groups: Sequence[Sequence[str]],
) -> dict[str, Any]:
    """This rank's part of a sharded checkpoint (see the module docstring). ``groups``:
    the names of the parameters of each of the user's optimizer's groups."""
    lay = ropt.layout
    slot = _local(plan, rank)
    named = dict(model.named_parameters())
    state: dict[str, dict[str, Any]] = {}
    master: dict[str, Any] = {}
    for i, name in enumerate(plan.names):
        j = slot.get(i)
        st = {
            k: _sharded(plan, i, rank, None if j is None else lay.state_view(k, j), lay.dtype)
            for k in lay.states
        }
        if j is not None:  # the scalars (Adam's step): the same on every rank holding a piece
            kept = ropt.state.get(lay.params[j], {})
            st.update({k: v for k, v in kept.items() if k not in lay.states})
        state[name] = st
        if named[name].dtype != plan.dtype:  # a bf16/fp16 parameter's float32 master
            view = None if j is None else lay.param_view(j)
            master[name] = _sharded(plan, i, rank, view, plan.dtype)
    param_groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": list(names)}
        for g, names in zip(ropt.param_groups, groups, strict=True)
    ]
    out: dict[str, Any] = {
        "model": {k: v.detach() for k, v in model.state_dict().items()},
        "optim": {"state": state, "param_groups": param_groups},
    }
    if master:
        out["master_weights"] = master
    return out


def check_same_plan(meta: dict[str, Any], world: int, chunk_numel: int, where: str) -> None:
    """A leto checkpoint of sharded state loads only at the world size and chunk size it
    was written at (its process state is per rank and per plan): one line if not."""
    w, c = meta.get("world_size"), meta.get("chunk_numel")
    if w != world:
        raise CheckpointError(
            f"{where} holds sharded state written by {w} ranks; this job has {world}: "
            "a sharded checkpoint resumes at its own world size"
        )
    if c != chunk_numel:
        raise CheckpointError(
            f"{where} holds sharded state in chunks of {c} elements; this job's chunk_size "
            f"is {chunk_numel}: a sharded checkpoint resumes at its own chunk size"
        )


def load_shard_state(
    path: Path,
    model: nn.Module,
    lay: RetainedLayout,
    plan: ShardPlan,
    rank: int,
    where: str,
    *,
    optimizer: bool = True,
) -> None:
    """This rank's pieces of the checkpoint at ``path`` into its retained state, in
    place: the parameters (the float32 masters where it has them, else the model's
    values), each retained optimizer state (zero where it has none: not created yet;
    not ``optimizer``: left as it is), and the model's buffers. The model's parameters
    are not loaded: they are gathered from the shards afterwards."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    try:
        check_tree(path, "checkpoint")  # before DCP unpickles anything in it
        with quiet():
            md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except InsecurePathError as e:
        raise CheckpointError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - DCP raises several types
        raise CheckpointError(f"cannot read the checkpoint in {path}: {e}") from None
    slot = _local(plan, rank)
    target: dict[str, Any] = {"model": {}}
    for name, buf in model.named_buffers():
        if f"model.{name}" in md:
            target["model"][name] = buf.detach()
    masters: dict[str, Any] = {}
    states: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(plan.names):
        src = "master_weights" if f"master_weights.{name}" in md else "model"
        got = md.get(f"{src}.{name}")
        size = tuple(getattr(got, "size", ()))
        if got is None or size != plan.shapes[i]:
            why = "has no" if got is None else f"has {size} for"
            raise CheckpointError(
                f"{where} is not a checkpoint of this model: it {why} {name!r}"
                + ("" if got is None else f", the model's {plan.shapes[i]}")
            )
        j = slot.get(i)
        view = None if j is None else lay.param_view(j)
        (masters if src == "master_weights" else target["model"])[name] = _sharded(
            plan, i, rank, view, plan.dtype
        )
        if not optimizer:
            continue
        for k in lay.states:
            local = None if j is None else lay.state_view(k, j)
            if f"optim.state.{name}.{k}" in md:
                states.setdefault(name, {})[k] = _sharded(plan, i, rank, local, lay.dtype)
            elif local is not None:
                local.zero_()
    if not target["model"]:
        del target["model"]  # DCP takes an empty dict for a key of its own
    if masters:
        target["master_weights"] = masters
    if states:
        target["optim"] = {"state": states}
    try:
        with quiet(), torch.no_grad():
            load(target, checkpoint_id=str(path), no_dist=True)
    except Exception as e:  # noqa: BLE001 - DCP raises several types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read the checkpoint in {path}: {first}") from None


def has_optimizer_state(path: Path) -> bool:
    """Does the DCP checkpoint at ``path`` hold optimizer state tensors."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    with quiet():
        md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return any(k.startswith(("optim.state.", "optimizer.state.")) for k in md)
