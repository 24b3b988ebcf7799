"""CPU time of a benchmark job's processes: where a system's step time goes.

Wall time per step is what the overhead benchmark reports; on this machine (more
ranks than cores) it follows the CPU every process of the job spends per step.
These helpers read that CPU time (``/proc/PID/stat``: user + system, all threads)
and turn probes taken at two steps into milliseconds per step.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable
from typing import Any

from .workload import BenchError

__all__ = [
    "cpu_seconds",
    "cpu_seconds_of",
    "leto_cpu_report",
    "mean_by_key",
    "plain_cpu_report",
]

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[1].split()  # after "(comm)", which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICK


def cpu_seconds_of(tag: str) -> dict[str, float]:
    """CPU seconds of every process whose command line contains ``tag`` (and this one)."""
    from leto.backends.gloo.procs import processes_with

    out: dict[str, float] = {}
    for pid in [os.getpid(), *processes_with(tag)]:
        s = cpu_seconds(pid)
        if s is not None:
            out[str(pid)] = s
    return out


def plain_cpu_report(events: Iterable[dict[str, Any]], first: int, last: int) -> dict[str, Any]:
    """DDP workers' CPU per step (ms, mean over ranks) between two step stamps.

    ``events`` are the workers' records (``ev == "step"`` with ``cpu``: the
    process's CPU seconds at the end of the step, and ``fwd``: those spent in
    forward passes so far, reported as ``forward_ms`` when every rank has them).
    """
    at: dict[int, dict[int, tuple[float, float | None]]] = {}
    for e in events:
        if e.get("ev") == "step" and e["step"] in (first, last) and "cpu" in e:
            at.setdefault(e["rank"], {})[e["step"]] = (e["cpu"], e.get("fwd"))
    n = last - first
    both = [v for v in at.values() if len(v) == 2]
    if not both:
        raise BenchError(f"plain: no CPU stamps at steps {first} and {last}")
    per_rank = [1e3 * (v[last][0] - v[first][0]) / n for v in both]
    out: dict[str, Any] = {"trainer_ms": statistics.fmean(per_rank), "trainer_ms_by_rank": per_rank}
    fwd = [
        1e3 * (b - a) / n
        for a, b in ((v[first][1], v[last][1]) for v in both)
        if a is not None and b is not None
    ]
    if len(fwd) == len(both):
        out["forward_ms"] = statistics.fmean(fwd)
    return out


def leto_cpu_report(records: Iterable[dict[str, Any]], first: int, last: int) -> dict[str, Any]:
    """leto's CPU per step (ms) between the probes at ``first`` and ``last``.

    ``records`` are ``RUN_DIR/bench-cpu.jsonl`` lines (:mod:`leto.bench.letojob`):
    every rank's trainer CPU, in all and by phase, its wall time by phase (means
    over ranks), and the CPU of the job's other processes (agents, coordinator,
    keepers, zygote, shadows: the total over them, from rank 0's view of every
    process of the job, and how many there were: ``/proc`` counts CPU in clock
    ticks, so a short window can show 0 ms for processes that did run).
    """
    by: dict[tuple[int, int], dict[str, Any]] = {}
    for r in records:
        if r["step"] in (first, last):
            by[(r["rank"], r["step"])] = r
    ranks = sorted({rank for rank, _ in by})
    n = last - first
    trainer, phases, walls, pids = [], [], [], set()
    for rank in ranks:
        a, b = by.get((rank, first)), by.get((rank, last))
        if a is None or b is None or a["pid"] != b["pid"]:
            continue  # the rank was replaced between the probes: its CPU is not one process's
        trainer.append(1e3 * (b["cpu"] - a["cpu"]) / n)
        phases.append({k: 1e3 * (v - a["phases"].get(k, 0.0)) / n for k, v in b["phases"].items()})
        wa, wb = a.get("phases_wall", {}), b.get("phases_wall", {})
        walls.append({k: 1e3 * (v - wa.get(k, 0.0)) / n for k, v in wb.items()})
        pids.add(str(a["pid"]))
    if not trainer:
        raise BenchError(f"leto: no trainer CPU probes at steps {first} and {last}")
    r0a, r0b = by.get((0, first)), by.get((0, last))
    others, spent = None, []
    if r0a is not None and r0b is not None and "job" in r0a and "job" in r0b:
        before, after = r0a["job"], r0b["job"]
        spent = [after[p] - before[p] for p in after if p in before and p not in pids]
        others = 1e3 * sum(max(0.0, s) for s in spent) / n
    return {
        "trainer_ms": statistics.fmean(trainer),
        "trainer_ms_by_rank": trainer,
        "phases_ms": mean_by_key(phases),
        "phases_wall_ms": mean_by_key(walls),
        "others_ms": others,
        "others_procs": len(spent),  # how many other processes were measured
    }


def mean_by_key(rows: list[dict[str, float]]) -> dict[str, float]:
    """Key by key means over ``rows`` (a key missing from a row counts 0)."""
    names = sorted({k for r in rows for k in r})
    return {k: statistics.fmean(r.get(k, 0.0) for r in rows) for k in names}
