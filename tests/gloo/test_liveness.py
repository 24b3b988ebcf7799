"""Every job ends (issue 25): a recovery resumes, or the job exits 1 with one line, within
``--recovery-timeout`` on every path (warm shadow, a shadow that cannot be built, cold
start, ``--no-shadows``, a replacement that never comes); RNN models get warm shadows;
a job of zero steps ends; nothing ``leto demo`` started outlives it.

``scripts/rnn.py`` is an LSTM + GRU model; its ``SHADOW`` variable makes trouble for
the shadows (see its docstring).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from jobs import HERE, TRAIN, digests_equal, explain, job

from leto.backends.gloo.harness import JobResult
from leto.backends.gloo.procs import processes_with

RNN = str(HERE / "scripts" / "rnn.py")
STEPS = 8
TIMEOUT = 8.0  # the --recovery-timeout of these jobs
CRASH = [{"kind": "crash", "rank": 1, "step": 3, "phase": "backward"}]


def rnn_job(
    run_dir: Path, *, faults: list[dict[str, Any]] = CRASH, shadow: str = "", extra: list[str] = ()
) -> JobResult:
    return job(
        run_dir,
        steps=STEPS,
        script=RNN,
        faults=faults,
        env={"SHADOW": shadow},
        extra=["--recovery-timeout", f"{TIMEOUT:g}", *extra],
        timeout=60,
    )


def t_of(res: JobResult, event: str) -> float:
    return float(next(e["t_rel"] for e in res.events if e["event"] == event))


def failed_lines(res: JobResult) -> list[str]:
    return [x for x in res.text(0).splitlines() if "job failed:" in x]


@pytest.fixture(scope="module")
def rnn_ref(session_dir: Path) -> JobResult:
    res = job(session_dir / "rnn-ref", steps=STEPS, script=RNN)
    assert res.ok and res.digests, explain(res)
    return res


def test_rnn_model_gets_warm_shadows_and_recovers_bitwise(tag: str, rnn_ref: JobResult) -> None:
    faults = [
        *CRASH,
        {"kind": "crash", "rank": 0, "step": 5, "phase": "apply", "chunk": 1, "where": "mid_write"},
    ]
    res = rnn_job(Path(tag) / "run", faults=faults)
    assert res.ok, explain(res)
    assert digests_equal(res, rnn_ref)
    # LSTM/GRU parameters have weak references: their shadows are built all the same
    states = [s["state"] for s in res.of("shadow")]
    assert states and set(states) == {"warm"}, res.of("shadow")
    assert [p["warm"] for p in res.of("promoted")] == [True, True]
    assert len(res.recoveries) == 2
    assert not res.of("degraded")


def test_a_shadow_that_cannot_be_built_is_reported_and_a_cold_start_recovers(
    tag: str, rnn_ref: JobResult
) -> None:
    res = rnn_job(Path(tag) / "run", shadow="skeleton")
    assert res.ok, explain(res)
    assert digests_equal(res, rnn_ref)
    # on the console at once (before the failure), one line per rank, --quiet or not
    warned = [x for x in res.text(0).splitlines() if "could not be built" in x]
    assert len(warned) == 2, res.text(0)
    assert all("Cannot swap t1" in x and "degraded" in x for x in warned)
    assert sorted(d["rank"] for d in res.of("degraded")) == [0, 1]
    assert t_of(res, "degraded") < t_of(res, "failure")
    assert [p["warm"] for p in res.of("promoted")] == [False]
    assert res.recoveries[0]["seconds"] < TIMEOUT
    assert res.of("training_done")[0]["degraded"] == [0, 1]


def test_no_shadows_recovers_by_a_cold_start(tag: str, rnn_ref: JobResult) -> None:
    res = rnn_job(Path(tag) / "run", extra=["--no-shadows"])
    assert res.ok, explain(res)
    assert digests_equal(res, rnn_ref)
    assert [p["warm"] for p in res.of("promoted")] == [False]
    assert res.recoveries[0]["seconds"] < TIMEOUT


def test_a_replacement_that_never_comes_fails_within_the_recovery_timeout(tag: str) -> None:
    res = rnn_job(Path(tag) / "run", shadow="hang")
    assert res.codes[0] == [1], explain(res)
    assert res.error is not None and "\n" not in res.error
    assert f"did not end within {TIMEOUT:g} s" in res.error, res.error
    assert "shadow of rank(s) [1]" in res.error, res.error
    waited = t_of(res, "job_failed") - t_of(res, "failure")
    assert TIMEOUT <= waited < TIMEOUT + 2, waited
    assert len(failed_lines(res)) == 1, res.text(0)


def test_a_replacement_that_cannot_start_fails_in_one_line(tag: str) -> None:
    res = rnn_job(Path(tag) / "run", shadow="crash")
    assert res.codes[0] == [1], explain(res)
    assert res.error is not None and "\n" not in res.error
    assert res.error.startswith("rank 1: cannot start a replacement process"), res.error
    assert "RuntimeError: this script cannot run as a shadow" in res.error
    assert t_of(res, "job_failed") - t_of(res, "failure") < TIMEOUT
    assert len(failed_lines(res)) == 1, res.text(0)


def test_a_script_of_zero_steps_ends_with_two_ranks(tag: str) -> None:
    # a rank done before every rank was ready: its `done` is kept until training starts
    res = job(Path(tag) / "run", steps=0, script=TRAIN, timeout=60)
    assert res.ok, explain(res)
    assert res.of("training_done")[0]["step"] == 0
    assert res.seconds < 30


def test_sigkill_of_leto_demo_leaves_nothing_behind(tag: str) -> None:
    """``leto demo`` runs one ``leto launch`` per node: SIGKILLed, it takes them with it
    (they die with their starter), and their keepers, zygotes, trainers and shadows with
    them (the ``tag`` fixture checks no process and no /dev/shm entry is left)."""
    env = {**os.environ, "TMPDIR": tag}  # the demo's run directories, so its processes' tag
    p = subprocess.Popen(
        [sys.executable, "-m", "leto.cli", "demo", "--no-faults", "--steps", "100000"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 90
    started = False
    while time.monotonic() < deadline and not started and p.poll() is None:
        time.sleep(0.2)
        logs = Path(tag).glob("leto-gloo-demo-*/*/events.jsonl")
        started = any('"event":"step"' in log.read_text() for log in logs)
    assert started, "the demo's training did not start"
    procs = processes_with(tag)
    assert len(procs) >= 16  # 2 agents, each with 2 keepers, a zygote, 2 trainers, 2 shadows
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.monotonic() + 5
    while processes_with(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(tag) == []


def test_the_same_exception_of_the_script_three_times_ends_the_job(tag: str) -> None:
    # rank 1's step_fn raises at step 3 in every incarnation: recovering cannot help;
    # the third time, the core's GiveUp ends the recovery and the job, in one line, and
    # --max-restarts does not restart it (leto.core.restart: a restart would repeat it)
    env = {"RAISE_AT": "3", "CKPT": str(Path(tag) / "ckpt")}
    res = job(Path(tag) / "run", steps=5, env=env, extra=["--max-restarts", "1"], timeout=90)
    assert not res.ok and res.of("job_restart") == [], res.of("job_restart")
    fails = res.of("failure")
    assert [(f["kind"], f["rank"]) for f in fails] == [("exception", 1)] * 3, fails
    assert len(res.recoveries) == 2, res.recoveries
    (failed,) = res.of("job_failed")
    assert failed["error"].startswith("rank 1 raised the same exception at step 3 3 times"), failed
    assert "TypeError: step_fn() got an unexpected keyword argument 'bad'" in failed["error"]
    # the core's GiveUp ended the recovery just begun (its JobFailed names the phase)
    assert failed.get("phase") not in (None, "running"), failed
    assert res.error is not None and "\n" not in res.error
