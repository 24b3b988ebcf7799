"""Shared by the real-process tests: run a job of scripts/train.py, check it cleaned up
and that its event log replays through the core's model (``leto spec trace``)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from leto.backends.gloo.harness import JobResult, run_local
from leto.backends.gloo.procs import processes_with
from leto.spec.trace import InputError, check

HERE = Path(__file__).resolve().parent
TRAIN = str(HERE / "scripts" / "train.py")
# every point of a step of the user's own loop, for a SIGKILL each
LOOP_POINTS: list[dict[str, Any]] = [
    {"phase": "forward"},
    {"phase": "backward"},  # the first micro-batch's backward: between micro-batches
    {"phase": "allreduce"},
    {"phase": "prepare"},
    {"phase": "decide", "where": "before"},
    {"phase": "decide", "where": "after"},
    {"phase": "apply", "chunk": 1, "where": "mid_write"},
    {"phase": "parity", "chunk": 0},
    {"phase": "finish"},
    {"phase": "tail"},  # after optimizer.step() and the user's code after it, before the next batch
]
STEPS_2x2 = 10  # the steps of the 2 x 2 jobs compared with conftest's ref_2x2
STEPS_1x2 = 13  # the steps of the 1 x 2 jobs compared with conftest's ref_1x2


def job(
    run_dir: Path,
    *,
    nnodes: int = 1,
    nproc: int = 2,
    steps: int,
    faults: list[dict[str, Any]] | None = None,
    env: dict[str, str] | None = None,
    extra: list[str] | None = None,
    script: str = TRAIN,
    timeout: float = 150.0,
    respawn: bool = True,
    spares: int = 0,
    rdzv: list[str] | None = None,
    spare_agents: int = 0,
    late_spare: Callable[[Path], bool] | None = None,
) -> JobResult:
    e = {"TOPO": f"{nnodes}x{nproc}", "STEPS": str(steps), **(env or {})}
    res = run_local(
        script,
        nnodes=nnodes,
        nproc=nproc,
        run_dir=run_dir,
        faults=faults,
        env=e,
        extra=["--quiet", "--hang-timeout", "3", "--heartbeat", "0.25", *(extra or [])],
        timeout=timeout,
        respawn_lost_nodes=respawn,
        spares=spares,
        rdzv=rdzv,
        spare_agents=spare_agents,
        late_spare=late_spare,
    )
    assert not res.leftovers, f"processes left running after the job: {res.leftovers}"
    assert_trace(res.run_dir)
    return res


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def guard(tag: str, before: set[str]) -> None:
    """No process of ``tag`` left (waited for briefly, then killed, so one failure does
    not cascade) and no ``/dev/shm`` entry beyond ``before``; else the test fails."""
    deadline = time.monotonic() + 5.0
    left = processes_with(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = processes_with(tag)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    leaked = sorted(shm_entries() - before)
    assert not left, f"processes left running after the test: {left}"
    assert not leaked, f"/dev/shm entries leaked by the test: {leaked}"


def kills(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One SIGKILL per step from step 2, at each point in turn, of ranks 0 and 1 in turn."""
    return [{"kind": "crash", "rank": i % 2, "step": i + 2, **k} for i, k in enumerate(points)]


def params_of(res: JobResult, ranks: int = 2) -> list[str]:
    """The SHA-256 of each rank's model parameters a test script wrote at its end."""
    return [(res.run_dir / f"params-rank{r}").read_text() for r in range(ranks)]


def script_job(
    script: str,
    run_dir: Path,
    settings: str,
    args: list[str],
    faults: list[dict[str, Any]] | None = None,
    *,
    hang_timeout: float = 3.0,
    timeout: float = 240.0,
) -> JobResult:
    """A 1x2 gloo job of ``script`` with ``--config`` a file of these ``settings`` (TOML
    lines under ``[leto]``) and the script's ``args``; nothing may be left running."""
    cfg = run_dir.parent / f"{run_dir.name}.toml"
    cfg.write_text('[leto]\nbackend = "gloo"\ntopology = "1x2"\n' + settings)
    res = run_local(
        script,
        run_dir=run_dir,
        faults=faults,
        extra=["--quiet", "--hang-timeout", str(hang_timeout), "--heartbeat", "0.25"],
        script_args=["--config", str(cfg), *args],
        timeout=timeout,
    )
    assert not res.leftovers, res.leftovers
    return res


def assert_trace(run_dir: Path) -> None:
    """The run's event log replays through the core's model with no divergence (a job
    that stopped before training started has nothing to replay)."""
    try:
        report = check(run_dir)
    except InputError as e:
        log = run_dir / "events.jsonl"
        started = log.exists() and '"event":"training_started"' in log.read_text()
        assert not started, f"training started but the log has no trace: {e}"
        return
    assert report.ok, report.line()


def left_after(tag: str, seconds: float = 5.0) -> list[int]:
    """The processes of ``tag`` still running after up to ``seconds`` for them to go."""
    deadline = time.monotonic() + seconds
    while processes_with(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    return processes_with(tag)


def explain(res: JobResult) -> str:
    """What to print when a job did not do what a test expected."""
    logs = sorted((res.run_dir / "logs").glob("*.log")) if (res.run_dir / "logs").exists() else []
    tails = []
    for p in logs:
        text = p.read_text(errors="replace").strip()
        if text:
            tails.append(f"--- {p.name}\n{text[-1500:]}")
    out = "\n".join(res.text(n) for n in res.output)
    return f"codes {res.codes}, error {res.error}\n{out}\n" + "\n".join(tails)


def story(res: JobResult) -> str:
    """The job's failures and recoveries, a line each, in order: what a test that counts
    them prints when the count is not the one it expected."""
    lines = []
    for e in res.events:
        if e["event"] == "failure":
            keys = ("kind", "rank", "step", "phase", "detected_by")
            what = " ".join(f"{k}={e[k]}" for k in keys if e.get(k) is not None)
            lines.append(f"{e['t_rel']:8.3f} gen {e.get('generation')} failure {what}")
        elif e["event"] == "recovery_end":
            lines.append(
                f"{e['t_rel']:8.3f} gen {e.get('generation')} recovery {e.get('kind')} "
                f"-> {e.get('target')} ({e.get('reason')})"
            )
    return "\n" + "\n".join(lines)


def digests_equal(a: JobResult, b: JobResult) -> bool:
    return a.digests is not None and a.digests == b.digests


os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
