"""Host memory that outlives a training process, for the benchmark's workers.

The bench process (the agent) creates one anonymous memfd segment per rank
(:func:`leto.backends.gloo.segments.create`: nothing in ``/dev/shm``, freed when
the last holder dies) and hands it to every process of that rank with
``pass_fds``. Two views of it:

* :class:`Arena`: named sub-segments with create-or-attach semantics, the
  :data:`leto.retained.layout.Allocator` that leto's retained layout asks for,
  plus two slots for the rank's process state (JSON). A promoted shadow attaches
  to the layout the dead trainer created in it.
* :class:`GeminiSlots`: Gemini-style in-memory checkpoints: two slots of this
  rank's own state and two of its peer's, each with a step header written after
  the bytes (a slot being written reads as empty).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Arena", "GeminiSlots", "arena_bytes", "gemini_bytes"]

_PAGE = 4096
_DIR_BYTES = 64 * 1024
_PS_SLOT = 256 * 1024


def _align(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


def arena_bytes(params: int, chunk_numel: int) -> int:
    """A generous size for a rank's retained layout (memfd pages cost nothing until touched)."""
    return _align(
        16 * (params + chunk_numel) + 16 * chunk_numel + _DIR_BYTES + 2 * _PS_SLOT + 8 * 2**20
    )


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


class Arena(_Mapped):
    """Named segments in one memfd: ``arena(name, nbytes)`` creates or attaches."""

    def _read_dir(self) -> dict[str, Any]:
        (n,) = struct.unpack_from("<q", self.mm, 0)
        if n <= 0:
            return {"next": _DIR_BYTES + 2 * _PS_SLOT, "segs": {}}
        out: dict[str, Any] = json.loads(bytes(self.mm[8 : 8 + n]))
        return out

    def _write_dir(self, d: dict[str, Any]) -> None:
        raw = json.dumps(d).encode()
        if len(raw) + 8 > _DIR_BYTES:
            raise MemoryError("arena directory full")
        self.mm[8 : 8 + len(raw)] = raw
        struct.pack_into("<q", self.mm, 0, len(raw))

    def __call__(self, name: str, nbytes: int) -> torch.Tensor:
        d = self._read_dir()
        seg = d["segs"].get(name)
        if seg is None:
            off = d["next"]
            if off + nbytes > self.size:
                raise MemoryError(
                    f"arena of {self.size} bytes cannot hold {name!r} ({nbytes} bytes)"
                )
            d["segs"][name] = [off, nbytes]
            d["next"] = _align(off + nbytes)
            self._write_dir(d)
        else:
            off, have = seg
            if have != nbytes:
                raise ValueError(f"segment {name!r} has {have} bytes, {nbytes} requested")
        return self.tensor(off, nbytes)

    # process state: two slots, [step, length, json]; the step is written last
    def write_state(self, step: int, state: dict[str, Any]) -> None:
        raw = json.dumps(state).encode()
        if len(raw) + 16 > _PS_SLOT:
            raise MemoryError("process state larger than its slot")
        base = _DIR_BYTES + (step % 2) * _PS_SLOT
        struct.pack_into("<q", self.mm, base, -1)
        self.mm[base + 16 : base + 16 + len(raw)] = raw
        struct.pack_into("<q", self.mm, base + 8, len(raw))
        struct.pack_into("<q", self.mm, base, step)

    def read_state(self) -> tuple[int, dict[str, Any]] | None:
        best: tuple[int, dict[str, Any]] | None = None
        for slot in (0, 1):
            base = _DIR_BYTES + slot * _PS_SLOT
            step, n = struct.unpack_from("<qq", self.mm, base)
            if step >= 0 and (best is None or step > best[0]):
                best = (step, json.loads(bytes(self.mm[base + 16 : base + 16 + n])))
        return best


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
