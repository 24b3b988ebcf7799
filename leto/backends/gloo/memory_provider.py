"""Where a keeper's retained memory comes from: one interface, host memfd or CUDA.

A keeper owns the memory; a trainer (and, on promotion, a shadow) maps it. The
provider is the part that differs by device:

* :class:`HostMemfdProvider`: anonymous memfd segments (:mod:`.segments`), handed
  over as descriptors (``SCM_RIGHTS``) and mapped as CPU tensors;
* :class:`~leto.backends.gloo.cuda_memory.CudaIpcProvider`: GPU memory the keeper
  allocates with torch, handed over as a CUDA IPC handle (``_share_cuda_``).

Both are used the same way: the keeper calls :meth:`MemoryProvider.allocate`
(zero-filled memory of ``nbytes`` under a name) and sends the :class:`Handle` over
its socket as JSON plus descriptors (:meth:`Handle.to_wire`; bytes as hex, so
nothing is unpickled); the other process rebuilds it (:meth:`Handle.from_wire`) and
:meth:`MemoryProvider.open`\\ s it: a writable 1-D uint8 tensor on the provider's
device that aliases the keeper's memory, no copy. The keeper keeps its own view, so
the memory outlives every process that opened it. :meth:`MemoryProvider.digest` is
the Fletcher checksum of :mod:`leto.retained.checksum` over the keeper's view: the
same value for the same bytes on any device (a tail of 1-3 bytes is read as one
zero-padded word).

The keeper itself (:mod:`.keeper`) still creates memfd segments directly; this
interface is what it would call to hold GPU memory instead.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import attrs
import torch

from leto.retained.checksum import checksum

from . import segments

__all__ = [
    "Handle",
    "HostMemfdProvider",
    "MemoryProvider",
    "ProviderError",
    "bytes_checksum",
    "check_size",
]

KINDS = ("memfd", "cuda-ipc")
_NAME_MAX = 200


class ProviderError(ValueError):
    """A request a memory provider refuses (bad size, released or foreign handle)."""


def check_size(name: str, nbytes: object) -> int:
    """``nbytes`` as a positive int, else :class:`ProviderError` naming the segment."""
    if not isinstance(name, str) or not name or len(name) > _NAME_MAX:
        raise ProviderError(f"bad segment name {name!r}")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise ProviderError(f"segment {name!r}: bad size {nbytes!r} (a positive int of bytes)")
    return nbytes


@attrs.frozen
class Handle:
    """What opens one segment in another process: JSON-safe ``fields`` plus descriptors.

    ``kind`` names the provider; ``fields`` holds only ints, bools and strings (a CUDA
    IPC handle's bytes as hex); ``fds`` are descriptors that travel by ``SCM_RIGHTS``
    (a memfd segment's one descriptor; none for CUDA).
    """

    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    name: str
    nbytes: int
    fields: dict[str, Any] = attrs.field(factory=dict)
    fds: tuple[int, ...] = ()

    def to_wire(self) -> tuple[dict[str, Any], list[int]]:
        """The message and descriptors to send over a keeper's socket (:mod:`.wire`)."""
        msg = {"kind": self.kind, "name": self.name, "nbytes": self.nbytes, "fields": self.fields}
        return msg, list(self.fds)

    @classmethod
    def from_wire(cls, msg: dict[str, Any], fds: list[int]) -> Handle:
        """A handle from a received message; a malformed one raises :class:`ProviderError`."""
        kind, name, nbytes, fields = (msg.get(k) for k in ("kind", "name", "nbytes", "fields"))
        if kind not in KINDS:
            raise ProviderError(f"unknown memory handle kind {kind!r}")
        check_size(name, nbytes)  # type: ignore[arg-type]
        if not isinstance(fields, dict) or not all(
            isinstance(v, int | str | bool) for v in fields.values()
        ):
            raise ProviderError(f"segment {name!r}: malformed handle fields")
        return cls(kind, name, nbytes, dict(fields), tuple(fds))  # type: ignore[arg-type]


class MemoryProvider(Protocol):
    """A keeper's source of retained memory on one device (contract:
    ``tests/gloo/test_memory_provider.py``)."""

    @property
    def device(self) -> torch.device: ...

    def allocate(self, name: str, nbytes: int) -> Handle:
        """Zero-filled memory of ``nbytes`` (> 0), held by this provider until released."""
        ...

    def open(self, handle: Handle) -> torch.Tensor:
        """A writable uint8 tensor of ``handle.nbytes`` on :attr:`device` aliasing the
        memory (any process); a handle this provider released is refused."""
        ...

    def view(self, handle: Handle) -> torch.Tensor:
        """The owner's own view of memory it allocated (the keeper's side)."""
        ...

    def release(self, handle: Handle) -> None:
        """Drop the owner's hold; the memory is freed once no process maps it."""
        ...

    def digest(self, handle: Handle) -> int:
        """:func:`bytes_checksum` of the owner's view."""
        ...


def bytes_checksum(t: torch.Tensor) -> int:
    """The Fletcher checksum of a 1-D uint8 tensor's bytes, computed on its device;
    equal for equal bytes on any device (a 1-3 byte tail is one zero-padded word)."""
    whole = t.numel() - t.numel() % 4
    parts = [t[:whole]] if whole else []
    if whole < t.numel():
        tail = torch.zeros(4, dtype=torch.uint8, device=t.device)
        tail[: t.numel() - whole] = t[whole:]
        parts.append(tail)
    return int(checksum(parts, index=0, version=0, algorithm="fletcher").item())


class HostMemfdProvider:
    """Retained memory in host memfd segments (today's keeper memory, :mod:`.segments`)."""

    def __init__(self, prefix: str = "leto") -> None:
        self.prefix = prefix
        self._held: dict[str, tuple[int, torch.Tensor]] = {}  # name -> (fd, own view)
        self._released: set[str] = set()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def allocate(self, name: str, nbytes: int) -> Handle:
        nbytes = check_size(name, nbytes)
        if name in self._held:
            raise ProviderError(f"segment {name!r} is already allocated")
        fd = segments.create(f"{self.prefix}-{name}", nbytes)
        self._held[name] = (fd, segments.as_tensor(fd, nbytes))
        self._released.discard(name)
        return Handle("memfd", name, nbytes, {}, (fd,))

    def open(self, handle: Handle) -> torch.Tensor:
        if handle.kind != "memfd" or len(handle.fds) != 1:
            raise ProviderError(f"segment {handle.name!r}: not a memfd handle ({handle.kind})")
        if handle.name in self._released:
            raise ProviderError(f"segment {handle.name!r} was released")
        try:
            return segments.as_tensor(handle.fds[0], handle.nbytes)
        except (OSError, ValueError) as e:
            raise ProviderError(f"segment {handle.name!r}: cannot map it: {e}") from None

    def view(self, handle: Handle) -> torch.Tensor:
        held = self._held.get(handle.name)
        if held is None:
            raise ProviderError(f"segment {handle.name!r} is not held here")
        return held[1]

    def release(self, handle: Handle) -> None:
        held = self._held.pop(handle.name, None)
        if held is None:
            raise ProviderError(f"segment {handle.name!r} is not held here")
        os.close(held[0])
        self._released.add(handle.name)

    def digest(self, handle: Handle) -> int:
        return bytes_checksum(self.view(handle))
