"""Tier 3 on disk: the model's and optimizer's own state dicts, in torch.distributed.checkpoint.

A checkpoint directory ``step-<n>/`` holds one DCP checkpoint of
``{"model": model.state_dict(), "optim": <optimizer state, keyed by FQN>}`` (the layout
``torch.distributed.checkpoint.state_dict.get_state_dict`` produces: parameter names, not
indices, so any DCP user can load it and DCP can reshard it on load) and, beside it,
``leto.json``: the process state (step, sampler, RNG, scheduler, the optimizer's scalars)
and the checksums the retained chunks must have after loading. ``leto.json`` is written
last (:meth:`CheckpointStore.publish`, the protocol's ``PublishCheckpoint``): a
directory without it is a checkpoint some writer had not finished, never loaded.

With float32 master weights (``master_weights = true``) the model's bf16/fp16
parameters are casts of them, so the checkpoint also holds ``"master_weights"``: the
master copy of each such parameter, by name (the model entry stays the model's own,
loadable into the bf16 model by any DCP user). A checkpoint without it (a DCP
checkpoint of the model alone) starts the master weights from the model's values.

Why it matters that the names are the model's: a checkpoint of retained flat buffers
(``param``, ``state.exp_avg``) could be read only by leto with the same chunking; this
one is read by ``dcp.load`` into any model with these parameter names, and a leto job
resumes from any DCP checkpoint of the same model (:func:`read_checkpoint`).

``dcp.load`` unpickles the checkpoint's metadata (and its non-tensor items), so a
directory is read only after :func:`leto.private.check_tree` (docs/security.md).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leto.retained.checkpoint import CheckpointError, CheckpointStore, load_all, read_meta
from leto.retained.layout import RetainedLayout
from leto.retained.optim import RetainedOptimizer

__all__ = [
    "checkpoint_path",
    "load_master_weights",
    "load_model_state",
    "load_retained_optimizer_state",
    "load_training_state",
    "optimizer_state_by_name",
    "read_checkpoint",
    "training_state",
    "young_daly_interval",
]

MODEL_KEYS = ("model",)
OPTIM_KEYS = ("optim", "optimizer")
MASTER_KEY = "master_weights"


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """Optimizer parameter index -> the model's name for that parameter."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    out: dict[int, str] = {}
    i = 0
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in name_of:
                raise CheckpointError(f"optimizer parameter {i} is not a parameter of the model")
            out[i] = name_of[id(p)]
            i += 1
    return out


def optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameters named as in the model (DCP's layout)."""
    names = _param_names(model, optimizer)
    sd = optimizer.state_dict()
    return {
        "state": {names[int(i)]: dict(st) for i, st in sd["state"].items()},
        "param_groups": [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [names[i] for i in g["params"]],
            }
            for g in sd["param_groups"]
        ],
    }


def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, copy: bool = False
) -> dict[str, Any]:
    """What a checkpoint holds besides the process state. ``copy``: staged (cloned), so
    that training may go on while it is written."""
    msd = {k: v.detach() for k, v in model.state_dict().items()}
    osd = optimizer_state_by_name(model, optimizer)
    master = {}
    if isinstance(optimizer, RetainedOptimizer):
        lay = optimizer.layout
        master = {lay.slots[i].name: lay.param_view(i) for i in lay.derived}
    if copy:
        msd = {k: v.clone() for k, v in msd.items()}
        master = {k: v.clone() for k, v in master.items()}
        osd["state"] = {
            n: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            for n, st in osd["state"].items()
        }
    out: dict[str, Any] = {"model": msd, "optim": osd}
    if master:  # float32 master weights: the model's own parameters are casts of them
        out[MASTER_KEY] = master
    return out


def load_master_weights(lay: RetainedLayout, state: dict[str, Any], where: str) -> None:
    """The master copies of ``lay``'s derived (bf16/fp16) parameters: the checkpoint's,
    or, where it has none, the cast up of the model's parameters (so call it after
    :func:`load_model_state`). Nothing to do without derived parameters."""
    saved = state.get(MASTER_KEY) or {}
    with torch.no_grad():
        for i in lay.derived:
            name, view = lay.slots[i].name, lay.param_view(i)
            v = saved.get(name)
            if v is None:
                view.copy_(lay.params[i])
            elif not isinstance(v, torch.Tensor) or v.shape != view.shape:
                raise CheckpointError(f"{where}: the master weight of {name!r} does not fit")
            else:
                view.copy_(v)


def _pick(state: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((state[k] for k in keys if k in state), None)


def load_model_state(model: nn.Module, state: dict[str, Any], where: str) -> None:
    """Copy a checkpoint's model state into ``model`` in place (into retained memory
    where the parameters are its views). Names and shapes are checked first: one line
    names what does not fit."""
    msd = _pick(state, MODEL_KEYS)
    if msd is None:  # a plain dcp.save(model.state_dict())
        msd = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    mine = model.state_dict()
    missing = sorted(set(mine) - set(msd))
    if missing:
        raise CheckpointError(
            f"{where} is not a checkpoint of this model: it has no {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    for k, t in mine.items():
        v = msd[k]
        if not isinstance(v, torch.Tensor) or v.shape != t.shape:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise CheckpointError(
                f"{where} is not a checkpoint of this model: {k!r} is {got}, the model's "
                f"{tuple(t.shape)}"
            )
    with torch.no_grad():
        for k, t in mine.items():
            t.copy_(msd[k])


def load_retained_optimizer_state(lay: RetainedLayout, state: dict[str, Any], where: str) -> None:
    """A checkpoint's optimizer state tensors into ``lay``'s retained state buffers, by
    parameter name; a state the checkpoint lacks (not created yet) is zero. The
    optimizer's scalars come from the process state. Master weights too
    (:func:`load_master_weights`: after :func:`load_model_state`)."""
    load_master_weights(lay, state, where)
    osd = _pick(state, OPTIM_KEYS) or {}
    by_name = osd.get("state", {})
    with torch.no_grad():
        for i, slot in enumerate(lay.slots):
            st = by_name.get(slot.name, {})
            for k in lay.states:
                view = lay.state_view(k, i)
                v = st.get(k)
                if v is None:
                    view.zero_()
                elif not isinstance(v, torch.Tensor) or v.numel() != view.numel():
                    raise CheckpointError(
                        f"{where}: optimizer state {k!r} of {slot.name!r} does not fit"
                    )
                else:
                    view.copy_(v.reshape(view.shape))


def load_training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any], where: str
) -> None:
    """Copy a checkpoint's model and optimizer state into ``model``/``optimizer`` (torch's
    ``load_state_dict`` for the optimizer: its scalars and hyper-parameters too)."""
    load_model_state(model, state, where)
    if isinstance(optimizer, RetainedOptimizer):
        load_master_weights(optimizer.layout, state, where)
    osd = _pick(state, OPTIM_KEYS)
    if optimizer is None or osd is None:
        return
    names = _param_names(model, optimizer)
    index = {n: i for i, n in names.items()}
    groups = osd.get("param_groups", [])
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{where}: the optimizer has {len(groups)} parameter groups, this one "
            f"{len(optimizer.param_groups)}"
        )
    try:
        sd = {
            "state": {index[n]: st for n, st in osd.get("state", {}).items()},
            "param_groups": [
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [index[n] for n in g["params"]],
                }
                for g in groups
            ],
        }
    except KeyError as e:
        raise CheckpointError(
            f"{where}: the optimizer state names {e} , not a parameter here"
        ) from None
    optimizer.load_state_dict(sd)


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A DCP checkpoint directory (leto's ``step-<n>/``, or any ``dcp.save`` of the same
    model), or a leto checkpoint directory (its latest durable ``step-<n>/``): its state
    and its ``leto.json`` (``None`` for a checkpoint leto did not write)."""
    p = checkpoint_path(path)
    return load_all(p), read_meta(p)


def checkpoint_path(path: str | os.PathLike[str]) -> Path:
    """The DCP checkpoint directory ``path`` names: itself, or a leto checkpoint
    directory's latest durable ``step-<n>/``."""
    p = Path(path)
    if not p.is_dir():
        why = "it is not a directory" if p.exists() else "it does not exist"
        raise CheckpointError(f"{p} is not a checkpoint directory ({why})")
    if not (p / ".metadata").is_file():
        latest = CheckpointStore(p).latest()
        if latest is None:
            raise CheckpointError(
                f"{p} is not a torch.distributed.checkpoint directory (no .metadata, no "
                "complete step-<n>/ inside)"
            )
        p = CheckpointStore(p).path(latest)
    return p


def young_daly_interval(save_seconds: float, mtbf_seconds: float, step_seconds: float) -> int:
    """Young/Daly's checkpoint interval sqrt(2 * C * MTBF), in steps (at least 1)."""
    for name, v in (
        ("save cost", save_seconds),
        ("mtbf", mtbf_seconds),
        ("step time", step_seconds),
    ):
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"young_daly_interval: {name} must be a positive number, got {v}")
    return max(1, round(math.sqrt(2 * save_seconds * mtbf_seconds) / step_seconds))
