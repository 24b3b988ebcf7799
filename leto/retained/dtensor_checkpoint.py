"""Disk checkpoints of retained FSDP2 / tensor-parallel state through DCP, keyed as
torchtitan keys them, and their resume on another mesh shape (issue 40, part 4).

A checkpoint is ``{"model": ..., "optimizer": ..., **extra}`` written with ``dcp.save``:
``model`` and ``optimizer`` are what ``torch.distributed.checkpoint.state_dict.
get_state_dict(model, optimizer)`` gives for plain FSDP2 + TP with a torch optimizer
(parameters by their module FQNs, DTensors; optimizer state by FQN: ``step``,
``exp_avg``, ``exp_avg_sq``...; ``param_groups`` with FQNs), so torchtitan's checkpoint
loader, or any DCP user, reads it, and DCP reshards it for another mesh.

Why a stand-in optimizer: :func:`~.dtensor_retained.retain_shards` gives the user's
optimizer the chunked optimizer's ``param_groups`` (over the layout's flat *pieces*, not
the model's DTensor parameters) and leaves its ``state`` unused; the Adam moments live in
the layout's state buffers. :func:`state_dict` therefore builds a torch optimizer of the
user's class over the model's parameters whose state is DTensors over *views* of those
buffers (``DTensor.from_local``, no copy) and hands it to ``get_state_dict``. The same
views are what :func:`load` gives ``dcp.load``, which reads into them in place, resharding
from whatever mesh wrote the checkpoint; ``set_state_dict`` is not called (FSDP2's
``load_state_dict`` would be a copy onto itself). After the load the chunked optimizer
takes the ``step`` counts and hyper-parameters, and the layout is sealed at the
checkpoint's step, so its checksums hold the loaded bytes.
"""

from __future__ import annotations

import os
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from . import dtensor_layout as dl
from .dtensor_retained import RetainedShards
from .errors import LayoutError

__all__ = ["load", "save", "state_dict"]


def _stand_in(rs: RetainedShards, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A torch optimizer of ``optimizer``'s class over the model's parameters: its groups
    the user's hyper-parameters (with every key torch's own groups have), its state the
    retained buffers as DTensor views and the chunked optimizer's ``step`` counts."""
    ropt = rs.optimizer
    param_of = {id(piece): p for piece, p in zip(rs.layout.params, rs.params, strict=True)}
    stand: torch.optim.Optimizer = cast(Any, type(optimizer))(list(rs.params))
    template = {k: v for k, v in stand.param_groups[0].items() if k != "params"}
    stand.param_groups = [
        {**template, **g, "params": [param_of[id(piece)] for piece in g["params"]]}
        for g in optimizer.param_groups
    ]
    states = [n for n in dl.optimizer_states(optimizer) if n in rs.layout.states]
    adam = isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
    for slot, piece, p in zip(rs.plan.slots(), rs.layout.params, rs.params, strict=True):
        if not isinstance(p, DTensor):
            raise LayoutError(f"parameter {slot.fqn!r} is not a DTensor")
        st: dict[str, Any] = {}
        if adam:
            step = ropt.state.get(piece, {}).get("step")
            st["step"] = step if step is not None else torch.tensor(0.0)
        for name in states:
            local = dl.shard_view(rs.plan, rs.layout.state_buffer(name), slot.fqn)
            st[name] = dl.like(p, local)
        stand.state[p] = st
    return stand


def state_dict(
    rs: RetainedShards, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` as ``get_state_dict`` gives them for plain
    FSDP2 with ``optimizer``; every tensor a view of the retained buffers (a step in
    between changes them: save before the next step, or copy)."""
    return _state_dict_of(model, _stand_in(rs, optimizer))


def save(
    rs: RetainedShards,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    checkpoint_id: str | os.PathLike[str],
    **extra: Any,
) -> None:
    """``dcp.save`` of :func:`state_dict` and ``extra`` (e.g. ``lr_scheduler``'s state
    dict, the step) at ``checkpoint_id`` (a directory every rank sees)."""
    dcp_save({**state_dict(rs, model, optimizer), **extra}, checkpoint_id=checkpoint_id)


def load(
    rs: RetainedShards,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    checkpoint_id: str | os.PathLike[str],
    *,
    step: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """``dcp.load`` a checkpoint written by :func:`save` (or by torch for plain FSDP2, on
    any mesh shape) into the retained buffers in place; the chunked optimizer takes its
    ``step`` counts and ``param_groups``' hyper-parameters; the layout is sealed as step
    ``step`` (the optimizer's version; by default Adam's step count, the same for every
    parameter). ``extra``: further entries to load (their values
    give the structure, as ``dcp.load`` wants); returns the loaded ``extra``."""
    ropt = rs.optimizer
    if rs.layout.prepared_step > ropt.version or ropt.version != rs.layout.base_version():
        raise LayoutError(
            f"load: step {rs.layout.prepared_step} is prepared or under way; load between steps"
        )
    stand = _stand_in(rs, optimizer)
    sd = {**_state_dict_of(model, stand), **extra}
    dcp_load(sd, checkpoint_id=checkpoint_id)
    _check_in_place(rs, stand)
    for piece, p in zip(rs.layout.params, rs.params, strict=True):
        if "step" in stand.state[p]:
            ropt.state[piece]["step"] = stand.state[p]["step"]
    for g, saved in zip(optimizer.param_groups, sd["optimizer"]["param_groups"], strict=True):
        g.update({k: v for k, v in saved.items() if k != "params" and k in g})
    version = _version(stand) if step is None else step
    ropt.version = version
    rs.layout.seal_all(version)
    return {k: sd[k] for k in extra}


def _state_dict_of(model: nn.Module, stand: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, stand)
    return {"model": msd, "optimizer": osd}


def _check_in_place(rs: RetainedShards, stand: torch.optim.Optimizer) -> None:
    """The load wrote into the retained buffers, not into tensors of its own."""
    bufs = [rs.layout.param_buffer, *(rs.layout.state_buffer(n) for n in rs.layout.states)]
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in bufs]

    def inside(t: torch.Tensor) -> bool:
        return t.numel() == 0 or any(lo <= t.data_ptr() < hi for lo, hi in spans)

    for p, st in stand.state.items():
        tensors = [p, *(v for v in st.values() if isinstance(v, DTensor))]
        locals_ = [t.to_local() for t in tensors if isinstance(t, DTensor)]
        if not all(inside(t) for t in locals_):
            raise LayoutError("dcp.load replaced a retained tensor instead of writing into it")


def _version(stand: torch.optim.Optimizer) -> int:
    counts = {float(st["step"]) for st in stand.state.values() if "step" in st}
    if len(counts) != 1:
        raise LayoutError(
            f"load: the checkpoint's step counts are {sorted(counts)}, not one: pass step="
        )
    return int(counts.pop())
