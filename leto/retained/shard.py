"""Sharded retained state (ZeRO-style): each data-parallel rank retains 1/W of the state.

**The flat space.** The model's parameters are packed into one flat element space
exactly as an unsharded :class:`~leto.retained.layout.RetainedLayout` packs them (in
``named_parameters()`` order, each ``align_bytes`` apart), then padded to ``W x K``
whole chunks, ``K`` the fewest chunks per rank that hold it. Rank ``r`` holds elements
``[r*K*C, (r+1)*K*C)``: exactly ``K`` chunks, so every shard boundary is a chunk
boundary of the flat space (no chunk straddles two ranks) and every rank has the same
number of chunks of the same size, which a node's parity needs.

**A rank's retained layout** is an ordinary ``RetainedLayout`` of its *pieces*: the
parts of the parameters inside its shard, each a 1-D parameter of its own (named
``name[a:b]``, ``a``/``b`` element indices in the parameter) at its offset in the shard
(a parameter crossing a shard boundary is split); a rank whose shard is padding only
(the last ranks, where the chunks do not divide evenly) holds one padding element. Its buffers hold the shard of the
parameters (the master copy), of the gradients and of every optimizer state; undo
copies, checksums, parity, snapshots and recovery are those of any layout, unchanged.
The chunked optimizers (SGD, Adam, AdamW) are elementwise, so a piece's update is, bit
for bit, that part of the whole parameter's update (:func:`retain_shard`); other
optimizers are refused.

**The model's parameters are not retained**: they are views of one flat tensor in the
trainer's own memory (:class:`FullParams`), rebuilt by one all-gather of the shards
after every applied step and after every recovery. Their ``.grad`` are the trainer's
own tensors too; a step reduce-scatters them (:meth:`ShardPlan.pack_grads`) so that
each rank receives the sum of its shard only.

**Master weights** (``master_weights=True``): the flat space is of the master dtype
(float32 for a bf16 model, :func:`~leto.retained.layout.master_dtype`), so a rank's
pieces, gradients and optimizer states are float32; the bf16 gradients are cast up
as they are packed for the reduce-scatter, and the model's bf16 parameters are the
cast of the gathered masters (:class:`FullParams`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .layout import Allocator, LayoutError, RetainedLayout
from .layout_meta import plan
from .optim import (
    RetainedOptimizer,
    bind_layout,
    chunked_for_pieces,
    required_states,
    step_pieces,
)
from .views import bind

PADDING = "(padding)"  # the one piece of a rank whose shard is padding only

__all__ = ["PADDING", "FullParams", "ShardPiece", "ShardPlan", "retain_shard", "retained_nbytes"]


@dataclass(frozen=True)
class ShardPiece:
    """Flat elements ``[start, stop)`` of parameter ``param``, held by rank ``rank``."""

    param: int
    rank: int
    start: int
    stop: int


class ShardPlan:
    """Where every parameter and every rank's shard lies in the flat space (see the
    module docstring). Deterministic: every process of a job computes the same plan."""

    def __init__(
        self,
        named: Sequence[tuple[str, nn.Parameter]],
        world: int,
        chunk_numel: int,
        align_bytes: int = 256,
        *,
        master_weights: bool = False,
    ) -> None:
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise LayoutError(f"world must be a positive int, got {world!r}")
        meta = plan(list(named), chunk_numel, (), 1, align_bytes, master_weights)
        self.names: tuple[str, ...] = tuple(n for n, _ in named)
        self.shapes: tuple[tuple[int, ...], ...] = tuple(tuple(s) for _, s, _, _ in meta["params"])
        self.offsets: tuple[int, ...] = tuple(o for _, _, o, _ in meta["params"])
        self.numels: tuple[int, ...] = tuple(c for _, _, _, c in meta["params"])
        self.dtype: torch.dtype = getattr(torch, meta["dtype"])
        self.world = world
        self.chunk_numel = chunk_numel
        #: the flat space's elements up to the last parameter's end (the rest is padding)
        self.used = used = self.offsets[-1] + self.numels[-1]
        #: chunks per rank
        total = -(-used // chunk_numel)
        self.chunks = max(1, -(-total // world))
        #: elements per rank (whole chunks)
        self.shard_numel = self.chunks * chunk_numel
        #: the padded flat space
        self.numel = world * self.shard_numel
        self.pieces: tuple[tuple[ShardPiece, ...], ...] = tuple(
            self._pieces(r) for r in range(world)
        )

    def _pieces(self, r: int) -> tuple[ShardPiece, ...]:
        lo, hi = r * self.shard_numel, (r + 1) * self.shard_numel
        out = []
        for i, (o, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            a, b = max(lo, o), min(hi, o + n)
            if a < b:
                out.append(ShardPiece(i, r, a, b))
        return tuple(out)

    def shard_range(self, r: int) -> tuple[int, int]:
        """Rank ``r``'s elements of the flat space."""
        return r * self.shard_numel, (r + 1) * self.shard_numel

    def piece_params(
        self, r: int, named: Sequence[tuple[str, nn.Parameter]], *, values: bool
    ) -> list[tuple[str, nn.Parameter]]:
        """Rank ``r``'s pieces as 1-D parameters (``values``: copies of the model's
        values; otherwise uninitialised, for attaching to retained state). A rank whose
        shard is padding only (the last ranks, when the chunks do not divide evenly)
        holds one element of it, a parameter no optimizer group has."""
        if not self.pieces[r]:
            return [(PADDING, nn.Parameter(torch.zeros(1, dtype=self.dtype), requires_grad=False))]
        out = []
        for pc in self.pieces[r]:
            name, p = named[pc.param]
            a, b = pc.start - self.offsets[pc.param], pc.stop - self.offsets[pc.param]
            if values:
                t = p.detach().reshape(-1)[a:b].to(self.dtype, copy=True)  # masters: exact
            else:
                t = torch.empty(b - a, dtype=self.dtype)
            out.append((f"{name}[{a}:{b}]", nn.Parameter(t, requires_grad=p.requires_grad)))
        return out

    def local_offsets(self, r: int) -> list[int]:
        """Each of rank ``r``'s pieces' offset within its shard."""
        lo = r * self.shard_numel
        return [pc.start - lo for pc in self.pieces[r]] or [0]

    def pack_grads(
        self, params: Sequence[nn.Parameter], out: torch.Tensor, extra: Sequence[float] = ()
    ) -> None:
        """The input of the gradients' reduce-scatter, in ``out`` (``world`` rows of
        ``shard_numel + len(params) + len(extra)``): row ``q`` holds rank ``q``'s shard of
        the gradients (zeros where absent), then a presence flag (1.0) per parameter with
        a gradient, then ``extra`` (the loss): each rank receives its shard's sum, and the
        flags and extras summed over the ranks. Sets every ``.grad`` to None."""
        S, k = self.shard_numel, len(params)
        rows = out.view(self.world, -1)
        if rows.shape[1] != S + k + len(extra):
            raise LayoutError(
                f"pack_grads: rows of {rows.shape[1]} elements, want {S + k + len(extra)}"
            )
        rows.zero_()
        for i, p in enumerate(params):
            g = p.grad
            if g is None:
                continue
            flat = g.reshape(-1)
            o = self.offsets[i]
            for q in range(self.world):
                lo, hi = q * S, (q + 1) * S
                a, b = max(lo, o), min(hi, o + self.numels[i])
                if a < b:
                    rows[q, a - lo : b - lo].copy_(flat[a - o : b - o])
            rows[:, S + i] = 1
            p.grad = None
        for j, v in enumerate(extra):
            rows[:, S + k + j] = v

    def present_pieces(self, r: int, flags: Sequence[float]) -> list[bool]:
        """Rank ``r``'s present mask (per piece) from the summed presence flags (per
        parameter)."""
        return [flags[pc.param] > 0 for pc in self.pieces[r]] or [False]


class FullParams:
    """The model's parameters as views of one flat tensor of the trainer (not retained).

    The flat tensor is of the dtype the all-gather moves: the parameters' own when they
    share one (with master weights, a bf16 model's float32 shards are cast to bf16
    before the gather: half the bytes, and the same bytes as casting the gathered
    masters, a cast being elementwise), else the plan's (master) dtype. A parameter of
    another dtype (a bf16 parameter of a model that mixes dtypes) keeps storage of its
    own and is cast from its part of the flat tensor after every gather
    (:meth:`derive`)."""

    def __init__(
        self, plan: ShardPlan, named: Sequence[tuple[str, nn.Parameter]], *, values: bool
    ) -> None:
        self.plan = plan
        dtypes = {p.dtype for _, p in named}
        self.dtype: torch.dtype = dtypes.pop() if len(dtypes) == 1 else plan.dtype
        self.flat = torch.zeros(plan.numel, dtype=self.dtype)
        #: the parameters cast from the flat tensor, each with its part of it
        self.derived: list[tuple[nn.Parameter, torch.Tensor]] = []
        for (_, p), o, n, shape in zip(named, plan.offsets, plan.numels, plan.shapes, strict=True):
            view = self.flat[o : o + n].view(shape)
            if values:
                view.copy_(p.detach())  # exact: to the parameter's dtype or a wider one
            if p.dtype == self.dtype:
                bind(p, view)
                continue
            if p.device != view.device or not p.is_contiguous():  # e.g. a meta skeleton
                bind(p, torch.empty(p.shape, dtype=p.dtype, device=view.device))
            self.derived.append((p, view))
        self.params = [p for _, p in named]

    def gather_input(self, lay: RetainedLayout) -> torch.Tensor:
        """What this rank sends to the all-gather: its shard's parameters, copied (no
        retained memory is handed to a collective) and cast to the gather's dtype."""
        return lay.param_buffer.to(self.dtype, copy=True)

    def derive(self) -> None:
        """After a gather: every parameter of another dtype, cast from its part."""
        with torch.no_grad():
            for p, view in self.derived:
                p.copy_(view)


def retained_nbytes(lay: RetainedLayout) -> int:
    """Bytes of a rank's retained segments: parameters, gradients, optimizer states,
    undo copies and the header (the small meta and super segments aside)."""
    bufs = [lay.param_buffer, lay.grad_buffer, *(lay.state_buffer(s) for s in lay.states)]
    n = sum(b.numel() * b.element_size() for b in bufs)
    return (
        n + lay.undo.copies.numel() * lay.undo.copies.element_size() + lay.header.words.numel() * 8
    )


def retain_shard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: ShardPlan,
    rank: int,
    *,
    alloc: Allocator | None,
    attach: bool,
    verify: bool = False,
    prefix: str = "leto",
    checksum_algorithm: str | None = None,
    groups: Sequence[Sequence[str]] | None = None,
) -> RetainedOptimizer:
    """Rank ``rank``'s retained shard of ``model`` and ``optimizer``: create (or
    ``attach`` to) the layout of its pieces, and the chunked optimizer over them.

    The optimizer's parameter groups become groups of pieces (each piece in its
    parameter's group, hyper-parameters shared): ``optimizer.param_groups`` is the
    retained optimizer's, so a scheduler bound to ``optimizer`` drives the LR.
    ``groups``: each group's parameters by name, where ``optimizer``'s groups hold
    pieces already (bound once, now bound again for another plan).
    """
    cls = chunked_for_pieces(optimizer, attach=attach, what="shard = true")
    named = list(model.named_parameters())
    if len(named) != len(plan.names) or any(
        n != m for (n, _), m in zip(named, plan.names, strict=True)
    ):
        raise LayoutError("shard: the model's parameters are not those the shard plan was made for")
    pieces = plan.piece_params(rank, named, values=not attach)
    layout = bind_layout(
        pieces,
        required_states(optimizer),
        attach=attach,
        alloc=alloc,
        prefix=prefix,
        chunk_numel=plan.chunk_numel,
        offsets=plan.local_offsets(rank),
        numel=plan.shard_numel,
        checksum_algorithm=checksum_algorithm,
    )
    index = {id(p): i for i, (_, p) in enumerate(named)}
    if groups is not None:
        at = {n: i for i, n in enumerate(plan.names)}
        params = [[at[n] for n in names] for names in groups]
    else:
        params = [[index[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    piece_of: dict[int, list[nn.Parameter]] = {}
    for pc, p in zip(plan.pieces[rank], layout.params, strict=False):  # none: padding only
        piece_of.setdefault(pc.param, []).append(p)
    mine = [
        {**g, "params": [q for i in ps for q in piece_of.get(i, [])]}
        for g, ps in zip(optimizer.param_groups, params, strict=True)
    ]
    return step_pieces(cls, optimizer, layout, mine, verify=verify)
