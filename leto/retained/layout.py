"""Retained state layout: flat buffers cut into chunks, with a header that survives the trainer.

One layout packs a model's parameters into flat buffers in retained memory and
makes every ``Parameter`` (and its ``.grad``) a *view* into them: no copy on the
training path.

Buffers (segments, each obtained from the injected allocator by name)::

    {prefix}.param          params, flat, each parameter aligned to ``align_bytes``
    {prefix}.grad           gradients, same element layout
    {prefix}.state.{name}   one per optimizer state (exp_avg, momentum_buffer, ...)
    {prefix}.undo           ``undo_slots`` copies of one chunk of params + states
    {prefix}.header         int64: per-chunk version and checksum, undo slots, grad mask
    {prefix}.meta           JSON: dtype, chunk size, names/shapes/offsets (no pickle)
    {prefix}.super          int64[8]: magic, format, meta length and CRC (written last)

**A chunk is one element range across all buffers**: chunk i is elements
``[i*C, (i+1)*C)`` of the param buffer, of the grad buffer and of every state
buffer. An elementwise optimizer step on chunk i therefore reads chunk i of the
gradients and writes chunk i of the params and states, nothing else; a parameter
may span several chunks. All buffers are padded to ``n_chunks * C`` elements
(padding is zero and stays zero under the supported optimizers), so every chunk
has the same size, which parity needs.

**Chunk data** (what versions, checksums, undo copies and parity cover) is the
chunk's slice of params and optimizer states. Gradients are a separate block
(the protocol's ``grad[r]``) with their own per-chunk checksum and version,
sealed at PREPARE by :meth:`RetainedLayout.seal_grads`.

**Undo and chunk status.** ``save_undo(i)`` copies chunk i's data into a free undo
slot (slot header: chunk, version, checksum; the chunk index is written last, so
a half-written slot is never taken for valid). The chunk's status is derived
from the header alone, so a new process reads it after a crash:

* CLEAN: no undo slot holds it; its bytes are at ``chunk_version(i)``;
* TORN: a slot holds it at the chunk's own version: the step may have written
  any part of the bytes; only the undo copy is trusted (``undo.restore``);
* APPLIED: a slot holds version v and the chunk header says v+1: the new bytes
  are complete and sealed, the old ones still kept (for the parity update).

Writes are ordered data, then checksum, then version, so a crash between any two
leaves a state that is TORN or consistent. (Ordering across devices and the
memory-model fences are the backend's job.)

**Gradients present.** ``torch.optim`` skips a parameter whose ``.grad`` is None.
Our grads are views that always exist, so presence is tracked instead: a
post-accumulate-grad hook marks a parameter when backward writes its gradient,
``zero_grad(set_to_none=True)`` clears the marks and fills the buffer with
``-0.0`` (the exact identity of IEEE addition: ``-0.0 + g == g`` bit for bit,
``+0.0`` would turn a ``-0.0`` gradient into ``+0.0``), and a ``.grad`` that the
user replaced (or set to None) is copied in (or counted absent) at PREPARE. The
mask is written to the header, so a roll-forward in a new process skips the same
parameters. This reproduces torch.optim's semantics for both ``set_to_none``
settings without copying gradients on the normal path.

**Master weights (mixed precision, opt-in: ``master_weights=True``).** The
buffers hold one dtype, the *master* dtype: ``torch.promote_types`` of float32 and
every parameter's dtype (float32 for a model of bf16, fp16 and fp32 parameters;
float64 if one is float64). A parameter of the master dtype is a view, as above.
A parameter of another dtype (bf16, fp16) is *derived*: it keeps storage of its
own in the trainer, and
:meth:`RetainedLayout.derive_params` writes it as the cast of its master copy
(round to nearest even: deterministic); the optimizer calls it after every
applied step and whenever it loads the state of a step, so the model always
holds the cast of the committed master weights. Its ``.grad`` is a tensor of its
own dtype too, cast into the float32 gradient buffer at PREPARE
(:meth:`GradBuffer.collect <leto.retained.grads.GradBuffer.collect>`); present is ``.grad is not None``, torch's
own rule. Without it (the default) the buffers are of the parameters' own single
dtype (a bf16 model trains in bf16, bitwise as plain torch does) and mixed dtypes
are refused: master weights change the math (the update is computed in float32
and rounded once), so they are the user's choice. An all-float32 model has no
derived parameter either way: nothing changes for it (the same meta bytes, no copy).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .alloc import Allocator, InMemorySegments, default_allocator
from .checksum import algorithm_error, default_algorithm
from .errors import ChecksumError, ChunkStateError, LayoutError, ShapeMismatchError
from .geometry import ChunkGeometry, ParamSlot, Piece
from .grads import GradBuffer
from .header import Header, describes, initialise
from .layout_meta import (
    alloc_segments,
    check_model,
    master_dtype,
    named_params,
    open_super,
    plan,
    read_meta,
    seal_super,
    segment_sizes,
)
from .records import ChunkRecords
from .undo import ChunkStatus, UndoSlots
from .views import bind

__all__ = [
    "Allocator",
    "default_allocator",
    "InMemorySegments",
    "LayoutError",
    "ShapeMismatchError",
    "ChunkStateError",
    "ChecksumError",
    "ChunkStatus",
    "ParamSlot",
    "Piece",
    "RetainedLayout",
    "DEFAULT_CHUNK_NUMEL",
    "master_dtype",
]

DEFAULT_CHUNK_NUMEL = 1 << 20


class RetainedLayout:
    """Params, grads and optimizer state of one model in chunked retained buffers.

    Build with :meth:`create` (fresh: copies the model's values in) or
    :meth:`attach` (existing retained state: validates the model against it and
    binds views, copying nothing). The model's parameters become views either way.

    Its parts, each owning its state and its words of the header:

    * ``geometry`` (:class:`~leto.retained.geometry.ChunkGeometry`): where each
      parameter and chunk lies in the flat buffers;
    * ``records`` (:class:`~leto.retained.records.ChunkRecords`): each chunk's version
      and checksum, and the suspect flag;
    * ``undo`` (:class:`~leto.retained.undo.UndoSlots`): the undo copies and the
      chunk status they define;
    * ``grads`` (:class:`~leto.retained.grads.GradBuffer`): the gradient buffer, which
      gradients are present, and the sealed gradients of a step.

    The layout itself binds the model, gives the views, and keeps what crosses the
    parts (a seal drops a staged undo copy; ``verify`` skips torn chunks) and the
    calls a step makes on every rank.
    """

    # ------------------------------------------------------------ construction

    def __init__(
        self,
        meta: dict[str, Any],
        segs: dict[str, torch.Tensor],
        named: list[tuple[str, nn.Parameter]],
        prefix: str,
    ) -> None:
        self.prefix = prefix
        self.dtype: torch.dtype = getattr(torch, meta["dtype"])
        self.chunk_numel: int = meta["chunk_numel"]
        self.n_chunks: int = meta["n_chunks"]
        self.numel: int = meta["numel"]
        self.undo_slots: int = meta["undo_slots"]
        self.align_bytes: int = meta["align_bytes"]
        self.states: tuple[str, ...] = tuple(meta["states"])
        self.checksum_algorithm: str = meta["checksum"]
        self.slots: tuple[ParamSlot, ...] = tuple(
            ParamSlot(n, tuple(s), o, c) for n, s, o, c in meta["params"]
        )
        by_name = dict(named)
        self.params: list[nn.Parameter] = [by_name[s.name] for s in self.slots]
        own = meta.get("model_dtypes") or [meta["dtype"]] * len(self.slots)
        #: each parameter's own dtype in the model (the master dtype unless derived)
        self.model_dtypes: tuple[torch.dtype, ...] = tuple(getattr(torch, d) for d in own)
        #: the parameters that are casts of their master copy, not views of it
        self.derived: tuple[int, ...] = tuple(
            i for i, d in enumerate(self.model_dtypes) if d != self.dtype
        )
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.device = segs["param"].device
        self.param_buffer = segs["param"].view(self.dtype)
        self._state_buf = {n: segs["state." + n].view(self.dtype) for n in self.states}
        self._data = [self.param_buffer, *(self._state_buf[n] for n in self.states)]
        self.geometry = ChunkGeometry(self.slots, self.chunk_numel, self.n_chunks)
        self.header = Header(segs["header"], self.n_chunks, self.undo_slots)
        h = self.header.read()
        self.records = ChunkRecords(
            self.header, self.geometry, self._data, self.checksum_algorithm, h
        )
        copies = (
            segs["undo"]
            .view(self.dtype)
            .view(self.undo_slots, 1 + len(self.states), self.chunk_numel)
        )
        self.undo = UndoSlots(self.header, self.records, self.geometry, copies, self._data, h)
        self.grads = GradBuffer(
            segs["grad"].view(self.dtype),
            self.header,
            self.geometry,
            self.params,
            self.derived,
            self.checksum_algorithm,
            h,
        )
        self.grad_buffer = self.grads.buffer

    @classmethod
    def create(
        cls,
        model: nn.Module | Iterable[tuple[str, nn.Parameter]],
        *,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
        states: Sequence[str] = (),
        undo_slots: int | None = 1,
        alloc: Allocator | None = None,
        prefix: str = "leto",
        align_bytes: int = 256,
        checksum_algorithm: str | None = None,
        master_weights: bool = False,
        offsets: Sequence[int] | None = None,
        numel: int | None = None,
    ) -> RetainedLayout:
        """Pack ``model``'s parameters into fresh retained buffers and bind views.

        ``states``: optimizer state buffers to allocate (see
        ``leto.retained.optim.required_states``); ``undo_slots``: chunks that may
        hold an undo copy at once (None: one per chunk, what the whole-step
        fallback needs); ``checksum_algorithm``: one of
        ``leto.retained.checksum.ALGORITHMS`` (None: xxh3 in host memory, Fletcher
        on a GPU); ``master_weights=True``: the buffers are of :func:`master_dtype`
        and bf16/fp16 parameters are derived from them (see the module docstring;
        False, the default: one dtype, the parameters' own); ``offsets`` and
        ``numel``: each parameter's element offset and the buffers' length (whole
        chunks), instead of packing them ``align_bytes`` apart (a shard of a larger
        flat space: :mod:`leto.retained.shard`). Every chunk starts at version 0.
        """
        why = None if checksum_algorithm is None else algorithm_error(checksum_algorithm)
        if why:
            raise LayoutError(why)
        named = named_params(model)
        meta = plan(
            named, chunk_numel, states, undo_slots, align_bytes, master_weights, offsets, numel
        )
        for name, p in named:
            if p.device.type == "meta":
                raise LayoutError(
                    f"parameter {name!r} is on the meta device: create needs values (use attach)"
                )
        alloc = alloc or default_allocator
        segs = alloc_segments(alloc, prefix, segment_sizes(meta))
        meta["checksum"] = checksum_algorithm or default_algorithm(segs["param"].device)
        meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
        sup, mseg = open_super(alloc, prefix, meta_bytes)
        dtype = getattr(torch, meta["dtype"])
        pbuf = segs["param"].view(dtype)
        with torch.no_grad():
            pbuf.zero_()
            for (_, p), (_, shape, off, n) in zip(named, meta["params"], strict=True):
                pbuf[off : off + n].view(shape).copy_(p.detach())
            segs["grad"].view(dtype).fill_(-0.0)
            for s in meta["states"]:
                segs["state." + s].zero_()
        initialise(segs["header"], meta["n_chunks"], meta["undo_slots"], len(named))
        layout = cls(meta, segs, named, prefix)
        layout.seal_all(0)
        old_grads = [p.grad for p in layout.params]
        _bind_all(layout)
        layout.derive_params()  # exact (the master is the cast up); a no-op without any
        layout.grads.adopt(old_grads)
        seal_super(sup, mseg, meta_bytes)
        return layout

    @classmethod
    def read_meta(cls, alloc: Allocator, prefix: str = "leto") -> dict[str, Any]:
        """The JSON description of the retained layout under ``prefix`` (validated)."""
        return read_meta(alloc, prefix)

    @classmethod
    def attach(
        cls,
        model: nn.Module | Iterable[tuple[str, nn.Parameter]],
        *,
        alloc: Allocator,
        prefix: str = "leto",
    ) -> RetainedLayout:
        """Bind ``model`` (e.g. a meta-device skeleton) to existing retained state.

        Validates names, shapes and dtype first and raises
        :class:`ShapeMismatchError` naming the parameter and both shapes, having
        modified nothing. Then binds params and grads as views (no copy).
        """
        named = named_params(model)
        meta = read_meta(alloc, prefix)
        named = check_model(named, meta)
        segs = alloc_segments(alloc, prefix, segment_sizes(meta))
        if not describes(segs["header"], meta["n_chunks"], meta["undo_slots"], len(meta["params"])):
            raise LayoutError(f"retained header under {prefix!r} does not match its description")
        layout = cls(meta, segs, named, prefix)
        _bind_all(layout)
        layout.derive_params()
        return layout

    def derive_params(self) -> None:
        """Write every derived (bf16/fp16) parameter as the cast of its master copy.

        Round to nearest even, elementwise: the same bytes in every process. A no-op
        for a layout without derived parameters (every parameter a view).
        """
        with torch.no_grad():
            for i in self.derived:
                self.params[i].data.copy_(self.param_view(i))

    def close(self) -> None:
        """Remove the grad hooks (the views stay)."""
        self.grads.close()

    # ----------------------------------------------------------------- views

    def index_of(self, p: torch.Tensor) -> int:
        """The layout index of parameter ``p`` (by identity)."""
        try:
            return self._index[id(p)]
        except KeyError:
            raise LayoutError("tensor is not a parameter of this layout") from None

    def param_view(self, i: int) -> torch.Tensor:
        return self.geometry.view_in(self.param_buffer, i)

    def grad_view(self, i: int) -> torch.Tensor:
        return self.geometry.view_in(self.grad_buffer, i)

    def state_buffer(self, name: str) -> torch.Tensor:
        try:
            return self._state_buf[name]
        except KeyError:
            raise LayoutError(
                f"the layout has no state buffer {name!r} (it has {list(self.states)})"
            ) from None

    def state_view(self, name: str, i: int) -> torch.Tensor:
        return self.geometry.view_in(self.state_buffer(name), i)

    def data_buffers(self) -> list[torch.Tensor]:
        """The flat buffers a chunk's data spans: params, then states in order."""
        return list(self._data)

    def chunk_data(self, i: int) -> list[torch.Tensor]:
        """Chunk i's slice of params and every state buffer (1-D views)."""
        return self.geometry.slices(self._data, i)

    # ---------------------------------------------------------- chunk status

    def chunk_version(self, i: int) -> int:
        """The step chunk i's bytes are at (for TORN: the step they were at before)."""
        return self.records.version(i)

    def chunk_status(self, i: int) -> ChunkStatus:
        return self.undo.status(i)

    def chunk_statuses(self) -> list[ChunkStatus]:
        """Every chunk's :meth:`chunk_status`, read in one pass over the header's cache
        (a recovery reads them all: its cost per chunk is a list entry, not a call)."""
        return self.undo.statuses()

    def base_version(self) -> int:
        """The step every chunk's trusted bytes are at least at (undo version for torn/applied)."""
        return self.undo.base_version()

    def seal_chunk(self, i: int, version: int) -> None:
        """Record chunk i's bytes as version ``version`` (checksum, then version).

        The optimizer calls it after a chunk's new bytes are written; recovery
        calls it after rebuilding a chunk from parity. Drops a staged undo copy.
        """
        self.geometry.check(i)
        self.undo.drop_staged()
        self.records.seal(i, version)

    def seal_all(self, version: int) -> None:
        """Record every chunk's bytes as ``version`` (one batched checksum pass)."""
        self.undo.drop_staged()
        self.records.seal_all(version)

    def verify(self, intact: Collection[int] = ()) -> list[int]:
        """Indices of CLEAN or APPLIED chunks whose bytes fail their checksum.

        TORN chunks are skipped: their bytes are untrusted by definition; check
        their undo copy with ``undo.verify``. ``intact``: chunks the caller
        checked since anything last wrote them (not read again).
        """
        bad = self.records.failing(intact)
        if not any(bad):
            return []
        st = self.chunk_statuses()
        return [i for i in range(self.n_chunks) if bad[i] and st[i] is not ChunkStatus.TORN]

    def unresumable(self, target: int, intact: Collection[int] = ()) -> str | None:
        """Why this state cannot resume at step ``target``, or None if it can.

        Every chunk must be CLEAN at version ``target`` and pass its checksum (what a
        recovery checks before training goes on); the checksums of ``intact`` chunks
        (checked since anything last wrote them) are not computed again.
        """
        st = self.chunk_statuses()
        wrong = [
            c
            for c, v in enumerate(self.records.versions())
            if st[c] is not ChunkStatus.CLEAN or v != target
        ]
        bad = self.verify(intact)
        if not wrong and not bad:
            return None
        return f"chunks {wrong} not clean at step {target}, chunks {bad} fail their checksums"

    # ------------------------------------------- what every step calls, by name

    def save_undo(self, i: int, *, verify: bool = False, staged: bool = False) -> None:
        """:meth:`UndoSlots.save <leto.retained.undo.UndoSlots.save>`: chunk i CLEAN -> TORN."""
        self.undo.save(i, verify=verify, staged=staged)

    def undo_data(self, i: int) -> list[torch.Tensor]:
        """The undo copy of chunk i (same structure as :meth:`chunk_data`)."""
        return self.undo.data(i)

    def stored_checksum(self, i: int) -> int:
        return self.records.stored_checksum(i)

    def seal_grads(
        self, step: int, present: Sequence[bool], checksums: torch.Tensor | None = None
    ) -> None:
        """PREPARE: :meth:`GradBuffer.seal <leto.retained.grads.GradBuffer.seal>`."""
        self.grads.seal(step, present, checksums)

    def clear_prepared(self) -> None:
        """Forget the prepared gradients (a rolled-back step: nothing in flight survives,
        or the next step's reduced gradients are about to overwrite them)."""
        self.grads.clear_prepared()

    @property
    def prepared_step(self) -> int:
        """The step whose gradients were sealed last (-1: none)."""
        return self.grads.prepared_step

    @property
    def suspect(self) -> bool:
        """A checksum pass found some chunk failing since the last recovery ended: the
        next recovery's report reads every chunk, none is deferred."""
        return self.records.suspect

    def mark_suspect(self, value: bool = True) -> None:
        self.records.mark_suspect(value)

    def __repr__(self) -> str:
        return (
            f"RetainedLayout(prefix={self.prefix!r}, params={len(self.params)}, dtype={self.dtype}, "
            f"device={self.device}, chunk_numel={self.chunk_numel}, n_chunks={self.n_chunks}, states={list(self.states)})"
        )


def _bind_all(layout: RetainedLayout) -> None:
    """Make every parameter a view of the param buffer (a derived one keeps storage of
    its own, on the layout's device) and its ``.grad`` a view of the grad buffer."""
    derived = set(layout.derived)
    for i, p in enumerate(layout.params):
        if i in derived:
            if p.device != layout.device or not p.is_contiguous():  # e.g. a meta skeleton
                bind(p, torch.empty(p.shape, dtype=p.dtype, device=layout.device))
            continue
        bind(p, layout.param_view(i))
        if p.requires_grad:
            layout.grads.bind(i, p)
