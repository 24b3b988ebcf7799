"""The node agent: one per node, started by ``leto launch``.

It owns everything leto runs on its node:

* one **keeper** per local rank (:mod:`.keeper`, retained memory in memfd segments);
* the **zygote** (:mod:`.zygote`), forked right after ``import torch``, from which
  every trainer and shadow is forked in milliseconds;
* the active **trainer** of each local rank and one warm **shadow** per rank
  (the script run up to ``leto.wrap``, its model a meta-device skeleton, connected
  and waiting); a promoted shadow is replaced in the background; when the
  trainers' memory crosses ``shadow_memory_budget`` the shadows are killed (cold)
  and re-warmed when it falls back under 90 % of it;
* the node's **host memory**: tier-1 blocks (parity, or replica records) and
  tier-2 snapshot segments, the ranks' process states and prepare records (small
  JSON);
* **detection**: a pidfd per process (an exit is seen the moment it happens), the
  exit status from the zygote, tracebacks reported by the bootstrap, heartbeats
  (silence or no progress for ``hang_timeout`` is a hang), keeper exits;
* on node 0, the job's **coordinator** (:mod:`.coordinator`) and the TCPStore of
  the rendezvous (``--rdzv-endpoint``), which the trainers share as
  ``MASTER_ADDR:MASTER_PORT``.

One thread runs everything (a selector loop), so there are no locks. Agents talk
to the coordinator over TCP (JSON frames); the coordinator's address is published
in the TCPStore at rendezvous. A node whose agent link closes is lost; starting
``leto launch`` again with the same ``--node-rank`` brings a replacement (spare)
node into the running job.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import procs as P
from . import segments
from .board import StatusBoard
from .coordinator import Coordinator, CoordinatorOptions
from .eventlog import EventLog
from .keeper import KeeperHandle, spawn_keeper
from .wire import Conn, WireError, abstract_name, check_peer, listen_unix

__all__ = ["Agent", "AgentOptions", "LaunchError"]

TO_COORDINATOR = {
    "ready",
    "vote",
    "finished",
    "snapshot_done",
    "stopped",
    "report",
    "reconciled",
    "rebuilt",
    "done",
    "fatal",
}
TO_TRAINERS = {
    "commit",
    "t2",
    "abort",
    "report",
    "reconcile",
    "rebuild",
    "resume",
    "complete",
    "start",
}
COMPUTE_PHASES = {"forward", "backward", "step"}


class LaunchError(RuntimeError):
    """A launch that cannot proceed (bad input, rendezvous failure); a clear message."""


@dataclass
class AgentOptions:
    script: str
    script_args: list[str]
    nnodes: int = 1
    nproc_per_node: int = 1
    node_rank: int = 0
    rdzv_host: str = "127.0.0.1"
    rdzv_port: int = 29400
    run_dir: str = "leto-run"
    hang_timeout: float = 10.0
    heartbeat: float = 0.5
    collective_timeout: float = 30.0
    rdzv_timeout: float = 60.0
    spare_timeout: float = 60.0
    recovery_timeout: float = 180.0
    shadow_memory_budget: int | None = None  # bytes of trainer RSS on this node
    shadows: bool = True
    threads: int = 1
    faults: list[dict[str, Any]] = field(default_factory=list)
    echo: bool = True
    quiet: bool = False


@dataclass
class Proc:
    pid: int
    pidfd: int
    role: str  # "trainer" | "shadow"
    local_rank: int
    rank: int
    incarnation: int
    spawned: float
    log_path: str
    conn: Conn | None = None
    board: StatusBoard | None = None  # its phase, step and progress (shared memory)
    status: str = "starting"  # starting | warm | running | promoting
    hb: float = 0.0
    phase: str = "startup"
    step: int = 0
    progress: int = -1
    progress_t: float = 0.0
    error: str | None = None
    expected_exit: bool = False
    exit_reported: int | None = None
    exited: int | None = None
    dead_at: float | None = None
    hang_reported: bool = False
    promote_gen: int | None = None
    promote_started: float = 0.0
    promote_warm: bool = True
    done: bool = False


class Agent:
    def __init__(self, opts: AgentOptions) -> None:
        self.o = opts
        self.node = opts.node_rank
        self.nproc = opts.nproc_per_node
        self.W = opts.nnodes * opts.nproc_per_node
        self.local_ranks = range(self.nproc)
        self.run_dir = Path(opts.run_dir).resolve()
        self.sel = selectors.DefaultSelector()
        self.keepers: dict[int, KeeperHandle] = {}
        self.trainer: dict[int, Proc | None] = dict.fromkeys(self.local_ranks)
        self.shadow: dict[int, Proc | None] = dict.fromkeys(self.local_ranks)
        self.shadow_state: dict[int, str] = dict.fromkeys(self.local_ranks, "none")
        self.shadow_failures: dict[int, int] = dict.fromkeys(self.local_ranks, 0)
        self.by_pid: dict[int, Proc] = {}
        self.spawns: dict[int, dict[str, Any]] = {}
        self.unclaimed: dict[int, list[Any]] = {}
        self.unclaimed_boards: dict[int, StatusBoard | None] = {}
        self.local_inbox: list[dict[str, Any]] = []
        self.incarnation = 0
        self.node_segments: dict[str, tuple[int, int]] = {}
        self.ps: dict[int, dict[int, str]] = {}
        self.pending: dict[int, str] = {}
        self.snap_active: int | None = None  # the node's current tier-2 snapshot slot
        self.snap_step: int | None = None  # and its step
        self.snap_writing: dict[int, int] = {}  # step -> slot being written for it
        self.generation = 0
        self.started = False
        self.spare = False
        self.complete = False
        self.failed: str | None = None
        self.stop = False
        self.exit_code = 1
        self.reclaimed = False
        self.recovering = False  # between abort and resume: no re-warming (memory stays put)
        self.coord: Coordinator | None = None
        self.coord_conn: Conn | None = None
        self.links: dict[int, Conn] = {}
        self.joined: set[int] = set()
        self.t_start = time.monotonic()
        self.store: Any = None
        self.job = ""
        self.log: EventLog | None = None
        self.zygote: Any = None
        self.listener: socket.socket | None = None
        self.agent_socket = ""
        self._finished_sent = False

    # ================================================================== console

    def say(self, text: str) -> None:
        if not self.o.quiet:
            print(f"leto[node {self.node}]: {text}", flush=True)

    # ================================================================== startup

    def run(self) -> int:
        """Start, run the loop, clean up; the process exit code."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        import torch._dynamo  # noqa: F401 - creating any torch optimizer imports it
        import torch.distributed  # noqa: F401 - paid once here; the zygote inherits it

        import leto.adapters.api  # noqa: F401 - what every trainer imports, preloaded
        import leto.adapters.state  # noqa: F401
        import leto.backends.gloo.runtime  # noqa: F401

        from .zygote import start_zygote

        self.zygote = start_zygote()  # before any thread exists in this process
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            self._rendezvous()
            self._start_node()
            self._loop()
        except LaunchError as e:
            self.failed = str(e)
            print(f"leto[node {self.node}]: error: {e}", file=sys.stderr, flush=True)
            if self.log is not None:
                self.log.write("job_failed", error=str(e))
        except KeyboardInterrupt:
            self.failed = "interrupted"
            if self.log is not None:
                self.log.write("job_failed", error="interrupted by a signal")
        except Exception as e:  # noqa: BLE001 - a bug here must still clean up and say so
            import traceback

            tb = traceback.format_exc()
            self.failed = f"internal error in the agent: {type(e).__name__}: {e}"
            print(f"leto[node {self.node}]: {self.failed}\n{tb}", file=sys.stderr, flush=True)
            if self.log is not None:
                self.log.write("job_failed", error=self.failed, traceback=tb)
        finally:
            self._cleanup()
        if self.failed is None and self.complete:
            return 0
        return 130 if self.failed == "interrupted" else 1

    def _on_signal(self, signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    def _rendezvous(self) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        o = self.o
        timeout = timedelta(seconds=o.rdzv_timeout)
        endpoint = f"{o.rdzv_host}:{o.rdzv_port}"
        if self.node == 0:
            if P.port_in_use(o.rdzv_host, o.rdzv_port):
                raise LaunchError(
                    f"the rendezvous endpoint {endpoint} is in use by another process "
                    "(pick a free port with --rdzv-endpoint HOST:PORT)"
                )
            try:
                self.store = TCPStore(
                    o.rdzv_host, o.rdzv_port, None, True, timeout, wait_for_workers=False
                )
            except Exception as e:  # noqa: BLE001 - DistNetworkError, RuntimeError
                raise LaunchError(f"cannot serve the rendezvous at {endpoint}: {e}") from None
            self.job = secrets.token_hex(8)
            self.listener = socket.create_server((o.rdzv_host, 0))
            cport = self.listener.getsockname()[1]
            self.store.set(
                "leto/job",
                json.dumps(
                    {
                        "job": self.job,
                        "nnodes": o.nnodes,
                        "nproc_per_node": o.nproc_per_node,
                        "coordinator": f"{o.rdzv_host}:{cport}",
                    }
                ),
            )
            self.log = EventLog(self.run_dir / "events.jsonl")
            self.log.write(
                "job_start",
                job=self.job,
                nodes=o.nnodes,
                nproc_per_node=o.nproc_per_node,
                world_size=self.W,
                script=o.script,
                args=o.script_args,
                rdzv=endpoint,
                hang_timeout=o.hang_timeout,
                shadow_memory_budget=o.shadow_memory_budget,
                faults=o.faults,
            )
            self.coord = Coordinator(
                o.nnodes,
                o.nproc_per_node,
                log=self.log,
                options=CoordinatorOptions(
                    spare_timeout=o.spare_timeout, recovery_timeout=o.recovery_timeout
                ),
            )
            self.sel.register(self.listener, selectors.EVENT_READ, ("agent_listener", None))
            self.joined.add(0)
            self.coord.node_up(0, spare=False, now=time.monotonic())
            self.say(f"job {self.job}: rendezvous at {endpoint}, waiting for {o.nnodes} node(s)")
        else:
            try:
                self.store = TCPStore(o.rdzv_host, o.rdzv_port, None, False, timeout)
                info = json.loads(self.store.get("leto/job"))
            except Exception as e:  # noqa: BLE001
                raise LaunchError(
                    f"cannot reach the rendezvous endpoint {endpoint} within {o.rdzv_timeout:g} s "
                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); is node 0's "
                    "`leto launch` running there with the same --rdzv-endpoint?"
                ) from None
            if info["nnodes"] != o.nnodes or info["nproc_per_node"] != o.nproc_per_node:
                raise LaunchError(
                    f"this node was started with --nnodes {o.nnodes} --nproc-per-node "
                    f"{o.nproc_per_node}, node 0 with --nnodes {info['nnodes']} "
                    f"--nproc-per-node {info['nproc_per_node']}"
                )
            self.job = info["job"]
            host, port = info["coordinator"].rsplit(":", 1)
            try:
                sock = socket.create_connection((host, int(port)), timeout=o.rdzv_timeout)
            except OSError as e:
                raise LaunchError(f"cannot reach the coordinator at {host}:{port}: {e}") from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.coord_conn = Conn(sock, send_timeout=30.0)
            self.coord_conn.send({"t": "hello", "node": self.node, "pid": os.getpid()})
            try:
                welcome, _ = self.coord_conn.recv(timeout=o.rdzv_timeout)
            except (WireError, TimeoutError) as e:
                raise LaunchError(f"the coordinator did not answer: {e}") from None
            if welcome.get("t") == "reject":
                raise LaunchError(str(welcome.get("why")))
            self.spare = bool(welcome.get("spare"))
            self.generation = int(welcome.get("gen", 0))
            self.sel.register(self.coord_conn, selectors.EVENT_READ, ("coord", None))
            self.say(
                f"joined job {self.job} at {endpoint}"
                + (" as a replacement (spare) node" if self.spare else "")
            )

    def _start_node(self) -> None:
        self.agent_socket = abstract_name(f"{self.job}-agent{self.node}")
        self.agent_listener = listen_unix(self.agent_socket)
        self.sel.register(self.agent_listener, selectors.EVENT_READ, ("listener", None))
        self.sel.register(self.zygote.conn, selectors.EVENT_READ, ("zygote", None))
        self.sel.register(self.zygote.pidfd, selectors.EVENT_READ, ("zygote_dead", None))
        for lr in self.local_ranks:
            self._start_keeper(lr)
        if self.node == 0 and self.o.nnodes == 1:
            self._go()

    def _start_keeper(self, lr: int) -> None:
        h = spawn_keeper(self._rank(lr), self.job, tag=str(self.run_dir))
        if self.generation:
            h.fence(self.generation)
        self.keepers[lr] = h
        self.sel.register(h.pidfd, selectors.EVENT_READ, ("keeper_dead", lr))

    def _rank(self, lr: int) -> int:
        return self.node * self.nproc + lr

    def _go(self, spare: bool = False) -> None:
        """Every node has joined (or this is a spare): start the processes."""
        self.started = True
        for lr in self.local_ranks:
            if not spare:
                self._spawn(lr, "trainer")
            if self.o.shadows:
                self._spawn(lr, "shadow")

    # ================================================================== processes

    def _spawn(self, lr: int, role: str, promote_gen: int | None = None) -> None:
        self.incarnation += 1
        rank = self._rank(lr)
        inc = self.incarnation
        log_path = str(self.run_dir / "logs" / f"node{self.node}-{role}{rank}-{inc}.log")
        rfd, wfd = os.pipe()
        o = self.o
        env = {
            "RANK": rank,
            "WORLD_SIZE": self.W,
            "LOCAL_RANK": lr,
            "LOCAL_WORLD_SIZE": self.nproc,
            "GROUP_RANK": self.node,
            "NODE_RANK": self.node,
            "ROLE_RANK": rank,
            "MASTER_ADDR": o.rdzv_host,
            "MASTER_PORT": o.rdzv_port,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "OMP_NUM_THREADS": o.threads,
            "LETO_ROLE": role,
            "LETO_INCARNATION": inc,
            "LETO_RUN_DIR": str(self.run_dir),
            "LETO_JOB": self.job,
        }
        spec = {
            "role": role,
            "rank": rank,
            "local_rank": lr,
            "node": self.node,
            "nnodes": o.nnodes,
            "nproc": self.nproc,
            "world": self.W,
            "incarnation": inc,
            "env": env,
            "script": o.script,
            "args": o.script_args,
            "cwd": os.getcwd(),
            "agent_socket": self.agent_socket[1:],
            "keeper_socket": self.keepers[lr].socket_name,
            "keeper_pid": self.keepers[lr].pid,
            "agent_pid": os.getpid(),
            "job": self.job,
            "threads": o.threads,
            "heartbeat": o.heartbeat,
            "collective_timeout": o.collective_timeout,
            "store_host": o.rdzv_host,
            "store_port": o.rdzv_port,
            "faults": [f for f in o.faults if f["rank"] == rank],
            "generation": self.generation,
        }
        rid = self.zygote.spawn(spec, wfd)
        os.close(wfd)
        os.set_blocking(rfd, False)
        logf = open(log_path, "ab")  # noqa: SIM115 - closed when the pipe closes
        self.spawns[rid] = {
            "lr": lr,
            "role": role,
            "inc": inc,
            "log": log_path,
            "promote_gen": promote_gen,
        }
        self.sel.register(
            rfd, selectors.EVENT_READ, ("log", {"fd": rfd, "file": logf, "rank": rank, "pid": None})
        )
        self.spawns[rid]["logkey"] = rfd
        if role == "shadow":
            self.shadow_state[lr] = "spawning"

    def _on_zygote(self) -> None:
        alive = self.zygote.conn.feed()
        for msg, fds in self.zygote.conn.messages():
            op = msg.get("op")
            if op == "spawned":
                sp = self.spawns.pop(int(msg["id"]))
                now = time.monotonic()
                p = Proc(
                    pid=int(msg["pid"]),
                    pidfd=fds[0],
                    role=sp["role"],
                    local_rank=sp["lr"],
                    rank=self._rank(sp["lr"]),
                    incarnation=sp["inc"],
                    spawned=now,
                    log_path=sp["log"],
                    hb=now,
                    progress_t=now,
                )
                p.promote_gen = sp["promote_gen"]
                if p.promote_gen is not None:
                    p.promote_started = now
                    p.promote_warm = False
                self.by_pid[p.pid] = p
                key = self.sel.get_key(sp["logkey"])
                key.data[1]["pid"] = p.pid
                key.data[1]["proc"] = p
                self.sel.register(p.pidfd, selectors.EVENT_READ, ("pidfd", p))
                if p.role == "trainer":
                    self.trainer[p.local_rank] = p
                    self._keeper(p.local_rank, "admit", self.generation, p.pid)
                else:
                    self.shadow[p.local_rank] = p
                self._claim(p)
            elif op == "exited":
                p2 = self.by_pid.get(int(msg["pid"]))
                if p2 is not None:
                    p2.exited = int(msg["code"])
                    if p2.dead_at is not None:
                        self._finalize_exit(p2)
            else:
                for fd in fds:
                    os.close(fd)
        if not alive and not self.stop:
            raise LaunchError("the zygote (fork server) died")

    def _on_pidfd(self, p: Proc) -> None:
        self.sel.unregister(p.pidfd)
        p.dead_at = time.monotonic()
        if self.trainer.get(p.local_rank) is p and not p.expected_exit:
            self.recovering = True  # its memory is going away: that is no reason to re-warm
        if p.exited is not None:
            self._finalize_exit(p)
        # else: the zygote's status report follows within milliseconds (tick has a fallback)

    def _finalize_exit(self, p: Proc) -> None:
        if p.pid not in self.by_pid:
            return
        del self.by_pid[p.pid]
        _look(p, time.monotonic())  # where it was when it died
        if p.board is not None:
            p.board.close()
            p.board = None
        stale = self.unclaimed_boards.pop(p.pid, None)
        if stale is not None:
            stale.close()
        try:
            os.close(p.pidfd)
        except OSError:
            pass
        if p.conn is not None:
            self._drop_conn(p.conn)
        lr = p.local_rank
        code = p.exited
        how = P.describe_status(code)
        if self.trainer.get(lr) is p:
            self.trainer[lr] = None
            if p.expected_exit or self.stop:
                return
            if self.complete and code == 0:
                p.done = True
                self._check_node_finished()
                return
            kind = "exception" if p.error else "crash"
            detected = "exception reported by the trainer" if p.error else "process exit (pidfd)"
            if code == 0 and p.status == "starting":
                how = (
                    "the script ended (exit code 0) without calling leto.wrap with "
                    "backend='gloo': `leto launch` runs scripts wrapped by leto"
                )
            latency = None if p.dead_at is None else round((p.dead_at - p.hb) * 1e3, 1)
            where = {"idle": "between steps", "startup": "during startup"}.get(
                p.phase, f"in {p.phase} of step {p.step + 1}"
            )
            self.say(
                f"rank {p.rank} {'raised an exception' if p.error else 'died'} ({how}) {where}"
            )
            self._ensure_shadow(lr)
            self.recovering = True  # (the abort follows) no re-warming on the freed memory
            self._to_coord(
                {
                    "t": "failure",
                    "kind": kind,
                    "rank": p.rank,
                    "detected_by": detected,
                    "detail": how,
                    "traceback": p.error,
                    "in_phase": p.phase,
                    "at_step": p.step,
                    "ms_since_heartbeat": latency,
                    "pid": p.pid,
                }
            )
        elif self.shadow.get(lr) is p:
            self.shadow[lr] = None
            if p.expected_exit or self.stop:
                return
            self.shadow_failures[lr] += 1
            self.shadow_state[lr] = "failed" if p.error else "none"
            reason = f"the shadow of rank {p.rank} exited ({how})"
            if p.error:
                reason += ":\n" + p.error
            self._to_coord({"t": "shadow", "rank": p.rank, "state": "failed", "reason": reason})
            if self.shadow_failures[lr] < 3 and not self.complete:
                self._spawn(lr, "shadow", promote_gen=p.promote_gen)
            elif p.promote_gen is not None:
                self._to_coord(
                    {"t": "fatal", "rank": p.rank, "error": f"cannot promote a shadow: {reason}"}
                )

    def _kill(self, p: Proc, *, wait: float = 5.0) -> None:
        """SIGKILL ``p`` and wait until it is gone (its handle readable)."""
        p.expected_exit = True
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        import select

        try:
            select.select([p.pidfd], [], [], wait)
        except (OSError, ValueError):
            pass

    def _keeper(self, lr: int, op: str, *args: int) -> None:
        """``fence``/``admit`` on the keeper of ``lr``; a keeper found dead is handled now."""
        for _ in range(3):
            h = self.keepers[lr]
            try:
                getattr(h, op)(*args)
                return
            except (WireError, TimeoutError, RuntimeError, OSError):
                try:
                    h.proc.wait(2.0)
                except Exception:  # noqa: BLE001
                    raise LaunchError(
                        f"the keeper of rank {self._rank(lr)} does not answer"
                    ) from None
                self._on_keeper_dead(lr)
        raise LaunchError(f"the keeper of rank {self._rank(lr)} keeps failing")

    def _on_keeper_dead(self, lr: int) -> None:
        h = self.keepers[lr]
        self.sel.unregister(h.pidfd)
        code = h.proc.wait()
        h.close()
        rank = self._rank(lr)
        if self.stop:
            return
        self.say(
            f"the keeper of rank {rank} died ({P.describe_status(code)}): its retained memory is lost"
        )
        t = self.trainer.get(lr)
        if t is not None:
            self._kill(t)  # the last holder of a mapping: now the memory is really gone
        self._start_keeper(lr)
        self._to_coord(
            {
                "t": "failure",
                "kind": "keeper_lost",
                "rank": rank,
                "detected_by": "keeper process exit (pidfd)",
                "detail": P.describe_status(code),
            }
        )

    # ================================================================== connections

    def _accept_proc(self) -> None:
        assert self.agent_listener is not None
        sock, _ = self.agent_listener.accept()
        try:
            check_peer(sock)
        except PermissionError:
            sock.close()
            return
        conn = Conn(sock, send_timeout=30.0)
        self.sel.register(conn, selectors.EVENT_READ, ("pconn", [conn, None]))

    def _drop_conn(self, conn: Conn) -> None:
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _on_pconn(self, slot: list[Any]) -> None:
        conn: Conn = slot[0]
        alive = conn.feed()
        for msg, fds in conn.messages():
            board = _board_of(fds) if slot[1] is None and msg.get("t") == "hello" else None
            for fd in fds:
                os.close(fd)
            if slot[1] is None:
                if msg.get("t") != "hello":
                    self._drop_conn(conn)
                    return
                pid = int(msg.get("pid", -1))
                p = self.by_pid.get(pid)
                if p is None:  # the zygote's "spawned" has not been read yet
                    self.unclaimed[pid] = slot
                    self.unclaimed_boards[pid] = board
                    slot[1] = "pending"
                    continue
                p.conn, p.board = conn, board
                slot[1] = p
                continue
            if slot[1] == "pending":
                slot.append(msg)  # held until the process is known
                continue
            self._on_proc_msg(slot[1], msg)
        if not alive:
            if isinstance(slot[1], Proc):
                slot[1].conn = None
            self._drop_conn(conn)

    def _claim(self, p: Proc) -> None:
        slot = self.unclaimed.pop(p.pid, None)
        if slot is None:
            return
        p.conn = slot[0]
        p.board = self.unclaimed_boards.pop(p.pid, None)
        slot[1] = p
        held = slot[2:]
        del slot[2:]
        for msg in held:
            self._on_proc_msg(p, msg)

    def _send_proc(self, p: Proc, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        if p.conn is None:
            return
        try:
            p.conn.send(msg, fds or [])
        except WireError:
            pass

    def _on_proc_msg(self, p: Proc, msg: dict[str, Any]) -> None:
        t = msg.get("t")
        now = time.monotonic()
        if t == "hb":
            p.hb = now
            _note(
                p,
                str(msg.get("phase", p.phase)),
                int(msg.get("step", p.step)),
                int(msg.get("progress", 0)),
                now,
            )
            return
        if t == "warm":
            p.status = "warm"
            p.hb = now
            lr = p.local_rank
            if p.promote_gen is not None:
                self._promote_now(p, p.promote_gen, warm=False)
                return
            self.shadow_state[lr] = "warm"
            self.shadow_failures[lr] = 0
            self._to_coord(
                {
                    "t": "shadow",
                    "rank": p.rank,
                    "state": "warm",
                    "ms": round((now - p.spawned) * 1e3, 1),
                }
            )
            if self.reclaimed:
                self._reclaim(lr, "trainer memory still above the budget")
            return
        if t == "promoted":
            p.status = "running"
            ms = round((now - p.promote_started) * 1e3, 1)
            self.say(
                f"rank {p.rank}: {'warm' if p.promote_warm else 'cold'} shadow promoted in {ms:.0f} ms"
            )
            self._to_coord(
                {
                    "t": "promoted",
                    "rank": p.rank,
                    "gen": p.promote_gen,
                    "warm": p.promote_warm,
                    "ms": ms,
                }
            )
            return
        if t == "error":
            p.error = str(msg.get("traceback"))
            return
        if t == "exit":
            p.exit_reported = int(msg.get("code", 1))
            return
        if t == "ps":
            self._keep_ps(int(msg["rank"]), int(msg["step"]), str(msg["json"]))
            return
        if t == "pending":
            self.pending[int(msg["rank"])] = str(msg["json"])
            return
        # a step's vote carries its pending process state, its "finished" the state
        # after it: kept here (for a recovery), not sent on to the coordinator
        if t == "vote" and "pending" in msg:
            self.pending[int(msg["rank"])] = str(msg.pop("pending"))
        if t == "finished" and "ps" in msg:
            self._keep_ps(int(msg["rank"]), int(msg["step"]), str(msg.pop("ps")))
        if t == "get_state":
            r = int(msg["rank"])
            self._send_proc(
                p,
                {
                    "re": msg["id"],
                    "ok": True,
                    "ps": {str(k): v for k, v in self.ps.get(r, {}).items()},
                    "pending": self.pending.get(r),
                },
            )
            return
        if t == "node_segment":
            name, nbytes = str(msg["name"]), int(msg["nbytes"])
            have = self.node_segments.get(name)
            if have is None:
                fd = segments.create(f"leto-{self.job}-node{self.node}-{name}", nbytes)
                have = (fd, nbytes)
                self.node_segments[name] = have
            if have[1] != nbytes:
                self._send_proc(
                    p, {"re": msg["id"], "ok": False, "why": f"{name} has {have[1]} bytes"}
                )
                return
            self._send_proc(p, {"re": msg["id"], "ok": True, "created": False}, [have[0]])
            return
        if t == "snapshot_slot":
            step = int(msg["step"])
            writing = self.snap_writing
            active = self.snap_active
            slot = writing.get(step)
            if slot is None:
                slot = 0 if active is None else 1 - int(active)
                if step >= 0:
                    writing[step] = slot
            self._send_proc(
                p,
                {
                    "re": msg["id"],
                    "ok": True,
                    "write": slot,
                    "active": active,
                    "active_step": self.snap_step,
                },
            )
            return
        if t == "ready":
            p.status = "running"
        if t in TO_COORDINATOR:
            self._to_coord(msg)
            return

    def _keep_ps(self, rank: int, step: int, ps: str) -> None:
        """Keep a rank's process state after ``step`` (the last few, and the snapshot's)."""
        hist = self.ps.setdefault(rank, {})
        hist[step] = ps
        for old in [s for s in hist if s < step - 3 and s != self.snap_step]:
            del hist[old]

    # ================================================================== coordinator

    def _to_coord(self, msg: dict[str, Any]) -> None:
        if self.coord is not None:
            self.coord.handle(0, msg, time.monotonic())
            self._flush_coord()
        elif self.coord_conn is not None:
            try:
                self.coord_conn.send(msg)
            except WireError:
                pass

    def _flush_coord(self) -> None:
        assert self.coord is not None
        while self.coord.outbox:
            node, msg = self.coord.outbox.pop(0)
            targets = sorted(self.joined) if node is None else [node]
            for n in targets:
                if n == 0:
                    self.local_inbox.append(msg)  # delivered by the loop: no re-entrance
                elif n in self.links:
                    try:
                        self.links[n].send(msg)
                    except WireError:
                        pass

    def _accept_link(self) -> None:
        assert self.listener is not None
        sock, _ = self.listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Conn(sock, send_timeout=30.0)
        self.sel.register(conn, selectors.EVENT_READ, ("link", [conn, None]))

    def _on_link(self, slot: list[Any]) -> None:
        conn: Conn = slot[0]
        assert self.coord is not None
        alive = conn.feed()
        now = time.monotonic()
        for msg, _fds in conn.messages():
            if slot[1] is None:
                n = int(msg.get("node", -1))
                if msg.get("t") != "hello" or not 0 < n < self.o.nnodes:
                    conn.send(
                        {"t": "reject", "why": f"node rank {n} is not in 1..{self.o.nnodes - 1}"}
                    )
                    self._drop_conn(conn)
                    return
                if n in self.links:
                    conn.send(
                        {
                            "t": "reject",
                            "why": f"node {n} has already joined this job (use another --node-rank)",
                        }
                    )
                    self._drop_conn(conn)
                    return
                spare = self.started
                if spare and self.coord.model is None:
                    conn.send(
                        {
                            "t": "reject",
                            "why": "the job is starting up; cannot take a spare node yet",
                        }
                    )
                    self._drop_conn(conn)
                    return
                slot[1] = n
                self.links[n] = conn
                self.joined.add(n)
                conn.send({"t": "welcome", "spare": spare, "gen": self.coord.generation})
                self.coord.node_up(n, spare=spare, now=now)
                if spare:
                    conn.send({"t": "go", "spare": True})
                elif len(self.joined) == self.o.nnodes:
                    self.say(f"all {self.o.nnodes} nodes joined: starting {self.W} trainers")
                    for m in self.links:
                        self.links[m].send({"t": "go", "spare": False})
                    self._go()
                continue
            self.coord.handle(int(slot[1]), msg, now)
        if not alive:
            n = slot[1]
            self._drop_conn(conn)
            if n is not None:
                self.links.pop(n, None)
                self.joined.discard(n)
                if not self.stop and not self.coord.complete:
                    self.say(f"lost node {n} (its agent's link closed)")
                self.coord.node_down(n, now)
        self._flush_coord()

    def _on_coord(self) -> None:
        assert self.coord_conn is not None
        alive = self.coord_conn.feed()
        for msg, _fds in self.coord_conn.messages():
            self._from_coord(msg)
        if not alive and not self.stop:
            if self.complete:
                self.stop = True
                return
            raise LaunchError("lost the coordinator (node 0's agent)")

    def _from_coord(self, msg: dict[str, Any]) -> None:
        t = msg.get("t")
        if t == "go":
            self._go(spare=bool(msg.get("spare")))
            return
        if t == "fail":
            self.failed = str(msg.get("error"))
            print(f"leto[node {self.node}]: job failed: {self.failed}", file=sys.stderr, flush=True)
            self.stop = True
            return
        if t == "abort":
            self.generation = max(self.generation, int(msg["gen"]))
            self.recovering = True
        if t == "resume":
            self.recovering = False
        if t == "t2":
            step = int(msg["step"])
            if step in self.snap_writing:
                self.snap_active = self.snap_writing.pop(step)
                self.snap_step = step
        if t == "fence":
            self._fence(int(msg["gen"]), [int(r) for r in msg.get("kill", [])])
            return
        if t == "promote":
            self._promote(int(msg["rank"]) - self.node * self.nproc, int(msg["gen"]))
            return
        if t == "need_shadow":
            self._ensure_shadow(int(msg["rank"]) - self.node * self.nproc, force=True)
            return
        if t == "complete":
            self.complete = True
        if t in TO_TRAINERS:
            for p in list(self.trainer.values()):
                if p is not None:
                    self._send_proc(p, msg)

    def _fence(self, gen: int, kill: list[int]) -> None:
        self.generation = gen
        killed = []
        for r in kill:
            lr = r - self.node * self.nproc
            if lr in self.local_ranks:
                p = self.trainer.get(lr)
                if p is not None:
                    self._kill(p)
                    killed.append({"rank": r, "pid": p.pid})
                    self.trainer[lr] = None
        for lr in self.local_ranks:
            self._keeper(lr, "fence", gen)
            p = self.trainer.get(lr)
            if p is not None and p.dead_at is None:
                self._keeper(lr, "admit", gen, p.pid)
        self._to_coord({"t": "fenced", "node": self.node, "gen": gen, "killed": killed})

    def _promote(self, lr: int, gen: int) -> None:
        sh = self.shadow.get(lr)
        self._keeper(lr, "fence", max(gen, self.generation))
        self.generation = max(gen, self.generation)
        if sh is not None and sh.status == "warm" and sh.conn is not None:
            self._promote_now(sh, gen, warm=True)
            return
        if sh is not None:  # still starting: promote it the moment it is warm
            sh.promote_gen = gen
            sh.promote_started = time.monotonic()
            sh.promote_warm = False
            return
        self._spawn(lr, "shadow", promote_gen=gen)

    def _promote_now(self, sh: Proc, gen: int, *, warm: bool) -> None:
        lr = sh.local_rank
        if not warm and sh.promote_started == 0.0:
            sh.promote_started = time.monotonic()
        if warm:
            sh.promote_started = time.monotonic()
        sh.promote_gen = gen
        sh.promote_warm = warm
        self.shadow[lr] = None
        self.shadow_state[lr] = "spawning"
        old = self.trainer.get(lr)
        if old is not None and old is not sh:
            self._kill(old)
        self.trainer[lr] = sh
        sh.role = "trainer"
        sh.status = "promoting"
        sh.hb = time.monotonic()
        sh.progress_t = sh.hb
        self._keeper(lr, "admit", gen, sh.pid)
        h = self.keepers[lr]
        self._send_proc(
            sh, {"t": "promote", "gen": gen, "keeper_pid": h.pid, "keeper_socket": h.socket_name}
        )
        self._ensure_shadow(lr)  # the replacement warms in the background

    def _ensure_shadow(self, lr: int, *, force: bool = False) -> None:
        """A shadow for ``lr`` if it has none (not while shadows are reclaimed, unless the
        coordinator needs one to promote: ``force``)."""
        starting = any(sp["lr"] == lr and sp["role"] == "shadow" for sp in self.spawns.values())
        if (
            self.o.shadows
            and self.shadow.get(lr) is None
            and not starting
            and not self.complete
            and not self.stop
            and (force or not self.reclaimed)
        ):
            self._spawn(lr, "shadow")

    def _reclaim(self, lr: int, reason: str) -> None:
        sh = self.shadow.get(lr)
        if sh is None or sh.promote_gen is not None:
            return
        self._kill(sh, wait=2.0)
        self.shadow[lr] = None
        self.shadow_state[lr] = "cold"
        self._to_coord({"t": "shadow", "rank": self._rank(lr), "state": "cold", "reason": reason})

    # ================================================================== loop

    def _loop(self) -> None:
        last_tick = 0.0
        if self.coord_conn is not None:  # messages that arrived with the welcome
            for msg, _fds in self.coord_conn.messages():
                self._from_coord(msg)
        while not self.stop:
            period = self._tick_period()
            for key, _ in self.sel.select(timeout=period):
                kind, obj = key.data
                if kind == "zygote":
                    self._on_zygote()
                elif kind == "zygote_dead":
                    if not self.stop:
                        raise LaunchError("the zygote (fork server) died")
                elif kind == "listener":
                    self._accept_proc()
                elif kind == "pconn":
                    self._on_pconn(obj)
                elif kind == "pidfd":
                    self._on_pidfd(obj)
                elif kind == "keeper_dead":
                    self._on_keeper_dead(obj)
                elif kind == "log":
                    self._on_log(obj)
                elif kind == "agent_listener":
                    self._accept_link()
                elif kind == "link":
                    self._on_link(obj)
                elif kind == "coord":
                    self._on_coord()
                if self.stop:
                    break
            now = time.monotonic()
            if now - last_tick >= period:
                last_tick = now
                self._tick(now)
            if self.coord is not None:
                self._flush_coord()
                while self.local_inbox and not self.stop:
                    self._from_coord(self.local_inbox.pop(0))
                    self._flush_coord()
                if self.coord.failed is not None and not self.stop:
                    self.failed = self.coord.failed
                    self.stop = True
                if (
                    self.coord.complete
                    and self._node_done()
                    and self.coord.finished_nodes >= set(range(1, self.o.nnodes)) - set()
                ):
                    self.stop = True

    def _tick_period(self) -> float:
        """Seconds between timer checks: 50 ms while an exit is being settled or a
        recovery runs; in steady training a twentieth of the hang timeout, at most 0.25
        s (each tick wakes the agent on cores the trainers share; the coordinator's
        other timers are seconds long)."""
        if self.recovering or any(p.dead_at is not None for p in self.by_pid.values()):
            return 0.05
        return max(0.05, min(0.25, self.o.hang_timeout / 20))

    def _node_done(self) -> bool:
        return self.complete and all(p is None for p in self.trainer.values())

    def _check_node_finished(self) -> None:
        if self._node_done() and not self._finished_sent:
            self._finished_sent = True
            self._to_coord({"t": "node_finished", "node": self.node})
            if self.coord is None:
                self.stop = True

    def _tick(self, now: float) -> None:
        o = self.o
        # exits whose status the zygote did not send in time
        for p in list(self.by_pid.values()):
            if p.dead_at is not None and now - p.dead_at > 0.2:
                self._finalize_exit(p)
        if self.coord is not None:
            self.coord.tick(now)
            if not self.started and now - self.t_start > o.rdzv_timeout:
                raise LaunchError(
                    f"only node(s) {sorted(self.joined)} of {o.nnodes} joined within "
                    f"{o.rdzv_timeout:g} s; start `leto launch` on every node with the same "
                    "--rdzv-endpoint and --nnodes"
                )
        # hangs: a silent heartbeat, or no progress inside the training computation
        for tp in self.trainer.values():
            if tp is None or tp.conn is None or tp.hang_reported or tp.status != "running":
                continue
            p = tp
            _look(p, now)
            silent = now - p.hb
            stuck = now - p.progress_t if p.phase in COMPUTE_PHASES else 0.0
            if silent > o.hang_timeout or stuck > o.hang_timeout:
                p.hang_reported = True
                how = (
                    f"no heartbeat for {silent:.1f} s"
                    if silent > o.hang_timeout
                    else f"no progress in {p.phase} for {stuck:.1f} s"
                )
                self.say(f"rank {p.rank} hangs ({how})")
                self._to_coord(
                    {
                        "t": "failure",
                        "kind": "hang",
                        "rank": p.rank,
                        "detected_by": "heartbeat timeout",
                        "detail": how,
                        "in_phase": p.phase,
                        "at_step": p.step,
                        "pid": p.pid,
                    }
                )
        # memory: shadows go cold while the trainers need the memory
        if o.shadow_memory_budget is not None and self.started:
            used = sum(P.rss_bytes(p.pid) for p in self.trainer.values() if p is not None)
            if not self.reclaimed and used > o.shadow_memory_budget:
                self.reclaimed = True
                why = f"trainers use {used >> 20} MiB > budget {o.shadow_memory_budget >> 20} MiB"
                self.say(f"shadows go cold: {why}")
                for lr in self.local_ranks:
                    self._reclaim(lr, why)
            elif (
                self.reclaimed
                and not self.recovering
                and all(p is not None and p.dead_at is None for p in self.trainer.values())
                and used < 0.9 * o.shadow_memory_budget
            ):
                self.reclaimed = False
                self.say(f"shadows re-warm: trainers use {used >> 20} MiB")
                for lr in self.local_ranks:
                    # not a second shadow where one is already starting (e.g. the one
                    # the coordinator asked for, to promote)
                    self._ensure_shadow(lr)
        if self.complete:
            self._check_node_finished()

    def _on_log(self, info: dict[str, Any]) -> None:
        fd = info["fd"]
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.sel.unregister(fd)
            os.close(fd)
            info["file"].close()
            return
        info["file"].write(data)
        info["file"].flush()
        p = info.get("proc")
        if self.o.echo and p is not None and p.role == "trainer":
            text = info.get("partial", "") + data.decode(errors="replace")
            lines = text.split("\n")
            info["partial"] = lines.pop()
            prefix = f"[rank {p.rank}] "
            if lines:
                sys.stdout.write("".join(prefix + line + "\n" for line in lines))
                sys.stdout.flush()

    # ================================================================== cleanup

    def _cleanup(self) -> None:
        self.stop = True
        for p in list(self.by_pid.values()):
            p.expected_exit = True
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.zygote is not None:
            try:
                os.kill(self.zygote.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(self.zygote.pid, 0)
            except ChildProcessError:
                pass
        import select

        for p in list(self.by_pid.values()):
            try:
                select.select([p.pidfd], [], [], 5.0)
                os.close(p.pidfd)
            except (OSError, ValueError):
                pass
        for h in self.keepers.values():
            try:
                h.proc.kill()
                h.proc.wait(5)
            except Exception:  # noqa: BLE001
                pass
            h.close()
        for fd, _ in self.node_segments.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.node_segments.clear()
        if self.zygote is not None:
            self.zygote.close()
        for key in list(self.sel.get_map().values()):
            if key.data[0] == "log":
                try:
                    key.data[1]["file"].close()
                    os.close(key.data[1]["fd"])
                except OSError:
                    pass
        if self.log is not None:
            if self.failed is None and self.complete:
                self.log.write(
                    "job_end",
                    status="ok",
                    recoveries=len(self.coord.recoveries) if self.coord else 0,
                )
            else:
                self.log.write("job_end", status="failed", error=self.failed)
            self.log.close()
        for c in list(self.links.values()):
            c.close()
        if self.coord_conn is not None:
            self.coord_conn.close()
        if self.listener is not None:
            self.listener.close()
        self.store = None


def _board_of(fds: list[int]) -> StatusBoard | None:
    """The status board a process sent with its hello (the descriptors stay open)."""
    if len(fds) != 1:
        return None
    try:
        return StatusBoard(fds[0])
    except (ValueError, OSError):
        return None


def _note(p: Proc, phase: str, step: int, progress: int, now: float) -> None:
    """What a process said (a heartbeat) or wrote (its board) about where it is.

    The counter only grows: a heartbeat sent before a phase change that the board
    already shows, or a board behind a phase sent as a message, is older news."""
    if progress < p.progress:
        return
    if progress != p.progress:
        p.progress = progress
        p.progress_t = now
    p.phase = phase
    p.step = step


def _look(p: Proc, now: float) -> None:
    """Read the process's status board, if it has one and has written it."""
    seen = p.board.read() if p.board is not None else None
    if seen is not None:
        _note(p, *seen, now)
