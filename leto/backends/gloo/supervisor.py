"""The node agent's supervisor: startup (the private run directory, the job's
secret, the zygote), the rendezvous (node 0 serves the TCPStore and the coordinator,
the others join it and prove the job's secret; with etcd, whoever leads serves them,
:mod:`.control_plane`), the selector loop and its timers
(exits not yet reported, hangs, shadow memory, the end of the job) and cleanup.

One thread runs it all; what each event means is the business of the agent's other
parts (:mod:`.children`, :mod:`.shadows`, :mod:`.routing`)."""

from __future__ import annotations

import importlib
import json
import os
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from leto.core.elastic import world_at_close
from leto.private import InsecurePathError, private_dir

from . import auth
from . import messages as M
from . import procs as P
from .commit_record import EtcdRecord
from .control_plane import restart_of
from .coordinator import Coordinator, CoordinatorOptions
from .deathwatch import DeathWatch
from .etcdstore import EtcdStore
from .eventlog import EventLog, job_started
from .host_memory import HostMemory
from .keeper import KeeperHandle
from .records import JOB_ENV, AgentOptions, LaunchError, Link, Proc, ProcConn, look
from .watch import Watchers
from .wire import Conn, WireError, abstract_name, keep_alive, listen_unix

__all__ = ["Supervisor", "SupervisorHost"]

COMPUTE_PHASES = {"forward", "backward", "step"}


class SupervisedChildren(Protocol):
    """What the agent's life asks of the node's processes."""

    def start_keeper(self, lr: int) -> None: ...

    def spawn(
        self, lr: int, role: str, promote_gen: int | None = None, *, cold: bool = False
    ) -> None: ...

    def on_zygote(self) -> None: ...

    def on_owner_died(self) -> None: ...

    def on_pidfd(self, p: Proc) -> None: ...

    def on_keeper_dead(self, lr: int) -> None: ...

    def finalize_exit(self, p: Proc) -> None: ...


class SupervisedRouting(Protocol):
    """The loop's events handed to routing, and the rendezvous' messages sent through it."""

    def accept_proc(self) -> None: ...

    def accept_link(self) -> None: ...

    def on_pconn(self, pc: ProcConn) -> None: ...

    def on_link(self, link: Link) -> None: ...

    def on_coord(self) -> None: ...

    def coord_messages(self) -> None: ...

    def from_coord(self, msg: M.Message) -> None: ...

    def to_coord(self, msg: M.Message) -> None: ...

    def flush_coord(self) -> None: ...

    def expire_unproven(self, now: float) -> None: ...

    def assign_spares(self, now: float) -> None: ...

    def place(self, sid: int, n: int, now: float, *, start: bool = False) -> None: ...

    def send_go(self, node: int) -> None: ...


class SupervisedShadows(Protocol):
    """The shadows' memory budget, checked by the loop's timers."""

    def budget(self, budget: int) -> None: ...


class SupervisedControl(Protocol):
    """The control plane (etcd) as the agent's life drives it."""

    leads: bool

    def open(self) -> None: ...

    def close(self) -> None: ...

    def first_of_job(self) -> bool: ...

    def claim(self, info: dict[str, Any]) -> None: ...

    def job_record(self) -> dict[str, Any]: ...

    def present(self) -> None: ...

    def keep_lease(self, now: float) -> None: ...

    def settle_rejoin(self, now: float) -> None: ...

    def claim_fault(self, fault: str) -> bool: ...

    def fired(self, fault: str) -> bool: ...


class SupervisorHost(Protocol):
    """What the agent's life uses of the agent: nearly all of it, as the part that
    starts it, joins it to the job, runs its loop and cleans up. Its options and the
    node's ranks; what the rendezvous sets (who the agent is in the job, the job's id,
    secret and places, the coordinator and its connections, the event log); its
    sockets, selector, zygote and deathwatch; the processes' tables; and its parts."""

    @property
    def o(self) -> AgentOptions: ...

    @property
    def nproc(self) -> int: ...

    @property
    def local_ranks(self) -> range: ...

    @property
    def who(self) -> str: ...

    @property
    def local_host(self) -> str: ...

    @property
    def t_start(self) -> float: ...

    def say(self, text: str) -> None: ...

    def name_self(self) -> None: ...

    node: int
    W: int
    pooled: bool
    spare: bool
    spare_id: int | None
    started: bool
    stop: bool
    failed: str | None
    restart: int | None
    generation: int
    fired: list[int]
    job: str
    secret: bytes | None
    umask: int
    run_dir: Path
    logs: Path
    leader_info: dict[str, Any] | None
    store: Any
    zygote: Any
    listener: socket.socket | None
    agent_listener: socket.socket | None
    agent_socket: str
    coord: Coordinator | None
    coord_conn: Conn | None
    log: EventLog | None
    watchers: Watchers | None

    @property
    def complete(self) -> bool: ...

    @property
    def recovering(self) -> bool: ...

    @property
    def record(self) -> EtcdRecord | None: ...

    @property
    def etcd(self) -> EtcdStore | None: ...

    @property
    def sel(self) -> selectors.BaseSelector: ...

    @property
    def deathwatch(self) -> DeathWatch: ...

    @property
    def trainer(self) -> dict[int, Proc | None]: ...

    @property
    def by_pid(self) -> dict[int, Proc]: ...

    @property
    def keepers(self) -> dict[int, KeeperHandle]: ...

    @property
    def joined(self) -> set[int]: ...

    @property
    def links(self) -> dict[int, Conn]: ...

    @property
    def pool_links(self) -> dict[int, Link]: ...

    @property
    def unproven(self) -> dict[int, Link]: ...

    @property
    def local_inbox(self) -> list[M.Message]: ...

    @property
    def spare_procs(self) -> list[subprocess.Popen[bytes]]: ...

    @property
    def memory(self) -> HostMemory: ...

    @property
    def children(self) -> SupervisedChildren: ...

    @property
    def routing(self) -> SupervisedRouting: ...

    @property
    def shadows(self) -> SupervisedShadows: ...

    @property
    def control(self) -> SupervisedControl: ...


class Supervisor:
    """The agent's life: start, rendezvous, loop, timers, cleanup."""

    def __init__(self, agent: SupervisorHost) -> None:
        self.agent = agent
        self.finished_sent = False  # this node's end was told to the coordinator

    def run(self) -> int:
        """Start, run the loop, clean up; the process exit code."""
        a = self.agent
        a.name_self()
        try:
            self.private()
        except (InsecurePathError, auth.SecretError, OSError, LaunchError) as e:
            print(f"leto[{a.who}]: error: {e}", file=sys.stderr, flush=True)
            return 1
        import torch._dynamo  # noqa: F401 - creating any torch optimizer imports it
        import torch.distributed  # noqa: F401 - paid once here; the zygote inherits it

        for name in a.o.preload:
            importlib.import_module(name)
        import leto.backends.gloo.runtime  # noqa: F401
        import leto.retained.process_state  # noqa: F401

        from .zygote import start_zygote

        a.zygote = start_zygote(a.who)  # before any thread exists in this process
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.on_signal)
        try:
            self.rendezvous()
            a.name_self()  # the job is known now
            self.watch_zygote()
            if not a.pooled:
                self.start_node()
            self.start_spares()
            self.loop()
        except LaunchError as e:
            a.failed = str(e)
            print(f"leto[{a.who}]: error: {e}", file=sys.stderr, flush=True)
            if a.log is not None:
                a.log.write("job_failed", error=str(e))
        except KeyboardInterrupt:
            a.failed = "interrupted"
            if a.log is not None:
                a.log.write("job_failed", error="interrupted by a signal")
        except Exception as e:  # noqa: BLE001 - a bug here must still clean up and say so
            import traceback

            tb = traceback.format_exc()
            a.failed = f"internal error in the agent: {type(e).__name__}: {e}"
            print(f"leto[{a.who}]: {a.failed}\n{tb}", file=sys.stderr, flush=True)
            if a.log is not None:
                a.log.write("job_failed", error=a.failed, traceback=tb)
        finally:
            self.cleanup()
        if a.failed is None and a.complete:
            return 0
        return 130 if a.failed == "interrupted" else 1

    def on_signal(self, signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    def private(self) -> None:
        """The run directory (0700, ours), files in it 0600, and the job's secret: from
        the environment, or on node 0 a new one written to RUN_DIR/secret (before the
        store exists, so a node that reached the store finds it written; with etcd,
        unless the job runs already: :meth:`first_of_job`)."""
        a = self.agent
        a.umask = os.umask(0o077)
        a.run_dir = private_dir(a.run_dir, "run directory")
        private_dir(a.run_dir / "logs", "log directory")
        a.secret = auth.from_environment()
        job = os.environ.pop(JOB_ENV, "")
        if a.o.restarts:  # the job's id: this start is one of its restarts
            a.job = job
        if a.node == 0 and a.o.etcd:  # before torch's import: the others read the secret
            a.control.leads = a.control.first_of_job()
        elif a.node == 0 and a.secret is None:
            a.secret = auth.new_secret()
            auth.write_secret(a.run_dir, a.secret)

    def rendezvous(self) -> None:
        """Node 0 serves the job's TCPStore and coordinator; every other node (and a
        spare) joins them. With etcd, a node 0 started while the job runs (some agent of
        it holds its presence in etcd: a replacement for a lost node 0) joins the job's
        current coordinator instead, wherever it is."""
        a = self.agent
        o = a.o
        if a.node == 0 and (not o.etcd or a.control.leads):
            info = self.serve()
            if o.etcd:
                a.control.claim(info)
            else:
                a.store.set("leto/job", json.dumps(info))
            for fid in o.fired_faults:  # a restart: what fired before does not fire again
                a.control.claim_fault(str(fid))
            self.start_coordinator()
            self.log_start(info["store"])
            a.joined.add(a.node)
            assert a.coord is not None
            a.coord.node_up(a.node, spare=False, now=time.monotonic())
            want = f"{o.min_nodes}..{o.nnodes}" if self.elastic() else str(o.nnodes)
            a.say(f"job {a.job}: rendezvous at {info['store']}, waiting for {want} node(s)")
            return
        answer = self.join_job()
        endpoint = f"{o.rdzv_host}:{o.rdzv_port}"
        if isinstance(answer, M.Pooled):
            a.spare_id = answer.spare_id
            a.say(f"waiting in the spare pool of job {a.job} at {endpoint}, warm")
            return
        a.spare = answer.spare
        a.generation = answer.gen
        a.control.present()
        a.say(
            f"joined job {a.job} at {endpoint}"
            + (" as a replacement (spare) node" if a.spare else "")
        )

    def serve(self) -> dict[str, Any]:
        """This agent serves the job's TCPStore and the coordinator's listener, on the
        rendezvous address (etcd: this machine's, any free port): the rendezvous record."""
        a = self.agent
        from datetime import timedelta

        import torch
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        o = a.o
        host, port = (a.local_host, 0) if o.etcd else (o.rdzv_host, o.rdzv_port)
        endpoint = f"{host}:{port}"
        if not o.etcd and P.port_in_use(host, port):
            raise LaunchError(
                f"the rendezvous endpoint {endpoint} is in use by another process "
                "(pick a free port with --rdzv-endpoint HOST:PORT)"
            )
        try:
            # bound here, to the address given: left to itself, the store listens on
            # every interface whatever host it is given. torch's libuv server takes a
            # listening socket from 2.8 on (pytorch#150215); before, the classic one
            old = torch.__version__ < (2, 8)  # type: ignore[operator]
            bound = P.listen_tcp(host, port)
            port = bound.getsockname()[1]  # etcd: any free port, published there
            endpoint = f"{host}:{port}"
            a.store = TCPStore(
                host,
                port,
                None,
                True,
                timedelta(seconds=o.rdzv_timeout),
                wait_for_workers=False,
                master_listen_fd=bound.detach(),  # the store owns it now
                **({"use_libuv": False} if old else {}),
            )
        except Exception as e:  # noqa: BLE001 - DistNetworkError, RuntimeError, OSError
            raise LaunchError(f"cannot serve the rendezvous at {endpoint}: {e}") from None
        o.rdzv_host, o.rdzv_port = host, port  # the trainers' MASTER_ADDR/PORT
        if not a.job:
            a.job = secrets.token_hex(8)
        a.listener = socket.create_server((host, 0))
        cport = a.listener.getsockname()[1]
        return {
            "job": a.job,
            "nnodes": o.nnodes,
            "nproc_per_node": o.nproc_per_node,
            "coordinator": f"{host}:{cport}",
            "store": endpoint,
            "node": a.node,
            "min_nodes": o.min_nodes or o.nnodes,
            "restart": o.restarts,
        }

    def unserve(self) -> None:
        """Stop serving (an election this agent lost)."""
        a = self.agent
        if a.listener is not None:
            a.listener.close()
            a.listener = None
        a.store = None

    def start_coordinator(self, *, continued: bool = False) -> None:
        """The coordinator, its event log and its watchers, in this agent. Every record
        names the job (the run directory may hold others' records, :mod:`leto.jobs`); a
        job ``continued`` (taken over) or restarted keeps the clock of its first record."""
        a = self.agent
        o = a.o
        path = a.run_dir / "events.jsonl"
        t0 = job_started(path, a.job) if continued or o.restarts else None
        a.log = EventLog(path, t0=t0, job=a.job)
        a.coord = Coordinator(
            o.nnodes,
            o.nproc_per_node,
            log=a.log,
            options=CoordinatorOptions(
                spare_timeout=o.spare_timeout,
                recovery_timeout=o.recovery_timeout,
                exclude_after=o.exclude_after,
                exclude_window=o.exclude_window,
                max_restarts=o.max_restarts,
                restarts=o.restarts,
                nodes_range=(o.min_nodes, o.nnodes) if 0 < o.min_nodes < o.nnodes else (0, 0),
            ),
            record=a.record,
        )
        try:
            a.watchers = Watchers(
                a.log,
                say=a.say,
                progress_every=None if o.quiet else o.progress_every,
                metrics=o.metrics,
                tensorboard=o.tensorboard,
            )
        except OSError as e:
            raise LaunchError(f"cannot serve the metrics at {o.metrics}: {e}") from None
        assert a.listener is not None
        a.sel.register(a.listener, selectors.EVENT_READ, ("agent_listener", None))

    def log_start(self, endpoint: str) -> None:
        a = self.agent
        o = a.o
        assert a.log is not None
        a.log.write(
            "job_start",
            nodes=o.nnodes,
            nproc_per_node=o.nproc_per_node,
            world_size=a.W,
            script=o.script,
            args=o.script_args,
            rdzv=endpoint,
            rdzv_backend="etcd" if o.etcd else "c10d",
            **({"etcd": a.etcd.where(), "rdzv_id": o.rdzv_id} if a.etcd is not None else {}),
            hang_timeout=o.hang_timeout,
            shadow_memory_budget=o.shadow_memory_budget,
            faults=o.faults,
            **({"restart": o.restarts} if o.restarts else {}),
            **({"min_nodes": o.min_nodes} if self.elastic() else {}),
        )

    def join_job(self) -> M.Welcome | M.Pooled:
        """Reach the job and join its coordinator; with etcd, the coordinator the job's
        record names now, tried again (the record re-read) until --rdzv-timeout: a
        coordinator may be failing over meanwhile."""
        a = self.agent
        deadline = time.monotonic() + a.o.rdzv_timeout
        while True:
            host, port = self.reach_job()
            try:
                answer = self.join(host, port)
            except LaunchError:
                if not a.o.etcd or time.monotonic() > deadline:
                    raise
                self.drop_coord()
                time.sleep(0.2)
                continue
            assert a.coord_conn is not None
            a.sel.register(a.coord_conn, selectors.EVENT_READ, ("coord", None))
            return answer

    def drop_coord(self) -> None:
        a = self.agent
        if a.coord_conn is not None:
            try:
                a.sel.unregister(a.coord_conn)
            except (KeyError, ValueError):
                pass
            a.coord_conn.close()
            a.coord_conn = None

    def reach_job(self) -> tuple[str, int]:
        """A node other than 0, or a spare: reach the job's store, check the job's
        topology, and read the address of its coordinator."""
        from datetime import timedelta

        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        a = self.agent
        o = a.o
        endpoint = f"{o.rdzv_host}:{o.rdzv_port}"
        timeout = timedelta(seconds=o.rdzv_timeout)
        if o.etcd:
            if a.etcd is None:
                a.control.open()
            info = a.control.job_record()
            a.leader_info = info
            host, port = str(info["store"]).rsplit(":", 1)
            o.rdzv_host, o.rdzv_port = host, int(port)  # the trainers' MASTER_ADDR/PORT
        deadline = time.monotonic() + o.rdzv_timeout
        try:
            while not o.etcd:
                a.store = TCPStore(o.rdzv_host, o.rdzv_port, None, False, timeout)
                info = json.loads(a.store.get("leto/job"))
                # a restart joins node 0's restart, not the job node 0 is still ending
                if restart_of(info) >= o.restarts or time.monotonic() > deadline:
                    break
                a.store = None
                time.sleep(0.5)
        except Exception as e:  # noqa: BLE001
            raise LaunchError(
                f"cannot reach the rendezvous endpoint {endpoint} within {o.rdzv_timeout:g} s "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); is node 0's "
                "`leto launch` running there with the same --rdzv-endpoint?"
            ) from None
        theirs = (info.get("min_nodes", info["nnodes"]), info["nnodes"], info["nproc_per_node"])
        if theirs != (o.min_nodes or o.nnodes, o.nnodes, o.nproc_per_node):
            raise LaunchError(
                f"this {'spare' if a.pooled else 'node'} was started with --nnodes "
                f"{_nodes(o.min_nodes or o.nnodes, o.nnodes)} --nproc-per-node "
                f"{o.nproc_per_node}, node 0 with --nnodes {_nodes(theirs[0], theirs[1])} "
                f"--nproc-per-node {theirs[2]}"
            )
        a.job = info["job"]
        o.restarts = restart_of(info)  # a node started by hand may join a restart
        host, port = info["coordinator"].rsplit(":", 1)
        return host, int(port)

    def need_secret(self) -> None:
        """A node other than 0 (or a spare) takes the job's secret from its run directory
        when the environment has none."""
        a = self.agent
        if a.secret is None:
            try:
                a.secret = auth.read_secret(a.run_dir)
            except auth.SecretError as e:
                raise LaunchError(str(e)) from None
        if a.secret is None:
            raise LaunchError(
                f"no job secret: node 0 writes it to RUN_DIR/{auth.FILE}, and {a.run_dir} "
                f"has none; give every node the same --run-dir (a shared directory), or "
                f"export {auth.ENV} with the same value on every node (docs/security.md)"
            )

    def join(self, host: str, port: int) -> M.Welcome | M.Pooled:
        """Connect to the coordinator, prove the job's secret and check its proof (see
        :mod:`.auth`): a node's welcome, or a spare agent's place in the pool."""
        a = self.agent
        o = a.o
        self.need_secret()
        assert a.secret is not None
        try:
            sock = socket.create_connection((host, port), timeout=o.rdzv_timeout)
        except OSError as e:
            raise LaunchError(f"cannot reach the coordinator at {host}:{port}: {e}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keep_alive(sock, o.hang_timeout)  # a coordinator cut off is lost, as one that died
        a.coord_conn = Conn(sock, send_timeout=30.0)
        nonce = auth.new_nonce()
        hello: M.Message
        try:
            challenge = M.decode(a.coord_conn.recv(timeout=o.rdzv_timeout)[0])
            if not isinstance(challenge, M.Challenge):
                raise WireError(f"expected a challenge, got {challenge.TAG!r}")
            ns = challenge.nonce
            if a.pooled:
                proof = auth.proof(a.secret, "spare", auth.POOL, ns, nonce)
                hello = M.SpareHello(nonce=nonce, proof=proof)
            else:
                proof = auth.proof(a.secret, "node", a.node, ns, nonce)
                hello = M.NodeHello(node=a.node, nonce=nonce, proof=proof)
            a.coord_conn.send(hello.to_wire())
            answer = M.decode(a.coord_conn.recv(timeout=o.rdzv_timeout)[0])
        except (WireError, TimeoutError) as e:
            raise LaunchError(f"the coordinator at {host}:{port} did not answer: {e}") from None
        if isinstance(answer, M.Reject):
            raise LaunchError(answer.why)
        if isinstance(answer, M.Pooled) and a.pooled:
            proven = auth.verify(a.secret, "pool", answer.spare_id, ns, nonce, answer.proof)
        elif isinstance(answer, M.Welcome) and not a.pooled:
            proven = auth.verify(a.secret, "coordinator", a.node, ns, nonce, answer.proof)
        else:
            want = "a place in the pool" if a.pooled else "a welcome"
            raise LaunchError(f"the coordinator at {host}:{port} sent {answer.TAG!r}, not {want}")
        if not proven:
            raise LaunchError(
                f"the coordinator at {host}:{port} did not prove the job's secret: "
                "not this job's coordinator (or a different secret)"
            )
        return answer

    def watch_zygote(self) -> None:
        a = self.agent
        a.sel.register(a.zygote.conn, selectors.EVENT_READ, ("zygote", None))
        a.sel.register(a.zygote.pidfd, selectors.EVENT_READ, ("zygote_dead", None))

    def take_place(self, node: int, gen: int, nnodes: int | None, *, start: bool) -> None:
        """A pooled spare is assigned the place of the lost ``node``: from here on it is
        that node's agent, joined as a replacement (the coordinator's :class:`Go`
        follows, which starts its shadows); ``start``: one of an elastic job's first
        nodes, of a world of ``nnodes`` nodes."""
        a = self.agent
        if not a.pooled:
            raise LaunchError(f"the coordinator assigned node {node} to an agent not in the pool")
        if nnodes is not None and not (a.o.min_nodes or a.o.nnodes) <= nnodes <= a.o.nnodes:
            raise LaunchError(f"the coordinator's world of {nnodes} node(s) is not --nnodes's")
        if nnodes is not None:
            a.o.nnodes, a.W = nnodes, nnodes * a.nproc
        if not 0 <= node < a.o.nnodes:
            raise LaunchError(f"the coordinator assigned node {node}, not in 0..{a.o.nnodes - 1}")
        a.say(f"is node {node}" if start else f"takes the place of node {node}, which was lost")
        a.pooled = False
        a.node = node
        a.name_self()
        a.spare = not start
        a.generation = gen
        a.control.present()
        self.start_node()

    def start_spares(self) -> None:
        """Node 0 with ``--spares N``: N spare agents, started here as children that
        die with this agent (``LETO_PARENT_PID``, see :func:`.procs.die_with_starter`;
        their own processes die with them), given the job's secret in the environment
        (the spare takes it out of it)."""
        a = self.agent
        o = a.o
        if a.node != 0 or not o.spares:
            return
        assert a.secret is not None
        env = P.tie_to_parent({**os.environ, auth.ENV: a.secret.decode()})
        for _ in range(o.spares):
            a.spare_procs.append(subprocess.Popen(o.spare_command, env=env))
        a.say(f"started {o.spares} spare agent(s) for the pool")

    def elastic(self) -> bool:
        """``--nnodes MIN:MAX`` with MIN < MAX, or the restart of a job that had it."""
        o = self.agent.o
        return bool(o.world_nodes) or 0 < o.min_nodes < o.nnodes

    def close_rendezvous(self, now: float) -> None:
        """Node 0 of an elastic job, until it starts: once the core says how many nodes
        it starts with (:func:`leto.core.elastic.world_at_close`: MAX joined, or MIN by
        the rendezvous timeout; a restart: the world the job started with), the pooled
        agents that joined first become nodes 1.., the others stay spares, and it goes."""
        a = self.agent
        o = a.o
        assert a.coord is not None
        lo, hi = (o.world_nodes, o.world_nodes) if o.world_nodes else (o.min_nodes, o.nnodes)
        n = world_at_close(lo, hi, 1 + len(a.coord.spares.ids), now - a.t_start > o.rdzv_timeout)
        if n is None:
            return
        o.nnodes, a.W = n, n * a.nproc
        for sid, node in a.coord.start_world(n):
            a.routing.place(sid, node, now, start=True)
        left = len(a.coord.spares.ids)
        a.say(f"{n} node(s) joined: starting {a.W} trainers ({left} spare(s) left in the pool)")
        for m in a.links:
            a.routing.send_go(m)
        self.go()

    def start_node(self) -> None:
        a = self.agent
        # each job's process logs apart (a run directory used again holds several jobs)
        try:
            a.logs = private_dir(a.run_dir / "logs" / a.job, "log directory")
        except InsecurePathError as e:
            raise LaunchError(str(e)) from None
        for role, pid in (("agent", os.getpid()), ("zygote", a.zygote.pid)):
            a.routing.to_coord(M.Started(role=role, pid=pid))
        a.agent_socket = abstract_name(f"{a.job}-agent{a.node}")
        a.agent_listener = listen_unix(a.agent_socket)
        a.sel.register(a.agent_listener, selectors.EVENT_READ, ("listener", None))
        for lr in a.local_ranks:
            a.children.start_keeper(lr)
        if a.coord is not None and a.o.nnodes == 1 and not self.elastic():
            self.go()

    def go(self, spare: bool = False) -> None:
        """Every node has joined (or this is a spare): start the processes."""
        a = self.agent
        a.started = True
        for lr in a.local_ranks:
            if not spare:
                a.children.spawn(lr, "trainer")
            if a.o.shadows:
                a.children.spawn(lr, "shadow")

    def loop(self) -> None:
        a = self.agent
        last_tick = 0.0
        if a.coord_conn is not None:  # messages that arrived with the welcome
            a.routing.coord_messages()
        while not a.stop:
            period = self.tick_period()
            for key, _ in a.sel.select(timeout=period):
                kind, obj = key.data
                if kind == "zygote":
                    a.children.on_zygote()
                elif kind == "zygote_dead":
                    if not a.stop:
                        raise LaunchError("the zygote (fork server) died")
                elif kind == "listener":
                    a.routing.accept_proc()
                elif kind == "pconn":
                    a.routing.on_pconn(obj)
                elif kind == "pidfd":
                    a.children.on_pidfd(obj)
                elif kind == "owner_died":
                    a.children.on_owner_died()
                elif kind == "keeper_dead":
                    a.children.on_keeper_dead(obj)
                elif kind == "log":
                    self.on_log(obj)
                elif kind == "agent_listener":
                    a.routing.accept_link()
                elif kind == "link":
                    a.routing.on_link(obj)
                elif kind == "coord":
                    a.routing.on_coord()
                if a.stop:
                    break
            now = time.monotonic()
            if now - last_tick >= period:
                last_tick = now
                self.tick(now)
            if a.coord is not None:
                a.routing.flush_coord()
                while a.local_inbox and not a.stop:
                    a.routing.from_coord(a.local_inbox.pop(0))
                    a.routing.flush_coord()
                if a.coord.failed is not None and not a.stop:
                    a.failed = a.coord.failed
                    a.restart = a.coord.restart.attempt if a.coord.restart else None
                    a.stop = True
                if (
                    a.coord.complete
                    and self.node_done()
                    # the world's nodes now (a shrink in place dropped the lost ones)
                    and a.coord.finished_nodes >= set(range(a.coord.topology.nodes)) - {a.node}
                ):
                    a.stop = True

    def tick_period(self) -> float:
        """Seconds between timer checks: 50 ms while an exit is being settled or a
        recovery runs; in steady training a twentieth of the hang timeout, at most 0.25
        s (each tick wakes the agent on cores the trainers share; the coordinator's
        other timers are seconds long)."""
        a = self.agent
        if a.recovering or any(p.dead_at is not None for p in a.by_pid.values()):
            return 0.05
        return max(0.05, min(0.25, a.o.hang_timeout / 20))

    def node_done(self) -> bool:
        a = self.agent
        return a.complete and all(p is None for p in a.trainer.values())

    def check_node_finished(self) -> None:
        a = self.agent
        if a.pooled:
            return
        if self.node_done() and not self.finished_sent:
            self.finished_sent = True
            a.routing.to_coord(M.NodeFinished(node=a.node))
            if a.coord is None:
                a.stop = True

    def tick(self, now: float) -> None:
        a = self.agent
        o = a.o
        # exits whose status the zygote did not send in time
        for p in list(a.by_pid.values()):
            if p.dead_at is not None and now - p.dead_at > 0.2:
                a.children.finalize_exit(p)
        a.control.keep_lease(now)
        if a.coord is not None:
            a.routing.expire_unproven(now)
            a.control.settle_rejoin(now)
            a.coord.tick(now)
            if a.coord.growing:  # a grow in place: the pool places its spare now
                a.routing.assign_spares(now)
            if not a.started and self.elastic():
                self.close_rendezvous(now)
            if not a.started and now - a.t_start > o.rdzv_timeout and self.elastic():
                raise LaunchError(
                    f"only {1 + len(a.coord.spares.ids)} node(s) joined within {o.rdzv_timeout:g} s, "
                    f"fewer than --nnodes {o.min_nodes}:{o.nnodes} asks; start `leto launch` "
                    "with the same --rdzv-endpoint and --nnodes on more nodes"
                )
            if not a.started and now - a.t_start > o.rdzv_timeout:
                raise LaunchError(
                    f"only node(s) {sorted(a.joined)} of {o.nnodes} joined within "
                    f"{o.rdzv_timeout:g} s; start `leto launch` on every node with the same "
                    "--rdzv-endpoint and --nnodes"
                )
        # hangs: a silent heartbeat, or no progress inside the training computation
        for tp in a.trainer.values():
            if tp is None or tp.conn is None or tp.hang_reported or tp.status != "running":
                continue
            p = tp
            look(p, now)
            silent = now - p.hb
            stuck = now - p.progress_t if p.phase in COMPUTE_PHASES else 0.0
            if silent > o.hang_timeout or stuck > o.hang_timeout:
                p.hang_reported = True
                how = (
                    f"no heartbeat for {silent:.1f} s"
                    if silent > o.hang_timeout
                    else f"no progress in {p.phase} for {stuck:.1f} s"
                )
                a.say(f"rank {p.rank} hangs ({how})")
                a.routing.to_coord(
                    M.Failure(
                        kind="hang",
                        rank=p.rank,
                        detected_by="heartbeat timeout",
                        detail=how,
                        in_phase=p.phase,
                        at_step=p.step,
                        pid=p.pid,
                    )
                )
        # memory: shadows go cold while the trainers need the memory
        if o.shadow_memory_budget is not None and a.started:
            a.shadows.budget(o.shadow_memory_budget)
        if a.complete:
            self.check_node_finished()

    def on_log(self, info: dict[str, Any]) -> None:
        a = self.agent
        fd = info["fd"]
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            a.sel.unregister(fd)
            os.close(fd)
            info["file"].close()
            return
        info["file"].write(data)
        info["file"].flush()
        p = info.get("proc")
        if a.o.echo and p is not None and p.role == "trainer":
            text = info.get("partial", "") + data.decode(errors="replace")
            lines = text.split("\n")
            info["partial"] = lines.pop()
            prefix = f"[rank {p.rank}] "
            if lines:
                try:
                    sys.stdout.write("".join(prefix + line + "\n" for line in lines))
                    sys.stdout.flush()
                except (OSError, ValueError):
                    # the console's reader went away (a pipe to `head`, a closed ssh
                    # session): the job goes on, each rank's log in the run directory
                    # has it all; nothing more is echoed
                    sys.stdout = open(os.devnull, "w")  # noqa: SIM115

    def cleanup(self) -> None:
        a = self.agent
        a.stop = True
        if a.restart and a.coord is not None:
            a.fired = [f["id"] for f in a.o.faults if a.control.fired(str(f["id"]))]
        for p in list(a.by_pid.values()):
            p.expected_exit = True
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if a.zygote is not None:
            try:
                os.kill(a.zygote.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(a.zygote.pid, 0)
            except ChildProcessError:
                pass
        import select

        for p in list(a.by_pid.values()):
            try:
                select.select([p.pidfd], [], [], 5.0)
                os.close(p.pidfd)
            except (OSError, ValueError):
                pass
        for h in a.keepers.values():
            try:
                h.proc.kill()
                h.proc.wait(5)
            except Exception:  # noqa: BLE001
                pass
            h.close()
        a.memory.close()
        if a.zygote is not None:
            a.zygote.close()
        for key in list(a.sel.get_map().values()):
            if key.data[0] == "log":
                try:
                    key.data[1]["file"].close()
                    os.close(key.data[1]["fd"])
                except OSError:
                    pass
        if a.log is not None:
            if a.failed is None and a.complete:
                a.log.write(
                    "job_end",
                    status="ok",
                    recoveries=len(a.coord.driver.recoveries) if a.coord else 0,
                )
            else:
                status = "restarting" if a.restart else "failed"
                a.log.write("job_end", status=status, error=a.failed)
            a.log.close()
        if a.watchers is not None:
            a.watchers.close()
        for c in list(a.links.values()):
            c.close()
        for link in list(a.unproven.values()):
            link.conn.close()
        for link in list(a.pool_links.values()):
            link.conn.close()
        if a.coord_conn is not None:
            a.coord_conn.close()
        if a.listener is not None:
            a.listener.close()
        self.end_spares()
        a.control.close()
        try:
            a.sel.unregister(a.deathwatch.fd)
        except (KeyError, ValueError):
            pass
        a.deathwatch.close()
        a.store = None

    def end_spares(self) -> None:
        """The spare agents this node started: told of the job's end (or their link
        closed), they exit; any still running after a few seconds is killed."""
        deadline = time.monotonic() + 5.0
        for p in self.agent.spare_procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _nodes(lo: int, hi: int) -> str:
    """--nnodes as it was given: N, or MIN:MAX."""
    return str(hi) if lo == hi else f"{lo}:{hi}"
