"""Retained memory on the CPU backend: anonymous memfd segments, mapped as tensors.

A segment is an ``os.memfd_create`` file: anonymous memory with no name in any
file system (nothing appears in ``/dev/shm``), created mode 0600, living exactly
as long as some process holds a descriptor or a mapping of it. The keeper
creates them and hands out descriptors over a Unix socket (``SCM_RIGHTS``); a
trainer maps them (``mmap``, ``MAP_SHARED``) and wraps the mapping as a uint8
tensor (``torch.frombuffer``): parameters, gradients and optimizer state are
views into it, with no copy. When every holder dies the kernel frees the memory:
a SIGKILLed launcher cannot leak it, and losing a keeper (with the trainer that
mapped its segments) really loses that memory.

A segment that only its creator may change (the keeper's fence word) is sealed
with ``F_SEAL_FUTURE_WRITE`` once its creator has mapped it (:func:`seal_writes`):
the creator's mapping still writes, but no descriptor of it, even one reopened
read-write through ``/proc/PID/fd``, can be written or mapped writable again.

This module imports torch only in :func:`as_tensor`.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Mapping", "as_tensor", "create", "digest", "seal_writes", "size_of"]

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1


def create(name: str, nbytes: int) -> int:
    """A new zero-filled memfd segment of ``nbytes`` (mode 0600, close-on-exec)."""
    if nbytes < 0:
        raise ValueError(f"segment {name!r}: negative size {nbytes}")
    fd = os.memfd_create(name[:240], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)
        # the size never changes again: a mapping can never be cut short under a reader
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    except BaseException:
        os.close(fd)
        raise
    return fd


def seal_writes(fd: int) -> None:
    """No new write to segment ``fd`` but through mappings that exist now: no
    ``write``, no new writable mapping, from any descriptor; and no more seals."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)


def size_of(fd: int) -> int:
    return os.fstat(fd).st_size


class Mapping:
    """A shared, writable mapping of a segment (``MAP_SHARED``)."""

    def __init__(self, fd: int, nbytes: int | None = None, *, writable: bool = True) -> None:
        size = size_of(fd)
        if nbytes is not None and nbytes != size:
            raise ValueError(f"segment has {size} bytes, {nbytes} expected")
        self.nbytes = size
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self.mm: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED, prot) if size else None

    def buffer(self) -> Any:
        return self.mm if self.mm is not None else bytearray()


def as_tensor(fd: int, nbytes: int | None = None) -> torch.Tensor:
    """Map segment ``fd`` and return a 1-D uint8 tensor over the mapping (no copy).

    The tensor keeps the mapping alive; the descriptor may be closed afterwards.
    """
    import warnings

    import torch

    m = Mapping(fd, nbytes)
    if m.mm is None:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = torch.frombuffer(m.mm, dtype=torch.uint8)
    return t


def digest(fd: int) -> str:
    """SHA-256 of a segment's bytes (read through a private read-only mapping)."""
    size = size_of(fd)
    h = hashlib.sha256()
    if size:
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            h.update(mm)
    return h.hexdigest()
