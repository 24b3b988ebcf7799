"""Where every parameter lies in a layout's flat buffers, and how the buffers cut into chunks.

Chunk i is elements ``[i*C, (i+1)*C)`` of every flat buffer (params, grads, each
optimizer state); a parameter may span several chunks, and the part of it inside
one chunk is a :class:`Piece`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ParamSlot", "Piece", "ChunkGeometry"]


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


class ChunkGeometry:
    """The parameters' slots and the chunk size: element ranges, views and pieces."""

    def __init__(self, slots: tuple[ParamSlot, ...], chunk_numel: int, n_chunks: int) -> None:
        self.slots = slots
        self.chunk_numel = chunk_numel
        self.n_chunks = n_chunks
        self._pieces = self._compute_pieces()

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

    def check(self, i: int) -> None:
        """Raise ``IndexError`` unless ``i`` is a chunk index."""
        if not 0 <= i < self.n_chunks:
            raise IndexError(f"chunk {i} out of range (0..{self.n_chunks - 1})")

    def view_in(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's view of ``buf``, any flat buffer laid out like the param buffer."""
        s = self.slots[i]
        return buf[s.offset : s.offset + s.numel].view(s.shape)

    def chunk_range(self, i: int) -> tuple[int, int]:
        self.check(i)
        return i * self.chunk_numel, (i + 1) * self.chunk_numel

    def chunk_pieces(self, i: int) -> tuple[Piece, ...]:
        self.check(i)
        return self._pieces[i]

    def slices(self, bufs: Sequence[torch.Tensor], i: int) -> list[torch.Tensor]:
        """Chunk i's slice of each of ``bufs`` (1-D views)."""
        a, b = self.chunk_range(i)
        return [buf[a:b] for buf in bufs]
