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
  any part of the bytes; only the undo copy is trusted (``restore_undo``);
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
(:meth:`RetainedLayout.collect_grads`); present is ``.grad is not None``, torch's
own rule. Without it (the default) the buffers are of the parameters' own single
dtype (a bf16 model trains in bf16, bitwise as plain torch does) and mixed dtypes
are refused: master weights change the math (the update is computed in float32
and rounded once), so they are the user's choice. An all-float32 model has no
derived parameter either way: nothing changes for it (the same meta bytes, no copy).
"""

from __future__ import annotations

import enum
import json
import re
import zlib
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .checksum import (
    DOMAIN_DATA,
    DOMAIN_GRAD,
    algorithm_error,
    checksum,
    checksum_chunks,
    default_algorithm,
)

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

Allocator = Callable[[str, int], torch.Tensor]
"""``alloc(name, nbytes) -> 1-D uint8 tensor`` of exactly ``nbytes`` bytes.

For :meth:`RetainedLayout.create` it may return fresh memory (its contents are
overwritten); for :meth:`RetainedLayout.attach` it must return the existing
segment of that name (a keeper maps it; the fake backend looks it up).
"""

DEFAULT_CHUNK_NUMEL = 1 << 20
MAGIC = 0x4C45544F52544E44  # "LETORTND"
FORMAT = 2  # 2: the meta records the checksum algorithm
_SUPER_WORDS = 8
_H_FIXED = 8  # header: magic, format, n_chunks, undo_slots, n_params, prepared, reduced, suspect
_H_PREPARED = 5
_H_REDUCED = 6
_H_SUSPECT = 7  # 1: a checksum pass found a chunk failing: the next report reads every chunk
_CHUNK_WORDS = 4  # version, checksum, grad version, grad checksum
_SLOT_WORDS = 3  # chunk (-1 = free), version, checksum
_STATE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RESERVED = {"param", "grad", "undo", "header", "meta", "super"}


def default_allocator(name: str, nbytes: int) -> torch.Tensor:
    """Plain process memory (``torch.empty``): no retention, for tests and single runs."""
    del name
    return torch.empty(nbytes, dtype=torch.uint8)


class InMemorySegments:
    """A create-or-attach allocator over a dict: a keeper in one process.

    A name seen before returns the same tensor (its size must match); a new name
    gets zeroed memory on ``device``. Drop entries from ``segments`` to simulate
    lost memory.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.segments: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, nbytes: int) -> torch.Tensor:
        seg = self.segments.get(name)
        if seg is None:
            seg = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            self.segments[name] = seg
        elif seg.numel() != nbytes:
            raise LayoutError(f"segment {name!r} has {seg.numel()} bytes, {nbytes} requested")
        return seg


class LayoutError(ValueError):
    """Bad layout arguments or a retained layout that does not fit."""


class ShapeMismatchError(LayoutError):
    """The model's parameters differ from the retained layout's."""


class ChunkStateError(RuntimeError):
    """An operation is not legal in the chunk's current status."""


class ChecksumError(RuntimeError):
    """Bytes do not match their recorded checksum."""


class ChunkStatus(enum.Enum):
    CLEAN = "clean"
    TORN = "torn"
    APPLIED = "applied"


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives: element ``offset`` in every flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``param`` inside one chunk: flat elements ``[start, stop)``."""

    param: int
    start: int
    stop: int


def _named(model: nn.Module | Iterable[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    if isinstance(model, nn.Module):
        return list(model.named_parameters())
    return list(model)


def _bind(p: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``p`` a view of ``view`` in place (keeps the Parameter object)."""
    try:
        p.data = view
    except RuntimeError:  # e.g. a meta-device skeleton: incompatible TensorImpl
        torch.utils.swap_tensors(p, nn.Parameter(view, requires_grad=p.requires_grad))  # type: ignore[no-untyped-call]


def _aliases(t: torch.Tensor | None, view: torch.Tensor) -> bool:
    return (
        t is not None
        and t.device == view.device
        and t.data_ptr() == view.data_ptr()
        and t.shape == view.shape
        and t.stride() == view.stride()
        and t.dtype == view.dtype
    )


def _copy_in(t: torch.Tensor, view: torch.Tensor, what: str) -> torch.Tensor:
    """Copy a foreign tensor into its retained ``view`` (same shape) and return the view."""
    if t.shape != view.shape:
        raise LayoutError(f"{what} has shape {_fmt(t.shape)}, want {_fmt(view.shape)}")
    with torch.no_grad():
        view.copy_(t)
    return view


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fmt(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def master_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype that holds every one of ``dtypes`` exactly: float32 promoted with each."""
    out = torch.float32
    for d in dtypes:
        out = torch.promote_types(out, d)
    return out


class RetainedLayout:
    """Params, grads and optimizer state of one model in chunked retained buffers.

    Build with :meth:`create` (fresh: copies the model's values in) or
    :meth:`attach` (existing retained state: validates the model against it and
    binds views, copying nothing). The model's parameters become views either way.
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
        self._derived = set(self.derived)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.device = segs["param"].device
        self.param_buffer = segs["param"].view(self.dtype)
        self.grad_buffer = segs["grad"].view(self.dtype)
        self._state_buf = {n: segs["state." + n].view(self.dtype) for n in self.states}
        self._undo = (
            segs["undo"]
            .view(self.dtype)
            .view(self.undo_slots, 1 + len(self.states), self.chunk_numel)
        )
        self._hdr = segs["header"].view(torch.int64)
        # host headers are written through numpy (a scalar store, not a tensor op)
        self._hnp = self._hdr.numpy() if self._hdr.device.type == "cpu" else None
        self._table = self._hdr[_H_FIXED : _H_FIXED + _CHUNK_WORDS * self.n_chunks].view(
            self.n_chunks, _CHUNK_WORDS
        )
        self._slot_base = _H_FIXED + _CHUNK_WORDS * self.n_chunks
        self._mask_base = self._slot_base + _SLOT_WORDS * self.undo_slots
        self._pieces = self._compute_pieces()
        self._hooks: list[Any] = []
        self._flags = [False] * len(self.params)
        self._read_header()

    @staticmethod
    def _plan(
        named: list[tuple[str, nn.Parameter]],
        chunk_numel: int,
        states: Sequence[str],
        undo_slots: int | None,
        align_bytes: int,
        master_weights: bool = False,
        offsets: Sequence[int] | None = None,
        numel: int | None = None,
    ) -> dict[str, Any]:
        if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel <= 0:
            raise LayoutError(f"chunk_numel must be a positive int, got {chunk_numel!r}")
        if not named:
            raise LayoutError("the model has no parameters")
        if not isinstance(master_weights, bool):
            raise LayoutError(f"master_weights must be true or false, got {master_weights!r}")
        for name, p in named:
            if not p.dtype.is_floating_point:
                raise LayoutError(
                    f"parameter {name!r} has dtype {p.dtype}: parameters must be floating point"
                )
        dtype = named[0][1].dtype
        if master_weights:
            dtype = master_dtype(p.dtype for _, p in named)
        else:
            for name, p in named:
                if p.dtype != dtype:
                    raise LayoutError(
                        f"parameter {name!r} has dtype {p.dtype}, but {named[0][0]!r} has "
                        f"{dtype}: one layout holds one dtype (master_weights=True keeps a "
                        "float32 master copy of every parameter)"
                    )
        item = torch.empty((), dtype=dtype).element_size()
        if (chunk_numel * item) % 4:
            raise LayoutError(
                f"a chunk must be a multiple of 4 bytes: chunk_numel={chunk_numel} x {item} bytes"
            )
        if (
            isinstance(align_bytes, bool)
            or not isinstance(align_bytes, int)
            or align_bytes <= 0
            or align_bytes % item
        ):
            raise LayoutError(
                f"align_bytes must be a positive multiple of {item}, got {align_bytes!r}"
            )
        states = list(states)
        for s in states:
            if not _STATE_NAME.match(s) or s in _RESERVED:
                raise LayoutError(f"bad state name {s!r}")
        if len(set(states)) != len(states):
            raise LayoutError(f"duplicate state names in {states}")
        align = align_bytes // item
        params, off = [], 0
        if offsets is None:
            for name, p in named:
                off = -(-off // align) * align
                params.append([name, list(p.shape), off, p.numel()])
                off += p.numel()
        else:  # a shard of a larger flat space (leto.retained.shard): its own offsets
            if len(offsets) != len(named):
                raise LayoutError(f"{len(offsets)} offsets for {len(named)} parameters")
            for (name, p), o in zip(named, offsets, strict=True):
                if isinstance(o, bool) or not isinstance(o, int) or o < off:
                    raise LayoutError(f"parameter {name!r}: offset {o!r} overlaps the one before")
                params.append([name, list(p.shape), o, p.numel()])
                off = o + p.numel()
        n_chunks = max(1, -(-off // chunk_numel))
        if numel is not None:
            if numel % chunk_numel or numel < off:
                raise LayoutError(
                    f"numel {numel} is not whole chunks of {chunk_numel} holding {off} elements"
                )
            n_chunks = max(1, numel // chunk_numel)
        if undo_slots is None:
            undo_slots = n_chunks
        if isinstance(undo_slots, bool) or not isinstance(undo_slots, int) or undo_slots < 1:
            raise LayoutError(f"undo_slots must be a positive int or None, got {undo_slots!r}")
        own = [_dtype_name(p.dtype) for _, p in named]
        extra = {} if all(p.dtype == dtype for _, p in named) else {"model_dtypes": own}
        return {
            **extra,
            "format": FORMAT,
            "dtype": _dtype_name(dtype),
            "chunk_numel": chunk_numel,
            "n_chunks": n_chunks,
            "numel": n_chunks * chunk_numel,
            "undo_slots": undo_slots,
            "align_bytes": align_bytes,
            "states": states,
            "params": params,
        }

    @staticmethod
    def _sizes(meta: dict[str, Any]) -> dict[str, int]:
        item = torch.empty((), dtype=getattr(torch, meta["dtype"])).element_size()
        buf = meta["numel"] * item
        sizes = {"param": buf, "grad": buf}
        for s in meta["states"]:
            sizes["state." + s] = buf
        sizes["undo"] = meta["undo_slots"] * (1 + len(meta["states"])) * meta["chunk_numel"] * item
        sizes["header"] = 8 * (
            _H_FIXED
            + _CHUNK_WORDS * meta["n_chunks"]
            + _SLOT_WORDS * meta["undo_slots"]
            + len(meta["params"])
        )
        return sizes

    @staticmethod
    def _alloc_all(alloc: Allocator, prefix: str, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        segs = {}
        for key, n in sizes.items():
            seg = alloc(f"{prefix}.{key}", n)
            if (
                seg.dtype != torch.uint8
                or seg.dim() != 1
                or seg.numel() != n
                or not seg.is_contiguous()
            ):
                raise LayoutError(
                    f"allocator returned a bad segment for {prefix}.{key}: want {n} contiguous uint8 bytes"
                )
            segs[key] = seg
        devices = {s.device for s in segs.values()}
        if len(devices) != 1:
            raise LayoutError(f"segments on several devices: {sorted(map(str, devices))}")
        return segs

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
        named = _named(model)
        meta = cls._plan(
            named, chunk_numel, states, undo_slots, align_bytes, master_weights, offsets, numel
        )
        for name, p in named:
            if p.device.type == "meta":
                raise LayoutError(
                    f"parameter {name!r} is on the meta device: create needs values (use attach)"
                )
        alloc = alloc or default_allocator
        segs = cls._alloc_all(alloc, prefix, cls._sizes(meta))
        meta["checksum"] = checksum_algorithm or default_algorithm(segs["param"].device)
        meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
        sup = alloc(f"{prefix}.super", 8 * _SUPER_WORDS)
        mseg = alloc(f"{prefix}.meta", len(meta_bytes))
        sup.view(torch.int64)[0] = 0  # not attachable until complete
        dtype = getattr(torch, meta["dtype"])
        pbuf = segs["param"].view(dtype)
        with torch.no_grad():
            pbuf.zero_()
            for (_, p), (_, shape, off, n) in zip(named, meta["params"], strict=True):
                pbuf[off : off + n].view(shape).copy_(p.detach())
            segs["grad"].view(dtype).fill_(-0.0)
            for s in meta["states"]:
                segs["state." + s].zero_()
        hdr = segs["header"].view(torch.int64)
        hdr.zero_()
        hdr[:7] = torch.tensor(
            [MAGIC, FORMAT, meta["n_chunks"], meta["undo_slots"], len(named), -1, -1]
        )
        base = _H_FIXED
        hdr[base : base + _CHUNK_WORDS * meta["n_chunks"]].view(-1, _CHUNK_WORDS)[:, 2] = -1
        sbase = base + _CHUNK_WORDS * meta["n_chunks"]
        hdr[sbase : sbase + _SLOT_WORDS * meta["undo_slots"]].view(-1, _SLOT_WORDS)[:, 0] = -1
        layout = cls(meta, segs, named, prefix)
        layout.seal_all(0)
        old_grads = [p.grad for p in layout.params]
        layout._bind_all()
        layout.derive_params()  # exact (the master is the cast up); a no-op without any
        with torch.no_grad():
            for i, g in enumerate(old_grads):
                if g is not None and layout.params[i].requires_grad:
                    layout.grad_view(i).copy_(g)  # a derived parameter keeps its own too
                    layout._flags[i] = True
        mseg.copy_(torch.frombuffer(bytearray(meta_bytes), dtype=torch.uint8).to(mseg.device))
        sv = sup.view(torch.int64)
        sv[1:4] = torch.tensor([FORMAT, len(meta_bytes), zlib.crc32(meta_bytes)])
        sv[0] = MAGIC  # last: the layout is complete
        return layout

    @classmethod
    def read_meta(cls, alloc: Allocator, prefix: str = "leto") -> dict[str, Any]:
        """The JSON description of the retained layout under ``prefix`` (validated)."""
        sup = alloc(f"{prefix}.super", 8 * _SUPER_WORDS).view(torch.int64).tolist()
        if sup[0] != MAGIC:
            raise LayoutError(f"no complete retained layout under prefix {prefix!r} (bad magic)")
        if sup[1] != FORMAT:
            raise LayoutError(f"retained layout format {sup[1]} is not supported (want {FORMAT})")
        raw = bytes(alloc(f"{prefix}.meta", sup[2]).cpu().numpy().tobytes())
        if zlib.crc32(raw) != sup[3]:
            raise ChecksumError(
                f"retained layout description under {prefix!r} is corrupted (CRC mismatch)"
            )
        meta: dict[str, Any] = json.loads(raw)
        why = algorithm_error(meta.get("checksum"))
        if why:
            raise LayoutError(f"retained layout under {prefix!r}: {why}")
        return meta

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
        named = _named(model)
        meta = cls.read_meta(alloc, prefix)
        have = {n: p for n, p in named}
        want = {n: (tuple(s), c) for n, s, _, c in meta["params"]}
        dtypes = meta.get("model_dtypes") or [meta["dtype"]] * len(meta["params"])
        own = {n: d for (n, _, _, _), d in zip(meta["params"], dtypes, strict=True)}
        for name, p in named:
            if name not in want:
                raise ShapeMismatchError(
                    f"parameter {name!r} of the model is not in the retained layout"
                )
            if tuple(p.shape) != want[name][0]:
                raise ShapeMismatchError(
                    f"parameter {name!r}: the model has shape {_fmt(p.shape)}, "
                    f"the retained layout has {_fmt(want[name][0])}"
                )
            if _dtype_name(p.dtype) != own[name]:
                raise ShapeMismatchError(
                    f"parameter {name!r}: the model has dtype {p.dtype}, the retained layout has {own[name]}"
                )
        missing = [n for n in want if n not in have]
        if missing:
            raise ShapeMismatchError(
                f"the model lacks retained parameters: {', '.join(map(repr, missing))}"
            )
        segs = cls._alloc_all(alloc, prefix, cls._sizes(meta))
        hdr = segs["header"].view(torch.int64)
        head = hdr[:5].tolist()
        if head != [MAGIC, FORMAT, meta["n_chunks"], meta["undo_slots"], len(meta["params"])]:
            raise LayoutError(f"retained header under {prefix!r} does not match its description")
        order = {n: i for i, (n, _, _, _) in enumerate(meta["params"])}
        named = sorted(named, key=lambda np_: order[np_[0]])
        layout = cls(meta, segs, named, prefix)
        layout._bind_all()
        layout.derive_params()
        mask = layout.present_mask()
        layout._flags = list(mask)
        return layout

    def _bind_all(self) -> None:
        for i, p in enumerate(self.params):
            if i in self._derived:
                if p.device != self.device or not p.is_contiguous():  # e.g. a meta skeleton
                    _bind(p, torch.empty(p.shape, dtype=p.dtype, device=self.device))
                continue
            _bind(p, self.param_view(i))
            if p.requires_grad:
                p.grad = self.grad_view(i)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))  # type: ignore[no-untyped-call]

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self._flags[i] = True

        return hook

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
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _compute_pieces(self) -> list[tuple[Piece, ...]]:
        out: list[list[Piece]] = [[] for _ in range(self.n_chunks)]
        c = self.chunk_numel
        for i, s in enumerate(self.slots):
            a, end = s.offset, s.offset + s.numel
            while a < end:
                k = a // c
                b = min(end, (k + 1) * c)
                out[k].append(Piece(i, a, b))
                a = b
        return [tuple(x) for x in out]

    # ----------------------------------------------------------------- views

    def index_of(self, p: torch.Tensor) -> int:
        """The layout index of parameter ``p`` (by identity)."""
        try:
            return self._index[id(p)]
        except KeyError:
            raise LayoutError("tensor is not a parameter of this layout") from None

    def _flat_view(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        s = self.slots[i]
        return buf[s.offset : s.offset + s.numel].view(s.shape)

    def param_view(self, i: int) -> torch.Tensor:
        return self._flat_view(self.param_buffer, i)

    def view_in(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's view of ``buf``, any flat buffer laid out like the param buffer."""
        return self._flat_view(buf, i)

    def grad_view(self, i: int) -> torch.Tensor:
        return self._flat_view(self.grad_buffer, i)

    def state_buffer(self, name: str) -> torch.Tensor:
        try:
            return self._state_buf[name]
        except KeyError:
            raise LayoutError(
                f"the layout has no state buffer {name!r} (it has {list(self.states)})"
            ) from None

    def state_view(self, name: str, i: int) -> torch.Tensor:
        return self._flat_view(self.state_buffer(name), i)

    def data_buffers(self) -> list[torch.Tensor]:
        """The flat buffers a chunk's data spans: params, then states in order."""
        return [self.param_buffer, *(self._state_buf[n] for n in self.states)]

    def chunk_range(self, i: int) -> tuple[int, int]:
        self._check_index(i)
        return i * self.chunk_numel, (i + 1) * self.chunk_numel

    def chunk_pieces(self, i: int) -> tuple[Piece, ...]:
        self._check_index(i)
        return self._pieces[i]

    def chunk_data(self, i: int) -> list[torch.Tensor]:
        """Chunk i's slice of params and every state buffer (1-D views)."""
        a, b = self.chunk_range(i)
        return [buf[a:b] for buf in self.data_buffers()]

    def chunk_grad(self, i: int) -> torch.Tensor:
        a, b = self.chunk_range(i)
        return self.grad_buffer[a:b]

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self.n_chunks:
            raise IndexError(f"chunk {i} out of range (0..{self.n_chunks - 1})")

    # ---------------------------------------------------------------- header

    def _read_header(self) -> None:
        h = self._hdr.tolist()
        rows = h[_H_FIXED : self._slot_base]
        self._ver = rows[0::_CHUNK_WORDS]
        self._gver = rows[2::_CHUNK_WORDS]
        srows = h[self._slot_base : self._mask_base]
        self._slot_chunk = srows[0::_SLOT_WORDS]
        self._slot_ver = srows[1::_SLOT_WORDS]
        self._prepared = h[_H_PREPARED]
        self._staged: tuple[int, int, int] | None = None  # stage_undo's (slot, chunk, version)

    def _hw(self, idx: int, value: int | torch.Tensor) -> None:
        if self._hnp is not None:
            self._hnp[idx] = value.item() if isinstance(value, torch.Tensor) else value
        else:
            self._hdr[idx] = value

    def _row(self, i: int) -> int:
        return _H_FIXED + _CHUNK_WORDS * i

    def chunk_version(self, i: int) -> int:
        """The step chunk i's bytes are at (for TORN: the step they were at before)."""
        self._check_index(i)
        return int(self._ver[i])

    def _slot_of(self, i: int) -> int | None:
        for k, c in enumerate(self._slot_chunk):
            if c == i:
                return k
        return None

    def chunk_status(self, i: int) -> ChunkStatus:
        self._check_index(i)
        return self._status(i, self._slot_of(i))

    def _status(self, i: int, k: int | None) -> ChunkStatus:
        if k is None:
            return ChunkStatus.CLEAN
        if self._ver[i] == self._slot_ver[k]:
            return ChunkStatus.TORN
        if self._ver[i] == self._slot_ver[k] + 1:
            return ChunkStatus.APPLIED
        raise ChunkStateError(
            f"chunk {i}: header version {self._ver[i]} and undo version {self._slot_ver[k]} are inconsistent"
        )

    def chunk_statuses(self) -> list[ChunkStatus]:
        """Every chunk's :meth:`chunk_status`, read in one pass over the header's cache
        (a recovery reads them all: its cost per chunk is a list entry, not a call)."""
        slot = {c: k for k, c in enumerate(self._slot_chunk) if c >= 0}
        if not slot:
            return [ChunkStatus.CLEAN] * self.n_chunks
        return [self._status(i, slot.get(i)) for i in range(self.n_chunks)]

    def chunk_versions(self) -> list[int]:
        """Every chunk's :meth:`chunk_version` (a copy)."""
        return list(self._ver)

    def base_version(self) -> int:
        """The step every chunk's trusted bytes are at least at (undo version for torn/applied)."""
        vs = []
        for i in range(self.n_chunks):
            k = self._slot_of(i)
            vs.append(self._slot_ver[k] if k is not None else self._ver[i])
        return int(min(vs))

    def stored_checksum(self, i: int) -> int:
        return int(self._hdr[self._row(i) + 1].item())

    def stored_checksums(self) -> torch.Tensor:
        """Every chunk's recorded checksum (int64, a copy)."""
        return self._table[:, 1].clone()

    def stored_checksum_list(self) -> list[int]:
        """Every chunk's :meth:`stored_checksum`, read in one call."""
        return [int(x) for x in self._table[:, 1].tolist()]

    def grad_checksums(self) -> list[int]:
        """The per-chunk gradient checksums recorded by the last :meth:`seal_grads`."""
        return [int(x) for x in self._table[:, 3].tolist()]

    def compute_checksum(self, i: int, version: int) -> torch.Tensor:
        """Checksum of chunk i's current data bytes, salted with ``version``."""
        return checksum(
            self.chunk_data(i),
            index=i,
            version=version,
            domain=DOMAIN_DATA,
            algorithm=self.checksum_algorithm,
        )

    def data_checksums(self, versions: Sequence[int]) -> torch.Tensor:
        """Checksums of every chunk's current data bytes, chunk i salted with ``versions[i]``."""
        return checksum_chunks(
            self.data_buffers(),
            self.n_chunks,
            versions,
            domain=DOMAIN_DATA,
            algorithm=self.checksum_algorithm,
        )

    def grad_checksums_at(self, step: int) -> torch.Tensor:
        """Checksums of every chunk of the current gradient bytes, as those of ``step``."""
        return checksum_chunks(
            [self.grad_buffer],
            self.n_chunks,
            [step] * self.n_chunks,
            domain=DOMAIN_GRAD,
            algorithm=self.checksum_algorithm,
        )

    def seal_chunk(self, i: int, version: int) -> None:
        """Record chunk i's bytes as version ``version`` (checksum, then version).

        The optimizer calls it after a chunk's new bytes are written; recovery
        calls it after rebuilding a chunk from parity.
        """
        self._check_index(i)
        self._staged = None
        r = self._row(i)
        self._hw(r + 1, self.compute_checksum(i, version))
        self._hw(r, version)
        self._ver[i] = version

    def seal_all(self, version: int) -> None:
        """Record every chunk's bytes as ``version`` (one batched checksum pass)."""
        self._staged = None
        self._table[:, 1] = self.data_checksums([version] * self.n_chunks)
        self._table[:, 0] = version
        self._ver = [version] * self.n_chunks

    def verify_chunk(self, i: int) -> bool:
        """Do chunk i's bytes match its recorded checksum and version?"""
        return bool(self.compute_checksum(i, self._ver[i]).item() == self.stored_checksum(i))

    def verify(self, intact: Collection[int] = ()) -> list[int]:
        """Indices of CLEAN or APPLIED chunks whose bytes fail their checksum.

        TORN chunks are skipped: their bytes are untrusted by definition; check
        their undo copy with :meth:`verify_undo`. ``intact``: chunks the caller
        checked since anything last wrote them (not read again).
        """
        if intact:
            intact = set(intact)
            bad = [i not in intact and not self.verify_chunk(i) for i in range(self.n_chunks)]
        else:
            bad = (self.data_checksums(self._ver) != self._table[:, 1]).tolist()
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
            c for c, v in enumerate(self._ver) if st[c] is not ChunkStatus.CLEAN or v != target
        ]
        bad = self.verify(intact)
        if not wrong and not bad:
            return None
        return f"chunks {wrong} not clean at step {target}, chunks {bad} fail their checksums"

    # --------------------------------------------------------------- gradients

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat grad buffer, keeping ``.grad`` views (no ``None``).

        ``set_to_none=True`` fills ``-0.0`` and marks every gradient absent (what
        torch's None means); ``False`` fills ``+0.0`` and keeps present marks,
        like torch's ``grad.zero_()``. A derived parameter's own ``.grad`` is set
        to None or zeroed, as torch does.
        """
        for i, p in enumerate(self.params):
            if not p.requires_grad:
                continue
            if i in self._derived:
                if set_to_none or p.grad is None:
                    p.grad = None
                else:
                    with torch.no_grad():
                        p.grad.zero_()
                continue
            view = self.grad_view(i)
            if p.grad is None:
                self._flags[i] = False
            elif not _aliases(p.grad, view):
                self._flags[i] = True
            if not _aliases(p.grad, view):
                p.grad = view
        with torch.no_grad():
            self.grad_buffer.fill_(-0.0 if set_to_none else 0.0)
        if set_to_none:
            self._flags = [False] * len(self.params)

    def collect_grads(self) -> list[bool]:
        """Which parameters have a gradient now; copies in any ``.grad`` the user replaced.

        A ``.grad`` of None counts absent (and stays None); a foreign tensor is
        copied into the flat buffer and the view re-bound. A derived parameter's
        ``.grad`` (its own dtype) is cast into the buffer and stays its own.
        """
        present = []
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                present.append(False)
                continue
            if i in self._derived:
                _copy_in(g, self.grad_view(i), f"the .grad of {self.slots[i].name!r}")
                present.append(True)
                continue
            view = self.grad_view(i)
            if not _aliases(g, view):
                p.grad = _copy_in(g, view, f"the .grad of {self.slots[i].name!r}")
                self._flags[i] = True
            present.append(self._flags[i])
        return present

    def seal_grads(self, step: int, present: Sequence[bool]) -> None:
        """PREPARE: record the gradients in retained memory as those of ``step``.

        Writes the present mask and a per-chunk gradient checksum; ``prepared``
        is written last.
        """
        if len(present) != len(self.params):
            raise LayoutError(f"present mask has {len(present)} entries, want {len(self.params)}")
        self._hw(_H_PREPARED, -1)
        self._prepared = -1
        self._hdr[self._mask_base : self._mask_base + len(present)] = torch.tensor(
            [int(bool(x)) for x in present], dtype=torch.int64
        ).to(self._hdr.device)
        self._table[:, 3] = self.grad_checksums_at(step)
        self._table[:, 2] = step
        self._gver = [step] * self.n_chunks
        self._hw(_H_PREPARED, step)
        self._prepared = step

    @property
    def suspect(self) -> bool:
        """A checksum pass found some chunk failing since the last recovery ended: the
        next recovery's report reads every chunk, none is deferred."""
        return int(self._hdr[_H_SUSPECT]) != 0

    def mark_suspect(self, value: bool = True) -> None:
        self._hw(_H_SUSPECT, int(value))

    def clear_prepared(self) -> None:
        """Forget the prepared gradients (a rolled-back step: nothing in flight survives,
        or the next step's reduced gradients are about to overwrite them)."""
        self._hw(_H_PREPARED, -1)
        self._prepared = -1
        self._hw(_H_REDUCED, -1)

    def mark_reduced(self, step: int) -> None:
        """The gradients of ``step`` are reduced into the buffer, not sealed yet (the
        protocol's Reduce: a recovery reports them as ``step``'s, unsealed)."""
        self._hw(_H_REDUCED, step)

    @property
    def reduced_step(self) -> int:
        """The step whose reduced gradients fill the buffer unsealed (-1: none; only
        meaningful while :attr:`prepared_step` is -1)."""
        return int(self._hdr[_H_REDUCED].item())

    @property
    def prepared_step(self) -> int:
        """The step whose gradients were sealed last (-1: none)."""
        return int(self._prepared)

    def present_mask(self) -> list[bool]:
        """The present mask sealed with the gradients (read from retained memory)."""
        return [
            bool(x)
            for x in self._hdr[self._mask_base : self._mask_base + len(self.params)].tolist()
        ]

    def verify_grads(self, step: int) -> list[int]:
        """Chunks whose gradients are not sealed for ``step`` or fail their checksum."""
        bad = (self.grad_checksums_at(step) != self._table[:, 3]).tolist()
        return [i for i in range(self.n_chunks) if bad[i] or self._gver[i] != step]

    # -------------------------------------------------------------------- undo

    def stage_undo(self, i: int) -> bool:
        """Copy CLEAN chunk i's data into a free undo slot ahead of its :meth:`save_undo`
        (``staged=True``), which then writes only the slot's header: the copy runs where
        the caller waits anyway (a step's COMMIT round trip). The slot stays free until
        then (its header unchanged: a recovery ignores its bytes). False (nothing copied)
        if no slot is free or the chunk is not clean.

        The caller writes nothing into chunk i between the two calls; any other undo
        operation, and any seal, drops the staged copy.
        """
        self._staged = None
        if self.chunk_status(i) is not ChunkStatus.CLEAN or -1 not in self._slot_chunk:
            return False
        k = self._slot_chunk.index(-1)
        self._copy_undo(k, i)
        self._staged = (k, i, self._ver[i])
        return True

    def _copy_undo(self, k: int, i: int) -> None:
        with torch.no_grad():
            for dst, src in zip(self._undo[k], self.chunk_data(i), strict=True):
                dst.copy_(src)

    def save_undo(self, i: int, *, verify: bool = False, staged: bool = False) -> None:
        """Copy chunk i's data into a free undo slot; the chunk becomes TORN.

        ``verify=True`` first checks the bytes against their checksum (two extra
        reads), so corruption is caught before a step launders it into new bytes.
        ``staged=True``: the bytes were copied by :meth:`stage_undo` (used if that copy
        is of chunk i at its version and its slot is still free; else copied here).
        """
        ahead, self._staged = self._staged, None
        status = self.chunk_status(i)
        if status is not ChunkStatus.CLEAN:
            raise ChunkStateError(f"save_undo: chunk {i} is {status.value}, not clean")
        if verify and not self.verify_chunk(i):
            raise ChecksumError(f"chunk {i} fails its checksum at version {self._ver[i]}")
        if staged and ahead is not None and ahead[1:] == (i, self._ver[i]):
            k = ahead[0]
            staged = self._slot_chunk[k] == -1
        else:
            staged = False
        if not staged:
            try:
                k = self._slot_chunk.index(-1)
            except ValueError:
                busy = [c for c in self._slot_chunk]
                raise ChunkStateError(
                    f"save_undo: no free undo slot for chunk {i} (slots hold chunks {busy}; finish or restore one)"
                ) from None
            self._copy_undo(k, i)
        base = self._slot_base + _SLOT_WORDS * k
        self._hw(base + 2, self._hdr[self._row(i) + 1])
        self._hw(base + 1, self._ver[i])
        self._slot_ver[k] = self._ver[i]
        self._hw(base, i)  # last: the slot is valid
        self._slot_chunk[k] = i

    def _slot_checked(self, i: int) -> int:
        k = self._slot_of(i)
        if k is None:
            raise ChunkStateError(f"chunk {i} has no undo copy")
        return k

    def undo_data(self, i: int) -> list[torch.Tensor]:
        """The undo copy of chunk i (same structure as :meth:`chunk_data`)."""
        return list(self._undo[self._slot_checked(i)])

    def undo_version(self, i: int) -> int:
        return int(self._slot_ver[self._slot_checked(i)])

    def undo_checksum(self, i: int) -> int:
        """The checksum recorded with chunk i's undo copy (of its bytes at :meth:`undo_version`)."""
        k = self._slot_checked(i)
        return int(self._hdr[self._slot_base + _SLOT_WORDS * k + 2].item())

    def verify_undo(self, i: int) -> bool:
        k = self._slot_checked(i)
        cs = checksum(
            list(self._undo[k]),
            index=i,
            version=self._slot_ver[k],
            domain=DOMAIN_DATA,
            algorithm=self.checksum_algorithm,
        )
        return bool(cs.item() == self.undo_checksum(i))

    def restore_undo(self, i: int) -> None:
        """Put chunk i's undo copy back (after checking it); the chunk becomes CLEAN at the old version."""
        self._staged = None
        k = self._slot_checked(i)
        if not self.verify_undo(i):
            raise ChecksumError(f"the undo copy of chunk {i} fails its checksum")
        with torch.no_grad():
            for dst, src in zip(self.chunk_data(i), self._undo[k], strict=True):
                dst.copy_(src)
        base = self._slot_base + _SLOT_WORDS * k
        r = self._row(i)
        self._hw(r + 1, self._hdr[base + 2])
        self._hw(r, self._slot_ver[k])
        self._ver[i] = self._slot_ver[k]
        self._hw(base, -1)
        self._slot_chunk[k] = -1

    def release_undo(self, i: int) -> None:
        """Drop chunk i's undo copy once its new bytes (and parity) are written."""
        status = self.chunk_status(i)
        if status is not ChunkStatus.APPLIED:
            raise ChunkStateError(
                f"release_undo: chunk {i} is {status.value}, not applied (its undo is still needed)"
            )
        k = self._slot_checked(i)
        self._hw(self._slot_base + _SLOT_WORDS * k, -1)
        self._slot_chunk[k] = -1

    def __repr__(self) -> str:
        return (
            f"RetainedLayout(prefix={self.prefix!r}, params={len(self.params)}, dtype={self.dtype}, "
            f"device={self.device}, chunk_numel={self.chunk_numel}, n_chunks={self.n_chunks}, states={list(self.states)})"
        )
