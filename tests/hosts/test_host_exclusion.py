"""A host that failed is not taken back (``--exclude-after 1``): 2 nodes x 2 ranks on
test hosts, a spare agent waiting on node 1's own host (the lowest spare id) and one on
a third host; node 1's agent is SIGKILLed mid-run. Node 1's host is excluded, the pool
passes over the spare there and gives node 1's place to the third host's spare, and the
job ends bitwise equal to the failure-free run (conftest's ``ref``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from jobs import STEPS_2x2, digests_equal, explain
from netjobs import NetJob
from netns import Hosts

from leto.backends.gloo.harness import JobResult

SLOW = {"STEP_SLEEP": "0.5"}  # 10 steps of 0.5 s: the kill falls mid-run


def test_a_host_that_failed_is_passed_over_for_a_spare_elsewhere_bitwise(
    tag: str, make_hosts: Callable[[int], Hosts], ref: JobResult
) -> None:
    hosts = make_hosts(3)
    extra = ["--exclude-after", "1", "--spare-timeout", "10", "--recovery-timeout", "30"]
    j = NetJob(
        hosts, Path(tag) / "exclude", nnodes=2, nproc=2, steps=STEPS_2x2, env=SLOW, extra=extra
    )
    try:
        j.start(1, ["--spare"], key=3)  # a spare on node 1's host: spare 0
        j.wait_for(lambda e: e["event"] == "spare_joined" and e["spare"] == 0)
        j.start(2, ["--spare"])  # and one on a host of its own: spare 1
        j.wait_for(lambda e: e["event"] == "spare_joined" and e["spare"] == 1)
        steps = [e["step"] for e in j.events() if e["event"] == "step"]
        after = max([2, *steps]) + 1  # a step that commits with both spares pooled
        assert after < STEPS_2x2 - 2, f"the spares joined too late: step {after - 1}"
        j.wait_for(lambda e: e["event"] == "step" and e["step"] >= after)
        j.procs[1].kill()  # node 1's agent, and its trainers with it
        res = j.finish(90.0)
    finally:
        j.kill()
    (ex,) = res.of("host_excluded")
    assert (ex["host"], ex["node"], ex["failures"]) == (hosts.addrs[1], 1, 1), ex
    assert "is not taken back" in ex["why"] and "--exclude-after 1" in ex["why"]
    assert [e["spare"] for e in res.of("spare_passed_over")] == [0]
    assert [(e["spare"], e["node"]) for e in res.of("spare_assigned")] == [(1, 1)]
    assert res.ok and res.codes[0] == [0] and res.codes[2] == [0], explain(res)
    assert digests_equal(res, ref), explain(res)
