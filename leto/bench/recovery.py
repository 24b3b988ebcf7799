"""``leto bench recovery``: one recovery of each system, broken down, repeated.

Each system runs as a real job on the same workload, four processes on gloo over
127.0.0.1: the checkpoint/restart baselines under the benchmark's torchrun-style
agent (:class:`leto.bench.agent.Job`), torchft's replica groups under the same
agent with a lighthouse (:mod:`leto.bench.ftjob`: a death restarts its group only),
nvidia-resiliency-ext's in-process restart with a reserve process per failure
(:mod:`leto.bench.nvrejob`), leto under ``leto launch``
(:class:`leto.bench.gloojob.GlooJob`, two nodes of two ranks). A baseline job
first calibrates (a few steps, then three saves of its own kind, timed in place);
the checkpoint interval follows (:mod:`leto.bench.interval`), and so does the
failure schedule, which every later system gets unchanged: the scheduled rank
dies at the scheduled step (after its forward pass, or with ``--fail-at update`` at
the update: :mod:`leto.bench.interval`), the system recovers, and
training goes on to the next failure. Every recovery is broken down into the
phases of :mod:`leto.bench.timeline` (leto's from its coordinator's record,
:func:`leto.bench.gloojob.leto_breakdown`; torchft's from its restarted group's
stamps, :func:`leto.bench.ftjob.torchft_breakdown`; nvre's from its processes' stamps,
:func:`leto.bench.nvrejob.nvre_breakdown`); the figures are medians over
the repeats, and ``ratio_vs_best_baseline`` is the best other system's median total
over leto's (torchft counts as one).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from .agent import RESTART_SYSTEMS, Job
from .ftjob import measure_torchft
from .interval import (
    check_fail_at,
    checkpoint_interval_steps,
    failure_schedule,
    without_checkpoints,
)
from .nvrejob import measure_nvre
from .timeline import PHASES, restart_breakdown
from .workload import BenchError, Workload

__all__ = ["CAL_STEPS", "ORDER", "measure_leto", "measure_system", "run_recovery", "summarize"]

ORDER = ("ckpt-disk", "ckpt-disk-async", "gemini", "torchft", "nvre", "leto-serial", "leto")
# leto's job, the lost share of the step in flight computed by its replacement alone
# (parallel_replay = false): beside "leto" with --accum, the parallel replay's gain
LETO = ("leto", "leto-serial")
CAL_STEPS = 5
CAL_SAVES = 3
_TIMEOUT_S = 300.0


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per-phase medians and the median total of several breakdowns."""
    out = {p: _median([r[p] for r in runs]) for p in PHASES}
    out["total"] = _median([r["total"] for r in runs])
    return out


class _Plan:
    """The plans a job's generations read (calibration first, then the schedule)."""

    def __init__(self, schedule: list[dict[str, int]] | None) -> None:
        self.schedule = schedule
        self.interval = 1

    def __call__(self, gen: int) -> dict[str, Any]:
        if self.schedule is None:
            return {
                "calibrate": {"steps": CAL_STEPS, "saves": CAL_SAVES},
                "interval": 10**9,
                "stop_step": 10**9,
            }
        return {
            "interval": self.interval,
            "fail": self.schedule[gen] if gen < len(self.schedule) else None,
            "stop_step": self.schedule[-1]["step"],
        }


def _calibration(job: Job) -> dict[str, float]:
    cal = job.seen("calibrated")
    return {
        "step_s": _median([e["step_s"] for e in cal]),
        "save_s": max(e["save_s"] for e in cal),
        "write_s": max(e["write_s"] for e in cal),
    }


def measure_system(
    system: str,
    wl: Workload,
    *,
    mtbf_s: float,
    repeats: int,
    schedule: list[dict[str, Any]] | None,
    gap_s: float,
    progress: Any = None,
    fail_at: str = "forward",
) -> dict[str, Any]:
    """Run baseline ``system`` through ``repeats`` failures; its breakdowns and calibration.

    ``schedule`` None: derive it from this job's own checkpoint interval (the first
    system measured sets the schedule every other system then gets), its failures
    striking at ``fail_at`` (:mod:`leto.bench.interval`).
    """
    plan = _Plan(None)
    with Job(system, wl, plan_for=plan, max_failures=repeats + 3) as job:
        job.start()
        job.pump(lambda: len(job.seen("calibrated")) == wl.world, _TIMEOUT_S, "calibration")
        cal = _calibration(job)
        k = 1
        if system.startswith("ckpt-disk"):
            k = checkpoint_interval_steps(cal["save_s"], mtbf_s, cal["step_s"], cal["write_s"])
        if schedule is None:
            schedule = failure_schedule(
                repeats,
                k,
                step_s=cal["step_s"],
                world=wl.world,
                after_step=CAL_STEPS,
                gap_s=gap_s,
                at=fail_at,
            )
        plan.schedule, plan.interval = schedule, k
        job.set_plan("plan/0/run", plan(0))
        if progress is not None:
            progress.advance(f"{system} calibrated")
        for j in range(len(schedule)):

            def recovered(j: int = j) -> bool:
                return len(job.failures) > j and job.gen > j and job.recovered()

            job.pump(
                recovered,
                _TIMEOUT_S,
                f"recovery {j + 1}",
            )
            if progress is not None:
                progress.advance(f"{system} recovery {j + 1}")
        job.pump(lambda: job.finished, _TIMEOUT_S, "the end of the run")
        runs = [restart_breakdown(job.events, f, wl.world) for f in job.failures]
    return {
        "calibration": cal,
        "interval_steps": k if system.startswith("ckpt-disk") else None,
        "interval_s": k * cal["step_s"] if system.startswith("ckpt-disk") else None,
        "runs": runs,
        "schedule": schedule,
    }


def measure_leto(
    wl: Workload,
    *,
    repeats: int,
    schedule: list[dict[str, Any]] | None,
    gap_s: float,
    progress: Any = None,
    tier2: bool = True,
    fail_at: str = "forward",
    accum: int = 1,
    replay: bool = True,
) -> dict[str, Any]:
    """leto through ``leto launch``: the same failures, recovered in place (``tier2``:
    with its tier-2 snapshot, leto's default; ``accum``: each rank's share of a step in
    that many micro-batches, ``replay``: a lost share's micro-batches computed by every
    rank, leto.core.replay)."""
    job_kw: dict[str, Any] = {"tier2": tier2, "micro_batches": accum, "parallel_replay": replay}
    from .gloojob import GlooJob, leto_breakdown, step_time

    if schedule is None:  # no baseline ran: leto's own step time spaces the failures
        with GlooJob(wl, steps=CAL_STEPS + 5, **job_kw) as cal_job:
            cal_job.start()
            cal_job.wait(lambda: bool(cal_job.seen("job_end")), _TIMEOUT_S, "calibration")
            step_s = step_time(cal_job.events, 2)
        schedule = failure_schedule(
            repeats,
            1,
            step_s=step_s,
            world=wl.world,
            after_step=CAL_STEPS,
            gap_s=gap_s,
            at=fail_at,
        )
    last = schedule[-1]["step"]
    with GlooJob(wl, steps=last, failures=schedule, **job_kw) as job:
        job.start()
        for j in range(len(schedule)):
            job.wait(lambda j=j: len(job.seen("recovery_end")) > j, _TIMEOUT_S, f"recovery {j + 1}")
            if progress is not None:
                progress.advance(f"leto recovery {j + 1}")
        job.wait(lambda: bool(job.seen("job_end")), _TIMEOUT_S, "the end of the run")
        stamps = job.stamps()
        if len(stamps) != len(schedule):
            raise BenchError(
                f"leto: {len(stamps)} failure stamps for {len(schedule)} scheduled failures "
                f"(in {job.run_dir})"
            )
        runs = [leto_breakdown(job.events, st) for st in stamps]
        step_s = step_time(job.events, 2, schedule[0]["step"] - 1)
    backend = f"leto launch, gloo, {job.nodes} nodes x {wl.world // job.nodes} ranks"
    return {
        **without_checkpoints(step_s, runs, schedule, backend),
        "tier2": tier2,
        "accum": accum,
        "parallel_replay": replay,
    }


def run_recovery(
    systems: Sequence[str],
    wl: Workload,
    *,
    mtbf_s: float,
    repeats: int,
    gap_s: float = 10.0,
    progress: bool = True,
    tier2: bool = True,
    fail_at: str = "forward",
    accum: int = 1,
) -> dict[str, Any]:
    """The recovery benchmark's result (the JSON of ``leto bench recovery``); ``tier2``:
    leto's job keeps its tier-2 snapshot; ``fail_at``: where in its step a rank dies
    (:mod:`leto.bench.interval`); ``accum``: leto's steps in that many micro-batches."""
    check_fail_at(fail_at)  # before any job starts (the schedule comes after a calibration)
    from leto.sim.sweep import Progress

    ordered = [s for s in ORDER if s in systems]
    steps = len(ordered) * (repeats + 1)
    bar = Progress(steps, f"recovery {wl.label}") if progress else None
    start = time.monotonic()
    schedule: list[dict[str, Any]] | None = None
    out: dict[str, Any] = {}
    for system in ordered:
        common: dict[str, Any] = {
            "repeats": repeats,
            "schedule": schedule,
            "gap_s": gap_s,
            "progress": bar,
            "fail_at": fail_at,
        }
        if system in LETO:
            res = measure_leto(wl, tier2=tier2, accum=accum, replay=system == "leto", **common)
        elif system == "torchft":
            res = measure_torchft(wl, cal_steps=CAL_STEPS, **common)
        elif system == "nvre":
            res = measure_nvre(wl, cal_steps=CAL_STEPS, **common)
        else:
            res = measure_system(system, wl, mtbf_s=mtbf_s, **common)
        if system in (*LETO, "torchft", "nvre") and bar is not None:
            bar.advance(f"{system} done")
        schedule = res["schedule"]
        res["phases"] = summarize(res["runs"])
        res["total_s"] = res["phases"]["total"]
        out[system] = res
    baselines = {s: out[s]["total_s"] for s in out if s not in LETO}
    result: dict[str, Any] = {
        "benchmark": "recovery",
        "workload": {**wl.as_dict(), "params": wl.params, "label": wl.label},
        "mtbf_s": mtbf_s,
        "repeats": repeats,
        "fail_at": fail_at,
        "accum": accum,
        "schedule": schedule,
        "systems": out,
        "elapsed_s": time.monotonic() - start,
    }
    if baselines:
        best = min(baselines, key=lambda s: baselines[s])
        result["best_baseline"] = best
        if "leto" in out:
            result["ratio_vs_best_baseline"] = baselines[best] / out["leto"]["total_s"]
    result["phases"] = sim_phases(out)
    return result


def sim_phases(systems: dict[str, Any]) -> dict[str, float]:
    """Phase costs in the form ``leto simulate --bench`` reads (``docs/simulate.md``)."""
    out: dict[str, float] = {}
    restart = [s for s in systems if s in RESTART_SYSTEMS]
    if restart:
        out["restart_s"] = _median(
            [r["process_state"] + r["communicator"] for s in restart for r in systems[s]["runs"]]
        )
        out["detect_s"] = _median([r["detection"] for s in restart for r in systems[s]["runs"]])
    if "ckpt-disk" in systems:
        out["ckpt_fixed_s"] = systems["ckpt-disk"]["calibration"]["save_s"]
    if "leto" in systems:
        ph = systems["leto"]["phases"]
        out["detect_s"] = ph["detection"]
        out["promote_s"] = ph["process_state"] + ph["model_state"]
        out["rebuild_comm_s"] = ph["communicator"]
    return out


def run_scaling(
    systems: Sequence[str],
    workloads: Sequence[Workload],
    *,
    mtbf_s: float,
    repeats: int,
    gap_s: float = 10.0,
    progress: bool = True,
    tier2: bool = True,
    fail_at: str = "forward",
    accum: int = 1,
) -> dict[str, Any]:
    """The recovery benchmark at several model sizes (``leto bench scaling``)."""
    start = time.monotonic()
    results = [
        run_recovery(
            systems,
            wl,
            mtbf_s=mtbf_s,
            repeats=repeats,
            gap_s=gap_s,
            progress=progress,
            tier2=tier2,
            fail_at=fail_at,
            accum=accum,
        )
        for wl in workloads
    ]
    totals: dict[str, list[float]] = {}
    for name in results[0]["systems"]:
        totals[name] = [r["systems"][name]["total_s"] for r in results]
    return summarize_scaling(
        {
            "benchmark": "scaling",
            "sizes": [wl.label for wl in workloads],
            "params": [wl.params for wl in workloads],
            "state_bytes_per_rank": [wl.state_bytes for wl in workloads],
            "totals": totals,
            "growth": {n: t[-1] / t[0] for n, t in totals.items()},
            "ratio_vs_best_baseline": [r.get("ratio_vs_best_baseline") for r in results],
            "leto_tier2": tier2,
            "fail_at": fail_at,
            "accum": accum,
            "results": results,
            "elapsed_s": time.monotonic() - start,
        }
    )


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    if den == 0:
        raise BenchError("scaling needs at least two different model sizes")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def _resume(system: dict[str, Any]) -> float:
    """A system's resume at one size: the median of its recoveries' (total - lost work)."""
    runs = system.get("runs")
    if runs:
        return float(statistics.median(r["total"] - r["lost_work"] for r in runs))
    return float(system["phases"]["total"] - system["phases"]["lost_work"])


def summarize_scaling(res: dict[str, Any]) -> dict[str, Any]:
    """Add how each system's recovery grows with the state to a scaling result.

    A recovery's total (failure -> the step in flight completed) is split, per size,
    into *resume* (detect + process + model + comm: the time until training runs
    again; the median over the recoveries of each one's total minus its lost work, not
    the difference of two medians, which may come from different recoveries) and *lost
    work* (recomputing what the failure lost, at least the step in flight, whose cost
    grows with the model for every system). For each series:
    the seconds added from the smallest size to the largest (``added_s``) and the
    least-squares slope in seconds per GiB of state per rank (``slope_s_per_gib``).
    ``leto_slope_vs_disk``: leto's total slope over ``ckpt-disk``'s (below 1: leto's
    recovery grows slower).
    """
    gib = [b / 2**30 for b in res["state_bytes_per_rank"]]
    names = list(res["totals"])
    series: dict[str, dict[str, list[float]]] = {"total": res["totals"]}
    series["resume"] = {n: [_resume(r["systems"][n]) for r in res["results"]] for n in names}
    series["lost_work"] = {
        n: [r["systems"][n]["phases"]["lost_work"] for r in res["results"]] for n in names
    }
    res["resume"] = series["resume"]
    res["lost_work"] = series["lost_work"]
    res["added_s"] = {k: {n: v[-1] - v[0] for n, v in s.items()} for k, s in series.items()}
    res["slope_s_per_gib"] = {
        k: {n: _slope(gib, v) for n, v in s.items()} for k, s in series.items()
    }
    slopes = res["slope_s_per_gib"]["total"]
    if "leto" in slopes and "ckpt-disk" in slopes and slopes["ckpt-disk"] > 0:
        res["leto_slope_vs_disk"] = slopes["leto"] / slopes["ckpt-disk"]
    return res
