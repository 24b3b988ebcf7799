"""A trainer's connection to its rank's keeper: map retained segments, read the fence.

A segment comes as a :class:`~.memory_provider.Handle`'s wire form: a host segment's
descriptor is mapped (:func:`.segments.as_tensor`), a GPU segment's CUDA IPC handle is
opened (:class:`~.cuda_memory.CudaIpcProvider`); either way the trainer gets a uint8
tensor over the keeper's memory, no copy."""

from __future__ import annotations

import mmap
import os
import struct
from typing import TYPE_CHECKING, Any

from . import segments
from .wire import Conn, WireError, connect_unix

if TYPE_CHECKING:
    import torch

__all__ = ["FencedError", "KeeperClient", "KeeperError"]


class KeeperError(RuntimeError):
    """The keeper refused a request or went away."""


class FencedError(KeeperError):
    """This process belongs to a generation that has been fenced off."""


class KeeperClient:
    """``alloc(name, nbytes)`` is a :data:`leto.retained.layout.Allocator` backed by a keeper.

    ``device``: where the segments it asks for live (``"cpu"``: memfd segments; a CUDA
    device: GPU memory of the keeper). Small segments of flags (:meth:`alloc` with
    ``device="cpu"``) stay in host memory whatever the device.

    ``role="writer"`` is the rank's admitted trainer; ``role="shadow"`` connects
    ahead of promotion and may not map retained memory. The keeper must run as this
    user, and be ``keeper_pid`` where it is given (the kernel's credentials of the
    socket's server: its name is public, another process could have bound it).
    """

    def __init__(
        self,
        socket_name: str,
        *,
        generation: int,
        role: str = "writer",
        patience: float = 5.0,
        keeper_pid: int | None = None,
        device: str = "cpu",
    ) -> None:
        self.socket_name = socket_name
        self.device = device
        self._gpu: Any = None  # CudaIpcProvider opening the keeper's GPU handles
        self.generation = generation
        self.role = role
        try:
            sock = connect_unix("\0" + socket_name, peer_pid=keeper_pid)
            self.conn = Conn(sock, send_timeout=10.0)
        except OSError as e:
            raise KeeperError(f"cannot reach the keeper: {e}") from None
        self._fence: mmap.mmap | None = None
        self._opened: dict[str, tuple[int, int]] = {}  # name -> (descriptor, bytes): open()
        self._handles: dict[str, dict[str, Any]] = {}  # name -> GPU handle's wire form: open()
        self._hello(patience)

    def _call(self, msg: dict[str, object]) -> tuple[dict[str, object], list[int]]:
        try:
            self.conn.send(msg)
            reply, fds = self.conn.recv(timeout=30.0)
        except (WireError, TimeoutError) as e:
            raise KeeperError(f"keeper connection lost during {msg.get('op')}: {e}") from None
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            why = reply.get("why", "refused")
            if reply.get("error") == "fenced":
                raise FencedError(f"keeper refused {msg.get('op')}: {why}")
            raise KeeperError(f"keeper refused {msg.get('op')}: {why}")
        return reply, fds

    def _hello(self, patience: float = 5.0) -> None:
        import time

        deadline = time.monotonic() + patience
        while True:
            try:
                _, fds = self._call(
                    {"op": "hello", "generation": self.generation, "role": self.role}
                )
                break
            except FencedError as e:
                # the agent admits a new trainer right after forking it: a hello may win
                # that race; a fenced generation never becomes current again
                if "not the trainer admitted" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        if len(fds) != 1:
            raise KeeperError("keeper sent no fence word")
        try:
            old, self._fence = self._fence, mmap.mmap(fds[0], 8, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fds[0])
        if old is not None:
            old.close()

    def readmit(self, generation: int, role: str = "writer") -> None:
        """Join ``generation`` (after the agent fenced the keeper and admitted us)."""
        self.generation = generation
        self.role = role
        self._hello()

    @property
    def fence_generation(self) -> int:
        assert self._fence is not None
        return int(struct.unpack_from("<q", self._fence, 0)[0])

    def check_writer(self) -> None:
        """Raise :class:`FencedError` if our generation has been fenced off."""
        cur = self.fence_generation
        if cur != self.generation:
            raise FencedError(
                f"this trainer's generation {self.generation} is fenced (the keeper is at {cur})"
            )

    def alloc(self, name: str, nbytes: int, device: str | None = None) -> torch.Tensor:
        """Segment ``name`` of ``nbytes`` (made by the keeper on first ask) on ``device``
        (this client's by default), mapped here."""
        device = self.device if device is None else device
        handle = self._handles.pop(name, None)
        if handle is not None and handle.get("nbytes") == nbytes and device != "cpu":
            return self._open_gpu(handle)
        have = self._opened.pop(name, None)
        if have is not None:
            fd, size = have
            try:
                if size == nbytes and device == "cpu":  # else asked for as below: the
                    return segments.as_tensor(fd, nbytes)  # keeper says what is wrong
            finally:
                os.close(fd)
        reply, fds = self._call({"op": "alloc", "name": name, "nbytes": nbytes, "device": device})
        wire = reply.get("handle")
        if isinstance(wire, dict) and wire.get("kind") == "cuda-ipc":
            for fd in fds:
                os.close(fd)
            return self._open_gpu(wire)
        if len(fds) != 1:
            for fd in fds:  # none is kept: a reply to another request, say
                os.close(fd)
            raise KeeperError(f"keeper sent {len(fds)} descriptors for {name!r}")
        try:
            return segments.as_tensor(fds[0], nbytes)
        finally:
            os.close(fds[0])

    def _open_gpu(self, wire: dict[str, Any]) -> torch.Tensor:
        """The keeper's GPU segment ``wire`` describes, opened in this process."""
        from .cuda_memory import CudaIpcProvider
        from .memory_provider import Handle, ProviderError

        try:
            if self._gpu is None:
                self._gpu = CudaIpcProvider(self.device)
            return self._gpu.open(Handle.from_wire(wire, []))  # type: ignore[no-any-return]
        except ProviderError as e:
            raise KeeperError(f"cannot open the keeper's GPU segment: {e}") from None

    def open(self) -> dict[str, int]:
        """Every retained segment's size by name (:meth:`listing`), and their descriptors
        in the same round trip, kept for the :meth:`alloc` calls of an attachment that
        follows (each then maps without asking again); :meth:`close_opened` closes those
        it did not take."""
        self.close_opened()
        reply, fds = self._call({"op": "open"})
        sent, out = reply.get("sent"), reply.get("segments")
        try:
            if not isinstance(sent, list) or not isinstance(out, dict):
                raise KeeperError("keeper's open reply lacks its segments")
            have = {str(k): int(v) for k, v in out.items()}
            if len(fds) != len(sent) or any(n not in have for n in sent):
                raise KeeperError(f"keeper sent {len(fds)} descriptors for {len(sent)} segments")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self._opened = {str(n): (fd, have[str(n)]) for n, fd in zip(sent, fds, strict=True)}
        handles = reply.get("handles")
        self._handles = dict(handles) if isinstance(handles, dict) else {}
        return have

    def close_opened(self) -> None:
        """Close the descriptors :meth:`open` kept that no :meth:`alloc` took."""
        opened, self._opened = self._opened, {}
        self._handles = {}
        for fd, _ in opened.values():
            os.close(fd)

    __call__ = alloc

    def listing(self) -> dict[str, int]:
        reply, _ = self._call({"op": "list"})
        out = reply.get("segments", {})
        assert isinstance(out, dict)
        return {str(k): int(v) for k, v in out.items()}

    def close(self) -> None:
        self.close_opened()
        self.conn.close()
        if self._fence is not None:
            self._fence.close()
            self._fence = None
