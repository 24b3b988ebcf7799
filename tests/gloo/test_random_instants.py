"""Issue 39: kills at random instants, not only at named points. CI's short version of
``python tests/gloo/random_instants.py`` (docs/loop.md, "Kills at random instants"):
SIGKILLs and SIGSTOPs of the trainers of a full user loop at uniformly random instants,
each run bitwise its failure-free run; and the harness's check catches a wrong run."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import random_instants as ri
import torch
from jobs import HERE, explain, job

SEEDS = (1, 2, 3)  # 2 signals each; their kinds: stop+kill, stop+stop, kill+kill
KILLS = 2


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> ri.Reference:
    ref = ri.reference(tmp_path_factory.mktemp("random") / "ref")
    steps = ref.res.of("step")
    took = steps[-1]["t_rel"] - steps[0]["t_rel"]
    assert took > 1.0, f"training lasted {took:.2f} s: too short for random instants"
    assert len(ref.ckpts) == ri.STEPS // 3, sorted(ref.ckpts)
    return ref


@pytest.fixture(scope="module")
def runs(ref: ri.Reference, tmp_path_factory: pytest.TempPathFactory) -> list[ri.Run]:
    base = tmp_path_factory.mktemp("random-runs")
    return [ri.random_run(base / f"seed{s}", ref, KILLS, s) for s in SEEDS]


def test_signals_at_random_instants_end_bitwise(runs: list[ri.Run]) -> None:
    for run in runs:
        assert not run.problems, ri.report(run)
        if run.signals:
            assert run.res.recoveries, ri.report(run)
    sigs = [s.sig for r in runs for s in r.signals]
    assert len(sigs) == len(SEEDS) * KILLS, [ri.line(i, r) for i, r in enumerate(runs)]
    assert sigs.count("SIGKILL") == 3 and sigs.count("SIGSTOP") == 3, sigs


# the check itself: each doctored run must be reported


def _doctor(res: Any, **digests: Any) -> Any:
    """``res`` with its training_done digests changed (rank -> {key: value})."""
    events = []
    for e in res.events:
        if e["event"] == "training_done":
            d = {r: dict(v) for r, v in e["digests"].items()}
            for r, change in digests.items():
                d[r].update(change)
            e = {**e, "digests": d}
        events.append(e)
    return dataclasses.replace(res, events=events)


def _check(run: ri.Run, ref: ri.Reference, res: Any = None, signals: Any = None) -> list[str]:
    ckpts = ri.load_ckpts(run.res.run_dir)
    sig = run.signals if signals is None else signals
    return ri.verdict(res or run.res, sig, ref, ckpts)


def _with_signals(runs: list[ri.Run]) -> ri.Run:
    run = next((r for r in runs if r.signals), None)
    assert run is not None, "no run delivered a signal"
    return run


def test_the_check_passes_the_runs_as_they_are(runs: list[ri.Run], ref: ri.Reference) -> None:
    run = _with_signals(runs)
    assert _check(run, ref) == []


def test_the_check_catches_replicas_that_differ(runs: list[ri.Run], ref: ri.Reference) -> None:
    run = _with_signals(runs)
    probs = _check(run, ref, res=_doctor(run.res, **{"1": {"param": "0" * 64}}))
    assert any("the replicas differ" in p for p in probs), probs
    assert any("not bitwise" in p for p in probs), probs


def test_the_check_catches_a_result_not_bitwise(runs: list[ri.Run], ref: ri.Reference) -> None:
    """Both replicas alike, but not the failure-free run's optimizer state."""
    run = _with_signals(runs)
    wrong = {"state.exp_avg": "0" * 64}
    probs = _check(run, ref, res=_doctor(run.res, **{"0": wrong, "1": wrong}))
    assert probs == ["not bitwise the failure-free run (ranks ['0', '1'] differ)"], probs


def test_the_check_catches_a_failed_or_stalled_job_and_leftovers(
    runs: list[ri.Run], ref: ri.Reference
) -> None:
    run = _with_signals(runs)
    res = dataclasses.replace(run.res, codes={0: [1]}, leftovers=[12345])
    probs = _check(run, ref, res=res)
    assert any("the job failed" in p for p in probs), probs
    assert any("left running" in p for p in probs), probs
    res = dataclasses.replace(run.res, codes={0: [-signal.SIGKILL]})  # run_local's deadline
    probs = _check(run, ref, res=res)
    assert any("the job did not end" in p for p in probs), probs


def test_the_check_catches_a_signal_with_no_failure(runs: list[ri.Run], ref: ri.Reference) -> None:
    run = _with_signals(runs)
    s = run.signals[0]
    other = "SIGSTOP" if s.sig == "SIGKILL" else "SIGKILL"
    lost = dataclasses.replace(s, pid=s.pid + 1_000_000)
    probs = _check(run, ref, signals=[lost])
    assert probs == [f"{lost.line()}: no failure of that process in the event log"], probs
    wrong = dataclasses.replace(s, sig=other)
    probs = _check(run, ref, signals=[wrong])
    assert len(probs) == 1 and "logged as a" in probs[0], probs


def test_the_check_catches_a_users_checkpoint_that_differs(
    runs: list[ri.Run], ref: ri.Reference
) -> None:
    run = _with_signals(runs)
    ckpts = ri.load_ckpts(run.res.run_dir)
    name = sorted(ckpts)[-1]
    w = ckpts[name]["model"]["0.weight"]
    w.view(-1).view(torch.int32)[0] ^= 1  # one bit of one weight
    probs = ri.verdict(run.res, run.signals, ref, ckpts)
    assert probs == [f"user-ckpt/{name} differs from the failure-free run's"], probs


def test_the_check_catches_a_real_job_whose_replicas_split(tmp_path: Path) -> None:
    """A real job that exits 0 with two different models (tail.py's planted divergence,
    leto's replica check off) is reported."""
    env = {"PLANT_STEP": "4", "LETO_REPLICA_CHECK": "0"}
    res = job(tmp_path / "split", steps=8, script=str(HERE / "scripts" / "tail.py"), env=env)
    assert res.ok, explain(res)
    probs = ri.verdict(res, [], None, None)
    assert len(probs) == 1 and "the replicas differ" in probs[0], probs


def test_the_signalled_process_is_the_ranks_live_running_trainer(tmp_path: Path) -> None:
    """The newest pid file of a rank whose process is alive and this run's (its command
    line names the run directory, as a trainer's does); one stopped, or signalled before
    (a SIGKILLed process looks alive while it exits), is not signalled."""
    run_dir = tmp_path / "r"
    pids = run_dir / "pids"
    pids.mkdir(parents=True)
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(run_dir)])
    try:
        (pids / f"rank0.{p.pid}").touch()
        (pids / "rank0.4194303").touch()  # newer, but no such process (pid_max's)
        (pids / f"rank1.{os.getpid()}").touch()  # alive, but not this run's
        assert ri.live_trainer(run_dir, 1) is None
        live = ri.live_trainer(run_dir, 0)
        assert live is not None and live[0] == p.pid, live
        assert ri.ready(run_dir) == [(0, p.pid)]
        assert ri.ready(run_dir, {p.pid}) == [], "a trainer signalled before (exiting)"
        p.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while ri.ready(run_dir) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ri.ready(run_dir) == [], "a stopped trainer would be signalled again"
        assert ri.live_trainer(run_dir, 0) == (p.pid, "T")
        p.kill()
        p.wait()
        assert ri.live_trainer(run_dir, 0) is None
    finally:
        p.kill()
        p.wait()
