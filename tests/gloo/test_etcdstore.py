"""The job's etcd store (leto.backends.gloo.etcdstore) against a real 3-member cluster:
signed records, compare-and-swap by revision, leases, one member lost, and endpoints
that answer what etcd never sends (each costs that one connection, never the store)."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from etcd import EtcdCluster, Junk, junk_server

from leto.backends.gloo.agent import Agent, AgentOptions
from leto.backends.gloo.commit_record import EtcdRecord, RecordError
from leto.backends.gloo.election import Election
from leto.backends.gloo.etcdstore import EtcdStore, StoreError
from leto.backends.gloo.records import LaunchError

SECRET = b"s" * 32


@pytest.fixture
def junk() -> Iterator[tuple[str, int]]:
    with junk_server() as address:
        yield address


def test_records_are_signed_and_swapped_by_revision(etcd_shared: EtcdCluster) -> None:
    s = EtcdStore(etcd_shared.endpoints, "job-a", SECRET)
    assert s.get("gen") is None
    rev = s.write({"gen": 0}, [("gen", {"gen": 0})])  # create: the key must not exist
    assert rev is not None
    assert s.write({"gen": 0}, [("gen", {"gen": 9})]) is None  # it exists now
    e = s.get("gen")
    assert e is not None and e.value == {"gen": 0} and e.mod_revision == rev
    # a commit guarded by the generation's revision: refused once the generation moved
    assert s.write({"gen": rev}, [("commit", {"step": 1, "gen": 0})]) is not None
    moved = s.write({"gen": rev}, [("gen", {"gen": 1})])
    assert moved is not None and moved > rev
    assert s.write({"gen": rev}, [("commit", {"step": 2, "gen": 0})]) is None
    c = s.get("commit")
    assert c is not None and c.value == {"step": 1, "gen": 0}
    # another job's store (another id) sees nothing of it; a stranger's secret is refused
    assert EtcdStore(etcd_shared.endpoints, "job-b", SECRET).get("commit") is None
    stranger = EtcdStore(etcd_shared.endpoints, "job-a", b"t" * 32)
    with pytest.raises(StoreError, match="not signed with this job's secret"):
        stranger.get("commit")
    # a value someone wrote by hand (not a leto record): refused in one line
    raw = s._post(  # noqa: SLF001 - a put without the seal, as etcdctl would do it
        "kv/put",
        {
            "key": base64.b64encode(s.key("commit").encode()).decode(),
            "value": base64.b64encode(b'{"step": 99}').decode(),
        },
        lambda a: a,
    )
    assert raw
    with pytest.raises(StoreError, match="commit is not a leto record") as err:
        s.get("commit")
    assert "\n" not in str(err.value)
    # a lease: kept alive, and its key cleared with the job
    lease = s.grant(5)
    assert 0 < s.refresh(lease) <= 5
    assert s.write({"job": 0}, [("job", {"node": 0})], lease=lease, clear="r/") is not None
    s.revoke(lease)
    assert s.get("job") is None
    with pytest.raises(StoreError, match="expired"):
        s.refresh(lease)
    s.clear_all()
    assert s.get("gen") is None
    s.close()


def test_a_lost_member_and_bad_answers_cost_one_connection(
    etcd_cluster: EtcdCluster, junk: tuple[str, int]
) -> None:
    # the first endpoint answers garbage each time: the store moves on, every call works
    s = EtcdStore([junk, *etcd_cluster.endpoints], "job-c", SECRET, patience=5.0)
    for i in range(len(Junk.answers)):
        s.current = 0
        assert s.put("commit", {"step": i, "gen": 0}) > 0
    assert s.failovers >= len(Junk.answers)
    got = s.get("commit")
    assert got is not None and got.value == {"step": len(Junk.answers) - 1, "gen": 0}
    # one member of three killed (the one the store talks to): the next answers
    s2 = EtcdStore(etcd_cluster.endpoints, "job-c", SECRET)
    s2.ping()
    etcd_cluster.kill(0)
    for step in range(5):
        assert s2.put("commit", {"step": step, "gen": 0}) > 0
    assert s2.current != 0
    # nothing but bad endpoints: one line, within the patience
    bad = EtcdStore(
        [junk, ("127.0.0.1", etcd_cluster.client_ports[0])], "job-c", SECRET, patience=1.0
    )
    with pytest.raises(StoreError) as err:
        bad.get("commit")
    line = str(err.value)
    assert "no member answered" in line and "\n" not in line
    s.close()
    s2.close()
    bad.close()


def test_an_election_a_deposed_leader_is_fenced_and_a_lapsed_lease_frees_the_role(
    etcd_shared: EtcdCluster,
) -> None:
    sa, sb = (EtcdStore(etcd_shared.endpoints, "elect", SECRET) for _ in range(2))
    a, b = Election(sa, ttl=2), Election(sb, ttl=2)
    assert a.campaign({"coordinator": "A"}, first=True)
    rec_a = EtcdRecord(sa)
    rec_a.start()
    rec_a.commit(1, 0)
    assert not b.campaign({"coordinator": "B"})  # A leads
    leader = b.leader()
    assert leader == {"coordinator": "A", "lease": f"{a.lease:x}"}
    a.keep()
    # A's link closed: B deposes it, takes the role, then the commit record over
    assert b.depose(leader) is True
    assert b.depose(leader) is False  # ended already
    assert b.leader() is None
    assert b.campaign({"coordinator": "B"})
    rec_b = EtcdRecord(sb)
    assert rec_b.take_over().commit == {"step": 1, "gen": 0}
    with pytest.raises(RecordError, match="another coordinator fenced this one"):
        rec_a.commit(2, 0)  # A, alive behind a partition, can record nothing more
    with pytest.raises(StoreError, match="expired"):
        a.keep()  # and learns that it no longer leads
    rec_b.commit(2, 0)
    # B stops refreshing its lease (it died): once etcd ends it, the next campaign wins
    c = Election(EtcdStore(etcd_shared.endpoints, "elect", SECRET), ttl=2)
    assert not c.campaign({"coordinator": "C"})
    deadline = time.monotonic() + 10.0
    while not c.campaign({"coordinator": "C"}):
        assert time.monotonic() < deadline, "B's lease did not end"
        time.sleep(0.2)
    assert c.leader() == {"coordinator": "C", "lease": f"{c.lease:x}"}
    with pytest.raises(StoreError, match="not signed"):
        Election(EtcdStore(etcd_shared.endpoints, "elect", b"x" * 32), ttl=2).leader()
    c.resign()
    assert b.leader() is None


def _agent(cluster: EtcdCluster, node: int, run_dir: Path) -> Agent:
    """An agent (nothing started) of job "agents" on ``cluster``, its store open."""
    opts = AgentOptions(
        script="x.py", script_args=[], nnodes=2, node_rank=node, run_dir=str(run_dir),
        etcd=tuple(cluster.endpoints), rdzv_id="agents", rdzv_timeout=1.0, quiet=True,
    )  # fmt: skip
    ag = Agent(opts)
    ag.secret = SECRET
    ag.control.open()
    return ag


def test_node_0_claims_the_id_others_read_it_and_a_second_node_0_is_refused(
    etcd_shared: EtcdCluster, tmp_path: Path
) -> None:
    info = {"job": "j", "nnodes": 2, "nproc_per_node": 1, "coordinator": "h:1", "store": "h:2"}
    first, second, node1 = (_agent(etcd_shared, n, tmp_path) for n in (0, 0, 1))
    assert first.control.first_of_job()  # nobody of the job lives: its start
    first.control.claim(info)
    assert first.record is not None and first.record.gen_revision > 0
    # a node 0 started while the job runs (its agents hold a/<node>) replaces a lost one
    assert [n for n, _ in first.etcd.scan("a/")] == ["a/0"]  # type: ignore[union-attr]
    assert not second.control.first_of_job()
    with pytest.raises(LaunchError) as err:
        second.control.claim(info)
    assert "--rdzv-id agents: a job of this id is running" in str(err.value)
    assert "\n" not in str(err.value)
    got = node1.control.job_record()
    assert {k: got[k] for k in info} == info
    # a record that is signed but says nothing usable: one line, naming what is missing
    assert node1.etcd is not None
    node1.etcd.write({}, [("job", {k: v for k, v in info.items() if k != "store"})])
    with pytest.raises(LaunchError, match="has no valid 'store'"):
        node1.control.job_record()
    # the job completed: node 0 deletes its keys and gives the id back
    assert node1.etcd.get("r/gen") is not None
    first.complete = True
    first.control.close()
    assert node1.etcd.get("job") is None and node1.etcd.get("r/gen") is None
    with pytest.raises(LaunchError, match="no job 'agents' in etcd"):
        node1.control.job_record()
    assert second.control.first_of_job()
    second.control.claim(info)  # the id is free: a new job takes it
    for ag in (second, node1):
        ag.control.close()


def test_a_killed_test_process_takes_its_etcd_members_with_it(tmp_path: Path) -> None:
    """A test process SIGKILLed with its cluster up (a CI timeout, a ^C'd run that was
    then killed) leaves no etcd member running: the kernel kills each with it."""
    here = Path(__file__).parent
    code = (
        "import sys, time; from pathlib import Path; from etcd import EtcdCluster; "
        f"c = EtcdCluster(Path({str(tmp_path / 'etcd')!r}), members=1); "
        "print(c.procs[0].pid, flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=here, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        member = int(proc.stdout.readline())
        assert Path(f"/proc/{member}").exists()  # the member runs
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{member}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    outlived = Path(f"/proc/{member}").exists()
    if outlived:  # not left running by this test either
        os.kill(member, signal.SIGKILL)
    assert not outlived, f"etcd member {member} outlived its test process"
