"""Host memory that outlives a training process: the Gemini baseline's checkpoints.

The bench process (the agent) creates one anonymous memfd segment per rank
(:func:`leto.backends.gloo.segments.create`: nothing in ``/dev/shm``, freed when
the last holder dies) and hands it to every process of that rank with
``pass_fds``. :class:`GeminiSlots` views it as two slots of this rank's own state
and two of its peer's, each with a step header written after the bytes (a slot
being written reads as empty).
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["GeminiSlots", "gemini_bytes"]

_PAGE = 4096


def _align(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


def gemini_bytes(state_floats: int) -> int:
    return _PAGE + 4 * _align(4 * state_floats)


class _Mapped:
    def __init__(self, fd: int) -> None:
        self.size = os.fstat(fd).st_size
        self.mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        import warnings

        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the mapping is writable; torch warns anyway
            return torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=offset)


class GeminiSlots(_Mapped):
    """Slots 0-1: this rank's state at even/odd steps; 2-3: its peer's."""

    def __init__(self, fd: int, state_floats: int) -> None:
        super().__init__(fd)
        self.floats = state_floats
        self.stride = _align(4 * state_floats)

    def slot(self, i: int) -> torch.Tensor:
        import torch

        return self.tensor(_PAGE + i * self.stride, 4 * self.floats).view(torch.float32)

    def step_of(self, i: int) -> int:
        (s,) = struct.unpack_from("<q", self.mm, 8 * i)
        return int(s)

    def set_step(self, i: int, step: int) -> None:
        struct.pack_into("<q", self.mm, 8 * i, step)

    def clear(self) -> None:
        for i in range(4):
            self.set_step(i, -1)
