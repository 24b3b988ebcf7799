"""A node agent's part in the job's control plane in etcd (``--rdzv-backend etcd``):
its presence, the coordinator's election and its failover.

Every node's agent holds ``a/<node>`` under its own lease while it lives (a node 0
started while some agent of the job lives is a replacement, not a new job). Node 0's
agent is the job's first leader (:meth:`ControlPlane.claim`). When an agent's link to
the coordinator closes while the job runs, the coordinator fails over
(:meth:`ControlPlane.coordinator_lost`): the leader whose link closed is deposed, the
agents campaign (:class:`.election.Election`), the winner serves a new TCPStore and
coordinator and takes the commit record over from etcd (:meth:`ControlPlane.take_over`,
which fences its predecessor), the others join it, and the predecessor's node, whose
trainers and keepers died with its agent, is lost: the coordinator recovers from that
as from any node's loss. Nothing here decides for the protocol: the model rebuilt from
etcd does (:meth:`.Coordinator.take_over`).

The TCPStore moves with the coordinator: every agent tells its processes where it is
now (:class:`~.messages.StoreAt`); the fault claims of a fault plan, which must outlive
the store, are in etcd (``r/fault/<id>``, :meth:`ControlPlane.claim_fault`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Protocol

from torch.distributed import DistNetworkError

from . import auth
from . import messages as M
from .commit_record import EtcdRecord, RecordError
from .election import Election
from .etcdstore import EtcdStore, StoreError
from .records import AgentOptions, LaunchError, Proc

__all__ = ["ETCD_LEASE_TTL", "PRESENT", "ControlPlane"]

ETCD_LEASE_TTL = 15  # seconds: an agent's lease in etcd (kept alive each 3 s)
PRESENT = "a/"  # a/<node>: the node's agent lives (under its lease)


class PlaneSupervisor(Protocol):
    """How the control plane has its agent join, serve and leave the job."""

    def join_job(self) -> M.Welcome | M.Pooled: ...

    def drop_coord(self) -> None: ...

    def serve(self) -> dict[str, Any]: ...

    def unserve(self) -> None: ...

    def start_coordinator(self, *, continued: bool = False) -> None: ...

    def need_secret(self) -> None: ...


class PlaneRouting(Protocol):
    """What the control plane sends through its agent's routing."""

    def send_proc(self, p: Proc, msg: M.Message) -> None: ...

    def flush_coord(self) -> None: ...

    def assign_spares(self, now: float) -> None: ...


class PlaneCoordinator(Protocol):
    """What the control plane tells the coordinator it took over."""

    def take_over(self, records: list[dict[str, Any]], kept: dict[str, dict[str, Any]]) -> None: ...

    def node_up(self, node: int, *, spare: bool, now: float) -> None: ...

    def node_down(self, node: int, now: float, why: str = "agent link closed") -> None: ...

    def tell_tier2(self, node: int) -> None: ...


class PlaneHost(Protocol):
    """What the control plane uses of its agent: who it is and where it runs, its state
    in etcd (the store, the election, the commit record: set here), the leader it
    follows and the nodes that must rejoin it, and the parts it drives."""

    @property
    def o(self) -> AgentOptions: ...

    @property
    def node(self) -> int: ...

    @property
    def who(self) -> str: ...

    def say(self, text: str) -> None: ...

    @property
    def job(self) -> str: ...

    @property
    def run_dir(self) -> Path: ...

    @property
    def pooled(self) -> bool: ...

    @property
    def failed(self) -> str | None: ...

    @property
    def complete(self) -> bool: ...

    @property
    def leader_node(self) -> int | None: ...

    @property
    def store(self) -> Any: ...

    @property
    def trainer(self) -> dict[int, Proc | None]: ...

    @property
    def shadow(self) -> dict[int, Proc | None]: ...

    secret: bytes | None
    generation: int
    spare_id: int | None
    etcd: EtcdStore | None
    election: Election | None
    etcd_refreshed: float
    record: EtcdRecord | None
    leader_info: dict[str, Any] | None
    joined: set[int]
    lost_leader: int | None
    rejoin: set[int]
    rejoin_by: float

    @property
    def supervisor(self) -> PlaneSupervisor: ...

    @property
    def routing(self) -> PlaneRouting: ...

    @property
    def coord(self) -> PlaneCoordinator | None: ...


class ControlPlane:
    """See the module docstring: one per agent (``agent.control``)."""

    def __init__(self, agent: PlaneHost) -> None:
        self.agent = agent
        self.leads = False  # node 0: the job's start (not a replacement for a lost node 0)

    def first_of_job(self) -> bool:
        """Node 0 with etcd: is this the job's start (True), or is the job running (an
        agent of it holds its presence ``a/<node>`` in etcd: this node 0 replaces a lost
        one, and joins)? The job's secret: the environment's, or the run directory's of
        the running job, or (the job's start) a new one, written to RUN_DIR/secret."""
        a = self.agent
        env = a.secret is not None
        if a.secret is None and (a.run_dir / auth.FILE).exists():
            try:
                a.secret = auth.read_secret(a.run_dir)
            except auth.SecretError as e:
                raise LaunchError(str(e)) from None
        if a.secret is not None:
            if a.etcd is None:
                self.open()
            assert a.etcd is not None
            try:
                if a.etcd.scan(PRESENT):
                    return False
            except StoreError:
                pass  # signed with another secret: the claim below says what runs there
        if not env:
            a.secret = auth.new_secret()
            auth.write_secret(a.run_dir, a.secret)
            if a.etcd is not None:
                a.etcd.close()
            self.open()
        elif a.etcd is None:
            self.open()
        return True

    def present(self) -> None:
        """With etcd, a node's agent (not a pooled spare) holds ``a/<node>`` under its
        own lease (:meth:`keep_lease`) while it lives: a node 0 that starts while
        the job runs joins it instead of starting another; and it can campaign."""
        a = self.agent
        if a.etcd is None:
            return
        try:
            if a.election is None:
                a.election = Election(a.etcd, ETCD_LEASE_TTL)
            if not a.election.lease:
                a.election.lease = a.etcd.grant(ETCD_LEASE_TTL)
            a.etcd.put(f"{PRESENT}{a.node}", {"node": a.node}, lease=a.election.lease)
        except StoreError as e:
            raise LaunchError(str(e)) from None
        a.etcd_refreshed = time.monotonic()

    def _fault_key(self, fault: str) -> str:
        """Where the claim of the plan's fault ``fault`` lives: in etcd (it outlives
        every node), or on the job's TCPStore."""
        a = self.agent
        return f"r/fault/{fault}" if a.etcd is not None else f"leto/{a.job}/fault/{fault}"

    def claim_fault(self, fault: str) -> bool:
        """The first claim of the plan's fault ``fault`` in this job (it fires then)."""
        a = self.agent
        key = self._fault_key(fault)
        try:
            if a.etcd is not None:
                return a.etcd.write({key: 0}, [(key, {})]) is not None
            return int(a.store.add(key, 1)) == 1
        except StoreError as e:
            raise LaunchError(f"cannot claim the fault {fault}: {e}") from None
        except DistNetworkError:  # the coordinator's TCPStore went with its agent's link
            raise LaunchError(f"lost the coordinator (node {a.leader_node}'s agent)") from None

    def fired(self, fault: str) -> bool:
        """Has the plan's fault ``fault`` been claimed in this job (a restart marks it
        claimed in the next one)?"""
        a = self.agent
        key = self._fault_key(fault)
        try:
            if a.etcd is not None:
                return a.etcd.get(key) is not None
            return a.store is not None and int(a.store.add(key, 0)) > 0
        except StoreError as e:
            raise LaunchError(f"cannot read the fault {fault}'s claim: {e}") from None
        except DistNetworkError:  # the coordinator's TCPStore went with its agent's link
            raise LaunchError(f"lost the coordinator (node {a.leader_node}'s agent)") from None

    def coordinator_lost(self) -> None:
        """This agent's link to the coordinator closed while the job runs. With etcd
        the coordinator fails over: the leader whose link closed is deposed (its lease
        ended, so its record goes), and this agent campaigns (:class:`.election.
        Election`); the winner serves a new TCPStore and coordinator and takes the
        commit record over (:meth:`take_over`), the others join it (the same proof of
        the job's secret) and tell their processes where the store is now
        (:class:`~.messages.StoreAt`); a pooled spare waits for the new leader and joins
        its pool. Without etcd, or when no coordinator comes back within
        --rdzv-timeout, the job ends here."""
        a = self.agent
        old = a.leader_info
        if a.o.etcd and a.pooled and old is not None:
            self.repool(old)
            return
        if not a.o.etcd or a.election is None or old is None:
            raise LaunchError(
                f"lost the coordinator (node {a.leader_node}'s agent): without "
                "--rdzv-backend etcd no other agent can take its place, so the job ends "
                "here (an elastic job shrinks in place only while the coordinator lives)"
            )
        a.supervisor.drop_coord()
        a.say(f"lost the coordinator (node {old.get('node')}'s agent): electing another")
        deadline = time.monotonic() + a.o.rdzv_timeout
        served: dict[str, Any] | None = None
        try:
            while True:
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"lost the coordinator (node {old.get('node')}'s agent) and no other "
                        f"took its place within {a.o.rdzv_timeout:g} s"
                    )
                leader = a.election.leader()
                if leader is not None and leader.get("coordinator") == old.get("coordinator"):
                    a.election.depose(leader)  # its link closed: do not wait for its lease
                    continue
                if leader is None:
                    if served is None:
                        served = a.supervisor.serve()
                    if a.election.campaign(served):
                        self.take_over(old)
                        return
                    continue
                if served is not None:
                    a.supervisor.unserve()
                    served = None
                try:
                    answer = a.supervisor.join_job()
                except LaunchError:
                    continue
                if not isinstance(answer, M.Welcome) or answer.spare:
                    raise LaunchError(
                        "the new coordinator did not welcome this node back (it counts it "
                        "lost: start this node's `leto launch` again to replace it)"
                    )
                a.generation = max(a.generation, answer.gen)
                self.store_moved()
                assert a.leader_info is not None  # joining the job read it
                a.say(f"rejoined the job at its new coordinator {a.leader_info.get('coordinator')}")
                return
        except StoreError as e:
            raise LaunchError(f"lost the coordinator, and etcd: {e}") from None

    def repool(self, old: dict[str, Any]) -> None:
        """A pooled spare whose coordinator was lost: once another agent leads (the job's
        record names another coordinator), it joins that one's pool."""
        a = self.agent
        assert a.etcd is not None
        a.supervisor.drop_coord()
        deadline = time.monotonic() + a.o.rdzv_timeout
        try:
            while True:
                leader = a.etcd.get("job")
                if leader is not None and leader.value.get("coordinator") != old.get("coordinator"):
                    break
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"lost the coordinator (node {old.get('node')}'s agent) and no other "
                        f"took its place within {a.o.rdzv_timeout:g} s"
                    )
                time.sleep(0.1)
        except StoreError as e:
            raise LaunchError(f"lost the coordinator, and etcd: {e}") from None
        answer = a.supervisor.join_job()
        if not isinstance(answer, M.Pooled):
            raise LaunchError("the new coordinator did not take this spare into its pool")
        a.spare_id = answer.spare_id
        assert a.leader_info is not None  # joining the job read it
        a.say(f"back in the spare pool, at the new coordinator {a.leader_info.get('coordinator')}")

    def take_over(self, old: dict[str, Any]) -> None:
        """This agent won the election: the commit record taken over from etcd (the
        predecessor fenced), the coordinator rebuilt from it (:meth:`.Coordinator.
        take_over`); the other nodes rejoin, and the predecessor's node, whose agent
        is gone with its trainers, is lost (:meth:`.Coordinator.node_down`): the
        coordinator recovers from that as from any node's loss."""
        a = self.agent
        o = a.o
        a.record = EtcdRecord(a.etcd)  # type: ignore[arg-type]
        try:
            taken = a.record.take_over()
        except RecordError as e:
            raise LaunchError(str(e)) from None
        info = a.election.leader() if a.election is not None else None
        a.leader_info = info
        a.supervisor.start_coordinator(continued=True)
        assert a.coord is not None
        if not any(r.get("event") == "core_init" for r in taken.records):
            raise LaunchError(
                f"lost the coordinator (node {old.get('node')}'s agent) before training started"
            )
        a.coord.take_over(taken.records, taken.kept)
        now = time.monotonic()
        a.joined = {a.node}
        a.coord.node_up(a.node, spare=False, now=now)
        a.coord.tell_tier2(a.node)
        lost = old.get("node")
        a.lost_leader = lost if isinstance(lost, int) else None
        a.rejoin = set(range(o.nnodes)) - {a.node, a.lost_leader}
        a.rejoin_by = now + o.rdzv_timeout
        a.say(f"took the coordinator over (node {lost}'s agent was lost)")
        self.store_moved()
        self.settle_rejoin(now)

    def settle_rejoin(self, now: float) -> None:
        """Once every other live node has rejoined (or --rdzv-timeout has passed: those
        that did not are lost too), the predecessor's node is lost."""
        a = self.agent
        assert a.coord is not None
        if a.lost_leader is None:
            return
        if a.rejoin and now < a.rejoin_by:
            return
        for n in sorted(a.rejoin):
            a.coord.node_down(n, now, why="did not rejoin after the coordinator failed over")
        a.rejoin = set()
        lost, a.lost_leader = a.lost_leader, None
        a.coord.node_down(lost, now, why="its agent, the coordinator's, was lost")
        a.routing.flush_coord()
        a.routing.assign_spares(now)

    def store_moved(self) -> None:
        """This node's processes connect to the job's TCPStore where it is now."""
        a = self.agent
        for p in [*a.trainer.values(), *a.shadow.values()]:
            if p is not None:
                a.routing.send_proc(p, M.StoreAt(host=a.o.rdzv_host, port=a.o.rdzv_port))

    def open(self) -> None:
        """The job's etcd store (:mod:`.etcdstore`), signed with the job's secret."""
        a = self.agent
        o = a.o
        a.supervisor.need_secret()
        assert a.secret is not None
        a.etcd = EtcdStore(o.etcd, o.rdzv_id, a.secret, patience=min(15.0, o.rdzv_timeout))
        try:
            a.etcd.ping()
        except StoreError as e:
            raise LaunchError(str(e)) from None

    def claim(self, info: dict[str, Any]) -> None:
        """Node 0: take the job's id in etcd, as the coordinator's first leader
        (:class:`.election.Election`: ``job`` under a lease this agent keeps alive;
        another node 0 with the same id is refused while this one lives), clear what an
        earlier job of the id left, publish the rendezvous and start the commit record
        (:class:`.commit_record.EtcdRecord`)."""
        a = self.agent
        assert a.etcd is not None
        try:
            a.election = Election(a.etcd, ETCD_LEASE_TTL)
            if not a.election.campaign(info, first=True):
                raise LaunchError(
                    f"--rdzv-id {a.o.rdzv_id}: a job of this id is running (its coordinator holds "
                    f"{a.etcd.key('job')} in etcd at {a.etcd.where()}); give another --rdzv-id"
                )
            a.record = EtcdRecord(a.etcd)
            a.record.start()
        except (StoreError, RecordError) as e:
            raise LaunchError(str(e)) from None
        self.present()

    def job_record(self) -> dict[str, Any]:
        """A node other than 0, or a spare: the job's rendezvous record, once node 0 has
        published it (within --rdzv-timeout), checked (signed with the job's secret)."""
        a = self.agent
        assert a.etcd is not None
        deadline = time.monotonic() + a.o.rdzv_timeout
        while True:
            try:
                entry = a.etcd.get("job")
            except StoreError as e:
                raise LaunchError(str(e)) from None
            # a restart joins node 0's restart, not the job node 0 is still ending
            if entry is not None and restart_of(entry.value) >= a.o.restarts:
                break
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"no job {a.o.rdzv_id!r} in etcd at {a.etcd.where()} within "
                    f"{a.o.rdzv_timeout:g} s; is node 0's `leto launch` running with the same "
                    "--rdzv-endpoint and --rdzv-id?"
                )
            time.sleep(0.2)
        info = entry.value
        if not isinstance(info.get("node", 0), int):
            raise LaunchError(f"the job record {a.etcd.key('job')} in etcd has no valid 'node'")
        for k, kind in (("job", str), ("nnodes", int), ("nproc_per_node", int),
                        ("coordinator", str), ("store", str)):  # fmt: skip
            if not isinstance(info.get(k), kind):
                raise LaunchError(f"the job record {a.etcd.key('job')} in etcd has no valid {k!r}")
        return info

    def keep_lease(self, now: float) -> None:
        """Keep this agent's lease (its presence; the leader's, the job's id) alive; a
        lease etcd let expire stops this agent in one line (another could take its role)."""
        a = self.agent
        if a.election is None or now - a.etcd_refreshed < ETCD_LEASE_TTL / 5:
            return
        try:
            a.election.keep()
        except StoreError as e:
            raise LaunchError(f"lost the job's id in etcd: {e}") from None
        a.etcd_refreshed = now

    def close(self) -> None:
        """The job's end: every agent gives its lease back (the leader's holds the job's
        id), and the leader, after a job that completed, deletes the job's keys; the
        commit record of a failed job is kept."""
        a = self.agent
        if a.etcd is None:
            return
        try:
            if a.election is not None:
                if a.failed is None and a.complete and a.record is not None:
                    a.etcd.clear_all()
                a.election.resign()
        except StoreError as e:
            print(f"leto[{a.who}]: warning: {e}", file=sys.stderr, flush=True)
        a.etcd.close()
        a.etcd = None


def restart_of(info: Any) -> int:
    """The restart a job record names (0: the job's first start)."""
    n = info.get("restart", 0) if isinstance(info, dict) else 0
    return n if isinstance(n, int) and not isinstance(n, bool) else 0
