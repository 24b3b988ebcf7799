"""FSDP2 / tensor-parallel shards as a chunked retained layout (issue 40's second brick).

:mod:`.dtensor_layout` lays a rank's padded local shards end to end in flat buffers and
binds FSDP2's parameters, its reduce-scatter outputs and torch's optimizer state to
them. This module makes those buffers a :class:`~leto.retained.layout.RetainedLayout`,
the structure every protection of leto works on (chunks with versions and checksums,
undo copies, seals, tier-1 and tier-2 codes), without a copy on the step's path:

* one 1-D *piece* per shard slot (its padded local shard, padding zero) at the slot's
  offset, the layout's length whole chunks: ``RetainedLayout.create(pieces, offsets=...,
  numel=...)``, as the ZeRO path lays out its pieces (:mod:`.shard`);
* FSDP2 computes on the layout's parameter buffer (:func:`~.dtensor_layout.bind_params`)
  and reduce-scatters into its gradient buffer (:func:`~.dtensor_layout.bind_grads`);
* the step is leto's chunked optimizer over the pieces (SGD, Adam, AdamW: elementwise,
  so a piece's update is that part of the shard's update, bit for bit): chunk by chunk,
  each with its undo copy, sealed (:meth:`RetainedShards.step`: a piece has a gradient
  when FSDP2 gave its parameter one). The user's optimizer shares its
  ``param_groups`` (an LR scheduler bound to it keeps working); its own state is not
  used, and its ``zero_grad`` reaches the pieces, not the sharded parameters:
  :meth:`RetainedShards.zero_grad` (or the model's own) drops those.

``attach=True`` binds a model built by the same calls to the bytes an allocator already
holds (a process replacing a dead one: the keeper's segments), checking each shard's
shape against the retained description. What it refuses, in one line: another optimizer
(its step is not elementwise, or not known to be), an optimizer with state already,
and everything :func:`~.dtensor_layout.plan_layout` refuses.

Not yet: the gloo backend's use of it (``leto.wrap`` refuses FSDP models) and mixed
precision's fp32 masters over bf16 shards. ``docs/research/fsdp2/README.md`` has the
plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import dtensor_layout as dl
from .alloc import Allocator
from .layout import RetainedLayout
from .optim import (
    RetainedOptimizer,
    bind_layout,
    chunked_for_pieces,
    required_states,
    step_pieces,
)

__all__ = ["RetainedShards", "retain_shards"]


@dataclass(frozen=True)
class RetainedShards:
    """A sharded model bound to a retained layout: the chunked optimizer that steps it,
    the shard plan, the reduce-scatters writing its gradients, and the model's sharded
    parameters in the layout's order."""

    optimizer: RetainedOptimizer
    plan: dl.DTensorLayout
    reduce_scatters: tuple[dl.RegionReduceScatter, ...]
    params: tuple[nn.Parameter, ...]

    @property
    def layout(self) -> RetainedLayout:
        return self.optimizer.layout

    def present(self) -> list[bool]:
        """Which pieces have a gradient: those whose parameter FSDP2 gave one. Each such
        piece's ``.grad`` becomes its view of the gradient buffer (where FSDP2's
        reduce-scatter wrote it), the others' None, as the chunked step reads them."""
        out = [p.grad is not None for p in self.params]
        self.layout.grads.set_present(out)
        return out

    def step(self) -> None:
        """One whole transactional step of the shards (``optimizer.step`` of the chunked
        optimizer, with the gradients FSDP2 produced)."""
        self.present()
        self.optimizer.step()

    def zero_grad(self) -> None:
        """Drop the sharded parameters' gradients (``set_to_none``): the next backward's
        reduce-scatter writes straight into the gradient buffer again."""
        for p in self.params:
            p.grad = None


def _pieces(
    model: nn.Module, plan: dl.DTensorLayout, *, values: bool
) -> list[tuple[str, nn.Parameter]]:
    """One flat parameter per shard slot: its padded local shard (zeros without ``values``)."""
    params = dict(model.named_parameters())
    out = []
    for s in plan.slots():
        padded = torch.zeros(s.padded_shape, dtype=plan.dtype, device=params[s.fqn].device)
        if values:
            local = params[s.fqn].to_local().detach()  # type: ignore[attr-defined]
            padded.narrow(s.shard_dim, 0, s.local_shape[s.shard_dim]).copy_(local)
        out.append((s.fqn, nn.Parameter(padded.reshape(-1))))
    return out


def retain_shards(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    chunk_numel: int,
    alloc: Allocator,
    attach: bool = False,
    prefix: str = "leto",
    verify: bool = False,
    checksum_algorithm: str | None = None,
) -> RetainedShards:
    """Create (or ``attach`` to) the retained layout of ``model``'s shards (``fully_shard``
    and ``parallelize_module`` already called) and the chunked optimizer over them."""
    cls = chunked_for_pieces(optimizer, attach=attach, what="FSDP2 state")
    plan = dl.plan_layout(model)
    pieces = _pieces(model, plan, values=not attach)
    n_chunks = max(1, -(-plan.numel // chunk_numel))
    layout = bind_layout(
        pieces,
        required_states(optimizer),
        attach=attach,
        alloc=alloc,
        prefix=prefix,
        chunk_numel=chunk_numel,
        offsets=[s.offset for s in plan.slots()],
        numel=n_chunks * chunk_numel,
        checksum_algorithm=checksum_algorithm,
    )
    dl.bind_params(model, plan, layout.param_buffer, copy_in=False)
    comms = dl.bind_grads(model, plan, layout.grad_buffer)
    piece_of = {
        name: p for name, p in zip([s.fqn for s in plan.slots()], layout.params, strict=True)
    }
    fqn = {id(p): n for n, p in model.named_parameters()}
    groups = [
        {**g, "params": [piece_of[fqn[id(p)]] for p in g["params"]]} for g in optimizer.param_groups
    ]
    new = step_pieces(cls, optimizer, layout, groups, verify=verify)
    named = dict(model.named_parameters())
    return RetainedShards(new, plan, tuple(comms), tuple(named[s.fqn] for s in plan.slots()))
