"""nvidia-resiliency-ext's in-process restart as a system of ``leto bench recovery``.

The job (:mod:`leto.bench.nvreworker`: how it is configured, and why a reserve
process per scheduled failure) is ``world`` active processes and the reserves, all
started here with ``RANK``/``WORLD_SIZE`` as torchrun would set them, and the two
``TCPStore`` s hosted here. Nothing is restarted from outside: after a death the
wrapper aborts the survivors' process group, restarts the wrapped function in each
surviving process with a reserve in the dead rank's place, and the function
rebuilds its process group and restores the state from a survivor.

A recovery's phases, on the critical path (the last process to get there; the
same names as :mod:`leto.bench.timeline`, :func:`nvre_breakdown`):

=================  ========================================================================
detection          every process of the next iteration has begun the wrapper's abort (its
                   monitor thread saw the interruption in the wrapper's store)
process_state      the in-process restart: abort, health check, the iteration barrier,
                   rank reassignment (the reserve activated), the wrapped function entered
communicator       ``init_process_group`` on gloo, DDP
model_state        model and optimizer broadcast from a survivor
lost_work          the first step after the restore (the step in flight, recomputed)
=================  ========================================================================

``total`` runs from the failure until every rank has completed that step.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .interval import failure_schedule, without_checkpoints
from .workload import BenchError, Workload

__all__ = ["MAX_RESERVES", "PACKAGE", "measure_nvre", "missing", "nvre_breakdown", "version"]

PACKAGE = "nvidia-resiliency-ext"
MAX_RESERVES = 8  # reserve processes a job may start: one per scheduled failure
_TIMEOUT_S = 300.0
_REPO = str(Path(__file__).resolve().parents[2])


def missing() -> str | None:
    """Why nvidia-resiliency-ext's in-process restart cannot run here (None: it can)."""
    try:
        import nvidia_resiliency_ext.inprocess  # noqa: F401
    except Exception as e:  # an ImportError, or a dependency missing
        first = (str(e).splitlines() or [""])[0]
        return (
            f"nvidia_resiliency_ext.inprocess is not importable ({type(e).__name__}: {first}); "
            f"pip install {PACKAGE}==0.4.1"
        )
    return None


def version() -> str:
    return importlib.metadata.version(PACKAGE)


def _first(events: list[dict[str, Any]], ev: str, it: int) -> dict[int, dict[str, Any]]:
    """Each process's first ``ev`` in restart iteration ``it``."""
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["ev"] == ev and e["it"] == it:
            out.setdefault(e["proc"], e)
    return out


def _last(events: list[dict[str, Any]], ev: str, it: int, procs: set[int]) -> float:
    got = _first(events, ev, it)
    if not procs <= set(got):
        raise ValueError(f"processes {sorted(procs - set(got))} never reported {ev!r} in {it}")
    return float(max(got[p]["t"] for p in procs))


def nvre_breakdown(events: list[dict[str, Any]], j: int, world: int) -> dict[str, Any]:
    """Recovery ``j`` (from the failure of restart iteration ``j``; module docstring)."""
    fails = [e for e in events if e["ev"] == "fail" and e["it"] == j]
    if len(fails) != 1:
        raise ValueError(f"{len(fails)} failures reported in restart iteration {j}")
    fe = fails[0]
    active = set(_first(events, "enter", j + 1))
    if len(active) != world:
        raise ValueError(f"{len(active)} processes trained in iteration {j + 1}, not {world}")
    aborts = {p: e for p, e in _first(events, "abort", j).items() if e["t"] >= fe["t"]}
    if not active <= set(aborts):
        raise ValueError(f"processes {sorted(active - set(aborts))} never aborted after {j}")
    t_detect = max(aborts[p]["t"] for p in active)
    t_enter = _last(events, "enter", j + 1, active)
    t_pg = _last(events, "pg", j + 1, active)
    t_loaded = _last(events, "loaded", j + 1, active)
    t_done = _last(events, "step", j + 1, active)
    before = set(_first(events, "enter", j))
    reserve = sorted(active - before)
    loaded = _first(events, "loaded", j + 1)
    out: dict[str, Any] = {
        "detection": t_detect - fe["t"],
        "process_state": t_enter - t_detect,
        "communicator": t_pg - t_enter,
        "model_state": t_loaded - t_pg,
        "lost_work": t_done - t_loaded,
        "total": t_done - fe["t"],
    }
    out["detail"] = {
        "failed_step": fe["step"],
        "failed_rank": fe.get("rank"),
        "restored_to": min(e["step"] for e in loaded.values()),
        "first_abort": min(aborts[p]["t"] for p in active) - fe["t"],
        "reserve": reserve,
        "reserve_rank": [_first(events, "enter", j + 1)[p]["rank"] for p in reserve],
    }
    return out


def _steady_step_s(events: list[dict[str, Any]], world: int) -> float:
    """The median gap between consecutive steps every rank of iteration 0 completed."""
    last: dict[int, list[float]] = {}
    for e in events:
        if e["ev"] == "step" and e["it"] == 0:
            last.setdefault(e["step"], []).append(e["t"])
    ts = [max(v) for s, v in sorted(last.items()) if len(v) == world]
    gaps = [b - a for a, b in zip(ts[1:], ts[2:], strict=False)]  # not the first step's
    if not gaps:
        raise BenchError("nvre: no steps to time in its calibration")
    return float(statistics.median(gaps))


def run_job(
    wl: Workload, schedule: list[dict[str, Any]], stop_step: int, *, timeout: float = _TIMEOUT_S
) -> list[dict[str, Any]]:
    """One nvre job through ``schedule`` until ``stop_step``: every process's events."""
    if len(schedule) > MAX_RESERVES:
        raise BenchError(
            f"nvre: {len(schedule)} failures need as many reserves, at most {MAX_RESERVES}"
        )
    import torch.distributed as dist

    stores = [
        dist.TCPStore(  # type: ignore[attr-defined] # (torch's stubs: c10d)
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True
        )
        for _ in range(2)
    ]
    n = wl.world + len(schedule)
    d = Path(tempfile.mkdtemp(prefix="leto-bench-nvre-"))
    spec = {
        "workload": wl.as_dict(),
        "schedule": schedule,
        "stop_step": stop_step,
        "app_port": stores[0].port,
        "wrapper_port": stores[1].port,
        "parent": os.getpid(),
    }
    env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(stores[0].port), WORLD_SIZE=str(n))
    procs = []
    for r in range(n):
        s = dict(spec, events=str(d / f"events-{r}.jsonl"))
        with open(d / f"r{r}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "leto.bench.nvreworker", json.dumps(s)],
                    env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=str(d),
                )
            )
    deadline = time.monotonic() + timeout
    codes: list[int | None] = [None] * n
    try:
        while any(c is None for c in codes) and time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0, -9) for c in codes) or codes.count(-9) > len(schedule):
                break  # a process failed: the others would wait for it until their timeouts
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes.count(-9) != len(schedule) or any(c != 0 for c in codes if c != -9):
        raise BenchError(
            f"nvre: exit codes {codes} for {len(schedule)} scheduled deaths (logs in {d})"
        )
    events: list[dict[str, Any]] = []
    for r in range(n):
        with open(d / f"events-{r}.jsonl", encoding="utf-8") as f:
            events += [json.loads(line) for line in f]
    events.sort(key=lambda e: e["t"])
    shutil.rmtree(d, ignore_errors=True)  # kept, with its logs, where the job failed
    return events


def measure_nvre(
    wl: Workload,
    *,
    repeats: int,
    schedule: list[dict[str, Any]] | None,
    gap_s: float,
    cal_steps: int,
    progress: Any = None,
    fail_at: str = "forward",
) -> dict[str, Any]:
    """nvre through the same failures (or its own schedule, from its step time, when
    no system before it set one)."""
    reason = missing()
    if reason is not None:
        raise BenchError(reason)
    if schedule is None:
        cal = run_job(wl, [], cal_steps + 5)
        step_s = _steady_step_s(cal, wl.world)
        schedule = failure_schedule(
            repeats, 1, step_s=step_s, world=wl.world, after_step=cal_steps, gap_s=gap_s, at=fail_at
        )
    events = run_job(wl, schedule, schedule[-1]["step"] + 2)
    runs = []
    for j in range(len(schedule)):
        try:
            runs.append(nvre_breakdown(events, j, wl.world))
        except ValueError as e:
            raise BenchError(f"nvre: recovery {j + 1}: {e}") from None
        if progress is not None:
            progress.advance(f"nvre recovery {j + 1}")
    backend = (
        f"{PACKAGE} {version()} inprocess.Wrapper, gloo, {wl.world} ranks"
        f" + {len(schedule)} reserve processes"
    )
    step_s = _steady_step_s(events, wl.world)
    return {**without_checkpoints(step_s, runs, schedule, backend), "version": version()}
