"""``leto bench goodput``: productive training time in a fixed wall-clock budget.

Every system trains the same workload as a real job for ``budget_s`` seconds of
wall clock, counted from the moment training proper starts (after start-up and
the first steps, the same for all), while failures strike on one schedule:
Poisson arrivals at the given MTBF, each on a random rank (seeded, so every system
gets the same times and ranks). A failure kills the rank's trainer at its next
failure point (after a forward pass), one at a time: a failure that falls due
while an earlier one is being recovered strikes once training runs again. The
baselines get it as ``SIGUSR1`` from their agent (:mod:`leto.bench.agent`); leto's
trainers, under ``leto launch``, read the schedule themselves
(:mod:`leto.bench.letojob`).

The checkpointing baselines checkpoint at the Young/Daly interval for the MTBF and
the save cost they measure in the job; ``gemini`` snapshots every step; ``leto``
runs with every tier on; ``torchft`` (:mod:`leto.bench.ftjob`: one replica group per
rank, the lighthouse as torchft's README sets it) gets each failure as ``SIGUSR1``
too, its dead group restarted and healed from a live peer while the other groups
train on.

ETTR = productive time / budget, where productive time is the training progress
at the end of the budget (steps the model keeps: work lost to a restart does not
count) times the failure-free step time of plain DDP on this workload, measured
in short plain jobs before and after each system (their mean). A system's own
per-step cost (checkpoint stalls, snapshots, leto's transactions and parity)
therefore lowers its ETTR. torchft's progress counts each committed step by the
share of the global batch it trained: a step its quorum committed with ``p`` of the
``W`` groups counts ``p / W`` (the throughput the job loses while a group heals).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from .agent import Job
from .interval import checkpoint_interval_steps
from .recovery import CAL_SAVES, ORDER
from .workload import BenchError, Workload

__all__ = ["failure_times", "plain_step_time", "run_goodput", "run_torchft", "torchft_work"]

_TIMEOUT_S = 300.0
_REF_STEPS = 20
_CAL_STEPS = 10


def failure_times(budget_s: float, mtbf_s: float, world: int, seed: int) -> list[dict[str, Any]]:
    """Poisson failure times in ``[0, budget_s)`` and the rank each one strikes."""
    if mtbf_s <= 0:
        raise BenchError(f"MTBF must be positive, got {mtbf_s}")
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= budget_s:
            return out
        out.append({"t": t, "rank": rng.randrange(world)})


def plain_step_time(wl: Workload) -> float:
    """Failure-free step time of plain DDP on ``wl`` (a short plain job)."""
    from .overhead import _plain

    return _plain(wl, 3, _REF_STEPS)[0]


def _drive(
    job: Job,
    system: str,
    t0: float,
    budget_s: float,
    schedule: list[dict[str, Any]],
    progress: Any,
    each: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``job`` until the budget is spent, signalling each scheduled failure once the
    one before it was recovered (``each`` after every slice of running); the failures
    signalled, with their times."""
    injected: list[dict[str, Any]] = []
    nxt = 0
    last_tick = 0
    while (now := time.monotonic()) < t0 + budget_s:
        busy = len(job.failures) < len(injected) or not job.recovered()
        if nxt < len(schedule) and now - t0 >= schedule[nxt]["t"] and not busy:
            if job.signal_failure(schedule[nxt]["rank"]):
                injected.append({**schedule[nxt], "t_signal": now - t0})
                nxt += 1
        job.run_for(min(0.05, t0 + budget_s - now))
        if each is not None:
            each()
        if progress is not None and int(now - t0) // 10 > last_tick:
            last_tick = int(now - t0) // 10
            progress(system, now - t0)
    return injected


def run_system(
    system: str,
    wl: Workload,
    *,
    budget_s: float,
    mtbf_s: float,
    schedule: list[dict[str, Any]],
    progress: Any = None,
) -> dict[str, Any]:
    """One baseline through the budget; its progress over time."""
    saves = CAL_SAVES
    run_plan: dict[str, Any] = {"interval": 10**9, "fail": None, "stop_step": 10**9}

    def plan(gen: int) -> dict[str, Any]:
        if gen == 0 and "calibrated" not in state:
            return {"calibrate": {"steps": _CAL_STEPS, "saves": saves}, **run_plan}
        return run_plan

    state: dict[str, Any] = {}
    with Job(system, wl, plan_for=plan) as job:
        job.start()
        job.pump(lambda: len(job.seen("calibrated")) == wl.world, _TIMEOUT_S, "calibration")
        cal = job.seen("calibrated")
        step_s = statistics.median(e["step_s"] for e in cal)
        save_s = max(e["save_s"] for e in cal)
        write_s = max(e["write_s"] for e in cal)
        k = None
        if system.startswith("ckpt-disk"):
            k = checkpoint_interval_steps(save_s, mtbf_s, step_s, write_s)
            run_plan["interval"] = k
        state["calibrated"] = True
        job.set_plan("plan/0/run", run_plan)
        t0 = time.monotonic()
        step0 = job.progress() or _CAL_STEPS
        samples: list[tuple[float, int]] = [(0.0, 0)]

        def sample() -> None:
            p = job.progress()
            if p is not None and p - step0 != samples[-1][1]:
                samples.append((time.monotonic() - t0, p - step0))

        injected = _drive(job, system, t0, budget_s, schedule, progress, sample)
        end = job.progress()
        if end is None:  # a restart is under way: its progress is what it reloads
            job.pump(lambda: job.progress() is not None, _TIMEOUT_S, "the restart point")
            end = job.progress()
        assert end is not None
        fail_t = [f["t_detect"] - t0 for f in job.failures]
    steps = end - step0
    return {
        "steps": steps,
        "step_s": step_s,
        "checkpoint_interval_steps": k,
        "save_s": save_s,
        "failures": len(fail_t),
        "failure_times_s": fail_t,
        "injected": injected,
        "timeline": samples + [(budget_s, steps)],
    }


def torchft_work(events: list[dict[str, Any]], world: int) -> list[tuple[float, int, float]]:
    """torchft's committed steps in order: (time, step, work), ``work`` the share of the
    global batch the step trained (its quorum's groups over the job's ``world``), each
    step once (every group of its quorum reports it; the first report's time)."""
    out: dict[int, tuple[float, float]] = {}
    for e in events:
        if e["ev"] == "step" and e["step"] not in out:
            out[e["step"]] = (e["t"], e["participants"] / world)
    return [(t, s, w) for s, (t, w) in sorted(out.items())]


def run_torchft(
    wl: Workload, *, budget_s: float, schedule: list[dict[str, Any]], progress: Any = None
) -> dict[str, Any]:
    """torchft through the budget; its progress over time in full global batches."""
    from . import ftjob

    reason = ftjob.missing()
    if reason is not None:
        raise BenchError(reason)
    lh = ftjob._Lighthouse(wl.world)
    try:
        with Job(
            "torchft",
            wl,
            plan_for=lambda gen: {"schedule": []},
            max_failures=len(schedule) + 1,
            extra_spec=lh.spec(),
        ) as job:
            job.start()
            job.pump(lambda: ftjob._full_steps(job) >= _CAL_STEPS, _TIMEOUT_S, "calibration")
            step_s = ftjob._steady_step_s(job.events, wl.world)
            t0 = time.monotonic()
            injected = _drive(job, "torchft", t0, budget_s, schedule, progress)
            fail_t = [f["t_detect"] - t0 for f in job.failures]
            committed = torchft_work(job.events, wl.world)
    finally:
        lh.close()
    # the agent stamps events with time.monotonic() (as t0 here)
    done = [(t - t0, w) for t, _, w in committed if t0 < t <= t0 + budget_s]
    timeline: list[tuple[float, float]] = [(0.0, 0.0)]
    for t, w in done:
        timeline.append((t, timeline[-1][1] + w))
    work = timeline[-1][1]
    return {
        "steps": work,
        "steps_committed": len(done),
        "full_steps": sum(1 for _, w in done if w == 1.0),
        "step_s": step_s,
        "checkpoint_interval_steps": None,
        "save_s": None,
        "failures": len(fail_t),
        "failure_times_s": fail_t,
        "injected": injected,
        "timeline": timeline + [(budget_s, work)],
        "version": ftjob.version(),
    }


def run_leto(
    wl: Workload, *, budget_s: float, schedule: list[dict[str, Any]], progress: Any = None
) -> dict[str, Any]:
    """leto through the budget (``leto launch``); its progress over time."""
    from .gloojob import GlooJob, step_time

    failures = [{"rank": f["rank"], "t": f["t"]} for f in schedule]
    with GlooJob(wl, steps=10**9, failures=failures, t0_after_step=_CAL_STEPS) as job:
        job.start()
        job.wait(lambda: job.t0() is not None, _TIMEOUT_S, "training to start")
        t0 = job.t0()
        assert t0 is not None
        last_tick = 0
        while (now := time.time()) < t0 + budget_s:
            job.poll()
            if job.ended():
                raise BenchError(f"leto: the job ended during the budget{job.tail()}")
            if progress is not None and int(now - t0) // 10 > last_tick:
                last_tick = int(now - t0) // 10
                progress("leto", now - t0)
            time.sleep(min(0.1, t0 + budget_s - now))
        job.stop()
        steps_at = [
            (e["t"] - t0, e["step"] - _CAL_STEPS)
            for e in job.events
            if e["event"] == "step" and e["step"] >= _CAL_STEPS and e["t"] <= t0 + budget_s
        ]
        fail_t = [e["t"] - t0 for e in job.seen("failure") if t0 <= e["t"] <= t0 + budget_s]
        stamps = [st for st in job.stamps() if st["t"] <= t0 + budget_s]
        step_s = step_time(job.events, 2, _CAL_STEPS)
    steps = steps_at[-1][1] if steps_at else 0
    timeline = [(0.0, 0)] + [(t, n) for t, n in steps_at if t >= 0] + [(budget_s, steps)]
    return {
        "steps": steps,
        "step_s": step_s,
        "checkpoint_interval_steps": None,
        "save_s": None,
        "failures": len(fail_t),
        "failure_times_s": fail_t,
        "injected": stamps,
        "timeline": timeline,
    }


def run_goodput(
    systems: Sequence[str],
    wl: Workload,
    *,
    budget_s: float,
    mtbf_s: float,
    seed: int = 0,
    rounds: int = 1,
    progress: bool = True,
) -> dict[str, Any]:
    """The goodput benchmark's result (the JSON of ``leto bench goodput``).

    ``rounds`` interleaves the systems as the overhead benchmark does: every round runs
    each system once, in an order rotated by one per round, all on that round's failure
    schedule (seed ``seed + round``), with plain DDP's step time measured before and
    after each. The gain is leto's ETTR minus the best baseline's (the baseline with the
    best mean ETTR), round by round; its mean and a 95% interval over the rounds are what
    the machine's drift cannot decide alone."""
    import sys

    from .overhead import ci95

    if rounds < 1:
        raise BenchError(f"goodput needs at least one round, got {rounds}")
    ordered = [s for s in ORDER if s in systems]
    schedules = [failure_times(budget_s, mtbf_s, wl.world, seed + r) for r in range(rounds)]
    live = progress and sys.stderr.isatty()

    def tick(system: str, t: float) -> None:
        if live:
            sys.stderr.write(f"\rgoodput {system:<16} {t:5.0f}/{budget_s:.0f} s")
            sys.stderr.flush()

    start = time.monotonic()
    # plain DDP's step time before and after every system (the machine's speed drifts)
    refs = [plain_step_time(wl)]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in ordered}
    for r in range(rounds):
        k = r % len(ordered)
        for system in ordered[k:] + ordered[:k]:
            if system == "leto":
                one = run_leto(wl, budget_s=budget_s, schedule=schedules[r], progress=tick)
            elif system == "torchft":
                one = run_torchft(wl, budget_s=budget_s, schedule=schedules[r], progress=tick)
            else:
                one = run_system(
                    system,
                    wl,
                    budget_s=budget_s,
                    mtbf_s=mtbf_s,
                    schedule=schedules[r],
                    progress=tick,
                )
            refs.append(plain_step_time(wl))
            ref = (refs[-2] + refs[-1]) / 2.0
            one["round"] = r
            one["plain_step_s"] = ref
            one["ettr"] = one["steps"] * ref / budget_s
            one["step_overhead_vs_plain_pct"] = 100.0 * (one["step_s"] / ref - 1.0)
            one["timeline"] = [(t, n, n * ref) for t, n in one["timeline"]]
            runs[system].append(one)
    if live:
        sys.stderr.write("\n")
    out = {system: _summary(rs) for system, rs in runs.items()}
    ettr = {s: r["ettr"] for s, r in out.items()}
    result: dict[str, Any] = {
        "benchmark": "goodput",
        "workload": {**wl.as_dict(), "params": wl.params, "label": wl.label},
        "budget_s": budget_s,
        "mtbf_s": mtbf_s,
        "seed": seed,
        "rounds": rounds,
        "schedule": schedules[0],
        "schedules": schedules,
        "plain_step_s": statistics.fmean(refs),
        "plain_step_s_runs": refs,
        "ettr": ettr,
        "systems": out,
        "elapsed_s": time.monotonic() - start,
    }
    baselines = {s: v for s, v in ettr.items() if s != "leto"}
    if baselines:
        best = max(baselines, key=lambda s: baselines[s])
        result["best_baseline"] = best
        if "leto" in ettr:
            by_round = [
                100.0 * (a["ettr"] - b["ettr"])
                for a, b in zip(runs["leto"], runs[best], strict=True)
            ]
            result["gain_pp_vs_best_baseline"] = statistics.fmean(by_round)
            result["gain_pp_by_round"] = by_round
            result["gain_pp_ci95"] = ci95(by_round)
    return result


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system over the rounds: the means, the first round's timeline (the plot's),
    and every round's own result under ``runs``."""
    first = runs[0]
    return {
        **first,
        "steps": statistics.fmean(r["steps"] for r in runs),
        "step_s": statistics.fmean(r["step_s"] for r in runs),
        "failures": statistics.fmean(r["failures"] for r in runs),
        "ettr": statistics.fmean(r["ettr"] for r in runs),
        "ettr_runs": [r["ettr"] for r in runs],
        "step_overhead_vs_plain_pct": statistics.fmean(
            r["step_overhead_vs_plain_pct"] for r in runs
        ),
        "runs": runs,
    }
