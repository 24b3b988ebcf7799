"""``--rdzv-backend etcd``: the rendezvous and the commit record in a 3-member etcd
cluster; the first endpoint named is not etcd (it answers garbage), a member is
SIGKILLed mid-run (the one every agent talks to once it moved on from the first) and a
trainer crashes later: the job ends bitwise equal to the failure-free run (c10d)."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

from etcd import EtcdCluster, junk_server
from jobs import STEPS_2x2, digests_equal, explain, job
from test_hostile import _listening_on, _tcp

from leto.backends.gloo import auth
from leto.backends.gloo.etcdstore import EtcdStore
from leto.backends.gloo.harness import JobResult


def _watch_commits(
    cluster: EtcdCluster, run_dir: Path, job_id: str, until: threading.Event, step: int
) -> int | None:
    """Wait for COMMIT(``step``) in etcd (read from the members that stay), SIGKILL
    member 0, and return the step the record held then (None: the job ended first)."""
    store: EtcdStore | None = None
    while not until.is_set():
        if store is None:
            secret = auth.read_secret(run_dir) if (run_dir / auth.FILE).exists() else None
            if secret is not None:
                store = EtcdStore(cluster.endpoints[1:], job_id, secret)
        if store is not None:
            got = store.get("r/commit")
            if got is not None and got.value["step"] >= step:
                cluster.kill(0)
                store.close()
                return int(got.value["step"])
        time.sleep(0.02)
    return None


def _attack_successor(
    cluster: EtcdCluster, run_dir: Path, job_id: str, until: threading.Event
) -> dict[str, Any]:
    """Once node 1's agent leads (etcd's ``job`` names it), where its TCPStore and
    coordinator listen, and what an HTTP request to its coordinator gets."""
    seen: dict[str, Any] = {}
    store: EtcdStore | None = None
    try:
        while not until.is_set():
            if store is None and (run_dir / auth.FILE).exists():
                store = EtcdStore(cluster.endpoints, job_id, auth.read_secret(run_dir) or b"")
            leader = store.get("job") if store is not None else None
            if leader is not None and leader.value["node"] == 1:
                coordinator = leader.value["coordinator"].rsplit(":", 1)
                seen["store_on"] = _listening_on(int(leader.value["store"].rsplit(":", 1)[1]))
                seen["coordinator_on"] = _listening_on(int(coordinator[1]))
                seen["http"] = _tcp(coordinator[0], int(coordinator[1]), b"GET / HTTP/1.0\r\n\r\n")
                return seen
            time.sleep(0.02)
    except BaseException as e:  # noqa: BLE001 - reported by the test
        seen["error"] = f"{type(e).__name__}: {e}"
    finally:
        if store is not None:
            store.close()
    return seen


def test_etcd_member_killed_mid_run_recovers_bitwise(
    etcd_cluster: EtcdCluster, tmp_path: Path, ref_2x2: JobResult
) -> None:
    with contextlib.ExitStack() as stack:
        _member_killed(etcd_cluster, tmp_path, ref_2x2, stack)


def _member_killed(
    etcd_cluster: EtcdCluster, tmp_path: Path, ref_2x2: JobResult, stack: contextlib.ExitStack
) -> None:
    run_dir = tmp_path / "run"
    job_id = "kill-a-member"
    junk = stack.enter_context(junk_server())  # named first: every agent asks it first
    endpoints = f"{junk[0]}:{junk[1]},{etcd_cluster.endpoint_flag}"
    rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoints, "--rdzv-id", job_id]
    crash = {"kind": "crash", "rank": 3, "step": 7, "phase": "backward"}
    out: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            out["res"] = job(run_dir, nnodes=2, nproc=2, steps=STEPS_2x2, faults=[crash], rdzv=rdzv)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            out["error"] = e
        finally:
            done.set()

    t0 = time.monotonic()
    th = threading.Thread(target=run)
    th.start()
    try:
        killed_at = _watch_commits(etcd_cluster, run_dir, job_id, done, step=3)
    finally:
        th.join()
    if "error" in out:
        raise out["error"]
    res: JobResult = out["res"]
    assert res.ok, explain(res)
    assert killed_at is not None and 3 <= killed_at < 7, killed_at  # before the crash
    assert digests_equal(res, ref_2x2), "not bitwise equal to the failure-free run"
    start = res.of("job_start")[0]
    assert start["rdzv_backend"] == "etcd" and start["rdzv_id"] == job_id
    assert [r["kind"] for r in res.recoveries] == ["inplace"]
    (record,) = res.of("commit_record")
    # one transaction per step (the crash before the vote re-commits nothing), one per fence
    assert record["backend"] == "etcd"
    assert record["commits"] == STEPS_2x2 and record["fences"] == 1, record
    # node 0 moved on from the endpoint that answers garbage, then from the killed member
    assert record["failovers"] >= 2, record
    # the job completed: node 0 gave its id back and deleted the job's keys
    store = EtcdStore(etcd_cluster.endpoints[1:], job_id, auth.read_secret(run_dir) or b"")
    assert store.get("job") is None and store.get("r/commit") is None
    store.close()
    print(f"etcd job {time.monotonic() - t0:.1f} s, commit record {record}")


def test_node0_agent_killed_mid_run_fails_over_bitwise(
    etcd_cluster: EtcdCluster, tmp_path: Path, ref_2x2: JobResult
) -> None:
    """Node 0's agent, which runs the coordinator and serves the TCPStore, is SIGKILLed
    in step 5 (with its trainers and keepers): node 1's agent takes the coordinator over
    from etcd, the spare agent that waited in node 0's pool (``leto launch --spare``,
    started beside the nodes) joins node 1's pool and takes node 0's place, and the job
    ends bitwise equal to the failure-free run, its trace one behaviour."""
    run_dir = tmp_path / "run"
    job_id = "kill-node-0"
    rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_cluster.endpoint_flag]
    lose = {"kind": "lose_node", "rank": 0, "step": 5, "phase": "backward"}
    res = job(
        run_dir, nnodes=2, nproc=2, steps=STEPS_2x2, faults=[lose],
        rdzv=[*rdzv, "--rdzv-id", job_id], spare_agents=1, respawn=False,
    )  # fmt: skip
    assert res.codes == {0: [-9], 1: [0], -1: [0]}, explain(res)
    assert res.of("job_end")[-1]["status"] == "ok", explain(res)
    assert digests_equal(res, ref_2x2), "not bitwise equal to the failure-free run"
    (took,) = res.of("coordinator_took_over")
    assert took["committed"] == 4, took
    # the successor goes on with the same job's log: its id, and its clock
    assert len({e.get("job") for e in res.events}) == 1
    # (records of the two agents interleave in the file: the clock is the job's, not
    # each writer's; a successor that started its own would begin again near 0)
    i = next(k for k, e in enumerate(res.events) if e["event"] == "coordinator_took_over")
    before = sorted(e["t_rel"] for e in res.events[:i])
    after = [e["t_rel"] for e in res.events[i:]]
    assert min(after) >= before[len(before) // 2], (before, after)
    # a whole node's ranks are beyond tier 1 (its parity): the tier-2 snapshot of step 4,
    # or of step 2 when node 0 died before etcd held step 4's (its agent was writing it)
    assert [r["kind"] for r in res.recoveries] == ["tier2"], res.recoveries
    assert res.recoveries[0]["resumed_at"] in (2, 4), res.recoveries
    # the spare, pooled again at node 1's coordinator, took node 0's place
    assert [e["spare"] for e in res.of("spare_joined")] == [0, 0], res.of("spare_joined")
    assert [(e["spare"], e["node"]) for e in res.of("spare_assigned")] == [(0, 0)]
    joined = [(e["node"], e["spare"]) for e in res.of("node_joined")]
    assert joined[-1] == (0, True), joined
    store = EtcdStore(etcd_cluster.endpoints, job_id, auth.read_secret(run_dir) or b"")
    assert store.get("job") is None and store.scan("a/") == []  # given back at the end
    store.close()


def test_coordinator_killed_during_a_recovery_fails_over_bitwise(
    etcd_cluster: EtcdCluster, tmp_path: Path, ref_2x2: JobResult
) -> None:
    """Rank 3 (node 1) crashes in step 8; while the ranks carry out that recovery's
    Reconcile, node 0's agent, the coordinator's, is SIGKILLed: node 1's agent takes
    over the recovery in progress from etcd, adds node 0's loss to it, and the job ends
    bitwise equal to the failure-free run. Step 8, not 7: the tier-2 snapshot of step 6
    is complete before step 7 commits; in step 7, a crash can reach the coordinator
    before a slower rank's snapshot_done of step 6 (dropped then, as of an older
    generation), and node 0's ranks come back from the snapshot of step 4."""
    run_dir = tmp_path / "run"
    rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_cluster.endpoint_flag]
    faults = [
        {"kind": "crash", "rank": 3, "step": 8, "phase": "backward"},
        {"kind": "lose_node", "rank": 0, "step": 8, "phase": "recovery", "where": "Reconcile"},
    ]
    done = threading.Event()
    seen: dict[str, Any] = {}
    attacker = threading.Thread(
        target=lambda: seen.update(_attack_successor(etcd_cluster, run_dir, "in-recovery", done))
    )
    attacker.start()
    try:
        res = job(
            run_dir, nnodes=2, nproc=2, steps=STEPS_2x2, faults=faults,
            rdzv=[*rdzv, "--rdzv-id", "in-recovery"],
        )  # fmt: skip
    finally:
        done.set()
        attacker.join()
    assert res.ok, explain(res)
    # the successor's listeners: on the address given only, and an HTTP request to its
    # coordinator closes that connection (refused, in the log), not the job
    loopback = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
    assert seen.get("store_on") == [loopback] and seen["coordinator_on"] == [loopback], seen
    closed, frames = seen["http"]
    assert closed and [f["t"] for f in frames] == ["challenge"], seen
    (refused,) = res.of("connection_refused")
    assert refused["t"] > res.of("coordinator_took_over")[0]["t"], refused
    assert "frame of 1195725856 bytes" in refused["why"], refused  # b"GET "
    assert res.codes[0][0] == -9 and res.codes[1] == [0], res.codes
    assert digests_equal(res, ref_2x2), "not bitwise equal to the failure-free run"
    (took,) = res.of("coordinator_took_over")
    assert took["committed"] == 7 and took["generation"] == 1, took
    # the successor rebuilt the recovery in progress (its Reconcile fed) and restarted it
    assert [(f["kind"], f["generation"]) for f in res.of("failure")] == [
        ("crash", 0),
        ("node_lost", 1),
    ]
    (restart,) = res.of("recovery_restart")
    assert (restart["generation"], restart["phase"]) == (1, "rebuilding"), restart
    # node 0's ranks from the tier-2 snapshot of step 6 (step 7 is computed again)
    assert [(r["generation"], r["resumed_at"]) for r in res.recoveries] == [(2, 6)]
