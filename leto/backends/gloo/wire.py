"""Messages between leto's processes: length-prefixed JSON, file descriptors beside.

Every message is one JSON object (UTF-8), framed by a 4-byte big-endian length.
File descriptors (memfd segments, pidfds, pipes) travel as ``SCM_RIGHTS``
ancillary data of the frame's first bytes on a Unix socket. Nothing read from a
socket is ever unpickled: a peer can at worst send JSON we reject.

:class:`Conn` wraps a connected stream socket: ``send(obj, fds)`` and
``recv() -> (obj, fds)`` (blocking), plus a non-blocking ``feed()`` /
``messages()`` pair for selector loops. Frames above :data:`MAX_FRAME` bytes are
refused (a corrupt or hostile length would otherwise exhaust memory).

Unix sockets are *abstract* (Linux): nothing is created in the file system, so a
SIGKILLed process leaves nothing behind, and the name carries a random 128-bit
token. Every accepted peer must run as the same user (``SO_PEERCRED``).
"""

from __future__ import annotations

import array
import json
import os
import secrets
import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = [
    "MAX_FRAME",
    "MAX_FDS",
    "Conn",
    "PeerError",
    "WireError",
    "abstract_name",
    "check_peer",
    "connect_unix",
    "listen_unix",
]

MAX_FRAME = 64 << 20
MAX_FDS = 64
_HEAD = struct.Struct("!I")


class WireError(ConnectionError):
    """The peer closed the connection or sent something that is not a leto message."""


class PeerError(PermissionError):
    """A peer of another user tried to connect."""


def abstract_name(tag: str) -> str:
    """A fresh abstract socket name (leading NUL) that nobody can guess."""
    return f"\0leto-{tag}-{secrets.token_hex(16)}"


def listen_unix(name: str, backlog: int = 64) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.bind(name)
    s.listen(backlog)
    return s


def connect_unix(name: str, timeout: float | None = 10.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(timeout)
    try:
        s.connect(name)
    except OSError:
        s.close()
        raise
    s.settimeout(None)
    return s


def check_peer(sock: socket.socket) -> int:
    """The peer's pid; raises :class:`PeerError` unless it runs as our user."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise PeerError(f"peer pid {pid} runs as uid {uid}, not {os.getuid()}")
    return int(pid)


def _encode(obj: Any) -> bytes:
    body = json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()
    if len(body) > MAX_FRAME:
        raise WireError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return _HEAD.pack(len(body)) + body


def _decode(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"not a leto message: {e}") from None
    if not isinstance(obj, dict):
        raise WireError(f"not a leto message: a JSON {type(obj).__name__}, not an object")
    return obj


class Conn:
    """One connected stream socket carrying framed JSON messages (and fds on Unix)."""

    def __init__(self, sock: socket.socket, send_timeout: float | None = 10.0) -> None:
        self.sock = sock
        self.sock.settimeout(send_timeout)
        self._send_timeout = send_timeout
        self._buf = bytearray()
        self._fds: list[int] = []
        self._lock = threading.Lock()
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    # --- sending ------------------------------------------------------------------

    def send(self, obj: dict[str, Any], fds: Sequence[int] = ()) -> None:
        """Send one message (thread-safe); ``fds`` arrive with it, in order."""
        if len(fds) > MAX_FDS:
            raise WireError(f"{len(fds)} file descriptors in one message (max {MAX_FDS})")
        data = _encode({**obj, "_nfds": len(fds)} if fds else obj)
        with self._lock:
            try:
                if fds:
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
                    sent = self.sock.sendmsg([data], anc)
                    if sent < len(data):
                        self.sock.sendall(data[sent:])
                else:
                    self.sock.sendall(data)
            except OSError as e:
                self.closed = True
                raise WireError(f"connection lost: {e}") from None

    # --- blocking receive -----------------------------------------------------------

    def _read_some(self, block: bool) -> bool:
        """Read what is available into the buffer; False at EOF."""
        space = socket.CMSG_SPACE(MAX_FDS * 4)
        try:
            data, anc, flags, _ = self.sock.recvmsg(
                1 << 16, space, 0 if block else socket.MSG_DONTWAIT
            )
        except (BlockingIOError, InterruptedError):
            return True
        except ConnectionResetError:
            data, anc, flags = b"", [], 0
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(payload[: len(payload) - (len(payload) % arr.itemsize)])
                self._fds.extend(arr)
        if flags & socket.MSG_CTRUNC:
            raise WireError("file descriptors were truncated in transit")
        if not data:
            self.closed = True
            return False
        self._buf += data
        return True

    def _take(self) -> tuple[dict[str, Any], list[int]] | None:
        if len(self._buf) < _HEAD.size:
            return None
        (n,) = _HEAD.unpack_from(self._buf)
        if n > MAX_FRAME:
            raise WireError(f"frame of {n} bytes announced (max {MAX_FRAME}): not a leto peer")
        if len(self._buf) < _HEAD.size + n:
            return None
        body = bytes(self._buf[_HEAD.size : _HEAD.size + n])
        del self._buf[: _HEAD.size + n]
        obj = _decode(body)
        want = obj.pop("_nfds", 0)
        if not isinstance(want, int) or not 0 <= want <= MAX_FDS:
            raise WireError(f"bad file descriptor count {want!r}")
        if want > len(self._fds):
            raise WireError(f"message announces {want} file descriptors, {len(self._fds)} arrived")
        fds, self._fds = self._fds[:want], self._fds[want:]
        return obj, fds

    def recv(self, timeout: float | None = None) -> tuple[dict[str, Any], list[int]]:
        """The next message (blocking); :class:`WireError` at EOF, TimeoutError after ``timeout``."""
        got = self._take()
        if got is not None:
            return got
        import select

        deadline = None if timeout is None else _now() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - _now())
            try:
                ready, _, _ = select.select([self.sock], [], [], left)
            except (OSError, ValueError) as e:
                raise WireError(f"connection lost: {e}") from None
            if not ready:
                raise TimeoutError(f"no message within {timeout} s")
            try:
                alive = self._read_some(block=False)
            except OSError as e:
                raise WireError(f"connection lost: {e}") from None
            got = self._take()
            if got is not None:
                return got
            if not alive:
                raise WireError("connection closed by peer")

    # --- selector-driven receive -------------------------------------------------------

    def feed(self) -> bool:
        """Read what the socket has (call when the selector says readable); False at EOF."""
        try:
            return self._read_some(block=False)
        except OSError:
            self.closed = True
            return False

    def messages(self) -> Iterator[tuple[dict[str, Any], list[int]]]:
        """Complete messages buffered so far."""
        while True:
            got = self._take()
            if got is None:
                return
            yield got

    def close(self) -> None:
        self.closed = True
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        try:
            self.sock.close()
        except OSError:
            pass


def _now() -> float:
    import time

    return time.monotonic()
