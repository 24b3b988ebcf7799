"""2 nodes x 2 ranks on test hosts of their own (``netns.py``): each node's ``leto launch``
in its own network namespace, node 0's endpoint its address. Failure-free; node 1's link
cut mid-step with a spare on a third host (the spare takes its place), the link mended
once the node was declared lost (the cut-off node's processes end, nothing of theirs
counts); and a cut with no spare (one line, within the timeouts). Each run that
completes is bitwise equal to the failure-free run on 127.0.0.1 (conftest's ``ref``);
detection (the cut to the coordinator's ``failure``) and recovery (that to
``recovery_end``) are printed (``-s``) and held to the timeouts."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from jobs import STEPS_2x2, digests_equal, explain, story
from netjobs import NetJob
from netns import Hosts

from leto.backends.gloo.harness import JobResult

HANG = 3.0  # NetJob's --hang-timeout: a link silent this long is cut
# slow steps, so that a cut falls in a step; a short collective timeout bounds how long a
# survivor may wait in a collective with a peer cut off; a lost node waits 2 s for a spare
SLOW = {"STEP_SLEEP": "0.3"}
TIMEOUTS = ["--collective-timeout", "10", "--recovery-timeout", "30", "--spare-timeout", "2"]
# a crash of rank 0 (node 0) in step 3, and rank 2 (node 1) hung while it carries out that
# recovery's Reconcile: the recovery lasts until node 1 is seen lost, so a cut at its
# start falls in it
IN_RECOVERY = [
    {"kind": "crash", "rank": 0, "step": 3, "phase": "backward"},
    {"kind": "hang", "rank": 2, "step": 3, "phase": "recovery", "where": "Reconcile"},
]


def _run(
    hosts: Hosts, run_dir: Path, spares: int, at: str, faults: list[dict[str, object]] | None = None
) -> tuple[JobResult, float]:
    """The job with node 1's link cut at the first event ``at`` (``step``: as step 3
    commits), mended once the node is declared lost if there is a spare; the result and
    the cut's time."""
    extra = [*TIMEOUTS, *(["--faults", json.dumps(faults)] if faults else [])]
    j = NetJob(
        hosts, run_dir, nnodes=2, nproc=2, steps=STEPS_2x2, spares=spares, env=SLOW, extra=extra
    )
    try:
        j.wait_for(lambda e: e["event"] == at and (at != "step" or e["step"] >= 3))
        hosts.cut(1)
        cut = time.time()
        if spares:
            j.wait_for(lambda e: e["event"] == "failure" and e["kind"] == "node_lost")
            hosts.mend(1)  # the node was declared lost: its link comes back
        return j.finish(90.0), cut
    finally:
        j.kill()


def _lost(res: JobResult, cut: float) -> float:
    (f,) = [f for f in res.of("failure") if f["kind"] == "node_lost"]
    assert (f["kind"], f["node"], f["detected_by"]) == ("node_lost", 1, "agent link closed"), f
    detect = f["t"] - cut
    print(f"\ncut link: node 1 declared lost {detect:.2f} s after the cut")
    assert 0 < detect <= HANG + 1.5, (
        f"detected {detect:.2f} s after the cut (hang timeout {HANG} s)"
    )
    assert "lost the coordinator (node 0's agent)" in res.text(1), res.text(1)
    return float(f["t"])


def test_2x2_on_test_hosts_is_bitwise_equal(
    tag: str, make_hosts: Callable[[int], Hosts], ref: JobResult
) -> None:
    hosts = make_hosts(2)
    j = NetJob(hosts, Path(tag) / "hosts-2x2", nnodes=2, nproc=2, steps=STEPS_2x2)
    try:
        res = j.finish(90.0)
    finally:
        j.kill()
    assert res.ok and res.codes == {0: [0], 1: [0]}, explain(res)
    (start,) = res.of("job_start")
    assert start["rdzv"] == f"{hosts.addrs[0]}:29400", start
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"


def test_a_link_cut_in_a_recovery_loses_the_node_and_a_spare_takes_its_place_bitwise(
    tag: str, make_hosts: Callable[[int], Hosts], ref: JobResult
) -> None:
    """The link is mended as soon as the node is declared lost: its agent ends all the
    same (its coordinator dropped the link), and nothing it did counts."""
    res, cut = _run(make_hosts(3), Path(tag) / "cut", 1, "recovery_start", IN_RECOVERY)
    assert res.ok, explain(res)
    assert res.codes == {0: [0], 1: [1], 2: [0]}, explain(res)  # node 1 cut off: ended
    (start,) = res.of("recovery_start")
    lost = _lost(res, cut)
    (restart,) = res.of("recovery_restart")  # node 1's loss joined the recovery under way
    assert [(c["kind"], c["node"]) for c in restart["cause"]] == [("node_lost", 1)], restart
    assert start["t"] <= cut < lost, (start, cut, lost)
    assert [(e["spare"], e["node"]) for e in res.of("spare_assigned")] == [(0, 1)], story(res)
    (rec,) = res.recoveries
    print(f"recovered {rec['t'] - lost:.2f} s after the detection ({rec['seconds']:.2f} s in all)")
    assert rec["t"] - lost <= 10.0, story(res)  # within the collective timeout, far from 30 s
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"


def test_a_cut_link_with_no_spare_ends_in_one_line_within_the_timeouts(
    tag: str, make_hosts: Callable[[int], Hosts]
) -> None:
    res, cut = _run(make_hosts(2), Path(tag) / "cut-alone", 0, "step")
    assert res.codes == {0: [1], 1: [1]}, explain(res)
    lost = _lost(res, cut)
    (end,) = res.of("job_failed")
    assert end["t"] - lost <= 2.0 + 1.0, end  # --spare-timeout 2
    line = "node 1 was lost and no replacement joined within 2 s (the spare pool was empty)"
    assert line in str(end["error"]), end
    said = [x for x in res.text(0).splitlines() if "job failed" in x]
    assert len(said) == 1 and line in said[0], res.text(0)
