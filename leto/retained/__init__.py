"""The tensor layer: retained state layout, chunked optimizers, parity on tensors.

* :mod:`leto.retained.layout`: :class:`RetainedLayout` packs a model's params,
  grads and optimizer state into chunked flat buffers from an injected allocator
  and makes the parameters views into them; per-chunk version, checksum and undo,
  each held by a part of the layout: :mod:`~leto.retained.geometry`,
  :mod:`~leto.retained.records`, :mod:`~leto.retained.undo`,
  :mod:`~leto.retained.grads` (over one :mod:`~leto.retained.header`), planned and
  described by :mod:`~leto.retained.layout_meta`.
* :mod:`leto.retained.optim`: :class:`ChunkedSGD`, :class:`ChunkedAdam`,
  :class:`ChunkedAdamW` (torch's own math, chunk by chunk:
  :mod:`~leto.retained.optim_chunked`) and the :class:`WholeStepOptimizer` fallback
  (:mod:`~leto.retained.optim_whole`), all with the same transaction API
  (:mod:`~leto.retained.optim_base`).
* :mod:`leto.retained.dtensor_layout`: the mesh-aware layout for FSDP2 / TP / HSDP
  models: each rank's padded DTensor shards of parameters, gradients and optimizer
  state bound to flat buffers (no copy on the step's path); every private torch
  attribute it needs is read through :mod:`~leto.retained.torch_private`.
* :mod:`leto.retained.checksum`: salted Fletcher checksums over int32 words.
* :mod:`leto.retained.parity`: sum-mod-256 parity (encode, update, decode) over
  a tiny :class:`Collective` protocol, with an in-process implementation.

Standalone: imports torch, never ``leto.core``.
"""

from __future__ import annotations

from .checksum import checksum
from .layout import (
    DEFAULT_CHUNK_NUMEL,
    Allocator,
    ChecksumError,
    ChunkStateError,
    ChunkStatus,
    InMemorySegments,
    LayoutError,
    ParamSlot,
    Piece,
    RetainedLayout,
    ShapeMismatchError,
    default_allocator,
)
from .optim import (
    ChunkedAdam,
    ChunkedAdamW,
    ChunkedOptimizer,
    ChunkedSGD,
    RetainedOptimizer,
    UnsupportedOptimizerError,
    WholeStepOptimizer,
    check_supported,
    is_chunkable,
    required_states,
    retain,
    to_retained,
)
from .parity import Collective, InProcessCollective, InProcessGroup, TorchDistCollective, run_spmd

__all__ = [
    "Allocator",
    "ChecksumError",
    "ChunkStateError",
    "ChunkStatus",
    "ChunkedAdam",
    "ChunkedAdamW",
    "ChunkedOptimizer",
    "ChunkedSGD",
    "Collective",
    "DEFAULT_CHUNK_NUMEL",
    "InMemorySegments",
    "InProcessCollective",
    "InProcessGroup",
    "LayoutError",
    "ParamSlot",
    "Piece",
    "RetainedLayout",
    "RetainedOptimizer",
    "ShapeMismatchError",
    "TorchDistCollective",
    "UnsupportedOptimizerError",
    "WholeStepOptimizer",
    "check_supported",
    "checksum",
    "default_allocator",
    "is_chunkable",
    "required_states",
    "retain",
    "run_spmd",
    "to_retained",
]
