"""``leto bench overhead``: failure-free step time, plain data parallelism vs leto.

Three (or four) trainings of the same model, data and ranks run in this process,
one step of each in turn (the order rotates every round), so the machine's noise
falls on all of them alike:

* ``plain``: plain data parallelism (:class:`leto.bench.inprocess.PlainDP`);
* ``leto``: leto's engine on the fake backend, every tier on (tier-1 parity per
  step, a tier-2 snapshot every K steps);
* ``leto-no-tier2``: the same with tier 2 off;
* ``leto-no-tiers``: tiers 1 and 2 off (the retained layer and the transactions
  alone), to show where the cost is.

Both run every rank one after another in one process (the fake backend's model
of a job), so the ratio is leto's per-rank cost over plain training's. Step time
is the mean over whole tier-2 periods (a snapshot every K steps is part of the
cost), after warm-up steps. ``overhead_pct`` is ``100 * (leto / plain - 1)``.
The engine's clocks split leto's step by protocol event (``events_s``: seconds
per step), which says where the overhead goes.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from .workload import Workload

__all__ = ["CONFIGS", "run_overhead"]

# name -> engine options (None: plain data parallelism)
CONFIGS: dict[str, dict[str, bool] | None] = {
    "plain": None,
    "leto": {"tier1": True, "tier2": True},
    "leto-no-tier2": {"tier1": True, "tier2": False},
    "leto-no-tiers": {"tier1": False, "tier2": False},
}


def run_overhead(
    wl: Workload,
    *,
    periods: int = 3,
    tier2_interval: int = 10,
    warmup: int = 2,
    progress: bool = True,
) -> dict[str, Any]:
    """Interleaved failure-free steps (``periods`` tier-2 periods of each config)."""
    from leto.sim.sweep import Progress

    from .inprocess import PlainDP, build_engine

    steps = periods * tier2_interval
    bar = Progress(steps + 1, f"overhead {wl.label}") if progress else None
    runners: dict[str, Any] = {}
    for name, opts in CONFIGS.items():
        if opts is None:
            runners[name] = PlainDP(wl)
        else:
            runners[name] = build_engine(wl, tier2_interval=tier2_interval, **opts)
    for r in runners.values():
        for _ in range(warmup):
            r.run_step()
    for r in runners.values():
        if hasattr(r, "step_event_s"):
            r.step_event_s.clear()
    if bar is not None:
        bar.advance("warm-up")
    names = list(runners)
    times: dict[str, list[float]] = {n: [] for n in names}
    start = time.monotonic()
    for i in range(steps):
        order = names[i % len(names) :] + names[: i % len(names)]
        for n in order:
            t = time.perf_counter()
            runners[n].run_step()
            times[n].append(time.perf_counter() - t)
        if bar is not None:
            bar.advance(f"round {i + 1}")
    mean = {n: statistics.fmean(v) for n, v in times.items()}
    median = {n: statistics.median(v) for n, v in times.items()}
    base = mean["plain"]
    pct = {n: 100.0 * (mean[n] / base - 1.0) for n in names if n != "plain"}
    events = {
        n: {k: v / steps for k, v in sorted(r.step_event_s.items())}
        for n, r in runners.items()
        if hasattr(r, "step_event_s")
    }
    topo = runners["leto"].backend.topology
    return {
        "benchmark": "overhead",
        "workload": {**wl.as_dict(), "params": wl.params, "label": wl.label},
        "backend": f"fake ({topo.nodes}x{topo.node_sizes[0]} ranks in one process)",
        "steps_per_config": steps,
        "tier2_interval": tier2_interval,
        "step_s": mean,
        "step_s_median": median,
        "overhead_pct": pct["leto"],
        "overhead_pct_tier2_off": pct["leto-no-tier2"],
        "overhead_pct_no_tiers": pct["leto-no-tiers"],
        "events_s": events,
        "samples_s": times,
        "elapsed_s": time.monotonic() - start,
    }
