"""A node agent's messages: from its trainers and shadows (the Unix socket: who
connected comes from the kernel, its hello is taken only from a child of this node's
zygote), to and from the coordinator (in process on the node whose agent runs it,
node 0 or with etcd the elected one; over TCP elsewhere), and, there, the other
nodes' links (a TCP connection is a node only once its hello has
proven the job's secret, see :mod:`.auth`). A bad frame, or a first message that is
not such a hello, closes that one connection, never the agent."""

from __future__ import annotations

import json
import os
import selectors
import socket
import sys
import time
from typing import Any, Protocol

import attrs

from . import auth
from . import messages as M
from . import procs as P
from .board import MUTEX_AT, SIZE, StatusBoard
from .coordinator import Coordinator
from .deathwatch import DeathWatch
from .eventlog import EventLog
from .host_memory import HostMemory
from .records import AgentOptions, LaunchError, Link, Proc, ProcConn, note
from .wire import MAX_FRAME, Conn, WireError, check_peer, keep_alive

__all__ = ["Routing", "RoutingHost"]

# what the coordinator says that the trainers act on (the agent passes it on)
TO_TRAINERS = (
    M.Commit,
    M.Tier2,
    M.Abort,
    M.CallReports,
    M.Reconcile,
    M.Rebuild,
    M.Resume,
    M.Reshape,
    M.Complete,
)
UNPROVEN_FRAME = 4096  # bytes a TCP peer may send before it has proven the job's secret
UNPROVEN_SECONDS = 10.0  # and how long it has to do so
UNPROVEN_MAX = 16  # connections waiting to prove it at once (the oldest is closed)
POOL_MAX = 256  # spare agents waiting in the pool at once
HELD_MAX = 256  # messages held for a process whose spawn report has not been read yet
REFUSALS_LOGGED = 100


class RoutedChildren(Protocol):
    """What the coordinator's messages ask of the node's processes."""

    def discard(self, lr: int, source: int, step: int) -> None: ...

    def fence(self, gen: int, kill: list[int]) -> None: ...

    def unprotected(self, msg: M.Unprotected) -> None: ...


class RoutedShadows(Protocol):
    """What the messages of the coordinator and the processes ask of the shadows."""

    def promote(self, lr: int, gen: int) -> None: ...

    def needed(self, lr: int) -> None: ...

    def on_warm(self, p: Proc, now: float) -> None: ...

    def on_promoted(self, p: Proc, now: float) -> None: ...

    def resumed(self) -> None: ...


class RoutedSupervisor(Protocol):
    """The node's start, and a spare's place in the job, as messages decide them."""

    def go(self, spare: bool = False) -> None: ...

    def take_place(self, node: int, gen: int, nnodes: int | None, *, start: bool) -> None: ...

    def elastic(self) -> bool: ...


class RoutedControl(Protocol):
    """What routing asks of the control plane: a fault's claim, a leader's loss or rejoin."""

    def claim_fault(self, fault: str) -> bool: ...

    def coordinator_lost(self) -> None: ...

    def settle_rejoin(self, now: float) -> None: ...


class RoutingHost(Protocol):
    """What routing uses of its agent: who it is and the job's shape, its sockets, links
    and connections (held in place), its processes' tables, the state the coordinator's
    messages change (stop, complete, failed, restart, generation, recovering), and the
    parts and the coordinator it hands messages to."""

    @property
    def o(self) -> AgentOptions: ...

    @property
    def node(self) -> int: ...

    @property
    def nproc(self) -> int: ...

    W: int

    @property
    def who(self) -> str: ...

    def say(self, text: str) -> None: ...

    @property
    def pooled(self) -> bool: ...

    @property
    def started(self) -> bool: ...

    @property
    def secret(self) -> bytes | None: ...

    @property
    def lost_leader(self) -> int | None: ...

    def renumber(self, lost: list[int], gen: int) -> None: ...

    @property
    def rejoin(self) -> set[int]: ...

    @property
    def joined(self) -> set[int]: ...

    stop: bool
    complete: bool
    failed: str | None
    restart: int | None
    generation: int
    recovering: bool
    refusals: int

    @property
    def sel(self) -> selectors.BaseSelector: ...

    @property
    def deathwatch(self) -> DeathWatch: ...

    @property
    def zygote(self) -> Any: ...

    @property
    def listener(self) -> socket.socket | None: ...

    @property
    def agent_listener(self) -> socket.socket | None: ...

    @property
    def log(self) -> EventLog | None: ...

    @property
    def trainer(self) -> dict[int, Proc | None]: ...

    @property
    def by_pid(self) -> dict[int, Proc]: ...

    @property
    def unclaimed(self) -> dict[int, ProcConn]: ...

    @property
    def unclaimed_boards(self) -> dict[int, StatusBoard | None]: ...

    @property
    def local_inbox(self) -> list[M.Message]: ...

    @property
    def links(self) -> dict[int, Conn]: ...

    @property
    def pool_links(self) -> dict[int, Link]: ...

    @property
    def unproven(self) -> dict[int, Link]: ...

    @property
    def coord(self) -> Coordinator | None: ...

    @property
    def coord_conn(self) -> Conn | None: ...

    @property
    def memory(self) -> HostMemory: ...

    @property
    def children(self) -> RoutedChildren: ...

    @property
    def shadows(self) -> RoutedShadows: ...

    @property
    def supervisor(self) -> RoutedSupervisor: ...

    @property
    def control(self) -> RoutedControl: ...


class Routing:
    """Messages between the trainers, the coordinator and the other nodes."""

    def __init__(self, agent: RoutingHost) -> None:
        self.agent = agent

    def accept_proc(self) -> None:
        a = self.agent
        got = _accept(a.agent_listener)
        if got is None:
            return
        sock, _ = got
        try:
            pid = check_peer(sock)
        except OSError:  # PeerError: another user
            sock.close()
            return
        conn = Conn(sock, send_timeout=30.0)
        a.sel.register(conn, selectors.EVENT_READ, ("pconn", ProcConn(conn, pid)))

    def drop_conn(self, conn: Conn) -> None:
        a = self.agent
        try:
            a.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def on_pconn(self, pc: ProcConn) -> None:
        """Messages from a process on the agent's socket. Which process it is comes from
        the kernel: its hello is taken only from a process this agent's zygote forked
        (its spawn report may not have been read yet: its messages wait for it). Once
        it is known, it is this node's trainer or shadow and speaks the protocol; a bad
        frame from anyone closes its connection."""
        a = self.agent
        conn = pc.conn
        alive = conn.feed()
        got, bad = conn.drain()
        for i, (obj, fds) in enumerate(got):
            try:
                msg = M.decode(obj)
            except WireError as e:
                msg, bad = None, e
            if msg is None:
                for fd in fds:
                    os.close(fd)
            elif not pc.hello:
                bad = self.proc_hello(pc, msg, fds)
            else:
                for fd in fds:
                    os.close(fd)
                if pc.proc is not None:
                    self.on_proc_msg(pc.proc, msg)
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
            a.say(f"closed the connection of pid {pc.pid}: {bad}")
            alive = False
        if not alive:
            if pc.proc is not None and pc.proc.conn is conn:
                pc.proc.conn = None
            if a.unclaimed.get(pc.pid) is pc:
                del a.unclaimed[pc.pid]
                stale = a.unclaimed_boards.pop(pc.pid, None)
                if stale is not None:
                    stale.close()
            self.drop_conn(conn)

    def drain_proc(self, p: Proc) -> None:
        """Take every message ``p`` sent before it died (none of its threads runs: all
        it sent is on the socket), so that its death is judged with them (a traceback
        sent before the exit makes it an exception, not a crash)."""
        a = self.agent
        while p.conn is not None and P.readable(p.conn.fileno()):
            try:
                _, pc = a.sel.get_key(p.conn).data
            except (KeyError, ValueError):
                return
            self.on_pconn(pc)

    def proc_hello(self, pc: ProcConn, msg: M.Message, fds: list[int]) -> WireError | None:
        """Take the first message of a connection; why not, if it is refused."""
        a = self.agent
        p = a.by_pid.get(pc.pid)
        why = None
        if not isinstance(msg, M.Hello):
            why = f"its first message is {msg.TAG!r}, not a hello"
        elif msg.pid is not None and msg.pid != pc.pid:
            why = f"its hello claims pid {msg.pid}, the kernel says {pc.pid}"
        elif p is None and P.parent_of(pc.pid) != a.zygote.pid:
            why = f"pid {pc.pid} is not a process this agent started"
        board = _board_of(fds) if why is None else None
        if board is not None:
            try:
                a.deathwatch.watch(fds[0], MUTEX_AT, SIZE, pc.pid)
            except (OSError, RuntimeError) as e:  # its death is then the pidfd's news
                a.say(f"pid {pc.pid}: its death is watched by its pidfd only ({e})")
        for fd in fds:
            os.close(fd)
        if why is not None:
            return WireError(why)
        pc.hello = True
        if p is None:  # the zygote's "spawned" has not been read yet
            a.unclaimed[pc.pid] = pc
            a.unclaimed_boards[pc.pid] = board
            return None
        p.conn, p.board = pc.conn, board
        pc.proc = p
        return None

    def claim(self, p: Proc) -> None:
        a = self.agent
        pc = a.unclaimed.pop(p.pid, None)
        if pc is None:
            return
        p.conn = pc.conn
        p.board = a.unclaimed_boards.pop(p.pid, None)
        pc.proc = p
        held, pc.held = pc.held, []
        for msg in held:
            self.on_proc_msg(p, msg)

    def send_proc(self, p: Proc, msg: M.Message) -> None:
        self._send_proc(p, msg.to_wire())

    def reply(self, p: Proc, rid: int, body: dict[str, Any], fds: list[int] | None = None) -> None:
        """The answer to request ``rid`` of ``p`` (matched by id, not by tag)."""
        self._send_proc(p, {"re": rid, **body}, fds)

    def _send_proc(self, p: Proc, obj: dict[str, Any], fds: list[int] | None = None) -> None:
        if p.conn is None:
            return
        try:
            p.conn.send(obj, fds or [])
        except WireError:
            pass

    def on_proc_msg(self, p: Proc, msg: M.Message) -> None:
        """A message from this node's trainer or shadow ``p``: the agent's business,
        or the coordinator's (passed on)."""
        a = self.agent
        mem = a.memory
        now = time.monotonic()
        match msg:
            case M.Heartbeat():
                p.hb = now
                note(p, msg.phase, msg.step, msg.progress, now)
            case M.Warm():
                a.shadows.on_warm(p, now)
            case M.Promoted():
                a.shadows.on_promoted(p, now)
            case M.Error():
                p.error = msg.traceback
            case M.Exit():
                p.exit_reported = msg.code
            case M.ProcessState():
                mem.keep_ps(msg.rank, msg.step, msg.json)
            case M.Pending():
                mem.pending[msg.rank] = msg.json
            case M.GetState():
                self.reply(p, msg.id, mem.state_of(msg.rank))
            case M.NodeSegment():
                self.reply(p, msg.id, *mem.node_segment(msg.name, msg.nbytes))
            case M.NodeListing():
                self.reply(p, msg.id, mem.node_listing())
            case M.SnapshotSlot():
                self.reply(p, msg.id, mem.snapshot_slot(msg.step))
            case M.ClaimFault():
                self.reply(p, msg.id, {"first": a.control.claim_fault(msg.fault)})
            # a step's vote carries its pending process state, its "finished" the state
            # after it: kept here (for a recovery), not sent on to the coordinator
            case M.Vote(pending=str() as pending):
                mem.pending[msg.rank] = pending
                self.to_coord(attrs.evolve(msg, pending=None))
            case M.Finished(ps=str() as ps):
                mem.keep_ps(msg.rank, msg.step, ps)
                self.to_coord(attrs.evolve(msg, ps=None))
            case M.Ready():
                p.status = "running"
                self.to_coord(msg)
            case M.Unprotected():
                a.children.unprotected(msg)
            case (
                M.Vote()
                | M.Finished()
                | M.SnapshotDone()
                | M.CheckpointStaged()
                | M.CheckpointWritten()
                | M.Stopped()
                | M.Kept()
                | M.Replayed()
                | M.Report()
                | M.Reconciled()
                | M.Rebuilt()
                | M.Done()
                | M.Fatal()
            ):
                self.to_coord(msg)
            case _:
                pass  # a kind a process does not send: ignored, as before

    def to_coord(self, msg: M.Message) -> None:
        a = self.agent
        if a.coord is not None:
            a.coord.handle(a.node, msg, time.monotonic())
            self.flush_coord()
        elif a.coord_conn is not None:
            try:
                a.coord_conn.send(msg.to_wire())
            except WireError:
                pass

    def flush_coord(self) -> None:
        a = self.agent
        assert a.coord is not None
        if a.coord.outbox:
            a.coord.make_durable()
        while a.coord.outbox:
            node, msg = a.coord.outbox.pop(0)
            targets = sorted(a.joined) if node is None else [node]
            for n in targets:
                if n == a.node:
                    a.local_inbox.append(msg)  # delivered by the loop: no re-entrance
                elif n in a.links:
                    try:
                        a.links[n].send(msg.to_wire())
                    except WireError:
                        pass
            if isinstance(msg, M.Reshape):  # the nodes after a lost one: numbered anew
                a.renumber(msg.lost_nodes, msg.gen)
            if node is None and isinstance(msg, (M.Complete, M.Fail)):
                for link in list(a.pool_links.values()):  # the job's end: spares leave
                    _send_link(link.conn, msg)

    def accept_link(self) -> None:
        """A TCP connection to the coordinator: challenged at once (:mod:`.auth`); it
        may send a few bytes, for a few seconds, until its hello proves the secret."""
        a = self.agent
        got = _accept(a.listener)
        if got is None:
            return
        sock, addr = got
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keep_alive(sock, a.o.hang_timeout)  # a node cut off is lost, not silent for ever
        conn = Conn(sock, send_timeout=1.0, max_frame=UNPROVEN_FRAME)
        link = Link(conn, f"{addr[0]}:{addr[1]}", auth.new_nonce(), time.monotonic())
        if len(a.unproven) >= UNPROVEN_MAX:
            oldest = min(a.unproven.values(), key=lambda k: k.since)
            self.refuse(oldest, "too many connections waiting to prove the job's secret")
        if not _send_link(conn, M.Challenge(nonce=link.challenge)):
            conn.close()
            return
        a.unproven[id(link)] = link
        a.sel.register(conn, selectors.EVENT_READ, ("link", link))

    def refuse(self, link: Link, why: str, tell: str | None = None) -> None:
        """Close a connection that is not (or not yet) a node, saying why in the log."""
        a = self.agent
        a.unproven.pop(id(link), None)
        if tell is not None:
            _send_link(link.conn, M.Reject(why=tell))
        self.drop_conn(link.conn)
        a.refusals += 1
        if a.refusals <= REFUSALS_LOGGED:
            a.say(f"refused a connection from {link.peer}: {why}")
            if a.log is not None:
                a.log.write("connection_refused", peer=link.peer, why=why)

    def expire_unproven(self, now: float) -> None:
        a = self.agent
        for link in list(a.unproven.values()):
            if now - link.since > UNPROVEN_SECONDS:
                self.refuse(link, f"no proof of the job's secret within {UNPROVEN_SECONDS:g} s")

    def prove(self, link: Link, obj: dict[str, Any], now: float) -> bool:
        """A connection's first message: a node's hello with its proof, or it is closed."""
        a = self.agent
        assert a.coord is not None and a.secret is not None
        conn = link.conn
        try:
            msg = M.decode(obj)
        except WireError as e:
            self.refuse(link, f"not a leto node's hello: {e}: {json.dumps(obj)[:80]}")
            return False
        if isinstance(msg, M.SpareHello):
            return self.prove_spare(link, msg)
        if not isinstance(msg, M.NodeHello):
            self.refuse(link, f"not a leto node's hello: {json.dumps(obj)[:80]}")
            return False
        n, nonce = msg.node, msg.nonce
        if not auth.verify(a.secret, "node", n, link.challenge, nonce, msg.proof):
            self.refuse(
                link,
                f"node {n} did not prove the job's secret",
                tell="authentication failed: this node does not hold the job's secret "
                f"(node 0's RUN_DIR/{auth.FILE}, or {auth.ENV})",
            )
            return False
        why = None
        if not 0 <= n < a.o.nnodes or n == a.node:
            why = f"node rank {n} is not one of this job's other nodes"
        elif n == a.lost_leader:
            why = f"node {n} is not yet known lost here (the coordinator is failing over)"
        elif n in a.links:
            why = f"node {n} has already joined this job (use another --node-rank)"
        elif a.started and a.coord.model is None:
            why = "the job is starting up; cannot take a spare node yet"
        elif a.coord.failed is not None:
            why = "the job has ended" + (" and restarts: join it again" if a.coord.restart else "")
        elif a.started and a.coord.exclusions.refusal(link.peer) is not None:
            why = f"node {n}'s replacement is refused: {a.coord.exclusions.refusal(link.peer)}"
        if why is not None:
            self.refuse(link, why, tell=why)
            return False
        del a.unproven[id(link)]
        conn.max_frame = MAX_FRAME
        conn.sock.settimeout(30.0)
        rejoined = n in a.rejoin  # a live node, back after the coordinator failed over
        spare = a.started and not rejoined
        a.rejoin.discard(n)
        link.node = n
        a.links[n] = conn
        a.joined.add(n)
        a.coord.exclusions.joined(n, link.peer)
        proof = auth.proof(a.secret, "coordinator", n, link.challenge, nonce)
        _send_link(conn, M.Welcome(spare=spare, gen=a.coord.generation, proof=proof))
        a.coord.node_up(n, spare=spare, now=now)
        if spare:
            _send_link(conn, M.Go(spare=True))
        elif rejoined:
            a.say(f"node {n} rejoined")
            a.coord.tell_tier2(n)
            a.control.settle_rejoin(now)
        elif len(a.joined) == a.o.nnodes and not a.supervisor.elastic():
            a.say(f"all {a.o.nnodes} nodes joined: starting {a.W} trainers")
            for m in a.links:
                self.send_go(m)
            a.supervisor.go()
        return True

    def prove_spare(self, link: Link, msg: M.SpareHello) -> bool:
        """A spare agent's hello: proven as a node's is (:mod:`.auth`), it joins the
        pool, or its connection is closed with the reason and the job goes on."""
        a = self.agent
        assert a.coord is not None and a.secret is not None
        if not auth.verify(a.secret, "spare", auth.POOL, link.challenge, msg.nonce, msg.proof):
            self.refuse(
                link,
                "a spare agent did not prove the job's secret",
                tell="authentication failed: this spare agent does not hold the job's secret "
                f"(node 0's RUN_DIR/{auth.FILE}, or {auth.ENV})",
            )
            return False
        why = None
        if a.coord.complete or a.coord.failed is not None:
            why = "the job has ended"
        elif len(a.pool_links) >= POOL_MAX:
            why = f"the spare pool is full ({POOL_MAX} spare agents)"
        if why is not None:
            self.refuse(link, why, tell=why)
            return False
        del a.unproven[id(link)]
        link.conn.max_frame = MAX_FRAME
        link.conn.sock.settimeout(30.0)
        sid = a.coord.spares.joined(link.peer)
        link.spare = sid
        a.pool_links[sid] = link
        proof = auth.proof(a.secret, "pool", sid, link.challenge, msg.nonce)
        _send_link(link.conn, M.Pooled(spare_id=sid, proof=proof))
        a.say(f"spare {sid} joined the pool ({link.peer}; {len(a.pool_links)} waiting)")
        self.assign_spares(time.monotonic())  # a node may be waiting for it
        return True

    def assign_spares(self, now: float) -> None:
        """Send the spares the coordinator's pool assigns (:meth:`.SparePool.assign`,
        where it is decided) to the lost nodes' places, once training has started: each
        link becomes its node's, and the spare proceeds as a replacement started by hand
        would."""
        a = self.agent
        c = a.coord
        assert c is not None
        if c.model is None and not c.growing:  # not started, or a world change under way
            return
        said = set(c.spares.passed)
        for sid, n in c.spares.assign(c.nodes_lost_at, c.nodes_up):
            self.place(sid, n, now)
        for sid in sorted(c.spares.passed - said):  # each said once, here as in the log
            peer = c.spares.peers[sid]
            a.say(f"spare {sid} ({peer}) passed over: {c.exclusions.refusal(peer)}")

    def send_go(self, node: int) -> None:
        """The job starts: node ``node`` starts its trainers."""
        _send_link(self.agent.links[node], M.Go(spare=False))

    def place(self, sid: int, n: int, now: float, *, start: bool = False) -> None:
        """The pooled spare ``sid`` becomes node ``n``: a lost node's replacement, or
        (``start``) one of an elastic job's first nodes, whose go comes with the others'."""
        a = self.agent
        assert a.coord is not None
        link = a.pool_links.pop(sid)
        link.spare, link.node = None, n
        a.links[n] = link.conn
        a.joined.add(n)
        a.coord.exclusions.joined(n, link.peer)
        a.say(f"spare {sid} {'is' if start else 'takes the place of'} node {n}")
        nnodes = a.coord.topology.nodes  # the world's now (an in-place change's too)
        msg = M.Assign(node=n, gen=a.coord.generation, nnodes=nnodes, at_start=start)
        _send_link(link.conn, msg)
        a.coord.node_up(n, spare=not start, now=now)
        if not start:
            _send_link(link.conn, M.Go(spare=True))

    def on_link(self, link: Link) -> None:
        a = self.agent
        conn = link.conn
        assert a.coord is not None
        alive = conn.feed()
        got, bad = conn.drain()
        now = time.monotonic()
        for obj, _fds in got:
            if link.spare is not None:
                bad = WireError("a pooled spare agent speaks only once it is assigned a node")
                break
            if link.node is None:
                if not self.prove(link, obj, now):
                    return
                continue
            try:
                msg = M.decode(obj)
            except WireError as e:
                bad = e  # the messages before it were good, the link is not
                break
            a.coord.handle(link.node, msg, now)
        if link.spare is not None:
            if bad is not None or not alive:
                self.drop_spare(link, str(bad) if bad else "its link closed")
            return
        if link.node is None:
            if bad is not None or not alive:
                self.refuse(link, str(bad) if bad else "closed before its hello")
            return
        if bad is not None:
            a.say(f"node {link.node} sent a bad frame ({bad}): closing its link")
            alive = False
        if not alive:
            n = link.node
            self.drop_conn(conn)
            a.links.pop(n, None)
            a.joined.discard(n)
            if not a.stop and not a.coord.complete:
                a.say(f"lost node {n} (its agent's link closed)")
            a.coord.node_down(n, now)
            self.flush_coord()  # the recovery's orders so far go to the nodes up before
            self.assign_spares(now)
        self.flush_coord()

    def drop_spare(self, link: Link, why: str) -> None:
        """A pooled spare is gone (or misbehaved): out of the pool."""
        a = self.agent
        assert a.coord is not None and link.spare is not None
        sid = link.spare
        a.pool_links.pop(sid, None)
        self.drop_conn(link.conn)
        if not a.stop and not a.coord.complete and a.coord.failed is None:
            a.say(f"spare {sid} left the pool ({why})")
        a.coord.spares.left(sid)

    def on_coord(self) -> None:
        a = self.agent
        assert a.coord_conn is not None
        alive = a.coord_conn.feed()
        self.coord_messages()
        if not alive and not a.stop:
            if a.complete:
                a.stop = True
                return
            a.control.coordinator_lost()
            if a.coord_conn is not None:  # what came with the new coordinator's answer
                self.coord_messages()  # (an Assign and Go, a Tier2): its socket is quiet

    def coord_messages(self) -> None:
        a = self.agent
        assert a.coord_conn is not None
        got, bad = a.coord_conn.drain()
        for obj, _fds in got:
            try:
                msg = M.decode(obj)
            except WireError as e:
                bad = e
                break
            self.from_coord(msg)
        if bad is not None and not a.stop:
            raise LaunchError(f"the coordinator sent a bad frame: {bad}")

    def from_coord(self, msg: M.Message) -> None:
        a = self.agent
        if a.pooled and not isinstance(msg, (M.Assign, M.Fail, M.Complete)):
            return  # a spare has no processes yet: nothing else concerns it
        match msg:
            case M.Assign():
                a.supervisor.take_place(msg.node, msg.gen, msg.nnodes, start=msg.at_start)
                return
            case M.Go():
                a.supervisor.go(spare=msg.spare)
                return
            case M.Fail() if a.pooled:
                a.say(f"the job failed; leaving the pool ({msg.error})")
                a.failed = msg.error
                a.stop = True
                return
            case M.Complete() if a.pooled:
                a.complete = True
                a.stop = True
                return
            case M.Fail():
                a.failed = msg.error
                if msg.restart:  # --max-restarts: this agent starts again (leto launch)
                    a.restart = msg.restart
                    what = f"restarting the job (restart {msg.restart}) from its checkpoint"
                    print(f"leto[{a.who}]: {what}: {a.failed}", file=sys.stderr, flush=True)
                else:
                    print(f"leto[{a.who}]: job failed: {a.failed}", file=sys.stderr, flush=True)
                a.stop = True
                return
            case M.Fence():
                a.children.fence(msg.gen, msg.kill)
                return
            case M.Discard():
                a.children.discard(msg.rank - a.node * a.nproc, msg.source, msg.step)
                return
            case M.PromoteRank():
                a.shadows.promote(msg.rank - a.node * a.nproc, msg.gen)
                return
            case M.NeedShadow():
                a.shadows.needed(msg.rank - a.node * a.nproc)
                return
            case M.Abort():
                a.generation = max(a.generation, msg.gen)
                a.recovering = True
            case M.Reshape():  # the trainers it starts from now on are of the new world
                a.renumber(msg.lost_nodes, msg.gen)  # first: its old world's numbers
                a.o.nnodes, a.W = msg.nodes, msg.nodes * a.nproc
                a.recovering = False
                a.shadows.resumed()
            case M.Resume():
                a.recovering = False
                a.shadows.resumed()
            case M.Tier2():
                a.memory.snapshot_current(msg.step)
            case M.Complete():
                a.complete = True
        # and on to the trainers
        if isinstance(msg, TO_TRAINERS):
            for p in list(a.trainer.values()):
                if p is not None:
                    self.send_proc(p, msg)


def _accept(listener: socket.socket | None) -> tuple[socket.socket, Any] | None:
    """A new connection on ``listener``; None if there is none to take."""
    assert listener is not None
    try:
        return listener.accept()
    except OSError:  # out of descriptors, or the peer gave up
        return None


def _send_link(conn: Conn, msg: M.Message) -> bool:
    """Send on a TCP link; False if it is gone (its closing is handled where it is read)."""
    try:
        conn.send(msg.to_wire())
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
