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

What comes in from outside is checked where it arrives (``docs/security.md``): a
TCP connection to the coordinator is a node only once it has proven the job's
secret (:mod:`.auth`), a process on the agent's Unix socket is the one the kernel
names (``SO_PEERCRED``) and must be a child of this node's zygote, and a bad frame
or a first message that is not such a hello closes that one connection, never the
agent. The TCPStore and the coordinator listen on the rendezvous address only, and
the run directory is private (:mod:`.private`).
"""

from __future__ import annotations

import importlib
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

from leto.private import InsecurePathError, private_dir

from . import auth, segments
from . import procs as P
from .board import StatusBoard
from .coordinator import Coordinator, CoordinatorOptions
from .eventlog import EventLog
from .keeper import KeeperHandle, spawn_keeper
from .wire import MAX_FRAME, Conn, WireError, abstract_name, check_peer, listen_unix

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
UNPROVEN_FRAME = 4096  # bytes a TCP peer may send before it has proven the job's secret
UNPROVEN_SECONDS = 10.0  # and how long it has to do so
UNPROVEN_MAX = 16  # connections waiting to prove it at once (the oldest is closed)
HELD_MAX = 256  # messages held for a process whose spawn report has not been read yet
REFUSALS_LOGGED = 100


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
    # modules every trainer imports, imported once here so that the zygote's children
    # inherit them (the launcher names its training API: this layer does not know it)
    preload: tuple[str, ...] = ()


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
    cold_start: bool = False  # a shadow started to be promoted: no skeleton, never warm
    done: bool = False


@dataclass(eq=False)
class Link:
    """A TCP connection to the coordinator: a node once its hello proved the secret."""

    conn: Conn
    peer: str
    challenge: str
    since: float
    node: int | None = None


@dataclass(eq=False)
class ProcConn:
    """A connection on the agent's Unix socket, from the process the kernel names."""

    conn: Conn
    pid: int  # SO_PEERCRED: who connected, whatever its hello says
    proc: Proc | None = None
    hello: bool = False
    held: list[dict[str, Any]] = field(default_factory=list)


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
        # ranks whose shadow could not be built (the reason): replaced by cold starts only
        self.degraded: dict[int, str] = {}
        self.asked: set[int] = set()  # ranks the coordinator needs a shadow of (need_shadow)
        self.by_pid: dict[int, Proc] = {}
        self.spawns: dict[int, dict[str, Any]] = {}
        self.unclaimed: dict[int, ProcConn] = {}
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
        self.unproven: dict[int, Link] = {}  # by id()
        self.refusals = 0
        self.secret: bytes | None = None  # the job's (auth); read by a node != 0 at rendezvous
        self.umask = 0o022  # the user's, given back to the trainers
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
        try:
            self._private()
        except (InsecurePathError, auth.SecretError, OSError) as e:
            print(f"leto[node {self.node}]: error: {e}", file=sys.stderr, flush=True)
            return 1
        import torch._dynamo  # noqa: F401 - creating any torch optimizer imports it
        import torch.distributed  # noqa: F401 - paid once here; the zygote inherits it

        for name in self.o.preload:
            importlib.import_module(name)
        import leto.backends.gloo.runtime  # noqa: F401
        import leto.retained.process_state  # noqa: F401

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

    def _private(self) -> None:
        """The run directory (0700, ours), files in it 0600, and the job's secret: from
        the environment, or on node 0 a new one written to RUN_DIR/secret (before the
        store exists, so a node that reached the store finds it written)."""
        self.umask = os.umask(0o077)
        self.run_dir = private_dir(self.run_dir, "run directory")
        private_dir(self.run_dir / "logs", "log directory")
        self.secret = auth.from_environment()
        if self.node == 0 and self.secret is None:
            self.secret = auth.new_secret()
            auth.write_secret(self.run_dir, self.secret)

    def _rendezvous(self) -> None:
        from datetime import timedelta

        import torch
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
                # bound here, to the address given: left to itself, the store listens on
                # every interface whatever host it is given. torch's libuv server takes a
                # listening socket from 2.8 on (pytorch#150215); before, the classic one
                old = torch.__version__ < (2, 8)  # type: ignore[operator]
                bound = P.listen_tcp(o.rdzv_host, o.rdzv_port)
                self.store = TCPStore(
                    o.rdzv_host,
                    o.rdzv_port,
                    None,
                    True,
                    timeout,
                    wait_for_workers=False,
                    master_listen_fd=bound.detach(),  # the store owns it now
                    **({"use_libuv": False} if old else {}),
                )
            except Exception as e:  # noqa: BLE001 - DistNetworkError, RuntimeError, OSError
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
            welcome = self._join(host, int(port))
            assert self.coord_conn is not None
            self.spare = bool(welcome.get("spare"))
            self.generation = int(welcome.get("gen", 0))
            self.sel.register(self.coord_conn, selectors.EVENT_READ, ("coord", None))
            self.say(
                f"joined job {self.job} at {endpoint}"
                + (" as a replacement (spare) node" if self.spare else "")
            )

    def _join(self, host: str, port: int) -> dict[str, Any]:
        """Connect to the coordinator, prove the job's secret and check its proof (see
        :mod:`.auth`); the welcome."""
        o = self.o
        if self.secret is None:
            try:
                self.secret = auth.read_secret(self.run_dir)
            except auth.SecretError as e:
                raise LaunchError(str(e)) from None
        if self.secret is None:
            raise LaunchError(
                f"no job secret: node 0 writes it to RUN_DIR/{auth.FILE}, and {self.run_dir} "
                f"has none; give every node the same --run-dir (a shared directory), or "
                f"export {auth.ENV} with the same value on every node (docs/security.md)"
            )
        try:
            sock = socket.create_connection((host, port), timeout=o.rdzv_timeout)
        except OSError as e:
            raise LaunchError(f"cannot reach the coordinator at {host}:{port}: {e}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.coord_conn = Conn(sock, send_timeout=30.0)
        nonce = auth.new_nonce()
        try:
            challenge, _ = self.coord_conn.recv(timeout=o.rdzv_timeout)
            ns = challenge.get("nonce")
            if challenge.get("t") != "challenge" or not isinstance(ns, str):
                raise WireError(f"expected a challenge, got {str(challenge)[:80]}")
            proof = auth.proof(self.secret, "node", self.node, ns, nonce)
            self.coord_conn.send({"t": "hello", "node": self.node, "nonce": nonce, "proof": proof})
            welcome, _ = self.coord_conn.recv(timeout=o.rdzv_timeout)
        except (WireError, TimeoutError) as e:
            raise LaunchError(f"the coordinator at {host}:{port} did not answer: {e}") from None
        if welcome.get("t") == "reject":
            raise LaunchError(str(welcome.get("why")))
        if not auth.verify(self.secret, "coordinator", self.node, ns, nonce, welcome.get("proof")):
            raise LaunchError(
                f"the coordinator at {host}:{port} did not prove the job's secret: "
                "not this job's node 0 (or a different secret)"
            )
        return welcome

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

    def _spawn(
        self, lr: int, role: str, promote_gen: int | None = None, *, cold: bool = False
    ) -> None:
        """Fork a trainer or a shadow of ``lr``; a *cold* shadow (one to be promoted at
        once) keeps its parameters instead of building a skeleton."""
        cold = role == "shadow" and (cold or promote_gen is not None)
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
            "skeleton": not cold,
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
            "umask": self.umask,
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
            "cold": cold,
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
                p.cold_start = sp["cold"]
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
            why = _last_line(p.error) or how
            if p.status == "starting" and not p.cold_start and lr not in self.degraded:
                self._degrade(lr, p.rank, why)  # it died building its skeleton
            reason = f"the shadow of rank {p.rank} exited ({how})"
            if p.error:
                reason += ":\n" + p.error
            self._to_coord(
                {
                    "t": "shadow",
                    "rank": p.rank,
                    "state": "failed",
                    "reason": reason,
                    "degraded": self.degraded.get(lr),
                }
            )
            if self.complete:
                return
            # a promotion or the coordinator waits for this rank's replacement
            needed = p.promote_gen is not None or p.cold_start or lr in self.asked
            on_demand = lr in self.degraded or not self.o.shadows
            if self.shadow_failures[lr] < 3 and (needed or not on_demand):
                self._spawn(lr, "shadow", promote_gen=p.promote_gen, cold=on_demand)
            elif needed:
                self._to_coord(
                    {
                        "t": "fatal",
                        "rank": p.rank,
                        "error": f"cannot start a replacement process: it exited ({how}): {why}",
                    }
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
        try:
            sock, _ = self.agent_listener.accept()
        except OSError:  # out of descriptors, or the peer gave up
            return
        try:
            pid = check_peer(sock)
        except OSError:  # PeerError: another user
            sock.close()
            return
        conn = Conn(sock, send_timeout=30.0)
        self.sel.register(conn, selectors.EVENT_READ, ("pconn", ProcConn(conn, pid)))

    def _drop_conn(self, conn: Conn) -> None:
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _on_pconn(self, pc: ProcConn) -> None:
        """Messages from a process on the agent's socket. Which process it is comes from
        the kernel: its hello is taken only from a process this agent's zygote forked
        (its spawn report may not have been read yet: its messages wait for it). Once
        it is known, it is this node's trainer or shadow and speaks the protocol; a bad
        frame from anyone closes its connection."""
        conn = pc.conn
        alive = conn.feed()
        got, bad = conn.drain()
        for i, (msg, fds) in enumerate(got):
            if not pc.hello:
                bad = self._proc_hello(pc, msg, fds)
            else:
                for fd in fds:
                    os.close(fd)
                if pc.proc is not None:
                    self._on_proc_msg(pc.proc, msg)
                elif len(pc.held) < HELD_MAX:
                    pc.held.append(msg)  # until the process is known
                else:
                    bad = WireError(f"{HELD_MAX} messages before its spawn was reported")
            if bad is not None:
                for _, rest in got[i + 1 :]:
                    for fd in rest:
                        os.close(fd)
                break
        if bad is not None:
            self.say(f"closed the connection of pid {pc.pid}: {bad}")
            alive = False
        if not alive:
            if pc.proc is not None and pc.proc.conn is conn:
                pc.proc.conn = None
            if self.unclaimed.get(pc.pid) is pc:
                del self.unclaimed[pc.pid]
                stale = self.unclaimed_boards.pop(pc.pid, None)
                if stale is not None:
                    stale.close()
            self._drop_conn(conn)

    def _proc_hello(self, pc: ProcConn, msg: dict[str, Any], fds: list[int]) -> WireError | None:
        """Take the first message of a connection; why not, if it is refused."""
        p = self.by_pid.get(pc.pid)
        claimed = msg.get("pid", pc.pid)
        why = None
        if msg.get("t") != "hello":
            why = f"its first message is {str(msg.get('t'))[:40]!r}, not a hello"
        elif claimed != pc.pid:
            why = f"its hello claims pid {str(claimed)[:40]}, the kernel says {pc.pid}"
        elif p is None and P.parent_of(pc.pid) != self.zygote.pid:
            why = f"pid {pc.pid} is not a process this agent started"
        board = _board_of(fds) if why is None else None
        for fd in fds:
            os.close(fd)
        if why is not None:
            return WireError(why)
        pc.hello = True
        if p is None:  # the zygote's "spawned" has not been read yet
            self.unclaimed[pc.pid] = pc
            self.unclaimed_boards[pc.pid] = board
            return None
        p.conn, p.board = pc.conn, board
        pc.proc = p
        return None

    def _claim(self, p: Proc) -> None:
        pc = self.unclaimed.pop(p.pid, None)
        if pc is None:
            return
        p.conn = pc.conn
        p.board = self.unclaimed_boards.pop(p.pid, None)
        pc.proc = p
        held, pc.held = pc.held, []
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
            self.asked.discard(lr)
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
        """A TCP connection to the coordinator: challenged at once (:mod:`.auth`); it
        may send a few bytes, for a few seconds, until its hello proves the secret."""
        assert self.listener is not None
        try:
            sock, addr = self.listener.accept()
        except OSError:  # out of descriptors, or the peer gave up
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Conn(sock, send_timeout=1.0, max_frame=UNPROVEN_FRAME)
        link = Link(conn, f"{addr[0]}:{addr[1]}", auth.new_nonce(), time.monotonic())
        if len(self.unproven) >= UNPROVEN_MAX:
            oldest = min(self.unproven.values(), key=lambda k: k.since)
            self._refuse(oldest, "too many connections waiting to prove the job's secret")
        if not _send_link(conn, {"t": "challenge", "nonce": link.challenge}):
            conn.close()
            return
        self.unproven[id(link)] = link
        self.sel.register(conn, selectors.EVENT_READ, ("link", link))

    def _refuse(self, link: Link, why: str, tell: str | None = None) -> None:
        """Close a connection that is not (or not yet) a node, saying why in the log."""
        self.unproven.pop(id(link), None)
        if tell is not None:
            _send_link(link.conn, {"t": "reject", "why": tell})
        self._drop_conn(link.conn)
        self.refusals += 1
        if self.refusals <= REFUSALS_LOGGED:
            self.say(f"refused a connection from {link.peer}: {why}")
            if self.log is not None:
                self.log.write("connection_refused", peer=link.peer, why=why)

    def _expire_unproven(self, now: float) -> None:
        for link in list(self.unproven.values()):
            if now - link.since > UNPROVEN_SECONDS:
                self._refuse(link, f"no proof of the job's secret within {UNPROVEN_SECONDS:g} s")

    def _prove(self, link: Link, msg: dict[str, Any], now: float) -> bool:
        """A connection's first message: a node's hello with its proof, or it is closed."""
        assert self.coord is not None and self.secret is not None
        conn = link.conn
        n, nonce = msg.get("node"), msg.get("nonce")
        if msg.get("t") != "hello" or type(n) is not int:
            self._refuse(link, f"not a leto node's hello: {json.dumps(msg)[:80]}")
            return False
        if not auth.verify(self.secret, "node", n, link.challenge, nonce, msg.get("proof")):
            self._refuse(
                link,
                f"node {n} did not prove the job's secret",
                tell="authentication failed: this node does not hold the job's secret "
                f"(node 0's RUN_DIR/{auth.FILE}, or {auth.ENV})",
            )
            return False
        why = None
        if not 0 < n < self.o.nnodes:
            why = f"node rank {n} is not in 1..{self.o.nnodes - 1}"
        elif n in self.links:
            why = f"node {n} has already joined this job (use another --node-rank)"
        elif self.started and self.coord.model is None:
            why = "the job is starting up; cannot take a spare node yet"
        if why is not None:
            self._refuse(link, why, tell=why)
            return False
        del self.unproven[id(link)]
        conn.max_frame = MAX_FRAME
        conn.sock.settimeout(30.0)
        spare = self.started
        link.node = n
        self.links[n] = conn
        self.joined.add(n)
        proof = auth.proof(self.secret, "coordinator", n, link.challenge, str(nonce))
        welcome = {"t": "welcome", "spare": spare, "gen": self.coord.generation, "proof": proof}
        _send_link(conn, welcome)
        self.coord.node_up(n, spare=spare, now=now)
        if spare:
            _send_link(conn, {"t": "go", "spare": True})
        elif len(self.joined) == self.o.nnodes:
            self.say(f"all {self.o.nnodes} nodes joined: starting {self.W} trainers")
            for m in self.links:
                _send_link(self.links[m], {"t": "go", "spare": False})
            self._go()
        return True

    def _on_link(self, link: Link) -> None:
        conn = link.conn
        assert self.coord is not None
        alive = conn.feed()
        got, bad = conn.drain()
        now = time.monotonic()
        for msg, _fds in got:
            if link.node is None:
                if not self._prove(link, msg, now):
                    return
                continue
            self.coord.handle(link.node, msg, now)
        if link.node is None:
            if bad is not None or not alive:
                self._refuse(link, str(bad) if bad else "closed before its hello")
            return
        if bad is not None:
            self.say(f"node {link.node} sent a bad frame ({bad}): closing its link")
            alive = False
        if not alive:
            n = link.node
            self._drop_conn(conn)
            self.links.pop(n, None)
            self.joined.discard(n)
            if not self.stop and not self.coord.complete:
                self.say(f"lost node {n} (its agent's link closed)")
            self.coord.node_down(n, now)
        self._flush_coord()

    def _on_coord(self) -> None:
        assert self.coord_conn is not None
        alive = self.coord_conn.feed()
        self._coord_messages()
        if not alive and not self.stop:
            if self.complete:
                self.stop = True
                return
            raise LaunchError("lost the coordinator (node 0's agent)")

    def _coord_messages(self) -> None:
        assert self.coord_conn is not None
        got, bad = self.coord_conn.drain()
        for msg, _fds in got:
            self._from_coord(msg)
        if bad is not None and not self.stop:
            raise LaunchError(f"the coordinator sent a bad frame: {bad}")

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
            lr = int(msg["rank"]) - self.node * self.nproc
            sh = self.shadow.get(lr)
            if sh is not None and sh.status == "warm":  # (its report may have been refused)
                self._to_coord({"t": "shadow", "rank": sh.rank, "state": "warm"})
                return
            self.asked.add(lr)
            self._ensure_shadow(lr, force=True)
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
            self._promote_now(sh, gen, warm=not sh.cold_start)
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
        coordinator needs one to promote: ``force``). Without shadows (``--no-shadows``,
        or a rank whose skeleton could not be built) only ``force`` starts one, cold."""
        starting = any(sp["lr"] == lr and sp["role"] == "shadow" for sp in self.spawns.values())
        on_demand = not self.o.shadows or lr in self.degraded
        if (
            self.shadow.get(lr) is None
            and not starting
            and not self.complete
            and not self.stop
            and (force or not (self.reclaimed or on_demand))
        ):
            self._spawn(lr, "shadow", cold=on_demand)

    def _degrade(self, lr: int, rank: int, why: str) -> None:
        """The shadow of ``lr`` could not be built: say so now; its rank runs without one."""
        self.degraded[lr] = why
        print(
            f"leto[node {self.node}]: warning: the shadow of rank {rank} could not be built "
            f"({why}); the job runs degraded: a failure of rank {rank} is recovered by a "
            "cold start",
            file=sys.stderr,
            flush=True,
        )

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
            self._coord_messages()
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
            self._expire_unproven(now)
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
            each = [P.rss_bytes(p.pid) for p in self.trainer.values() if p is not None]
            used = sum(each)
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
                # a trainer killed but not yet reaped reads as 0 (a zombie has no RSS):
                # its memory is not free for a shadow, its exit is about to be handled
                and all(b > 0 for b in each)
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
        for link in list(self.unproven.values()):
            link.conn.close()
        if self.coord_conn is not None:
            self.coord_conn.close()
        if self.listener is not None:
            self.listener.close()
        self.store = None


def _last_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1].strip() if lines else ""


def _send_link(conn: Conn, msg: dict[str, Any]) -> bool:
    """Send on a TCP link; False if it is gone (its closing is handled where it is read)."""
    try:
        conn.send(msg)
    except WireError:
        return False
    return True


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
