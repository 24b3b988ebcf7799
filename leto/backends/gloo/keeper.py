"""The keeper: one small process per rank that owns the rank's retained memory.

It holds the rank's segments and hands them to the rank's trainer over an abstract
Unix socket; the trainer maps them. A segment is in host memory (a memfd segment,
:mod:`.segments`, handed over as its descriptor) or, where the trainer asks for it
on a GPU, in GPU memory the keeper allocates through
:class:`~leto.backends.gloo.cuda_memory.CudaIpcProvider` (handed over as a CUDA IPC
handle); either way the reply carries a :class:`~.memory_provider.Handle`'s wire form
(:meth:`Handle.to_wire`). A keeper of host memory imports no torch and does no tensor
work: it only owns memory, so a trainer's death leaves the state intact, and a
keeper's death (the protocol's ``LoseMemory``: the agent then also kills the rank's
trainer, the only other holder) really frees it. GPU memory makes the keeper import
torch and CUDA at the first GPU segment.

**Fencing.** The keeper knows the current generation and which process may
write in it: the agent ``fence``\\ s it to generation g+1 during recovery and
``admit``\\ s exactly one pid (the rank's trainer) per generation. A ``hello``
from any other process, or from a connection opened in an older generation,
is refused, so no process of an old generation can obtain retained memory. A
process that mapped memory earlier cannot be unmapped from outside: the agent
kills such a stale process (and reaps it) before the fence completes, and the
keeper's read-only *fence word* (an int64 segment holding the current
generation, mapped by every trainer) makes a stale trainer refuse its own
writes: :func:`~leto.backends.gloo.runtime` checks it before every chunk write.
The fence word is sealed against writes (``F_SEAL_FUTURE_WRITE``) once the
keeper has mapped it: the descriptor a trainer gets cannot be reopened
read-write through ``/proc``, so only the keeper can move the fence.

**Hostile peers.** Only processes of the keeper's user may connect, and which
process a connection is comes from the kernel (``SO_PEERCRED``), never from the
message: the admitted pid is compared with that. A bad frame (an oversized
length, JSON nested too deep, not JSON at all) or a malformed request closes
that client's connection or is refused; the keeper itself carries on.

Protocol (JSON, :mod:`.wire`): from the agent over the control socket
``fence``, ``admit``, ``list``, ``digest``, ``stop``; from a trainer ``hello``
(first), ``alloc`` (create-or-attach by name and device: returns the handle, and
the fd of a host segment), ``open`` (every segment's handle), ``list``, ``digest``. Every reply has ``ok`` and, on refusal, ``error`` and ``why``.
"""

from __future__ import annotations

import argparse
import os
import selectors
import signal
import socket
import struct
import sys
from typing import Any

from . import segments
from .procs import die_with_parent
from .title import set_title
from .wire import MAX_FDS, Conn, WireError, abstract_name, check_peer, listen_unix

__all__ = ["Keeper", "KeeperHandle", "main", "spawn_keeper"]

_NAME_MAX = 200


class Keeper:
    """The keeper's state, independent of sockets (unit-testable)."""

    def __init__(self, job: str, rank: int) -> None:
        self.job = job
        self.rank = rank
        self.generation = 0
        self.writer: dict[int, int] = {}  # generation -> admitted pid
        self.segments: dict[str, tuple[int, int]] = {}  # name -> (fd, nbytes); GPU: fd -1
        self.handles: dict[str, dict[str, Any]] = {}  # GPU segments: name -> handle's wire form
        self._provider: Any = None  # CudaIpcProvider, at the first GPU segment
        self.fence_fd = segments.create(f"leto-{job}-r{rank}-fence", 8)
        self._fence_map = segments.Mapping(self.fence_fd, 8)
        segments.seal_writes(self.fence_fd)  # from now on only this mapping writes it
        self.refused = 0
        self._write_fence()

    def _write_fence(self) -> None:
        mm = self._fence_map.mm
        assert mm is not None
        mm[0:8] = struct.pack("<q", self.generation)

    def readonly_fence_fd(self) -> int:
        """A new read-only descriptor of the fence word (a trainer cannot write it)."""
        return os.open(f"/proc/self/fd/{self.fence_fd}", os.O_RDONLY | os.O_CLOEXEC)

    # --- control (the agent) ----------------------------------------------------

    def fence(self, generation: int) -> None:
        if generation < self.generation:
            raise ValueError(f"fence to generation {generation} < current {self.generation}")
        self.generation = generation
        for g in [g for g in self.writer if g < generation]:
            del self.writer[g]
        self._write_fence()

    def admit(self, generation: int, pid: int) -> None:
        if generation < self.generation:
            raise ValueError(f"admit for generation {generation} < current {self.generation}")
        self.writer[generation] = pid

    # --- trainers ------------------------------------------------------------------

    def may_write(self, generation: int, pid: int) -> str | None:
        """None if ``pid`` may write in ``generation``, else why not."""
        if generation != self.generation:
            return f"generation {generation} is fenced (the keeper is at {self.generation})"
        if self.writer.get(generation) != pid:
            return (
                f"pid {pid} is not the trainer admitted for generation {generation} "
                f"(admitted: {self.writer.get(generation)})"
            )
        return None

    def alloc(self, name: str, nbytes: int, device: str = "cpu") -> tuple[dict[str, Any], bool]:
        """Segment ``name`` of ``nbytes`` on ``device`` (made on first ask): its
        handle's wire form (:meth:`wire`) and whether it was made now."""
        if not isinstance(name, str) or not name or len(name) > _NAME_MAX:
            raise ValueError(f"bad segment name {name!r}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"bad size {nbytes!r} for segment {name!r}")
        if not isinstance(device, str) or not (device == "cpu" or device.startswith("cuda")):
            raise ValueError(f"bad device {device!r} for segment {name!r}")
        have = self.segments.get(name)
        if have is not None:
            if have[1] != nbytes:
                raise ValueError(f"segment {name!r} has {have[1]} bytes, {nbytes} requested")
            if self.device_of(name) != device:
                raise ValueError(
                    f"segment {name!r} is in {self.device_of(name)} memory, {device} requested"
                )
            return self.wire(name), False
        if device == "cpu":
            fd = segments.create(f"leto-{self.job}-r{self.rank}-{name}", nbytes)
            self.segments[name] = (fd, nbytes)
        else:
            self.handles[name] = self._gpu(device).allocate(name, nbytes).to_wire()[0]
            self.segments[name] = (-1, nbytes)
        return self.wire(name), True

    def _gpu(self, device: str) -> Any:
        """The GPU memory provider (CUDA IPC), made at the first GPU segment."""
        if self._provider is None:
            from .cuda_memory import CudaIpcProvider

            self._provider = CudaIpcProvider(device)
        elif str(self._provider.device) != device and device != "cuda":
            raise ValueError(f"this keeper holds {self._provider.device} memory, not {device}")
        return self._provider

    def device_of(self, name: str) -> str:
        handle = self.handles.get(name)
        return "cpu" if handle is None else str(self._provider.device)

    def wire(self, name: str) -> dict[str, Any]:
        """Segment ``name``'s handle as sent (a host segment's descriptor travels beside)."""
        handle = self.handles.get(name)
        if handle is not None:
            return handle
        return {"kind": "memfd", "name": name, "nbytes": self.segments[name][1], "fields": {}}

    def listing(self) -> dict[str, int]:
        return {n: b for n, (_, b) in sorted(self.segments.items())}

    def digests(self, names: list[str] | None) -> dict[str, str]:
        want = sorted(self.segments) if names is None else names
        return {n: self._digest(n) for n in want if n in self.segments}

    def _digest(self, name: str) -> str:
        """SHA-256 of segment ``name``'s bytes (a GPU segment's through a host copy)."""
        if name not in self.handles:
            return segments.digest(self.segments[name][0])
        import hashlib

        view = self._provider.view(self._provider_handle(name))
        return hashlib.sha256(view.cpu().numpy().tobytes()).hexdigest()

    def _provider_handle(self, name: str) -> Any:
        from .memory_provider import Handle

        return Handle.from_wire(self.handles[name], [])

    def nbytes(self) -> int:
        return sum(b for _, b in self.segments.values())


class _Client:
    def __init__(self, conn: Conn, pid: int) -> None:
        self.conn = conn
        self.pid = pid
        self.generation: int | None = None
        self.writer = False


def _reply(conn: Conn, obj: dict[str, Any], fds: list[int] | None = None) -> None:
    try:
        conn.send(obj, fds or [])
    except WireError:
        pass


def serve(keeper: Keeper, control: Conn, listener: socket.socket) -> None:
    """The keeper's loop: until the agent says ``stop`` or goes away."""
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "listen")
    sel.register(control, selectors.EVENT_READ, "control")
    clients: dict[int, _Client] = {}
    while True:
        for key, _ in sel.select():
            tag = key.data
            if tag == "listen":
                try:
                    sock, _ = listener.accept()
                except OSError:  # out of descriptors, or the peer gave up: not ours to die of
                    continue
                try:
                    pid = check_peer(sock)
                except OSError:  # PeerError: another user
                    sock.close()
                    continue
                c = _Client(Conn(sock), pid)
                clients[c.conn.fileno()] = c
                sel.register(c.conn, selectors.EVENT_READ, c)
            elif tag == "control":
                alive = control.feed()
                got, bad = control.drain()
                for msg, fds in got:
                    for fd in fds:
                        os.close(fd)
                    if _control(keeper, control, msg):
                        return
                if not alive or bad is not None:
                    return  # the agent is gone: so is this node's retained memory
            else:
                c = tag
                alive = c.conn.feed()
                got, bad = c.conn.drain()
                for msg, fds in got:
                    for fd in fds:
                        os.close(fd)
                    _request(keeper, c, msg)
                if not alive or bad is not None or c.conn.closed:  # a bad frame: done
                    sel.unregister(c.conn)
                    clients.pop(c.conn.fileno(), None)
                    c.conn.close()


def _control(keeper: Keeper, conn: Conn, msg: dict[str, Any]) -> bool:
    op = msg.get("op")
    try:
        if op == "fence":
            keeper.fence(int(msg["generation"]))
            _reply(conn, {"ok": True, "op": op, "generation": keeper.generation})
        elif op == "admit":
            keeper.admit(int(msg["generation"]), int(msg["pid"]))
            _reply(conn, {"ok": True, "op": op})
        elif op == "list":
            _reply(conn, {"ok": True, "op": op, "segments": keeper.listing()})
        elif op == "digest":
            _reply(conn, {"ok": True, "op": op, "digests": keeper.digests(msg.get("names"))})
        elif op == "stop":
            _reply(conn, {"ok": True, "op": op})
            return True
        else:
            _reply(conn, {"ok": False, "op": op, "error": "unknown", "why": f"unknown op {op!r}"})
    except (KeyError, TypeError, ValueError) as e:
        _reply(conn, {"ok": False, "op": op, "error": "bad_request", "why": str(e)})
    return False


def _request(keeper: Keeper, c: _Client, msg: dict[str, Any]) -> None:
    op = msg.get("op")
    try:
        if op == "hello":
            gen = int(msg["generation"])
            role = msg.get("role", "trainer")
            if role == "writer":
                why = keeper.may_write(gen, c.pid)
                if why is not None:
                    keeper.refused += 1
                    _reply(c.conn, {"ok": False, "op": op, "error": "fenced", "why": why})
                    return
                c.writer = True
            c.generation = gen
            fd = keeper.readonly_fence_fd()
            try:
                _reply(c.conn, {"ok": True, "op": op, "generation": keeper.generation}, [fd])
            finally:
                os.close(fd)
            return
        if c.generation is None:
            _reply(c.conn, {"ok": False, "op": op, "error": "protocol", "why": "hello first"})
            return
        if op in ("alloc", "open"):
            why = None if c.writer else "a shadow may not map retained memory before promotion"
            why = why or keeper.may_write(c.generation, c.pid)
            if why is not None:
                keeper.refused += 1
                _reply(c.conn, {"ok": False, "op": op, "error": "fenced", "why": why})
            elif op == "alloc":
                handle, created = keeper.alloc(msg["name"], msg["nbytes"], msg.get("device", "cpu"))
                fd = keeper.segments[msg["name"]][0]
                reply = {"ok": True, "op": op, "created": created, "handle": handle}
                _reply(c.conn, reply, [fd] if fd >= 0 else [])
            else:
                # every segment with its handle (host segments with their descriptors, up
                # to MAX_FDS, in name order): a trainer attaching to the retained state
                # maps them after one round trip
                have = keeper.listing()
                hosts = [n for n in sorted(have) if n not in keeper.handles]
                sent = hosts[:MAX_FDS]
                fds = [keeper.segments[n][0] for n in sent]
                reply = {"ok": True, "op": op, "segments": have, "sent": sent}
                reply["handles"] = dict(keeper.handles)
                _reply(c.conn, reply, fds)
        elif op == "list":
            _reply(c.conn, {"ok": True, "op": op, "segments": keeper.listing()})
        elif op == "digest":
            _reply(c.conn, {"ok": True, "op": op, "digests": keeper.digests(msg.get("names"))})
        else:
            _reply(c.conn, {"ok": False, "op": op, "error": "unknown", "why": f"unknown op {op!r}"})
    except (KeyError, TypeError, ValueError, ArithmeticError, OSError) as e:
        _reply(c.conn, {"ok": False, "op": op, "error": "bad_request", "why": str(e)})


class KeeperHandle:
    """The agent's side of one keeper process: its handle and its control socket."""

    def __init__(self, proc: Any, control: Conn, socket_name: str, rank: int) -> None:
        self.proc = proc
        self.pid: int = proc.pid
        self.control = control
        self.socket_name = socket_name
        self.rank = rank
        self.pidfd = os.pidfd_open(proc.pid)

    def call(self, msg: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        self.control.send(msg)
        reply, fds = self.control.recv(timeout=timeout)
        for fd in fds:
            os.close(fd)
        if not reply.get("ok"):
            raise RuntimeError(f"keeper of rank {self.rank}: {msg.get('op')}: {reply.get('why')}")
        return reply

    def fence(self, generation: int) -> None:
        self.call({"op": "fence", "generation": generation})

    def admit(self, generation: int, pid: int) -> None:
        self.call({"op": "admit", "generation": generation, "pid": pid})

    def listing(self) -> dict[str, int]:
        out: dict[str, int] = self.call({"op": "list"})["segments"]
        return out

    def digests(self, names: list[str] | None = None) -> dict[str, str]:
        out: dict[str, str] = self.call({"op": "digest", "names": names})["digests"]
        return out

    def alive(self) -> bool:
        return bool(self.proc.poll() is None)

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the keeper to exit (its memory is freed); kill it if it does not."""
        import subprocess

        if self.proc.poll() is None:
            try:
                self.call({"op": "stop"}, timeout=timeout)
            except (WireError, TimeoutError, RuntimeError, OSError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.close()

    def close(self) -> None:
        self.control.close()
        try:
            os.close(self.pidfd)
        except OSError:
            pass


def spawn_keeper(rank: int, job: str, *, tag: str = "", timeout: float = 20.0) -> KeeperHandle:
    """Start a keeper process for ``rank`` (it dies with this process)."""
    import subprocess

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    cmd = [
        sys.executable,
        "-m",
        "leto.backends.gloo.keeper",
        "--control-fd",
        str(theirs.fileno()),
        "--rank",
        str(rank),
        "--job",
        job,
        "--parent",
        str(os.getpid()),
    ]
    if tag:
        cmd += ["--tag", tag]
    proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
    theirs.close()
    control = Conn(ours, send_timeout=10.0)
    try:
        msg, _ = control.recv(timeout=timeout)
    except (WireError, TimeoutError) as e:
        proc.kill()
        proc.wait()
        control.close()
        raise RuntimeError(f"the keeper of rank {rank} did not start: {e}") from None
    if msg.get("op") != "ready":
        proc.kill()
        proc.wait()
        control.close()
        raise RuntimeError(f"the keeper of rank {rank} sent {msg!r} instead of ready")
    return KeeperHandle(proc, control, str(msg["socket"]), rank)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="leto-keeper")
    p.add_argument("--control-fd", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--parent", type=int, required=True)
    # the job's run directory: in the keeper's title, where the tests find a job's processes
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    # its own arguments are the agent's business: the job's run directory instead
    set_title(f"keeper rank {a.rank}", a.job, f"run dir {a.tag}" if a.tag else "")
    die_with_parent(a.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control = Conn(socket.socket(fileno=a.control_fd), send_timeout=10.0)
    keeper = Keeper(a.job, a.rank)
    name = abstract_name(f"{a.job}-keeper{a.rank}")
    listener = listen_unix(name)
    control.send({"op": "ready", "socket": name[1:], "pid": os.getpid()})
    try:
        serve(keeper, control, listener)
    except KeyboardInterrupt:  # pragma: no cover
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
