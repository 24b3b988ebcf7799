"""Issue 39: a trainer killed in its loop's tail (after ``optimizer.step()``, before its
next batch) was replaced with its scheduler one step behind: the job exited 0 with the
replicas holding different weights. Each run here ends bitwise equal to the
failure-free run, every rank's parameters alike."""

from __future__ import annotations

from pathlib import Path

import pytest
from jobs import HERE, explain, job

TAIL = str(HERE / "scripts" / "tail.py")


def _params(res) -> set[str]:  # type: ignore[no-untyped-def]
    assert res.digests is not None, explain(res)
    return {d["param"] for d in res.digests.values()}


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    res = job(tmp_path_factory.mktemp("tail") / "ref", steps=8, script=TAIL)
    assert res.ok, explain(res)
    assert len(_params(res)) == 1, "the failure-free run's replicas differ"
    return res


@pytest.mark.parametrize("at", ["step", "sched"])
def test_a_death_in_the_loop_tail_is_bitwise(ref, tmp_path: Path, at: str) -> None:  # type: ignore[no-untyped-def]
    res = job(tmp_path / at, steps=8, script=TAIL, env={"KILL_AT": at})
    assert res.ok, explain(res)
    assert len(res.recoveries) == 1, res.recoveries
    assert len(_params(res)) == 1, f"the replicas differ: {res.digests}"
    assert res.digests == ref.digests, "not bitwise equal to the failure-free run"


def test_the_named_tail_point_is_bitwise(ref, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    faults = [
        {"kind": "crash", "rank": 0, "step": 2, "phase": "tail"},
        {"kind": "crash", "rank": 1, "step": 5, "phase": "tail"},
    ]
    res = job(tmp_path / "named", steps=8, script=TAIL, faults=faults)
    assert res.ok, explain(res)
    assert len(res.recoveries) == 2, res.recoveries
    assert res.digests == ref.digests, "not bitwise equal to the failure-free run"


def test_a_planted_divergence_of_the_replicas_ends_the_job_in_one_line(tmp_path: Path) -> None:
    res = job(tmp_path / "plant", steps=8, script=TAIL, env={"PLANT_STEP": "4"})
    assert not res.ok, "a job whose replicas disagree ended as a success"
    failed = [e for e in res.events if e["event"] == "job_failed"]
    assert failed, explain(res)
    line = failed[0]["error"]
    assert "\n" not in line, line
    assert "replicas disagree after step 5" in line, line
    assert "ranks 0 / ranks 1" in line or "ranks 1 / ranks 0" in line, line
    split = [e for e in res.events if e["event"] == "replicas_disagree"]
    assert [(e["step"], e["groups"]) for e in split] == [(5, [[0], [1]])], split


@pytest.fixture(scope="module")
def ref3(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    res = job(tmp_path_factory.mktemp("tail3") / "ref", steps=8, nproc=3, script=TAIL)
    assert res.ok, explain(res)
    assert len(_params(res)) == 1, "the failure-free run's replicas differ"
    return res


def test_one_diverged_replica_of_three_is_repaired_in_place_from_the_majority(
    ref3, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Ranks 0 and 2 agree, rank 1 does not: its memory is discarded (the core's
    LoseMemory), its chunks copied from rank 0 and its optimizer's and scheduler's state
    taken from rank 0; the job goes on and ends bitwise the failure-free run."""
    res = job(tmp_path / "plant3", steps=8, nproc=3, script=TAIL, env={"PLANT_STEP": "4"})
    assert res.ok, explain(res)
    split = [(e["step"], e["groups"], e.get("repair")) for e in res.of("replicas_disagree")]
    assert split == [(5, [[0, 2], [1]], [[1, 0]])], split
    failures = [(f["rank"], f["kind"]) for f in res.of("failure")]
    assert failures == [(1, "diverged")], failures
    assert len(res.recoveries) == 1, res.recoveries
    assert res.recoveries[0].get("tier1_from_replicas", 0) > 0, res.recoveries[0]
    (done,) = res.of("training_done")
    assert done["replica_repairs"] == 1 and done["replica_checks"] == 7, done
    assert len(_params(res)) == 1, f"the replicas differ: {res.digests}"
    assert res.digests == ref3.digests, "not bitwise equal to the failure-free run"


def test_a_replica_whose_gradients_diverged_is_repaired_in_place(ref3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 scales its reduced gradients in step 5 (a clip on one rank): its prepare
    record is of those gradients, so the copy of rank 0's is checked against rank 0's
    record; bitwise the failure-free run (a new user's trial failed here: "gradients
    copied from rank 0 fail their checksums")."""
    res = job(tmp_path / "grad3", steps=8, nproc=3, script=TAIL, env={"PLANT_GRAD_STEP": "5"})
    assert res.ok, explain(res)
    split = [(e["step"], e.get("repair")) for e in res.of("replicas_disagree")]
    assert split == [(5, [[1, 0]])], split
    assert res.digests == ref3.digests, "not bitwise equal to the failure-free run"


def test_a_divergence_that_returns_after_its_repair_stops_the_job(tmp_path: Path) -> None:
    """Rank 1 scales its learning rate after every step from step 4: repaired once
    (after step 5), it differs again (after step 7: the repair's recovery resumed it at
    step 5, so its scaled rate first acts in step 7); the job stops in one line saying so."""
    env = {"PLANT_STEP": "4", "PLANT_ALL": "1"}
    res = job(tmp_path / "again", steps=8, nproc=3, script=TAIL, env=env)
    assert not res.ok, "a job whose replicas keep disagreeing ended as a success"
    split = [(e["step"], e.get("repair")) for e in res.of("replicas_disagree")]
    assert split == [(5, [[1, 0]]), (7, None)], split
    (failed,) = res.of("job_failed")
    line = failed["error"]
    assert "\n" not in line, line
    assert f"replicas disagree after step {split[1][0]} (rank 1 differs" in line, line
    assert "not repaired in place: rank 1 diverged again after its repair at step 5" in line, line


def test_with_tier1_as_parity_a_divergence_is_not_repaired(tmp_path: Path) -> None:
    """Parity encodes the diverged bytes: no copy of the majority's state lies beside
    rank 1, and the job stops, saying why."""
    env = {"PLANT_STEP": "4", "LETO_TIER1_CODE": "parity"}
    res = job(tmp_path / "parity", steps=8, nproc=3, script=TAIL, env=env)
    assert not res.ok, explain(res)
    (failed,) = res.of("job_failed")
    assert "not repaired in place: tier 1 keeps parity" in failed["error"], failed


def test_without_the_check_the_same_divergence_ends_with_split_replicas(tmp_path: Path) -> None:
    """The check is what catches it: off, the job exits 0 with two different models."""
    env = {"PLANT_STEP": "4", "LETO_REPLICA_CHECK": "0"}
    res = job(tmp_path / "unchecked", steps=8, script=TAIL, env=env)
    assert res.ok, explain(res)
    assert len(_params(res)) == 2, res.digests


def test_a_peer_death_inside_the_scripts_own_collective_is_one_recovery(
    ref, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 dies after optimizer.step(), before the script's own all_reduce, which rank
    0 is inside: that is the recovery's, not a second failure (rank 0 is not replaced)."""
    res = job(tmp_path / "coll", steps=8, script=TAIL, env={"KILL_AT": "step", "USER_COLL": "1"})
    assert res.ok, explain(res)
    failures = [(f["rank"], f["kind"]) for f in res.of("failure")]
    assert failures == [(1, "crash")], failures
    assert len(res.recoveries) == 1, res.recoveries
    assert res.digests == ref.digests, "not bitwise equal to the failure-free run"


def test_a_step_slower_than_the_hang_timeout_three_times_ends_the_job(tmp_path: Path) -> None:
    """A healthy rank whose forward outlasts --hang-timeout (3 s here) in every
    incarnation was replaced again and again (36 recoveries in 2 minutes, a new user's
    trial); the third time at the same step and phase the job ends in one line."""
    env = {"SLOW_STEP": "3", "SLOW_S": "4.5"}
    res = job(tmp_path / "slow", steps=5, script=TAIL, env=env, timeout=90)
    assert not res.ok
    assert [(f["kind"], f["rank"]) for f in res.of("failure")] == [("hang", 1)] * 3
    (failed,) = res.of("job_failed")
    assert failed["error"].startswith("rank 1 made no progress in forward of step 3"), failed
    assert "raise --hang-timeout" in failed["error"] and "\n" not in failed["error"]


def test_a_console_whose_reader_goes_away_does_not_end_the_job(tmp_path: Path) -> None:
    """`leto launch ... | head -2`: the agent's echo of the trainers' output met a broken
    pipe and the job ended as an internal error of the agent (a new user's trial); the
    job now goes on, exit 0, its logs whole."""
    import json
    import subprocess
    import sys

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "leto.cli", "launch", "--nproc-per-node", "2",
           "--run-dir", str(run), TAIL]  # fmt: skip
    env = {**__import__("os").environ, "STEPS": "8"}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert p.stdout is not None
    p.stdout.readline()  # the reader takes one line and goes away
    p.stdout.close()
    assert p.wait(timeout=120) == 0
    ends = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["status"] for e in ends if e["event"] == "job_end"] == ["ok"]
    assert sum(e["event"] == "step" for e in ends) == 8


def test_a_node_lost_after_a_snapshot_restores_the_closed_state_bitwise(tmp_path: Path) -> None:
    """A new user's trial: 2 nodes x 1 rank, node 1 lost after the tier-2 snapshot of
    step 10 (tier2_interval's default): the restore from that snapshot resumed with the
    scheduler one step behind on every rank (replicas agreeing, the job exiting 0) while
    the snapshot was taken inside ``optimizer.step()``, before the loop's tail stepped
    the scheduler; it is taken at the step boundary now."""
    ref2 = job(tmp_path / "ref2", nnodes=2, nproc=1, steps=13, script=TAIL)
    lose = [{"kind": "lose_node", "rank": 1, "step": 12, "phase": "forward"}]
    res = job(tmp_path / "lose", nnodes=2, nproc=1, steps=13, script=TAIL, faults=lose)
    assert res.ok and ref2.ok, explain(res)
    (rec,) = res.recoveries
    assert rec["kind"] == "tier2" and rec["resumed_at"] == 10, rec
    assert res.digests == ref2.digests, explain(res)  # the scheduler's state included
