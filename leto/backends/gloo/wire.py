"""Messages between leto's processes: length-prefixed JSON, file descriptors beside.

Every message is one JSON object (UTF-8), framed by a 4-byte big-endian length.
File descriptors (memfd segments, pidfds, pipes) travel as ``SCM_RIGHTS``
ancillary data of the frame's first bytes on a Unix socket. Nothing read from a
socket is ever unpickled: a peer can at worst send JSON we reject.

:class:`Conn` wraps a connected stream socket: ``send(obj, fds)`` and
``recv() -> (obj, fds)`` (blocking), plus a non-blocking ``feed()`` /
``drain()`` pair for selector loops. Whatever a peer sends, a bad frame is a
:class:`WireError` for that connection, never another exception: the length
prefix is bounded (:data:`MAX_FRAME`, or a connection's smaller ``max_frame``
before its peer has authenticated), the nesting of arrays and objects is
bounded (:data:`MAX_DEPTH`, checked before the JSON parser sees the body, which
would otherwise recurse until ``RecursionError``), and so are the descriptors a
connection may hold unclaimed (:data:`MAX_FDS`).

Unix sockets are *abstract* (Linux): nothing is created in the file system, so a
SIGKILLed process leaves nothing behind. Their names are not secret (every user
sees them in ``/proc/net/unix``): what keeps other users out is the kernel's
credentials of the peer (``SO_PEERCRED``), checked on both sides: a server
accepts only peers of its own user, and a client talks only to a server of its
own user (and, where it knows it, of the pid it expects).
"""

from __future__ import annotations

import array
import itertools
import json
import os
import re
import secrets
import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = [
    "MAX_DEPTH",
    "MAX_FRAME",
    "MAX_FDS",
    "Conn",
    "PeerError",
    "WireError",
    "abstract_name",
    "check_peer",
    "connect_unix",
    "keep_alive",
    "listen_unix",
    "too_deep",
]

MAX_FRAME = 64 << 20
MAX_FDS = 64
MAX_DEPTH = 64  # leto's own messages nest a few levels
_HEAD = struct.Struct("!I")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1, +1, -1, -1


class WireError(ConnectionError):
    """The peer closed the connection or sent something that is not a leto message."""


class PeerError(PermissionError):
    """A peer of another user tried to connect."""


def keep_alive(sock: socket.socket, seconds: float) -> None:
    """Have the kernel close a TCP link whose peer has not acknowledged anything for
    about ``seconds``: a keepalive probe each second of silence, and data or probes left
    unacknowledged for ``seconds`` end it (``TCP_USER_TIMEOUT``). A peer that dies closes
    its link at once; a cut cable, a host that froze or a partition closes nothing, and
    without this its link would look alive for ever (the peer's reads get ``ETIMEDOUT``,
    which :meth:`Conn.feed` takes as the link's end)."""
    whole = max(1, round(seconds))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, whole)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(seconds * 1000)))


def abstract_name(tag: str) -> str:
    """A fresh abstract socket name (leading NUL): unique, but visible to every user."""
    return f"\0leto-{tag}-{secrets.token_hex(16)}"


def listen_unix(name: str, backlog: int = 64) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.bind(name)
    s.listen(backlog)
    return s


def connect_unix(
    name: str, timeout: float | None = 10.0, *, peer_pid: int | None = None
) -> socket.socket:
    """Connect to ``name``; :class:`PeerError` unless the server runs as our user (and,
    given ``peer_pid``, is that process): a name is public, and another user could
    bind one that a dead server left free."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(timeout)
    try:
        s.connect(name)
        check_peer(s, peer_pid)
    except OSError:
        s.close()
        raise
    s.settimeout(None)
    return s


def check_peer(sock: socket.socket, pid: int | None = None) -> int:
    """The peer's pid as the kernel knows it (``SO_PEERCRED``, not what the peer
    claims); raises :class:`PeerError` unless it runs as our user (and is ``pid``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    peer, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise PeerError(f"peer pid {peer} runs as uid {uid}, not {os.getuid()}")
    if pid is not None and peer != pid:
        raise PeerError(f"the peer is pid {peer}, not the expected pid {pid}")
    return int(peer)


def _encode(obj: Any) -> bytes:
    body = json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()
    if len(body) > MAX_FRAME:
        raise WireError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return _HEAD.pack(len(body)) + body


def too_deep(body: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether the JSON text ``body`` nests arrays and objects more than ``limit`` deep
    (brackets inside strings do not count; the parser judges the rest)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    steps = memoryview(_STRING.sub(b"", body).translate(_STEPS, _NOT_BRACKETS)).cast("b")
    depth = 0
    for at in range(0, len(steps), 1 << 16):
        depths = list(itertools.accumulate(steps[at : at + (1 << 16)], initial=depth))
        if max(depths) > limit:
            return True
        depth = depths[-1]
    return False


def _decode(body: bytes) -> dict[str, Any]:
    if too_deep(body):
        raise WireError(f"not a leto message: nested more than {MAX_DEPTH} deep")
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, digits
        raise WireError(f"not a leto message: {e}") from None
    if not isinstance(obj, dict):
        raise WireError(f"not a leto message: a JSON {type(obj).__name__}, not an object")
    return obj


class Conn:
    """One connected stream socket carrying framed JSON messages (and fds on Unix).

    ``max_frame`` bounds the frames this end accepts: a server keeps it small until
    its peer has proven who it is, then raises it (to :data:`MAX_FRAME` at most).
    """

    def __init__(
        self, sock: socket.socket, send_timeout: float | None = 10.0, max_frame: int = MAX_FRAME
    ) -> None:
        self.sock = sock
        self.sock.settimeout(send_timeout)
        self._send_timeout = send_timeout
        self.max_frame = min(max_frame, MAX_FRAME)
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
        if len(self._fds) > MAX_FDS:
            raise WireError(f"{len(self._fds)} file descriptors sent without their messages")
        if not data:
            self.closed = True
            return False
        self._buf += data
        return True

    def _take(self) -> tuple[dict[str, Any], list[int]] | None:
        if len(self._buf) < _HEAD.size:
            return None
        (n,) = _HEAD.unpack_from(self._buf)
        if n > self.max_frame:
            raise WireError(f"frame of {n} bytes announced (max {self.max_frame}): not a leto peer")
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
        """Complete messages buffered so far (:class:`WireError` at a bad frame)."""
        while True:
            got = self._take()
            if got is None:
                return
            yield got

    def drain(self) -> tuple[list[tuple[dict[str, Any], list[int]]], WireError | None]:
        """The complete messages buffered so far, and the error of the first bad frame
        (None if none): the messages before it are good, the connection is not."""
        out: list[tuple[dict[str, Any], list[int]]] = []
        try:
            for got in self.messages():
                out.append(got)
        except WireError as e:
            return out, e
        return out, None

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
