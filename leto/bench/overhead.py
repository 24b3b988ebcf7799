"""``leto bench overhead``: failure-free step time, plain DDP vs the same training under leto.

Three configurations of the same model, data and four ranks, each a real job:

* ``plain``: ``DistributedDataParallel`` on gloo with AdamW (the baselines'
  worker, no checkpoints), under the benchmark's agent;
* ``leto``: ``leto launch`` (two nodes of two ranks) with its default settings,
  every tier on: tier 1 as gloo's default keeps it (``tier1_code = "auto"``:
  replicas, since data-parallel ranks hold the same state, so a node keeps each
  rank's versions and checksums and no parity; a lost rank is copied from
  another), a tier-2 snapshot every K steps;
* ``leto-no-tier2``: the same with tier 2 off;
* ``leto-parity``: every tier on, tier 1 as parity (``tier1_code = "parity"``): a
  parity of the node's chunks and gradients updated every step, what the other
  backends keep and what a job whose ranks hold different state needs.

They run one after another in short jobs, round after round, the order rotating
each round, so the machine's drift falls on all of them alike. A job's step time
is the mean wall time per step over whole tier-2 periods after warm-up steps
(from the workers' step stamps, and from leto's coordinator's committed steps);
``overhead_pct`` is ``100 * (mean leto / mean plain - 1)`` over the rounds, and
each round's own ratio is kept to show the spread.

The machine's speed drifts by several percent from one job to the next (the same
forward pass costs ±10% CPU), which the rounds' ratios inherit. Every job therefore
also measures the CPU its trainers spend in forward passes, work that is the same
in every configuration (the model, the batch, one thread), as a gauge of the
machine's speed during that job: ``overhead_pct_adjusted`` compares step times per
unit of it, ``100 * ((leto step / leto forward CPU) / (plain step / plain forward
CPU) - 1)`` for each round, then the mean of the rounds. It removes the drift that
scales all work alike and nothing that leto costs besides a slower forward pass
(which the two configurations' ``forward`` CPU would show); ``overhead_pct`` stays
the measured figure.

Where the time goes: every job also measures its CPU per step over the same
steps (:mod:`leto.bench.cpu`): the trainers' (leto's by protocol phase) and, for
leto, that of its agents, coordinator, keepers and shadows. With more ranks than
cores the step time follows the job's CPU, so ``cpu_ms_per_step[...]["extra_pct"]``
says how much of the overhead is work leto adds, and which phase adds it.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from .workload import BenchError, Workload

__all__ = [
    "CONFIGS",
    "adjusted_by_round",
    "ci95",
    "forward_ms",
    "machine_ticks",
    "run_overhead",
    "steal_pct",
]

CONFIGS = ("plain", "leto", "leto-no-tier2", "leto-parity", "leto-no-replica-check")
DEFAULT_CONFIGS = CONFIGS[:4]
_TIMEOUT_S = 300.0


def _plain(wl: Workload, warmup: int, steps: int) -> tuple[float, dict[str, Any]]:
    """Plain DDP's step time over steps ``warmup..warmup+steps``, and its CPU per step."""
    from .agent import Job
    from .cpu import plain_cpu_report

    stop = warmup + steps

    def plan(_gen: int) -> dict[str, Any]:
        return {"interval": 10**9, "fail": None, "stop_step": stop}

    with Job("plain", wl, plan_for=plan) as job:
        job.start()
        job.pump(lambda: job.finished, _TIMEOUT_S, "the plain job's end")
        t = {e["step"]: e["t"] for e in job.events if e["ev"] == "step" and e["rank"] == 0}
        cpu = plain_cpu_report(job.events, warmup, stop)
    return (t[stop] - t[warmup]) / steps, cpu


def _leto(
    wl: Workload,
    warmup: int,
    steps: int,
    *,
    tier2: bool,
    tier2_interval: int,
    tier1_code: str,
    replica_check: int = 1,
) -> tuple[float, dict[str, Any]]:
    """leto's step time over steps ``warmup..warmup+steps``, and its CPU per step."""
    from .gloojob import GlooJob, step_time

    # the CPU probes sit at a forward pass: from step warmup+1's to step stop+1's is
    # the same number of whole steps, so the job runs one step more than measured
    probe = (warmup + 1, warmup + steps + 1)
    with GlooJob(
        wl,
        steps=warmup + steps + 1,
        tier1_code=tier1_code,
        tier2=tier2,
        tier2_interval=tier2_interval,
        cpu_probe=probe,
        replica_check=replica_check,
    ) as job:
        job.start()
        job.wait(lambda: bool(job.seen("job_end")), _TIMEOUT_S, "the leto job's end")
        return step_time(job.events, warmup, warmup + steps), job.cpu(*probe)


def machine_ticks() -> tuple[int, int] | None:
    """The machine's CPU time stolen by the hypervisor and its whole CPU time, in clock
    ticks since boot (``/proc/stat``: the ``steal`` field and the sum of the first
    eight); None where there is no such file."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]
    return ticks[7], sum(ticks)


def steal_pct(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPU time stolen between two :func:`machine_ticks`."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return 100.0 * (after[0] - before[0]) / (after[1] - before[1])


def run_overhead(
    wl: Workload,
    *,
    rounds: int = 5,
    periods: int = 2,
    tier2_interval: int = 10,
    warmup: int = 5,
    configs: Sequence[str] = DEFAULT_CONFIGS,
    progress: bool = True,
) -> dict[str, Any]:
    """Interleaved short jobs of each configuration (see the module docstring);
    ``configs``: which of :data:`CONFIGS` (``plain`` first, always)."""
    from leto.sim.sweep import Progress

    if rounds < 1 or periods < 1:
        raise BenchError("overhead needs at least one round and one tier-2 period")
    configs = tuple(configs)
    if not configs or configs[0] != "plain" or not set(configs) <= set(CONFIGS):
        raise BenchError(f"overhead configurations start with plain, from {CONFIGS}: {configs}")
    steps = periods * tier2_interval
    bar = Progress(rounds * len(configs), f"overhead {wl.label}") if progress else None
    times: dict[str, list[float]] = {c: [] for c in configs}
    cpus: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    steal: dict[str, list[float | None]] = {c: [] for c in configs}
    start = time.monotonic()
    for r in range(rounds):
        k = r % len(configs)
        order = configs[k:] + configs[:k]
        for c in order:
            ticks = machine_ticks()
            if c == "plain":
                t, cpu = _plain(wl, warmup, steps)
            else:
                t, cpu = _leto(
                    wl,
                    warmup,
                    steps,
                    tier2=c != "leto-no-tier2",
                    tier2_interval=tier2_interval,
                    tier1_code="parity" if c == "leto-parity" else "auto",
                    replica_check=0 if c == "leto-no-replica-check" else 1,
                )
            times[c].append(t)
            cpus[c].append(cpu)
            steal[c].append(steal_pct(ticks, machine_ticks()))
            if bar is not None:
                bar.advance(f"round {r + 1} {c}")
    mean = {c: statistics.fmean(v) for c, v in times.items()}
    per_round = {
        c: [100.0 * (a / b - 1.0) for a, b in zip(times[c], times["plain"], strict=True)]
        for c in configs[1:]
    }
    adjusted = adjusted_by_round(times, cpus)
    return {
        "benchmark": "overhead",
        "workload": {**wl.as_dict(), "params": wl.params, "label": wl.label},
        "backend": "real processes: DDP on gloo vs leto launch (gloo, 2 nodes x 2 ranks)",
        "rounds": rounds,
        "steps_per_job": steps,
        "warmup_steps": warmup,
        "tier2_interval": tier2_interval,
        "step_s": mean,
        "step_s_runs": times,
        **{
            key: 100.0 * (mean[c] / mean["plain"] - 1.0)
            for key, c in (
                ("overhead_pct", "leto"),
                ("overhead_pct_tier2_off", "leto-no-tier2"),
                ("overhead_pct_parity", "leto-parity"),
                ("overhead_pct_replica_check_off", "leto-no-replica-check"),
            )
            if c in mean
        },
        "overhead_pct_by_round": per_round,
        # the machine's speed drifts by several percent between jobs: the median of the
        # rounds' own ratios is the estimate least moved by one slow or fast job
        "overhead_pct_median_round": {c: statistics.median(v) for c, v in per_round.items()},
        # how far the rounds let the estimate be trusted: a 95% interval for the mean
        # of the rounds' ratios (None with one round)
        "overhead_pct_ci95": {c: ci95(v) for c, v in per_round.items()},
        # step time per forward-pass CPU second: the drift between jobs taken out
        "overhead_pct_adjusted": {c: statistics.fmean(v) for c, v in adjusted.items()},
        "overhead_pct_adjusted_by_round": adjusted,
        "overhead_pct_adjusted_ci95": {c: ci95(v) for c, v in adjusted.items()},
        "cpu_ms_per_step": cpu_summary(cpus, wl.world, step_s=mean, cores=_cores()),
        "cpu_ms_per_step_runs": cpus,
        # the hypervisor's share of the machine during each job (None: not measured):
        # a job that ran on a machine with CPU stolen ran slower for a reason of its own
        "steal_pct_runs": steal,
        "elapsed_s": time.monotonic() - start,
    }


# Student's t, 0.975 quantile, for 1..30 degrees of freedom (beyond: 30's, conservative)
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def ci95(values: list[float]) -> list[float] | None:
    """A 95% confidence interval ``[lo, hi]`` for the mean of ``values`` (Student's t);
    None for fewer than two values."""
    n = len(values)
    if n < 2:
        return None
    m = statistics.fmean(values)
    half = _T975[min(n - 1, len(_T975)) - 1] * statistics.stdev(values) / n**0.5
    return [m - half, m + half]


def forward_ms(cpu: dict[str, Any]) -> float | None:
    """A job's trainer CPU per step in forward passes (ms), if it was measured."""
    if "forward_ms" in cpu:
        return float(cpu["forward_ms"])
    fwd = cpu.get("phases_ms", {}).get("forward")
    return None if fwd is None else float(fwd)


def adjusted_by_round(
    times: dict[str, list[float]], cpus: dict[str, list[dict[str, Any]]]
) -> dict[str, list[float]]:
    """Each round's overhead per unit of forward-pass CPU (see the module docstring);
    a configuration is left out if some job of it or of plain has no forward CPU."""

    def gauges(config: str) -> list[float] | None:
        fwd = [forward_ms(x) or 0.0 for x in cpus[config]]
        return fwd if all(f > 0 for f in fwd) else None

    out: dict[str, list[float]] = {}
    base = gauges("plain")
    for c in (c for c in times if c != "plain"):
        fwd = gauges(c)
        if base is None or fwd is None:
            continue
        out[c] = [
            100.0 * ((t / f) / (tp / fp) - 1.0)
            for t, f, tp, fp in zip(times[c], fwd, times["plain"], base, strict=True)
        ]
    return out


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def cpu_summary(
    cpus: dict[str, list[dict[str, Any]]],
    world: int,
    *,
    step_s: dict[str, float] | None = None,
    cores: int | None = None,
) -> dict[str, Any]:
    """Where each configuration's CPU goes, per step (means over the rounds).

    ``trainer_ms``: one trainer's CPU per step (mean over ranks); for leto also its
    CPU and wall time by phase (``phases_ms``, ``phases_wall_ms``) and ``others_ms``
    (the job's other processes, all together).
    ``job_ms``: every process of the job, ``world * trainer_ms + others_ms``;
    ``extra_pct``: how much more CPU per step than plain DDP's workers, the share of
    the step time it costs on a machine whose cores the job keeps busy.
    ``unused_core_ms`` (given the mean step times and the cores): core time per step that
    no process of the job used, ``cores * step - job_ms``: waiting (for the
    slowest rank, a message) where the job had work but not for every core.
    """
    from .cpu import mean_by_key

    out: dict[str, Any] = {}
    for c, runs in cpus.items():
        if not runs:
            continue
        s: dict[str, Any] = {"trainer_ms": statistics.fmean(r["trainer_ms"] for r in runs)}
        for key in ("phases_ms", "phases_wall_ms"):
            if key in runs[0]:
                s[key] = mean_by_key([r[key] for r in runs])
        if all("forward_ms" in r for r in runs):
            s["forward_ms"] = statistics.fmean(r["forward_ms"] for r in runs)
        others = [r["others_ms"] for r in runs if r.get("others_ms") is not None]
        s["others_ms"] = statistics.fmean(others) if others else 0.0
        s["job_ms"] = world * s["trainer_ms"] + s["others_ms"]
        if step_s is not None and cores is not None and c in step_s:
            s["unused_core_ms"] = cores * 1e3 * step_s[c] - s["job_ms"]
        out[c] = s
    base = out.get("plain")
    if base:
        for c, s in out.items():
            if c != "plain":
                s["extra_pct"] = 100.0 * (s["job_ms"] / base["job_ms"] - 1.0)
    return out
