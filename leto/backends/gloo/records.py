"""What a node agent keeps about its job and its children: the launch options
(:class:`AgentOptions`), one record per process it started (:class:`Proc`), per TCP
connection to the coordinator (:class:`Link`) and per connection on its Unix socket
(:class:`ProcConn`), and how a process's whereabouts are noted (:func:`note`,
:func:`look`). Plain records, no behaviour: the agent's parts (:mod:`.supervisor`,
:mod:`.children`, :mod:`.shadows`, :mod:`.routing`, :mod:`.host_memory`) act on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .board import StatusBoard
from .messages import Message
from .wire import Conn

__all__ = ["JOB_ENV", "AgentOptions", "LaunchError", "Link", "Proc", "ProcConn", "look", "note"]

# a restart (--max-restarts) is the same job: the agent that execs itself for it passes
# the job's id on here (node 0 keeps it; the others take node 0's at rendezvous)
JOB_ENV = "LETO_RESTART_JOB"


class LaunchError(RuntimeError):
    """A launch that cannot proceed (bad input, rendezvous failure); a clear message."""


@dataclass
class AgentOptions:
    script: str  # a path; with ``module``, a module's name (``python -m``)
    script_args: list[str]
    module: bool = False
    nnodes: int = 1
    # --nnodes MIN:MAX: MIN (0: a fixed size, nnodes); node 0 starts the job with MIN to
    # nnodes nodes (leto.core.elastic), or, at a restart, with the world it started with
    min_nodes: int = 0
    world_nodes: int = 0
    nproc_per_node: int = 1
    node_rank: int = 0
    rdzv_host: str = "127.0.0.1"
    rdzv_port: int = 29400
    run_dir: str = "leto-run"
    hang_timeout: float = 10.0
    heartbeat: float = 0.5
    collective_timeout: float = 30.0
    rdzv_timeout: float = 60.0
    # --rdzv-backend etcd: the members (empty: c10d, node 0 serves the rendezvous) and the
    # job's id there; rdzv_host is then the address node 0 serves on, rdzv_port 0 (any)
    etcd: tuple[tuple[str, int], ...] = ()
    rdzv_id: str = ""
    spare_timeout: float = 60.0
    recovery_timeout: float = 180.0
    exclude_after: int = 3
    exclude_window: float = 600.0
    shadow_memory_budget: int | None = None  # bytes of trainer RSS on this node
    shadows: bool = True
    threads: int = 1
    faults: list[dict[str, Any]] = field(default_factory=list)
    # a spare agent: no node rank until the coordinator assigns it a lost node's place
    spare: bool = False
    # node 0: spare agents to start here, each with this command line (the launcher's)
    spares: int = 0
    spare_command: list[str] = field(default_factory=list)
    echo: bool = True
    quiet: bool = False
    # seeing the job run (node 0; leto.backends.gloo.watch): the progress line's period
    # (None: off), the metrics' address (None: off), the TensorBoard directory
    progress_every: float | None = 10.0
    metrics: tuple[str, int] | None = None
    tensorboard: str | None = None
    # --max-restarts: how many whole-job restarts (node 0 decides), how many were made
    # before this start (0: the first), and the fault plan's entries that fired before
    max_restarts: int = 0
    restarts: int = 0
    fired_faults: tuple[int, ...] = ()
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
    seen_by: str = "pidfd"  # what showed its death: "deathwatch" (before the teardown) or "pidfd"
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
    spare: int | None = None  # a pooled spare agent's id, until it is assigned a node


@dataclass(eq=False)
class ProcConn:
    """A connection on the agent's Unix socket, from the process the kernel names."""

    conn: Conn
    pid: int  # SO_PEERCRED: who connected, whatever its hello says
    proc: Proc | None = None
    hello: bool = False
    held: list[Message] = field(default_factory=list)


def note(p: Proc, phase: str, step: int, progress: int, now: float) -> None:
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


def look(p: Proc, now: float) -> None:
    """Read the process's status board, if it has one and has written it."""
    seen = p.board.read() if p.board is not None else None
    if seen is not None:
        note(p, *seen, now)
