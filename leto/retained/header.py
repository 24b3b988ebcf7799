"""The int64 header segment of a retained layout: what each word holds, and stores into it.

The words, in order::

    magic, format, n_chunks, undo_slots, n_params, prepared, reduced, suspect
    per chunk:      version, checksum, grad version, grad checksum
    per undo slot:  chunk (-1 = free), version, checksum
    per parameter:  present (the mask sealed with the gradients)

The layout's parts each own some of these words (:mod:`.records` a chunk's version and
checksum and the suspect flag, :mod:`.undo` the slots, :mod:`.grads` the gradients'
words and the mask) and keep a host copy of what they read often; a :class:`Header`
is the one segment they share.
"""

from __future__ import annotations

import torch

__all__ = ["MAGIC", "FORMAT", "Header", "header_nbytes", "initialise", "describes"]

MAGIC = 0x4C45544F52544E44  # "LETORTND"
FORMAT = 2  # 2: the meta records the checksum algorithm
FIXED = 8  # header: magic, format, n_chunks, undo_slots, n_params, prepared, reduced, suspect
PREPARED = 5
REDUCED = 6
SUSPECT = 7  # 1: a checksum pass found a chunk failing: the next report reads every chunk
CHUNK_WORDS = 4  # version, checksum, grad version, grad checksum
VERSION, CHECKSUM, GRAD_VERSION, GRAD_CHECKSUM = range(CHUNK_WORDS)
SLOT_WORDS = 3  # chunk (-1 = free), version, checksum
SLOT_CHUNK, SLOT_VERSION, SLOT_CHECKSUM = range(SLOT_WORDS)


def header_nbytes(n_chunks: int, undo_slots: int, n_params: int) -> int:
    return 8 * (FIXED + CHUNK_WORDS * n_chunks + SLOT_WORDS * undo_slots + n_params)


def initialise(seg: torch.Tensor, n_chunks: int, undo_slots: int, n_params: int) -> None:
    """A fresh header: every chunk at version 0, no gradients sealed, every slot free."""
    hdr = seg.view(torch.int64)
    hdr.zero_()
    hdr[:7] = torch.tensor([MAGIC, FORMAT, n_chunks, undo_slots, n_params, -1, -1])
    base = FIXED
    hdr[base : base + CHUNK_WORDS * n_chunks].view(-1, CHUNK_WORDS)[:, GRAD_VERSION] = -1
    sbase = base + CHUNK_WORDS * n_chunks
    hdr[sbase : sbase + SLOT_WORDS * undo_slots].view(-1, SLOT_WORDS)[:, SLOT_CHUNK] = -1


def describes(seg: torch.Tensor, n_chunks: int, undo_slots: int, n_params: int) -> bool:
    """Does the header's fixed part say what the layout's description says?"""
    head = seg.view(torch.int64)[:5].tolist()
    return bool(head == [MAGIC, FORMAT, n_chunks, undo_slots, n_params])


class Header:
    """One layout's header segment: word positions and scalar stores.

    Host headers are written through numpy (a scalar store, not a tensor op).
    """

    def __init__(self, seg: torch.Tensor, n_chunks: int, undo_slots: int) -> None:
        self.words = seg.view(torch.int64)
        self._np = self.words.numpy() if self.words.device.type == "cpu" else None
        #: one row per chunk: version, checksum, grad version, grad checksum
        self.table = self.words[FIXED : FIXED + CHUNK_WORDS * n_chunks].view(n_chunks, CHUNK_WORDS)
        self.slot_base = FIXED + CHUNK_WORDS * n_chunks
        self.mask_base = self.slot_base + SLOT_WORDS * undo_slots

    def read(self) -> list[int]:
        """Every word (one read: a new process's host copies start from it)."""
        h: list[int] = self.words.tolist()
        return h

    def chunk_column(self, h: list[int], word: int) -> list[int]:
        """Word ``word`` of every chunk's row, from the words ``h`` of :meth:`read`."""
        return h[FIXED : self.slot_base][word::CHUNK_WORDS]

    def slot_column(self, h: list[int], word: int) -> list[int]:
        """Word ``word`` of every undo slot's row, from the words ``h`` of :meth:`read`."""
        return h[self.slot_base : self.mask_base][word::SLOT_WORDS]

    def write(self, idx: int, value: int | torch.Tensor) -> None:
        if self._np is not None:
            self._np[idx] = value.item() if isinstance(value, torch.Tensor) else value
        else:
            self.words[idx] = value

    def row(self, i: int) -> int:
        """The first word of chunk i's row."""
        return FIXED + CHUNK_WORDS * i

    def slot(self, k: int) -> int:
        """The first word of undo slot k's row."""
        return self.slot_base + SLOT_WORDS * k
