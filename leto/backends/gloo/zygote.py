"""The zygote: a fork server that has already paid for ``import torch``.

The agent imports torch once and, before it starts any thread, forks the zygote.
Every trainer and shadow of the node is then a ``fork`` of the zygote: it starts
in milliseconds with torch imported (the ~2.7 s ``import torch`` costs nothing
more per process), runs :func:`leto.backends.gloo.bootstrap.child_main` and never
returns. The zygote reaps its children and reports each exit status to the agent;
the agent also holds a pidfd of every child (sent here, over ``SCM_RIGHTS``, the
moment it is forked), so a death is seen at once, not when the status arrives.

Requests and replies are JSON (:mod:`.wire`):
``{"op": "spawn", "id": n, "spec": {...}}`` + the child's log pipe as fd ->
``{"op": "spawned", "id": n, "pid": p}`` + its pidfd; and, unsolicited,
``{"op": "exited", "pid": p, "code": c}`` (negative: killed by that signal).
The zygote dies with the agent (parent-death signal), and its children die with it.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
from typing import Any

from .procs import die_with_parent
from .title import set_title
from .wire import Conn, WireError

__all__ = ["ZygoteHandle", "start_zygote"]


class ZygoteHandle:
    def __init__(self, pid: int, conn: Conn) -> None:
        self.pid = pid
        self.conn = conn
        self.pidfd = os.pidfd_open(pid)
        self._next = 0

    def spawn(self, spec: dict[str, Any], log_fd: int) -> int:
        """Ask for a child (asynchronous); returns the request id."""
        self._next += 1
        self.conn.send({"op": "spawn", "id": self._next, "spec": spec}, [log_fd])
        return self._next

    def close(self) -> None:
        self.conn.close()
        try:
            os.close(self.pidfd)
        except OSError:
            pass


def start_zygote(who: str) -> ZygoteHandle:
    """Fork the zygote of the agent that is ``who`` ("node 0"; call before any thread
    exists in this process)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the zygote
        ours.close()
        code = 0
        try:
            set_title(f"zygote {who}")
            _serve(theirs, parent)
        except BaseException:  # noqa: BLE001 - the zygote must never return into the agent
            code = 1
        os._exit(code)
    theirs.close()
    return ZygoteHandle(pid, Conn(ours, send_timeout=30.0))


def _serve(sock: socket.socket, parent: int) -> None:
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Conn(sock, send_timeout=30.0)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    me = os.getpid()
    named = ("", "")  # what this zygote last called itself, and its job
    while True:
        try:
            watch: list[Any] = [conn.sock, wake_r]
            ready, _, _ = select.select(watch, [], [], 1.0)
        except InterruptedError:
            ready = []
        if wake_r in ready:
            try:
                while os.read(wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        _reap(conn)
        if conn.sock in ready:
            alive = conn.feed()
            for msg, fds in conn.messages():
                if msg.get("op") != "spawn" or len(fds) != 1:
                    for fd in fds:
                        os.close(fd)
                    continue
                spec = msg["spec"]
                # a spare's zygote is its node's once it has one, and the job is known
                now = (f"zygote node {spec.get('node')}", str(spec.get("job", "")))
                if now != named:
                    named = now
                    set_title(*now)
                child = os.fork()
                if child == 0:
                    _child(msg["spec"], fds[0], conn, (wake_r, wake_w), me)
                pfd = os.pidfd_open(child)
                try:
                    conn.send({"op": "spawned", "id": msg["id"], "pid": child}, [pfd])
                finally:
                    os.close(pfd)
                    os.close(fds[0])
            if not alive:
                return  # the agent is gone


def _reap(conn: Conn) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        try:
            conn.send({"op": "exited", "pid": pid, "code": os.waitstatus_to_exitcode(status)})
        except WireError:
            return


def _child(
    spec: dict[str, Any], log_fd: int, conn: Conn, wake: tuple[int, int], zygote: int
) -> None:
    """In the forked child: become a trainer or shadow; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        conn.sock.close()
        for fd in wake:
            os.close(fd)
        die_with_parent(zygote)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        from . import bootstrap

        code = bootstrap.child_main(spec)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        os._exit(code)
