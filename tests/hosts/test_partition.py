"""A partition: the coordinator's node (node 0, with one of the 3 etcd members beside it
on its host) cut off from node 1, the spare and the etcd majority, mid-step. Node 1's
agent sees its coordinator's link close (``--hang-timeout``), takes the coordinator over
from etcd, the spare takes node 0's place, and the job ends bitwise equal to the
failure-free run; the old leader, which can reach only the etcd minority, can commit
nothing (etcd's majority refuses it) and ends in one line once its lease cannot be kept."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from etcd_hosts import EtcdOnHosts
from jobs import STEPS_2x2, digests_equal, explain, story
from netjobs import NetJob
from netns import Hosts

from leto.adapters.report import summarize
from leto.backends.gloo.harness import JobResult

HANG = 3.0


def test_a_partition_of_the_coordinator_s_node_fails_over_bitwise(
    tag: str, make_hosts: Callable[[int], Hosts], ref: JobResult
) -> None:
    hosts = make_hosts(5)  # nodes 0 and 1, the spare, two etcd members (the third on host 0)
    etcd = EtcdOnHosts(hosts, [0, 3, 4], Path(tag) / "etcd")
    rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint_flag, "--rdzv-id", "part"]
    extra = ["--collective-timeout", "10", "--recovery-timeout", "30"]
    j = NetJob(
        hosts, Path(tag) / "part", nnodes=2, nproc=2, steps=STEPS_2x2, spares=1,
        env={"STEP_SLEEP": "0.3"}, extra=extra, rdzv=rdzv,
    )  # fmt: skip
    try:
        j.wait_for(lambda e: e["event"] == "step" and e["step"] >= 3)
        hosts.cut(0)
        cut = time.time()
        res = j.finish(90.0)
    finally:
        j.kill()
        etcd.stop()
    assert res.codes == {0: [1], 1: [0], 2: [0]}, explain(res)
    (took,) = res.of("coordinator_took_over")
    (f,) = res.of("failure")
    assert (f["kind"], f["node"]) == ("node_lost", 0), story(res)
    failover = took["t"] - cut
    print(f"\npartition: node 1 took the coordinator over {failover:.2f} s after the cut")
    assert 0 < failover <= HANG + 2.0, failover
    (rec,) = res.recoveries
    print(f"recovered {rec['t'] - took['t']:.2f} s after the take-over")
    assert rec["t"] - took["t"] <= 10.0, story(res)
    assert [(e["spare"], e["node"]) for e in res.of("spare_assigned")] == [(0, 0)], story(res)
    # the successor commits each step once from where the recovery resumed
    (record,) = res.of("commit_record")
    assert record["backend"] == "etcd" and took["committed"] >= 3, (took["committed"], record)
    assert record["commits"] == STEPS_2x2 - rec["resumed_at"], (record, rec)
    # the first end is the successor's, ok, at the end of training: the deposed leader's
    # own end comes about 10 s later (its lease lapsing); 1 s was too tight (1.08 s seen
    # in a fresh-clone CI run, the spares' and agents' goodbyes on a busy machine)
    ends = res.of("job_end")
    assert ends[0]["status"] == "ok" and ends[0]["t"] < res.of("training_done")[0]["t"] + 5, ends
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"
    said = [x for x in res.text(0).splitlines() if "error:" in x]
    assert len(said) == 1 and "lost the job's id in etcd" in said[0], res.text(0)
    assert "lease/revoke" not in res.text(0), res.text(0)  # the lease was over: nothing asked
    # the cut-off agent logs its own end in the job's log (after its successor's, as a
    # rule): the job still completed
    summary = summarize(res.events)
    assert (summary["status"], summary["error"]) == ("ok", None), (summary, res.of("job_end"))


def test_a_job_that_completed_stays_completed_in_its_summary() -> None:
    done = [{"event": "training_done", "step": 10}, {"event": "job_end", "status": "ok"}]
    late = [{"event": "job_failed", "error": "lost the job's id in etcd"}]
    late_end = [{"event": "job_end", "status": "failed", "error": "lost the job's id in etcd"}]
    s = summarize([*done, *late, *late_end])
    assert (s["status"], s["error"]) == ("ok", None), s
    s = summarize([*late, *late_end])  # a job that failed: its end, and its error
    assert (s["status"], s["error"]) == ("failed", "lost the job's id in etcd"), s
