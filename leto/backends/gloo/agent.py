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
* **detection**: a robust mutex each process's main thread holds (its death is seen
  before the kernel has torn its memory down, :mod:`.deathwatch`), else a pidfd per
  process and the exit status from the zygote, tracebacks reported by the bootstrap, heartbeats
  (silence or no progress for ``hang_timeout`` is a hang), keeper exits;
* on node 0 (with ``--rdzv-backend etcd``: on the agent elected, another node's
  after a failover, :mod:`.control_plane`), the job's **coordinator**
  (:mod:`.coordinator`) and the TCPStore of the rendezvous, which the trainers share
  as ``MASTER_ADDR:MASTER_PORT``.

One thread runs everything (a selector loop), so there are no locks. Agents talk
to the coordinator over TCP (JSON frames); the coordinator's address is published
in the TCPStore at rendezvous. A node whose agent link closes is lost; starting
``leto launch`` again with the same ``--node-rank`` brings a replacement (spare)
node into the running job, and so does, without anyone starting anything, a *spare
agent* (``leto launch --spare``, or ``--spares N`` on node 0): it proves the job's
secret, waits in the coordinator's pool with torch imported and its zygote forked,
and when a node is lost the coordinator assigns it that node's rank
(:meth:`.SparePool.assign`); from there on it is that node's agent.

What comes in from outside is checked where it arrives (``docs/security.md``): a
TCP connection to the coordinator is a node only once it has proven the job's
secret (:mod:`.auth`), a process on the agent's Unix socket is the one the kernel
names (``SO_PEERCRED``) and must be a child of this node's zygote, and a bad frame
or a first message that is not such a hello closes that one connection, never the
agent. The TCPStore and the coordinator listen on the rendezvous address only, and
the run directory is private (:mod:`.private`).

The agent is one object of shared state (this module) acted on by its parts, each a
small class that sees it through a Protocol of what it uses (``SupervisorHost``,
``ChildrenHost``, ...: :mod:`.node_tables` has what they share), not the agent's
class: :mod:`.supervisor` (startup, rendezvous, the loop and its timers, cleanup),
:mod:`.children` (spawning and reaping processes, the keepers, fencing),
:mod:`.shadows` (warm and cold shadows: ensure, promote, degrade, reclaim),
:mod:`.routing` (messages between the trainers, the coordinator and the other nodes'
agents), :mod:`.control_plane` (etcd: the election, the job's record) and
:mod:`.host_memory` (the node's process states, prepare records, node segments and
tier-2 snapshot slots). The records they share are in :mod:`.records`.
"""

from __future__ import annotations

import selectors
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from leto.core import reshape

from .board import StatusBoard
from .children import Children
from .commit_record import EtcdRecord
from .control_plane import ControlPlane
from .coordinator import Coordinator
from .deathwatch import DeathWatch
from .election import Election
from .etcdstore import EtcdStore, StoreError
from .eventlog import EventLog
from .host_memory import HostMemory
from .keeper import KeeperHandle
from .messages import Message
from .records import AgentOptions, LaunchError, Link, Proc, ProcConn
from .routing import Routing
from .shadows import Shadows
from .supervisor import Supervisor
from .title import set_title
from .watch import Watchers
from .wire import Conn

__all__ = ["Agent", "AgentOptions", "LaunchError"]


class Agent:
    """One node's agent: its state, shared by its parts."""

    def __init__(self, opts: AgentOptions) -> None:
        self.o = opts
        self.node = -1 if opts.spare else opts.node_rank
        self.nproc = opts.nproc_per_node
        self.W = opts.nnodes * opts.nproc_per_node
        self.local_ranks = range(self.nproc)
        self.run_dir = Path(opts.run_dir).resolve()
        self.logs = self.run_dir / "logs"  # the job's own folder of it, once the job is known
        self.sel = selectors.DefaultSelector()
        # deaths seen before the kernel's teardown of the dead process's memory
        self.deathwatch = DeathWatch()
        self.sel.register(self.deathwatch.fd, selectors.EVENT_READ, ("owner_died", None))
        self.keepers: dict[int, KeeperHandle] = {}
        self.trainer: dict[int, Proc | None] = dict.fromkeys(self.local_ranks)
        self.shadow: dict[int, Proc | None] = dict.fromkeys(self.local_ranks)
        self.shadow_state: dict[int, str] = dict.fromkeys(self.local_ranks, "none")
        self.shadow_failures: dict[int, int] = dict.fromkeys(self.local_ranks, 0)
        # ranks whose shadow could not be built (the reason): replaced by cold starts only
        self.degraded: dict[int, str] = {}
        self.told_unprotected = False  # a script without leto.wrap was reported (unwrapped)
        self.asked: set[int] = set()  # ranks the coordinator needs a shadow of (need_shadow)
        self.by_pid: dict[int, Proc] = {}
        self.spawns: dict[int, dict[str, Any]] = {}
        self.unclaimed: dict[int, ProcConn] = {}
        self.unclaimed_boards: dict[int, StatusBoard | None] = {}
        self.local_inbox: list[Message] = []
        self.incarnation = 0
        self.generation = 0
        self.renumbered_at = 0  # the generation of the last shrink that renumbered nodes
        self.started = False
        self.spare = False  # a replacement node (it joined a started job)
        # a spare agent in the job's pool (no node rank yet: self.node is -1)
        self.pooled = opts.spare
        self.spare_id: int | None = None
        self.spare_procs: list[subprocess.Popen[bytes]] = []  # node 0: spares it started
        self.complete = False
        self.failed: str | None = None
        # --max-restarts: the restart this agent starts next (told by the coordinator),
        # and node 0: the fault plan's entries that fired (not to fire again then)
        self.restart: int | None = None
        self.fired: list[int] = []
        self.stop = False
        self.reclaimed = False
        self.recovering = False  # between abort and resume: no re-warming (memory stays put)
        self.coord: Coordinator | None = None
        self.coord_conn: Conn | None = None
        self.links: dict[int, Conn] = {}
        self.pool_links: dict[int, Link] = {}  # the leader: pooled spares' links, by spare id
        self.unproven: dict[int, Link] = {}  # by id()
        self.refusals = 0
        self.secret: bytes | None = None  # the job's (auth); read by a node != 0 at rendezvous
        self.umask = 0o022  # the user's, given back to the trainers
        self.joined: set[int] = set()
        self.t_start = time.monotonic()
        self.store: Any = None
        # with etcd: this machine's address (where it serves, should it lead), the
        # rendezvous record of the leader this agent joined, and while a coordinator
        # that took over waits for the other nodes to rejoin: the predecessor's node,
        # the nodes awaited, until when
        self.local_host = opts.rdzv_host
        self.leader_info: dict[str, Any] | None = None
        self.lost_leader: int | None = None
        self.rejoin: set[int] = set()
        self.rejoin_by = 0.0
        # --rdzv-backend etcd: the job's store there, this agent's part in the election
        # (its lease), and the commit record (the leader's; None: embedded, in memory)
        self.etcd: EtcdStore | None = None
        self.election: Election | None = None
        self.etcd_refreshed = 0.0
        self.record: EtcdRecord | None = None
        self.job = ""
        self.log: EventLog | None = None
        self.watchers: Watchers | None = None  # the leader: progress line, metrics (watch.py)
        self.zygote: Any = None
        self.listener: socket.socket | None = None  # the coordinator's (the leader)
        self.agent_listener: socket.socket | None = None  # the node's Unix socket
        self.agent_socket = ""
        # its parts
        self.supervisor = Supervisor(self)
        self.control = ControlPlane(self)
        self.children = Children(self)
        self.shadows = Shadows(self)
        self.routing = Routing(self)
        self.memory = HostMemory(self)

    def run(self) -> int:
        """Start, run the loop, clean up; the process exit code."""
        return self.supervisor.run()

    @property
    def who(self) -> str:
        """How this agent names itself: "node 1", or "spare 0" while in the pool."""
        if self.pooled:
            return "spare" if self.spare_id is None else f"spare {self.spare_id}"
        return f"node {self.node}"

    def name_self(self) -> None:
        """What this agent is called in ``ps`` (:mod:`.title`): ``leto agent node 0 job ...``."""
        set_title(f"agent {self.who}", self.job)

    def say(self, text: str) -> None:
        if not self.o.quiet:
            print(f"leto[{self.who}]: {text}", flush=True)

    @property
    def leader_node(self) -> int | None:
        """The node whose agent runs the coordinator (None: not known)."""
        if self.coord is not None:
            return self.node
        if self.leader_info is None:
            return 0
        n = self.leader_info.get("node", 0)
        return n if isinstance(n, int) else None

    def rank(self, lr: int) -> int:
        return self.node * self.nproc + lr

    def renumber(self, lost: list[int], gen: int) -> None:
        """A shrink in place at generation ``gen`` lost the old world's nodes ``lost``:
        each surviving node after one is renumbered (:func:`leto.core.reshape.renumbered`).
        The one place an agent's identity changes: this node's index, its processes'
        ranks, the process states and prepare records it keeps by rank, and on the
        coordinator's node its links to the other agents (renumbered as the change is
        sent to them, before its own copy of it arrives here: once per change)."""
        if not lost or gen <= self.renumbered_at:
            return
        self.renumbered_at = gen
        gone = frozenset(lost)
        if not self.pooled and self.node not in gone:
            self.node = self.o.node_rank = reshape.renumbered(self.node, gone)
        if self.coord is not None:
            self.links = {
                reshape.renumbered(n, gone): c for n, c in self.links.items() if n not in gone
            }
            self.joined = {reshape.renumbered(n, gone) for n in self.joined if n not in gone}
            for key in self.sel.get_map().values():
                kind, link = key.data
                if kind == "link" and isinstance(link, Link) and link.node is not None:
                    link.node = None if link.node in gone else reshape.renumbered(link.node, gone)
        procs = [*self.by_pid.values(), *self.trainer.values(), *self.shadow.values()]
        for p in procs:
            if p is not None:
                p.rank = self.rank(p.local_rank)
        self.memory.renumber(lambda r: reshape.renumbered_rank(r, self.nproc, gone))
        self.name_self()
        self.control.present()  # with etcd: a/<node> under its new number too
        led = self.leader_info.get("node") if self.leader_info is not None else None
        if self.leader_info is not None and isinstance(led, int) and led not in gone:
            # the coordinator's node (elected with etcd) may be renumbered too
            self.leader_info = {**self.leader_info, "node": reshape.renumbered(led, gone)}
            if self.coord is not None and self.election is not None:
                try:
                    self.election.renumbered(self.node)
                except StoreError as e:
                    raise LaunchError(str(e)) from None
