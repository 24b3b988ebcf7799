"""A trainer's (or shadow's) connection to its node agent, with heartbeats.

Messages are the typed classes of :mod:`.messages`, both ways. A reader thread
takes every message off the socket: :class:`~.messages.Commit` and
:class:`~.messages.Tier2` decisions are recorded (a waiting step wakes up),
:class:`~.messages.Abort` raises a flag the training loop checks at each safe point,
:class:`~.messages.StoreAt` names the job's TCPStore's new address (the session
connects there before its next use of the store),
replies to requests are matched by id (plain ``{"re": id, ...}`` objects), and
commands (promote, call_reports, reconcile, rebuild, resume, complete, ...) queue up
for the loop that follows recovery. A heartbeat thread sends a
:class:`~.messages.Heartbeat` (phase, step, progress) every interval, so a process
that stops (SIGSTOP, a deadlock in native code) goes silent and the agent's
heartbeat timeout catches it; one stuck in Python with the heartbeat alive is
caught by the progress counter not moving. Between heartbeats, each phase change
is written to a :class:`~.board.StatusBoard` shared with the agent, not sent.

The socket's name is public (``/proc/net/unix``): the channel talks only to a
server of its own user and, given ``agent_pid``, only to that process; the agent,
for its part, knows which process connected from the kernel, not from the hello.
"""

from __future__ import annotations

import itertools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from . import messages as M
from .board import StatusBoard
from .wire import Conn, WireError, connect_unix

__all__ = ["AgentChannel", "Aborted", "AgentGone"]


class Aborted(Exception):
    """The coordinator started a recovery: stop at this safe point."""


class AgentGone(RuntimeError):
    """The node agent went away (the node is being torn down)."""


COMMANDS = (
    M.Promote,
    M.CallReports,
    M.Reconcile,
    M.Rebuild,
    M.Resume,
    M.Reshape,
    M.Complete,
    M.Fail,
    M.Abort,
)
_GONE = None  # queued when the agent goes away

Request = M.GetState | M.NodeSegment | M.NodeListing | M.SnapshotSlot | M.ClaimFault
"""The messages the agent replies to (:meth:`AgentChannel.request`)."""


class AgentChannel:
    def __init__(
        self,
        socket_name: str,
        hello: dict[str, Any],
        heartbeat: float = 0.5,
        agent_pid: int | None = None,
    ) -> None:
        sock = connect_unix("\0" + socket_name, timeout=30.0, peer_pid=agent_pid)
        self.conn = Conn(sock, send_timeout=30.0)
        self.info = dict(hello)
        self.phase = "startup"
        self.step = 0
        self.progress = 0
        # CPU seconds of this process (all its threads) and wall seconds in each phase
        self.phase_cpu: dict[str, float] = {}
        self.phase_wall: dict[str, float] = {}
        self._cpu_at = time.process_time()
        self._wall_at = time.perf_counter()
        self.commits: set[tuple[int, int]] = set()
        self.t2: set[int] = set()
        self.abort_gen = -1
        self.store_at: tuple[str, int] | None = None  # where the job's TCPStore moved
        self.commands: queue.Queue[M.Message | None] = queue.Queue()
        self._replies: dict[int, tuple[dict[str, Any], list[int]]] = {}
        self._forgotten: set[int] = set()  # requests whose replies nobody will read
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self.gone = False
        # called on this reader thread after an abort is recorded (the session's)
        self.on_abort: Callable[[], None] | None = None
        self._board_lock = threading.Lock()  # one writer at a time (its sequence count)
        # the phase, step and progress, for the agent to read when it looks (no message)
        self.board, fd = StatusBoard.create()
        try:
            self.conn.send(M.Hello(**hello, pid=os.getpid()).to_wire(), [fd])
        finally:
            os.close(fd)
        self._reader = threading.Thread(target=self._read, name="leto-agent-reader", daemon=True)
        self._reader.start()
        self._hb = threading.Thread(
            target=self._beat, args=(heartbeat,), name="leto-heartbeat", daemon=True
        )
        self._hb.start()

    # --- threads -------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                obj, fds = self.conn.recv()
                msg = None if isinstance(obj, dict) and "re" in obj else M.decode(obj)
            except (WireError, OSError):  # the agent went away, or sent what it never does
                with self._cond:
                    self.gone = True
                    self._cond.notify_all()
                self.commands.put(_GONE)
                return
            with self._cond:
                match msg:
                    case None:
                        if int(obj["re"]) in self._forgotten:
                            self._forgotten.discard(int(obj["re"]))
                            for fd in fds:
                                os.close(fd)
                        else:
                            self._replies[int(obj["re"])] = (obj, fds)
                    case M.Commit(step=step, gen=gen):
                        self.commits.add((gen, step))
                    case M.Tier2(step=step):
                        self.t2.add(step)
                    case M.Abort(gen=gen):
                        self.abort_gen = max(self.abort_gen, gen)
                    case M.StoreAt(host=host, port=port):
                        self.store_at = (host, port)
                self._cond.notify_all()
            if isinstance(msg, COMMANDS):
                self.commands.put(msg)
            if isinstance(msg, M.Abort) and self.on_abort is not None:
                try:
                    self.on_abort()
                except Exception as e:  # noqa: BLE001 - the reader must go on reading
                    sys.stderr.write(f"leto: the recovery beside the compute: {e!r}\n")

    def _beat(self, interval: float) -> None:
        while not self.gone:
            try:
                self.conn.send(self._heartbeat(self.phase))
            except WireError:
                return
            time.sleep(interval)

    # --- use -------------------------------------------------------------------------

    def _heartbeat(self, phase: str) -> dict[str, Any]:
        return M.Heartbeat(phase=phase, step=self.step, progress=self.progress).to_wire()

    def send(self, msg: M.Message, fds: list[int] | None = None) -> None:
        try:
            self.conn.send(msg.to_wire(), fds or [])
        except WireError as e:
            raise AgentGone(f"the node agent is gone: {e}") from None

    def request(self, msg: Request, timeout: float = 60.0) -> tuple[dict[str, Any], list[int]]:
        """Send ``msg`` (its ``id`` filled in here) and wait for the agent's reply to it."""
        return self.answer(self.ask(msg), msg.TAG, timeout)

    def ask(self, msg: Request) -> int:
        """Send ``msg`` with an ``id`` of its own; :meth:`answer` with that id waits for
        the reply (the round trip runs while the caller does something else)."""
        rid = next(self._ids)
        self.send(attrs.evolve(msg, id=rid))
        return rid

    def forget(self, rid: int) -> None:
        """Nobody will read the reply to request ``rid``: dropped when it comes."""
        with self._cond:
            if rid in self._replies:
                for fd in self._replies.pop(rid)[1]:
                    os.close(fd)
            else:
                self._forgotten.add(rid)

    def answer(self, rid: int, tag: str, timeout: float = 60.0) -> tuple[dict[str, Any], list[int]]:
        """The agent's reply to request ``rid`` (a ``tag`` message), once it is here."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while rid not in self._replies:
                if self.gone:
                    raise AgentGone("the node agent is gone")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no reply from the agent to {tag} in {timeout} s")
                self._cond.wait(left)
            reply, fds = self._replies.pop(rid)
        if not reply.get("ok", True):
            for fd in fds:
                os.close(fd)
            raise RuntimeError(f"agent refused {tag}: {reply.get('why')}")
        return reply, fds

    def aborted_since(self, gen: int) -> bool:
        return self.abort_gen >= gen

    def mark(self, phase: str, step: int | None = None) -> None:
        """Record progress on the status board (the agent reads it to place a death or a
        hang); a phase the board has no code for is sent to the agent at once instead."""
        changed = phase != self.phase or (step is not None and step != self.step)
        now, wall = time.process_time(), time.perf_counter()
        self.phase_cpu[self.phase] = self.phase_cpu.get(self.phase, 0.0) + now - self._cpu_at
        self.phase_wall[self.phase] = self.phase_wall.get(self.phase, 0.0) + wall - self._wall_at
        self._cpu_at, self._wall_at = now, wall
        self.phase = phase
        if step is not None:
            self.step = step
        with self._board_lock:
            self.progress += 1
            written = self.board.write(phase, self.step, self.progress)
        if not written and changed:
            try:
                self.conn.send(self._heartbeat(phase))
            except WireError:
                pass

    def tick(self) -> None:
        """Progress inside a phase (a layer of the forward or backward): the agent's hang
        check counts it, so a phase longer than the hang timeout is not a hang while its
        layers go by."""
        with self._board_lock:
            self.progress += 1
            self.board.write(self.phase, self.step, self.progress)

    def wait_for(self, what: str, key: Any, gen: int, timeout: float | None = None) -> None:
        """Block until ``commit``/``t2`` ``key`` arrived; :class:`Aborted` if ``gen`` is aborted."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self.abort_gen >= gen:
                    raise Aborted(f"recovery started (generation {self.abort_gen})")
                if self.gone:
                    raise AgentGone("the node agent is gone")
                have = self.commits if what == "commit" else self.t2
                if key in have:
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no {what} {key} within {timeout} s")
                self._cond.wait(0.5 if left is None else min(0.5, left))

    def next_command(self, timeout: float | None = None) -> M.Message:
        msg = self.commands.get(timeout=timeout)
        if msg is _GONE:
            raise AgentGone("the node agent is gone")
        return msg
