"""A retained layout's description: planning it, its segments' sizes, and the JSON
meta and superblock that let another process attach to it.

Segments, each obtained from the allocator by name (see :mod:`.layout`)::

    {prefix}.meta           JSON: dtype, chunk size, names/shapes/offsets (no pickle)
    {prefix}.super          int64[8]: magic, format, meta length and CRC (written last)
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .alloc import Allocator
from .checksum import algorithm_error
from .errors import ChecksumError, LayoutError, ShapeMismatchError
from .header import FORMAT, MAGIC, header_nbytes
from .views import fmt_shape

__all__ = [
    "master_dtype",
    "named_params",
    "plan",
    "segment_sizes",
    "alloc_segments",
    "open_super",
    "seal_super",
    "read_meta",
    "check_model",
]

_SUPER_WORDS = 8
_STATE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RESERVED = {"param", "grad", "undo", "header", "meta", "super"}


def master_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype that holds every one of ``dtypes`` exactly: float32 promoted with each."""
    out = torch.float32
    for d in dtypes:
        out = torch.promote_types(out, d)
    return out


def named_params(
    model: nn.Module | Iterable[tuple[str, nn.Parameter]],
) -> list[tuple[str, nn.Parameter]]:
    if isinstance(model, nn.Module):
        return list(model.named_parameters())
    return list(model)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan(
    named: list[tuple[str, nn.Parameter]],
    chunk_numel: int,
    states: Sequence[str],
    undo_slots: int | None,
    align_bytes: int,
    master_weights: bool = False,
    offsets: Sequence[int] | None = None,
    numel: int | None = None,
) -> dict[str, Any]:
    """The layout's description (the JSON meta, less the checksum algorithm), checked."""
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
        raise LayoutError(f"align_bytes must be a positive multiple of {item}, got {align_bytes!r}")
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
    own = [dtype_name(p.dtype) for _, p in named]
    extra = {} if all(p.dtype == dtype for _, p in named) else {"model_dtypes": own}
    return {
        **extra,
        "format": FORMAT,
        "dtype": dtype_name(dtype),
        "chunk_numel": chunk_numel,
        "n_chunks": n_chunks,
        "numel": n_chunks * chunk_numel,
        "undo_slots": undo_slots,
        "align_bytes": align_bytes,
        "states": states,
        "params": params,
    }


def segment_sizes(meta: dict[str, Any]) -> dict[str, int]:
    """Bytes of each segment but the meta and the superblock, by key."""
    item = torch.empty((), dtype=getattr(torch, meta["dtype"])).element_size()
    buf = meta["numel"] * item
    sizes = {"param": buf, "grad": buf}
    for s in meta["states"]:
        sizes["state." + s] = buf
    sizes["undo"] = meta["undo_slots"] * (1 + len(meta["states"])) * meta["chunk_numel"] * item
    sizes["header"] = header_nbytes(meta["n_chunks"], meta["undo_slots"], len(meta["params"]))
    return sizes


def alloc_segments(alloc: Allocator, prefix: str, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """Every segment of ``sizes`` from ``alloc``, checked: contiguous bytes, one device."""
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


def open_super(
    alloc: Allocator, prefix: str, meta_bytes: bytes
) -> tuple[torch.Tensor, torch.Tensor]:
    """The superblock and meta segments of a layout being created, the superblock
    marked not attachable until :func:`seal_super`."""
    sup = alloc(f"{prefix}.super", 8 * _SUPER_WORDS)
    mseg = alloc(f"{prefix}.meta", len(meta_bytes))
    sup.view(torch.int64)[0] = 0  # not attachable until complete
    return sup, mseg


def seal_super(sup: torch.Tensor, mseg: torch.Tensor, meta_bytes: bytes) -> None:
    """Write the meta, then the superblock, its magic last: the layout is complete."""
    mseg.copy_(torch.frombuffer(bytearray(meta_bytes), dtype=torch.uint8).to(mseg.device))
    sv = sup.view(torch.int64)
    sv[1:4] = torch.tensor([FORMAT, len(meta_bytes), zlib.crc32(meta_bytes)])
    sv[0] = MAGIC  # last: the layout is complete


def read_meta(alloc: Allocator, prefix: str = "leto") -> dict[str, Any]:
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


def check_model(
    named: list[tuple[str, nn.Parameter]], meta: dict[str, Any]
) -> list[tuple[str, nn.Parameter]]:
    """The model's parameters in the layout's order, after checking names, shapes and
    dtypes against ``meta`` (:class:`ShapeMismatchError` naming the parameter)."""
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
                f"parameter {name!r}: the model has shape {fmt_shape(p.shape)}, "
                f"the retained layout has {fmt_shape(want[name][0])}"
            )
        if dtype_name(p.dtype) != own[name]:
            raise ShapeMismatchError(
                f"parameter {name!r}: the model has dtype {p.dtype}, the retained layout has {own[name]}"
            )
    missing = [n for n in want if n not in have]
    if missing:
        raise ShapeMismatchError(
            f"the model lacks retained parameters: {', '.join(map(repr, missing))}"
        )
    order = {n: i for i, (n, _, _, _) in enumerate(meta["params"])}
    return sorted(named, key=lambda np_: order[np_[0]])
