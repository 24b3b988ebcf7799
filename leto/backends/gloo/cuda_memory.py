"""Keeper-owned GPU memory, handed to other processes as CUDA IPC handles.

The keeper allocates a CUDA storage per segment (``torch.zeros`` on its device, so
the memory is zero-filled) and keeps a tensor over it: the memory lives as long as
the keeper does, whatever happens to the trainers that opened it. The handle is the
tuple ``UntypedStorage._share_cuda_()`` returns (what ``torch.multiprocessing``'s
``reduce_tensor`` sends), written as JSON: device index, the IPC memory handle, the
storage's size and offset in its allocation, torch's reference-counter file and
offset, and the IPC event with its sync flag, bytes as hex. Another process opens it
with ``UntypedStorage._new_shared_cuda`` (``rebuild_cuda_tensor``'s call): a uint8
tensor over the same GPU memory, no copy; a warm shadow opens the same handle on
promotion.

Known limits (written before any GPU ran this; ``docs/gpu.md``):

* CUDA IPC cannot open a handle in the process that made it; this provider returns
  its own view there instead.
* torch counts the openers of a shared storage in a small shared-memory file
  (``/dev/shm/torch_*``); an opener that is SIGKILLed never decrements it, so that
  file may outlive the keeper, and memory the keeper releases is only freed when
  the count reaches zero. The driver's VMM export (``cuMemExportToShareableHandle``
  to a POSIX descriptor, sent like a memfd segment) has neither limit; it is the
  planned replacement.
* Writes become visible to another process once the writer's stream is
  synchronised: :meth:`CudaIpcProvider.allocate` synchronises after zero-filling,
  and a writer synchronises before it says it has written.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .memory_provider import Handle, ProviderError, bytes_checksum, check_size

__all__ = ["CudaIpcProvider", "cuda_ipc_fields", "open_cuda_ipc"]

_FIELDS = (
    "device",
    "handle",
    "storage_bytes",
    "offset",
    "ref_counter",
    "ref_counter_offset",
    "event",
    "event_sync",
)


def _hex(b: object) -> str:
    return b.hex() if isinstance(b, bytes) else ""


def cuda_ipc_fields(storage: torch.UntypedStorage) -> dict[str, Any]:
    """The JSON fields of ``storage._share_cuda_()`` (bytes as hex, ``None`` as "")."""
    dev, handle, size, offset, ref, ref_offset, event, event_sync = storage._share_cuda_()  # type: ignore[no-untyped-call]
    return {
        "device": int(dev),
        "handle": _hex(handle),
        "storage_bytes": int(size),
        "offset": int(offset),
        "ref_counter": _hex(ref),
        "ref_counter_offset": int(ref_offset),
        "event": _hex(event),
        "event_sync": bool(event_sync),
        "pid": os.getpid(),
    }


def open_cuda_ipc(fields: dict[str, Any]) -> torch.UntypedStorage:
    """The storage a :func:`cuda_ipc_fields` dict describes, opened in this process."""
    missing = [k for k in _FIELDS if k not in fields]
    if missing:
        raise ProviderError(f"CUDA IPC handle without {', '.join(missing)}")
    try:
        torch.cuda.current_device()  # initialises CUDA in this process
        return torch.UntypedStorage._new_shared_cuda(
            int(fields["device"]),
            bytes.fromhex(fields["handle"]),
            int(fields["storage_bytes"]),
            int(fields["offset"]),
            bytes.fromhex(fields["ref_counter"]),
            int(fields["ref_counter_offset"]),
            bytes.fromhex(fields["event"]) if fields["event"] else None,
            bool(fields["event_sync"]),
        )
    except (RuntimeError, ValueError) as e:
        raise ProviderError(f"cannot open the CUDA IPC handle: {e}") from None


class CudaIpcProvider:
    """Retained memory in GPU memory the keeper allocates (see the module docstring)."""

    def __init__(self, device: str | torch.device = "cuda") -> None:
        if not torch.cuda.is_available():
            raise ProviderError("no CUDA here: the CUDA IPC provider needs a GPU")
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ProviderError(f"the CUDA IPC provider allocates on a CUDA device, not {dev}")
        self._device = torch.device(
            "cuda", torch.cuda.current_device() if dev.index is None else dev.index
        )
        self._held: dict[str, tuple[torch.Tensor, str]] = {}  # name -> (own view, IPC handle)
        self._opened: dict[tuple[str, int], torch.Tensor] = {}  # (IPC handle, offset) -> view
        self._released: set[str] = set()

    @property
    def device(self) -> torch.device:
        return self._device

    def allocate(self, name: str, nbytes: int) -> Handle:
        nbytes = check_size(name, nbytes)
        if name in self._held:
            raise ProviderError(f"segment {name!r} is already allocated")
        t = torch.zeros(nbytes, dtype=torch.uint8, device=self._device)
        torch.cuda.synchronize(self._device)  # zeros written before anyone else reads
        fields = cuda_ipc_fields(t.untyped_storage())
        self._held[name] = (t, fields["handle"])
        self._released.discard(name)
        return Handle("cuda-ipc", name, nbytes, fields)

    def open(self, handle: Handle) -> torch.Tensor:
        if handle.kind != "cuda-ipc":
            raise ProviderError(f"segment {handle.name!r}: not a CUDA IPC handle ({handle.kind})")
        if handle.name in self._released:
            raise ProviderError(f"segment {handle.name!r} was released")
        held = self._held.get(handle.name)
        if held is not None and held[1] == handle.fields.get("handle"):
            return held[0]  # CUDA IPC cannot open a handle in its own process
        if handle.fields.get("pid") == os.getpid():
            raise ProviderError(f"segment {handle.name!r} is not held here any more")
        key = (str(handle.fields.get("handle")), int(handle.fields.get("offset", 0)))
        t = self._opened.get(key)
        if t is None:
            storage = open_cuda_ipc(handle.fields)
            if storage.nbytes() != handle.nbytes:
                raise ProviderError(
                    f"segment {handle.name!r} has {storage.nbytes()} bytes, {handle.nbytes} expected"
                )
            t = torch.empty(0, dtype=torch.uint8, device=storage.device)
            t.set_(storage, 0, (handle.nbytes,), (1,))
            self._opened[key] = t
        return t

    def view(self, handle: Handle) -> torch.Tensor:
        held = self._held.get(handle.name)
        if held is None:
            raise ProviderError(f"segment {handle.name!r} is not held here")
        return held[0]

    def release(self, handle: Handle) -> None:
        if self._held.pop(handle.name, None) is None:
            raise ProviderError(f"segment {handle.name!r} is not held here")
        self._released.add(handle.name)

    def digest(self, handle: Handle) -> int:
        return bytes_checksum(self.view(handle))
