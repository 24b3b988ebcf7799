"""A mesh-aware retained layout: this rank's FSDP2 / TP / HSDP shards as views of flat buffers.

After the user's ``parallelize_module`` and ``fully_shard`` calls, each parameter is an
``nn.Parameter(DTensor)`` whose local tensor is this rank's shard, padded by FSDP2 to
equal size on every rank of its shard group. :func:`plan_layout` lays these padded
shards end to end, group by group (``FSDPModule``\\ s in ``named_modules`` order, each
group's parameters in its ``fsdp_params`` order, each group's region aligned to
:data:`ALIGN_BYTES`): a function of the model, the mesh and the ``fully_shard`` calls,
so another process given the same calls finds the same offsets. The same offsets serve
three kinds of buffer, as leto's chunks need (one element range across all buffers):

* parameters (:func:`bind_params`): each local shard becomes a view of the parameter
  buffer (FSDP2 all-gathers from it and the optimizer writes it in place; no copy);
* gradients (:func:`bind_grads`): a group's reduce-scatter output *is* its gradient
  region, through the public ``FSDPModule.set_custom_reduce_scatter``, because that
  output is the group's padded shards in ``fsdp_params`` order. FSDP2 cuts each
  gradient out of it with ``as_strided(storage_offset=k)``, and ``k`` counts from the
  *storage's* start, so each region is handed over as a tensor with a storage of its own
  (``torch.from_dlpack`` of the slice: the same memory, storage offset 0): a plain slice
  would silently give one group another group's gradients;
* optimizer state (:func:`bind_optimizer_state`): Adam/AdamW's ``exp_avg``,
  ``exp_avg_sq`` (``max_exp_avg_sq``) and SGD's ``momentum_buffer``, created before the
  first step as DTensors over views (the public ``DTensor.from_local``); torch's
  optimizers update them in place.

What it refuses, in one line naming the part (:class:`UnsupportedParallelismError`): a
``reduce_dtype`` unlike the parameters' dtype (FSDP2 casts the gradients into a new
tensor: a copy), a module with several FSDP param groups (``set_custom_reduce_scatter``
refuses them), ``CPUOffloadPolicy`` (the shards FSDP2 computes on are host copies), a
root mesh with a dimension no parameter is sharded or replicated over (pipeline or
another parallelism this layout knows nothing of), parameters FSDP2 does not manage,
mixed dtypes. Private torch attributes are read only through
:mod:`leto.retained.torch_private`.

Gradients are bound when they are None as a backward starts (``zero_grad(set_to_none=
True)``): FSDP2 accumulates into an existing gradient (``grad += new``), so the region
is then not handed out and the new gradient costs one add; the same holds for HSDP's
partial sums (``set_requires_all_reduce(False)``), kept in a tensor of their own until
the microbatch that all-reduces.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.dlpack import from_dlpack

from . import torch_private as private
from .alloc import Allocator
from .errors import LayoutError, ShapeMismatchError

__all__ = [
    "ALIGN_BYTES",
    "BoundShards",
    "DTensorLayout",
    "GroupRegion",
    "RegionReduceScatter",
    "ShardSlot",
    "UnsupportedParallelismError",
    "alloc_buffers",
    "bind",
    "bind_grads",
    "bind_optimizer_state",
    "bind_params",
    "like",
    "optimizer_states",
    "plan_layout",
    "shard_view",
]

ALIGN_BYTES = 64
"""Each group's region starts at a multiple of this many bytes."""


class UnsupportedParallelismError(LayoutError):
    """The model's parallelism is one the mesh-aware layout cannot bind without a copy."""


@dataclass(frozen=True)
class ShardSlot:
    """One parameter's padded local shard: ``numel`` elements at ``offset`` of each buffer."""

    fqn: str
    offset: int
    padded_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    shard_dim: int

    @property
    def numel(self) -> int:
        return math.prod(self.padded_shape)


@dataclass(frozen=True)
class GroupRegion:
    """One FSDP param group's region: its reduce-scatter output, slots in ``fsdp_params`` order."""

    module: str
    offset: int
    numel: int
    slots: tuple[ShardSlot, ...]


@dataclass(frozen=True)
class DTensorLayout:
    """Where this rank's padded shards lie in every buffer (elements of ``dtype``)."""

    dtype: torch.dtype
    numel: int
    groups: tuple[GroupRegion, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def slots(self) -> Iterator[ShardSlot]:
        for g in self.groups:
            yield from g.slots

    def slot(self, fqn: str) -> ShardSlot:
        for s in self.slots():
            if s.fqn == fqn:
                return s
        raise KeyError(fqn)


def _walk(model: nn.Module) -> Iterator[tuple[str, FSDPModule, Any]]:
    """(module fqn, FSDP module, param group), in a deterministic order."""
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            for group in private.fsdp_param_groups(m):
                yield name, m, group


def _part(name: str) -> str:
    return f"module {name!r}" if name else "the root module"


def _check_module(name: str, groups: Sequence[Any]) -> None:
    if len(groups) > 1:
        raise UnsupportedParallelismError(
            f"{_part(name)} has {len(groups)} FSDP param groups (a per-parameter mesh):"
            " set_custom_reduce_scatter refuses them, gradients cannot be bound"
        )
    for group in groups:
        fps = private.fsdp_params(group)
        if any(private.offloads_to_cpu(fp) for fp in fps):
            raise UnsupportedParallelismError(
                f"{_part(name)} has a CPUOffloadPolicy: FSDP2 computes on host copies"
                " of its shards, which cannot be bound"
            )
        policy = private.mp_policy(group)
        for fp in fps:
            orig = private.sharded_param(fp).dtype
            reduce = policy.reduce_dtype or policy.param_dtype or orig
            if reduce != orig:
                raise UnsupportedParallelismError(
                    f"{_part(name)} reduces gradients in {reduce} unlike its parameters'"
                    f" {orig}: FSDP2 casts them into a new tensor (a copy); set"
                    f" MixedPrecisionPolicy(reduce_dtype={orig})"
                )


def _check_meshes(params: Mapping[str, torch.Tensor]) -> None:
    """Every dimension of the root mesh holds some parameter's placement: one that holds
    none is a parallelism this layout knows nothing of (pipeline, context parallel)."""
    meshes = {}
    for fqn, p in params.items():
        if not isinstance(p, DTensor):
            raise UnsupportedParallelismError(f"parameter {fqn!r} is not a DTensor")
        meshes[fqn] = p.device_mesh
    roots = {id(private.root_mesh(m)): private.root_mesh(m) for m in meshes.values()}
    if len(roots) != 1:
        raise UnsupportedParallelismError("the parameters' meshes were cut from several meshes")
    (root,) = roots.values()
    used = {d for m in meshes.values() for d in m.mesh_dim_names or ()}
    unused = [d for d in root.mesh_dim_names or () if d not in used]
    widest = max(m.size() for m in meshes.values())
    if unused or widest != root.size():
        raise UnsupportedParallelismError(
            f"no parameter is placed over dimension(s) {unused} of the root mesh"
            f" {root.mesh_dim_names}: pipeline or another parallelism is not supported"
        )


def plan_layout(model: nn.Module) -> DTensorLayout:
    """This rank's layout of ``model``'s padded local shards (``fully_shard`` already called).

    Raises :class:`UnsupportedParallelismError` naming the part it cannot bind.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    by_module: dict[str, list[Any]] = {}
    for name, _module, group in _walk(model):
        by_module.setdefault(name, []).append(group)
    if not by_module:
        raise UnsupportedParallelismError("no parameter of the model is managed by fully_shard")
    for name, groups in by_module.items():
        _check_module(name, groups)
    dtypes: dict[torch.dtype, str] = {}
    regions: list[GroupRegion] = []
    params: dict[str, torch.Tensor] = {}
    off = 0
    for name, _module, group in _walk(model):
        start = off
        slots = []
        for fp in private.fsdp_params(group):
            p = private.sharded_param(fp)
            fqn = names[id(p)]
            params[fqn] = p
            dtypes.setdefault(p.dtype, fqn)
            padded = tuple(private.padded_shard_size(fp))
            slots.append(
                ShardSlot(fqn, off, padded, tuple(private.sharded_size(fp)), private.shard_dim(fp))
            )
            off += math.prod(padded)
        regions.append(GroupRegion(name, start, off - start, tuple(slots)))
        if len(dtypes) > 1:
            (a, fa), (b, fb) = list(dtypes.items())[:2]
            raise UnsupportedParallelismError(
                f"parameters of two dtypes: {fa!r} is {a}, {fb!r} is {b}"
            )
        step = ALIGN_BYTES // next(iter(dtypes)).itemsize if dtypes else 1
        off = -(-off // step) * step
    loose = [n for n, _ in model.named_parameters() if n not in params]
    if loose:
        raise UnsupportedParallelismError(f"parameter {loose[0]!r} is not managed by fully_shard")
    _check_meshes(params)
    return DTensorLayout(next(iter(dtypes)), off, tuple(regions))


def _typed(buf: torch.Tensor, layout: DTensorLayout, what: str) -> torch.Tensor:
    """``buf`` (1-D, of ``layout.dtype`` or uint8 bytes) as ``layout.numel`` elements."""
    if buf.dim() != 1 or not buf.is_contiguous():
        raise LayoutError(f"the {what} buffer must be 1-D and contiguous")
    if buf.dtype == torch.uint8 and layout.dtype != torch.uint8:
        if buf.numel() < layout.nbytes:
            raise LayoutError(f"the {what} buffer has {buf.numel()} bytes, {layout.nbytes} needed")
        return buf[: layout.nbytes].view(layout.dtype)
    if buf.dtype != layout.dtype or buf.numel() < layout.numel:
        raise LayoutError(
            f"the {what} buffer is {buf.numel()} x {buf.dtype}, {layout.numel} x {layout.dtype} needed"
        )
    return buf[: layout.numel]


def shard_view(
    layout: DTensorLayout, buf: torch.Tensor, fqn: str, *, padded: bool = False
) -> torch.Tensor:
    """Parameter ``fqn``'s shard in ``buf`` (any of the layout's buffers): its local
    shape, or its padded shape with ``padded=True``."""
    s = layout.slot(fqn)
    v = _typed(buf, layout, "given")[s.offset : s.offset + s.numel].view(s.padded_shape)
    return v if padded else v.narrow(s.shard_dim, 0, s.local_shape[s.shard_dim])


def _matched(
    model: nn.Module, layout: DTensorLayout
) -> Iterator[tuple[FSDPModule, Any, GroupRegion]]:
    """The model's groups paired with the layout's regions; refuses a model that differs."""
    names = {id(p): n for n, p in model.named_parameters()}
    walked = list(_walk(model))
    if len(walked) != len(layout.groups):
        raise ShapeMismatchError(
            f"the model has {len(walked)} FSDP param groups, the layout {len(layout.groups)}"
        )
    for (name, module, group), region in zip(walked, layout.groups, strict=True):
        got = [
            (names[id(private.sharded_param(fp))], tuple(private.padded_shard_size(fp)))
            for fp in private.fsdp_params(group)
        ]
        want = [(s.fqn, s.padded_shape) for s in region.slots]
        if name != region.module or got != want:
            raise ShapeMismatchError(f"{_part(name)}: shards {got}, the layout has {want}")
        yield module, group, region


@torch.no_grad()
def bind_params(
    model: nn.Module, layout: DTensorLayout, buf: torch.Tensor, *, copy_in: bool = True
) -> None:
    """Make every local shard a view of ``buf``. ``copy_in``: write the current shards
    (and zero padding) into it first; ``False`` attaches to the bytes already there."""
    flat = _typed(buf, layout, "parameter")
    for _module, group, region in _matched(model, layout):
        for fp, s in zip(private.fsdp_params(group), region.slots, strict=True):
            padded = flat[s.offset : s.offset + s.numel].view(s.padded_shape)
            if copy_in:
                padded.zero_()
                local = private.sharded_param(fp).to_local()
                padded.narrow(s.shard_dim, 0, s.local_shape[s.shard_dim]).copy_(local)
            private.set_local_shard(fp, padded)


class RegionReduceScatter(private.ReduceScatter):
    """A reduce-scatter whose output is a group's gradient region (no copy).

    FSDP2 allocates the reduce-scatter input, then its output; the output is
    the region, unless a gradient already exists (FSDP2 then adds the new gradient to
    it, and the new one must not alias it) or HSDP keeps the output as a partial sum
    (``set_requires_all_reduce(False)``: FSDP2 adds the next output to it). ``hits``
    counts the outputs handed over.
    """

    def __init__(self, region: torch.Tensor, group: Any) -> None:
        if region.storage_offset() != 0:
            raise LayoutError("a gradient region must start its own storage (offset 0)")
        self.region = region
        self.group = group
        self.params = [private.sharded_param(fp) for fp in private.fsdp_params(group)]
        self.hits = 0
        self._input_given = False

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        output = self._input_given
        self._input_given = not output
        if (
            output
            and math.prod(int(n) for n in size) == self.region.numel()
            and dtype == self.region.dtype
            and torch.device(device) == self.region.device
            and all(p.grad is None for p in self.params)
            and not private.keeps_partial_reduce(self.group)
        ):
            self.hits += 1
            return self.region
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        work: dist.Work | None = dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )
        return work


def bind_grads(
    model: nn.Module, layout: DTensorLayout, buf: torch.Tensor
) -> list[RegionReduceScatter]:
    """Make each group's reduce-scatter write its gradients into ``buf``'s region."""
    flat = _typed(buf, layout, "gradient")
    out = []
    for module, group, region in _matched(model, layout):
        own = from_dlpack(flat[region.offset : region.offset + region.numel])
        if own.data_ptr() != flat[region.offset :].data_ptr() or own.storage_offset() != 0:
            raise LayoutError("torch.from_dlpack did not give the region a storage of its own")
        comm = RegionReduceScatter(own, group)
        module.set_custom_reduce_scatter(comm)
        out.append(comm)
    return out


def optimizer_states(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The per-parameter state buffers ``optimizer`` needs in the layout."""
    groups = optimizer.param_groups
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        extra = ("max_exp_avg_sq",) if any(g["amsgrad"] for g in groups) else ()
        return ("exp_avg", "exp_avg_sq", *extra)
    if type(optimizer) is torch.optim.SGD:
        if any(g["momentum"] != 0 and g["dampening"] != 0 for g in groups):
            raise UnsupportedParallelismError(
                "SGD with dampening: its first step differs from a step on a zero buffer"
            )
        return ("momentum_buffer",) if any(g["momentum"] != 0 for g in groups) else ()
    raise UnsupportedParallelismError(
        f"optimizer {type(optimizer).__name__}: its state is not known (Adam, AdamW, SGD are)"
    )


def like(p: DTensor, local: torch.Tensor) -> DTensor:
    """``local`` (this rank's shard of something shaped as ``p``) as a DTensor placed as
    ``p`` is: no copy, no collective (``DTensor.from_local`` without its check)."""
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def _scalar_step(group: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    """Adam's ``step`` as torch creates it lazily (``torch.optim.adam``'s ``_init_group``)."""
    fused = bool(group.get("fused"))
    wide = torch.get_default_dtype() == torch.float64 and not fused
    dtype = torch.float64 if wide else torch.float32
    if fused or group.get("capturable"):
        return torch.zeros((), dtype=dtype, device=device)
    return torch.tensor(0.0, dtype=dtype)


@torch.no_grad()
def bind_optimizer_state(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    layout: DTensorLayout,
    bufs: Mapping[str, torch.Tensor],
    *,
    fresh: bool = True,
) -> None:
    """Create ``optimizer``'s state before its first step as DTensors over views of
    ``bufs`` (one per :func:`optimizer_states` name). ``fresh``: fill them as torch's
    first step would find them (zeros; ``-0.0`` for a momentum buffer, so that
    ``buf * momentum + grad`` is ``grad`` bit for bit); ``False`` attaches to the
    bytes already there (Adam's ``step`` counts start at 0 either way: they are not
    in the buffers, the process state loaded next sets them)."""
    if fresh and optimizer.state:
        raise LayoutError("the optimizer has state already: bind it before its first step")
    names = optimizer_states(optimizer)
    missing = [n for n in names if n not in bufs]
    if missing:
        raise LayoutError(f"no buffer for optimizer state {missing[0]!r}")
    flats = {n: _typed(bufs[n], layout, n) for n in names}
    fqn = {id(p): n for n, p in model.named_parameters()}
    is_adam = isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
    for group in optimizer.param_groups:
        own = [n for n in names if n != "max_exp_avg_sq" or group.get("amsgrad")]
        if not is_adam and group["momentum"] == 0:
            own = []
        for p in group["params"]:
            if id(p) not in fqn or not isinstance(p, DTensor):
                raise LayoutError("an optimizer parameter is not one of the model's shards")
            s = layout.slot(fqn[id(p)])
            state: dict[str, Any] = {"step": _scalar_step(group, p.device)} if is_adam else {}
            for n in own:
                padded = flats[n][s.offset : s.offset + s.numel].view(s.padded_shape)
                local = padded.narrow(s.shard_dim, 0, s.local_shape[s.shard_dim])
                if fresh:
                    padded.zero_()
                    if n == "momentum_buffer":
                        local.fill_(-0.0)
                state[n] = like(p, local)
            if state:
                optimizer.state[p] = state


def alloc_buffers(
    layout: DTensorLayout, alloc: Allocator, *, prefix: str = "leto.dt", states: Sequence[str] = ()
) -> dict[str, torch.Tensor]:
    """The layout's buffers from a leto allocator: ``{prefix}.param``, ``{prefix}.grad``,
    ``{prefix}.state.{name}``, keyed ``param``, ``grad`` and each state's name."""
    segs = {"param": f"{prefix}.param", "grad": f"{prefix}.grad"}
    segs.update({n: f"{prefix}.state.{n}" for n in states})
    return {k: _typed(alloc(seg, layout.nbytes), layout, k) for k, seg in segs.items()}


@dataclass(frozen=True)
class BoundShards:
    """A model and its optimizer bound to one layout's buffers."""

    layout: DTensorLayout
    buffers: dict[str, torch.Tensor]
    reduce_scatters: tuple[RegionReduceScatter, ...]


def bind(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    alloc: Allocator,
    *,
    prefix: str = "leto.dt",
    fresh: bool = True,
) -> BoundShards:
    """Plan ``model``'s layout, allocate its buffers and bind parameters, gradients and
    the (not yet stepped) optimizer's state to them. ``fresh=False`` attaches to the
    bytes ``alloc`` already holds."""
    layout = plan_layout(model)
    states = optimizer_states(optimizer)
    bufs = alloc_buffers(layout, alloc, prefix=prefix, states=states)
    bind_params(model, layout, bufs["param"], copy_in=fresh)
    comms = bind_grads(model, layout, bufs["grad"])
    bind_optimizer_state(optimizer, model, layout, bufs, fresh=fresh)
    return BoundShards(layout, bufs, tuple(comms))
