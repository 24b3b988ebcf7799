"""``leto bench recovery``: one recovery of each system, broken down, repeated.

Each system runs as a real job (:class:`leto.bench.agent.Job`: one process per
rank, gloo over 127.0.0.1) on the same workload. The job first calibrates (a few
steps, then three saves of its own kind, timed in place); the agent derives the
checkpoint interval (:mod:`leto.bench.interval`) and the failure schedule, and
the job trains on: the scheduled rank dies at the scheduled step, the system
recovers, and training goes on to the next failure. Every recovery is broken
down by :mod:`leto.bench.timeline`; the figures are medians over the repeats.

leto's figure is measured in two parts until leto's gloo backend can run a job:

* in real processes (the harness: :mod:`leto.bench.worker`, ``system="leto"``):
  detection, promotion of a warm shadow that attaches to the rank's retained
  state (leto's retained layer in a memfd), the new gloo group, the step in flight;
* in leto's engine on the fake backend (:mod:`leto.bench.inprocess`), the
  state-side work of the same failure with every tier on: the integrity scan,
  the reconcile (roll back or forward, parity repair) and re-encoding tier-1
  parity and the tier-2 snapshot. Every rank's share runs one after another in
  one process, so this is an upper bound of the parallel work.

The headline ``leto`` breakdown takes ``model_state`` from the engine and the
other phases from the harness; ``leto.harness`` keeps the harness's own figures
(its ``model_state`` is the per-process checksum check and roll back).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from .agent import RESTART_SYSTEMS, Job
from .interval import checkpoint_interval_steps, failure_schedule
from .timeline import PHASES, leto_breakdown, restart_breakdown
from .workload import BenchError, Workload

__all__ = ["CAL_STEPS", "ORDER", "measure_system", "run_recovery", "summarize"]

ORDER = ("ckpt-disk", "ckpt-disk-async", "gemini", "leto")
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
    schedule: list[dict[str, int]] | None,
    gap_s: float,
    progress: Any = None,
) -> dict[str, Any]:
    """Run ``system`` through ``repeats`` failures; its breakdowns and calibration.

    ``schedule`` None: derive it from this job's own checkpoint interval (the first
    system measured sets the schedule every other system then gets).
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
            )
        plan.schedule, plan.interval = schedule, k
        job.set_plan("plan/0/run", plan(0))
        if progress is not None:
            progress.advance(f"{system} calibrated")
        for j in range(len(schedule)):
            job.pump(
                lambda j=j: len(job.failures) > j and job.gen > j and job.recovered(),
                _TIMEOUT_S,
                f"recovery {j + 1}",
            )
            if progress is not None:
                progress.advance(f"{system} recovery {j + 1}")
        job.pump(lambda: job.finished, _TIMEOUT_S, "the end of the run")
        pick = leto_breakdown if system == "leto" else restart_breakdown
        runs = [pick(job.events, f, wl.world) for f in job.failures]
    return {
        "calibration": cal,
        "interval_steps": k if system.startswith("ckpt-disk") else None,
        "interval_s": k * cal["step_s"] if system.startswith("ckpt-disk") else None,
        "runs": runs,
        "schedule": schedule,
    }


def _engine_model_state(wl: Workload, repeats: int, progress: Any = None) -> dict[str, Any]:
    """The engine's state-side work for the same failure (see the module docstring)."""
    from .inprocess import build_engine, engine_recovery

    eng = build_engine(wl)
    for _ in range(2):
        eng.run_step()
    runs = []
    for j in range(repeats):
        runs.append(engine_recovery(eng, "forward", rank=(j + 1) % wl.world))
        eng.run_step()
        if progress is not None:
            progress.advance(f"leto engine {j + 1}")
    return {
        "model_state_s": _median([r["model_state_s"] for r in runs]),
        "runs": runs,
        "topology": f"{eng.backend.topology.nodes}x{eng.backend.topology.node_sizes[0]}",
    }


def run_recovery(
    systems: Sequence[str],
    wl: Workload,
    *,
    mtbf_s: float,
    repeats: int,
    gap_s: float = 10.0,
    progress: bool = True,
) -> dict[str, Any]:
    """The recovery benchmark's result (the JSON of ``leto bench recovery``)."""
    from leto.sim.sweep import Progress

    ordered = [s for s in ORDER if s in systems]
    steps = len(ordered) * (repeats + 1) + (repeats if "leto" in ordered else 0)
    bar = Progress(steps, f"recovery {wl.label}") if progress else None
    start = time.monotonic()
    schedule: list[dict[str, int]] | None = None
    out: dict[str, Any] = {}
    for system in ordered:
        res = measure_system(
            system, wl, mtbf_s=mtbf_s, repeats=repeats, schedule=schedule, gap_s=gap_s, progress=bar
        )
        schedule = res["schedule"]
        if system == "leto":
            engine = _engine_model_state(wl, repeats, bar)
            harness = res["runs"]
            composite = []
            for h, e in zip(harness, engine["runs"], strict=False):
                c = {p: h[p] for p in PHASES}
                c["model_state"] = e["model_state_s"]
                c["total"] = sum(c[p] for p in PHASES)
                composite.append(c)
            res["harness"] = summarize(harness)
            res["engine"] = engine
            res["runs"] = composite
            res["measured"] = LETO_MEASURED
        res["phases"] = summarize(res["runs"])
        res["total_s"] = res["phases"]["total"]
        out[system] = res
    baselines = {s: out[s]["total_s"] for s in out if s != "leto"}
    result: dict[str, Any] = {
        "benchmark": "recovery",
        "workload": {**wl.as_dict(), "params": wl.params, "label": wl.label},
        "mtbf_s": mtbf_s,
        "repeats": repeats,
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


LETO_MEASURED = {
    "detection": "real processes: the agent's pidfd sees the trainer die",
    "process_state": "real processes: a warm shadow (torch imported, model on the meta device) "
    "attaches to the dead rank's retained layout in its memfd and loads its process state",
    "model_state": "leto's engine on the fake backend, every tier on (2x2 simulated ranks, "
    "one process, serial): integrity scan, reconcile, tier-1 parity and tier-2 snapshot "
    "re-encoded; the harness's own per-process check is in 'harness'",
    "communicator": "real processes: survivors and the promoted shadow form a new gloo "
    "process group (same processes, new generation)",
    "lost_work": "real processes: the step in flight, recomputed",
    "not_measured": "leto's own gloo backend (keeper processes, fencing, the coordinator's "
    "COMMIT records, tier-1/2 redundancy kept across processes) is not built yet; the harness "
    "stands in for it and the engine supplies the state-side work",
}


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


def check_systems(names: Sequence[str]) -> list[str]:
    bad = [n for n in names if n not in ORDER]
    if bad:
        raise BenchError(f"unknown system {bad[0]!r} (choose from {', '.join(ORDER)})")
    if not names:
        raise BenchError("no system to run")
    return list(names)


def run_scaling(
    systems: Sequence[str],
    workloads: Sequence[Workload],
    *,
    mtbf_s: float,
    repeats: int,
    gap_s: float = 10.0,
    progress: bool = True,
) -> dict[str, Any]:
    """The recovery benchmark at several model sizes (``leto bench scaling``)."""
    start = time.monotonic()
    results = [
        run_recovery(systems, wl, mtbf_s=mtbf_s, repeats=repeats, gap_s=gap_s, progress=progress)
        for wl in workloads
    ]
    totals: dict[str, list[float]] = {}
    for name in results[0]["systems"]:
        totals[name] = [r["systems"][name]["total_s"] for r in results]
        if name == "leto":
            totals["leto-harness"] = [r["systems"]["leto"]["harness"]["total"] for r in results]
    return {
        "benchmark": "scaling",
        "sizes": [wl.label for wl in workloads],
        "params": [wl.params for wl in workloads],
        "state_bytes_per_rank": [wl.state_bytes for wl in workloads],
        "totals": totals,
        "growth": {n: t[-1] / t[0] for n, t in totals.items()},
        "ratio_vs_best_baseline": [r.get("ratio_vs_best_baseline") for r in results],
        "results": results,
        "elapsed_s": time.monotonic() - start,
    }
