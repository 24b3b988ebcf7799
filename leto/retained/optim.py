"""Retained optimizers: an optimizer step applied as chunk transactions over a RetainedLayout.

SGD, Adam and AdamW are chunked (:mod:`leto.retained.optim_chunked`: torch's own
functional math on 1-D slices of the flat buffers, bitwise equal to ``torch.optim``);
the generic path is in :mod:`leto.retained.optim_whole`, and what they all share,
:class:`RetainedOptimizer`, in :mod:`leto.retained.optim_base`. This module picks one
for a torch optimizer (:func:`to_retained`, :func:`retain`) and keeps every name
importable from here.

The transaction API (driven by the core's chunk transactions)::

    opt.prepare(v + 1)          # PREPARE: gradients sealed in retained memory
    opt.begin(v + 1)            # APPLY starts: per-step scalars fixed (lr, step counts)
    for i in range(layout.n_chunks):
        opt.save_undo(i)        # chunk i: CLEAN -> TORN (old bytes kept)
        opt.apply_chunk(i)      # TORN -> APPLIED (new bytes + checksum + version)
        ...                     # parity update from layout.undo_data(i), layout.chunk_data(i)
        opt.finish_chunk(i)     # APPLIED -> CLEAN (undo released)
    opt.end()                   # process state moves to v + 1

``step()`` runs exactly that. Per-step scalars (Adam's step count, momentum
initialised, LR and the other hyper-parameters) are process state: they change
only in ``end()``, so a step that is rolled back needs nothing restored but the
chunks, and ``process_state()`` (JSON-able, no tensors) is everything a new
process needs besides the retained buffers to resume, roll forward or roll back.

``state_dict()``/``load_state_dict()`` keep torch's meaning (the full state, for
disk checkpoints: the retained state tensors appear as views); they are not the
retained path. A torch-format state dict can be loaded (it is copied into the
retained buffers).

Master weights (``retain(..., master_weights=True)``): the math runs on the layout's
float32 buffers whatever the parameters' dtype (a bf16 parameter's update, state and
gradient are float32), and ``end()`` -- like loading a step's state -- writes the
model's bf16/fp16 parameters as the cast of the new master weights
(:meth:`~leto.retained.layout.RetainedLayout.derive_params`).

Any other ``torch.optim.Optimizer`` runs through :class:`WholeStepOptimizer`: the
same API, but the step is one unit (the first ``apply_chunk`` runs the whole
torch step and seals every chunk), so it needs an undo copy of *every* chunk (a
second copy of params + states) and cannot interleave chunks with parity work.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .layout import Allocator, LayoutError, RetainedLayout
from .optim_base import PROCESS_STATE_FORMAT, RetainedOptimizer
from .optim_chunked import ChunkedAdam, ChunkedAdamW, ChunkedOptimizer, ChunkedSGD
from .optim_whole import UnsupportedOptimizerError, WholeStepOptimizer, _probe_states

__all__ = [
    "RetainedOptimizer",
    "ChunkedOptimizer",
    "ChunkedSGD",
    "ChunkedAdam",
    "ChunkedAdamW",
    "WholeStepOptimizer",
    "UnsupportedOptimizerError",
    "check_supported",
    "required_states",
    "is_chunkable",
    "to_retained",
    "retain",
    "bind_layout",
    "PROCESS_STATE_FORMAT",
]


# ----------------------------------------------------------------- factories

_CHUNKED: dict[type, Any] = {
    torch.optim.SGD: ChunkedSGD,
    torch.optim.Adam: ChunkedAdam,
    torch.optim.AdamW: ChunkedAdamW,
}
_STEP_CODE = ("step", "_init_group")  # what a subclass overrides to change the math


def _chunked_class(optimizer: torch.optim.Optimizer) -> Any:
    """The chunked class for ``optimizer``, or None (the generic path).

    SGD, Adam, AdamW, and a subclass of one that changes neither its step nor its
    hyper-parameters (the chunked versions call torch's functional math, not ``step``).
    """
    mro = type(optimizer).__mro__
    base = next((c for c in mro if c in _CHUNKED), None)
    if base is None:
        return None
    below = mro[: mro.index(base)]
    if any(name in c.__dict__ for c in below for name in _STEP_CODE):
        return None
    if not set(optimizer.defaults) <= _CHUNKED[base]._torch_defaults():
        return None
    return _CHUNKED[base]


def is_chunkable(optimizer: torch.optim.Optimizer) -> bool:
    """Does ``optimizer`` take the chunked fast path (see :func:`_chunked_class`)?"""
    return isinstance(optimizer, ChunkedOptimizer) or _chunked_class(optimizer) is not None


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`UnsupportedOptimizerError` (one line: which optimizer, why) unless
    leto can retain ``optimizer``: chunked, or a deterministic step it can replay."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"optimizer: {type(optimizer).__name__} is not a torch.optim.Optimizer"
        )
    if not is_chunkable(optimizer) and not isinstance(optimizer, RetainedOptimizer):
        _probe_states(optimizer)


def required_states(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The layout state buffers ``optimizer`` needs once retained."""
    if isinstance(optimizer, RetainedOptimizer):
        return optimizer.layout.states
    cls = _chunked_class(optimizer)
    if cls is not None:
        return tuple(cls.states_for(optimizer.param_groups))
    return _probe_states(optimizer)


def to_retained(
    optimizer: torch.optim.Optimizer,
    layout: RetainedLayout,
    *,
    alloc: Allocator | None = None,
    adopt: bool = True,
    verify: bool = False,
) -> RetainedOptimizer:
    """The retained version of a torch optimizer whose parameters are ``layout``'s.

    SGD, Adam and AdamW become chunked (their existing state, if any, is copied
    into the retained buffers; ``param_groups`` are shared with ``optimizer`` so
    a scheduler bound to it still drives the LR; do not step ``optimizer``
    itself any more). Any other optimizer is wrapped by :class:`WholeStepOptimizer`
    (its before copy from ``alloc``). ``adopt=False`` (attaching to retained state):
    the optimizer's own state is not copied in; the process state loaded next is.
    """
    cls = _chunked_class(optimizer)
    if cls is None:
        return WholeStepOptimizer(layout, optimizer, alloc=alloc, adopt=adopt, verify=verify)
    defaults = dict(optimizer.defaults)
    if cls is ChunkedAdamW:
        defaults.pop("decoupled_weight_decay", None)
    groups = [dict(g) for g in optimizer.param_groups]
    new: RetainedOptimizer = cls(layout, groups, verify=verify, **defaults)
    if adopt and optimizer.state:
        new.load_state_dict(optimizer.state_dict())
    new.param_groups = optimizer.param_groups
    return new


def bind_layout(
    model: nn.Module | list[tuple[str, nn.Parameter]],
    states: tuple[str, ...],
    *,
    attach: bool,
    alloc: Allocator | None,
    prefix: str,
    **create: Any,
) -> RetainedLayout:
    """The retained layout of ``model`` with the optimizer ``states``: attached to the
    existing one (checked to hold those states) or created (``create``: the rest of
    :meth:`RetainedLayout.create`'s arguments; one undo slot)."""
    if attach:
        if alloc is None:
            raise LayoutError("attach needs the allocator that holds the retained segments")
        layout = RetainedLayout.attach(model, alloc=alloc, prefix=prefix)
        missing = [s for s in states if s not in layout.states]
        if missing:
            raise LayoutError(f"the retained layout lacks the optimizer states {missing}")
        return layout
    return RetainedLayout.create(
        model, states=states, undo_slots=1, alloc=alloc, prefix=prefix, **create
    )


def retain(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    chunk_numel: int,
    alloc: Allocator | None = None,
    prefix: str = "leto",
    attach: bool = False,
    align_bytes: int = 256,
    verify: bool = False,
    master_weights: bool = False,
    checksum_algorithm: str | None = None,
) -> RetainedOptimizer:
    """Create (or ``attach`` to) the retained layout of ``model`` and retain ``optimizer``.

    The layout gets the state buffers the optimizer needs (the generic path's
    before copy comes from ``alloc`` too). With ``attach=True`` the
    existing layout is validated against the model (shapes) and the optimizer
    (states); load the process state afterwards. ``master_weights=True``: float32
    master weights, gradients and optimizer state for bf16/fp16 parameters
    (:class:`~leto.retained.layout.RetainedLayout`); on attach the retained layout
    says which.
    """
    layout = bind_layout(
        model,
        required_states(optimizer),
        attach=attach,
        alloc=alloc,
        prefix=prefix,
        chunk_numel=chunk_numel,
        align_bytes=align_bytes,
        master_weights=master_weights,
        checksum_algorithm=checksum_algorithm,
    )
    return to_retained(optimizer, layout, alloc=alloc, adopt=not attach, verify=verify)


def chunked_for_pieces(optimizer: torch.optim.Optimizer, *, attach: bool, what: str) -> Any:
    """The chunked class that steps pieces of ``optimizer``'s parameters (each rank its
    own: the ZeRO shards, FSDP2's), or :class:`UnsupportedOptimizerError` naming
    ``what`` (another optimizer's step is not elementwise, or not known to be; one with
    state already, unless ``attach``)."""
    cls = _chunked_class(optimizer)
    if cls is None:
        raise UnsupportedOptimizerError(
            f"{what}: {type(optimizer).__name__} has no chunked step; a rank steps its "
            "pieces of the parameters alone, which needs SGD, Adam or AdamW"
        )
    if optimizer.state and not attach:
        raise UnsupportedOptimizerError(
            f"{what}: the optimizer already has state; wrap it before its first step"
        )
    return cls


def step_pieces(
    cls: Any,
    optimizer: torch.optim.Optimizer,
    layout: RetainedLayout,
    groups: list[dict[str, Any]],
    *,
    verify: bool,
) -> RetainedOptimizer:
    """The chunked optimizer over ``layout``'s pieces in ``groups`` (the user's groups'
    hyper-parameters, each with its parameters' pieces); ``optimizer.param_groups``
    becomes its, so a scheduler bound to ``optimizer`` drives the LR."""
    defaults = dict(optimizer.defaults)
    if cls.__name__ == "ChunkedAdamW":
        defaults.pop("decoupled_weight_decay", None)
    new: RetainedOptimizer = cls(layout, groups, verify=verify, **defaults)
    optimizer.param_groups = new.param_groups
    return new
