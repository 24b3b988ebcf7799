"""The event loop: one strategy's plan played against one failure trace.

The timeline alternates recoveries and running segments. Failure ``i`` at ``t_i``
starts a recovery of ``D_i`` seconds (its tier's phases); the job runs from
``t_i + D_i`` to the next failure. A failure that strikes during a recovery restarts
it: its own recovery replaces the one in progress. Everything here is closed form per
inter-failure interval, in numpy; Python loops only over the rare events that need
history: chains of overlapping memory losses (the escalation walk) and disk fallbacks
of the in-memory strategies.

Escalation. A failure that loses memory leaves its redundancy incomplete from the
failure until ``window_s`` after its recovery ends (parity and snapshots re-encoded).
A chain is a run of failures each striking inside the previous one's window; within
it the lost elements accumulate, and each failure is handled at the tier the plan's
``escalate`` gives for all of them (the core's coverage analysis for leto). Once a
chain reaches the disk fallback it stays there until a recovery completes. A rollback
that the escalation adds (a tier-2 snapshot) is charged to the chain's first failure,
the last one that had progress behind it.

Progress. Checkpoint/restart (``periodic``): in a running segment of wall length ``W``
with checkpoint cycles of ``T`` training + ``C`` blocked, the job keeps ``k T``, ``k``
the checkpoints durable before the failure (the Daly model; exact, not averaged). The
in-memory strategies progress at ``rate`` per running second, lose each failure's
rework (at most the progress of the segment before it), and on a disk fallback roll
back to the last durable checkpoint, taken every ``interval_s`` of progress.

Every second of the horizon is accounted for: productive time plus the time lost by
cause equals the wall-clock time (the test suite checks it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import attrs

from leto.sim.strategies import FALLBACK, TIERS, Plan
from leto.sim.trace import Trace

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


@attrs.frozen
class Outcome:
    """One strategy on one trace."""

    strategy: str
    horizon_s: float
    productive_s: float
    lost_s: dict[str, float]  # wall seconds lost, by cause
    tiers: tuple[int, ...]  # failures handled at each tier 0..3
    interval_s: float  # the disk checkpoint interval the strategy used

    @property
    def ettr(self) -> float:
        return self.productive_s / self.horizon_s


def simulate(plan: Plan, trace: Trace) -> Outcome:
    import numpy as np

    n = len(trace)
    t = trace.times
    idx = np.arange(n)
    total = sum(plan.phases.values(), np.zeros((TIERS, n)))
    tier = plan.base_tier.astype(np.int64)
    rework = plan.rework_s[tier, idx]
    if plan.escalate is not None and n > 1:
        _escalate(plan, t, total, tier, rework)
    down = total[tier, idx]
    nxt = np.append(t[1:], trace.horizon_s)
    elapsed = np.minimum(down, nxt - t)
    run = np.empty(n + 1)  # run[0]: before the first failure; run[i + 1]: after failure i
    run[0] = t[0] if n else trace.horizon_s
    run[1:] = np.maximum(0.0, nxt - t - down)

    lost: dict[str, float] = {}
    share = np.divide(elapsed, down, out=np.zeros(n), where=down > 0)
    for phase, seconds in plan.phases.items():
        lost[phase] = float(np.dot(share, seconds[tier, idx]))
    if plan.periodic:
        productive = _periodic(plan, run, lost)
    else:
        productive = _resilient(plan, t, down, run, rework, tier == FALLBACK, lost)
    counts = np.bincount(tier, minlength=TIERS)
    return Outcome(
        strategy=plan.name,
        horizon_s=trace.horizon_s,
        productive_s=productive,
        lost_s={k: v for k, v in lost.items() if v > 0.0},
        tiers=tuple(int(c) for c in counts),
        interval_s=plan.interval_s,
    )


def _escalate(
    plan: Plan,
    t: npt.NDArray[np.float64],
    total: npt.NDArray[np.float64],
    tier: npt.NDArray[np.int64],
    rework: npt.NDArray[np.float64],
) -> None:
    """Raise the tier of failures that strike while earlier losses are unrepaired."""
    import numpy as np

    assert plan.escalate is not None
    n = len(t)
    has = np.fromiter((e is not None for e in plan.elements), dtype=bool, count=n)
    base_down = total[tier, np.arange(n)]
    window = base_down + np.where(has, plan.window_s, 0.0)
    starts = np.flatnonzero(t[1:] < t[:-1] + window[:-1]).tolist()
    done = -1
    for s in starts:
        if s <= done:
            continue
        open_: list[tuple[int, int, int]] = []
        if (e := plan.elements[s]) is not None:
            open_.append(e)
        fallen = tier[s] == FALLBACK
        behind = s  # the latest failure with progress behind it: a rollback is charged there
        j = s
        while j + 1 < n:
            finished = t[j] + total[tier[j], j]
            if t[j + 1] >= finished + (plan.window_s if open_ else 0.0):
                break
            j += 1
            if t[j] >= finished:
                behind = j
            if (e := plan.elements[j]) is not None:
                open_.append(e)
            if fallen:
                tier[j] = FALLBACK
            elif open_:
                tier[j] = max(int(tier[j]), plan.escalate(open_))
                fallen = tier[j] == FALLBACK
            if not fallen:
                rework[j] = plan.rework_s[tier[j], j]
                if behind != j and tier[behind] != FALLBACK:
                    rework[behind] = max(rework[behind], plan.rework_s[tier[j], behind])
        done = j


def _periodic(plan: Plan, run: npt.NDArray[np.float64], lost: dict[str, float]) -> float:
    """Checkpoint/restart: each segment keeps what its durable checkpoints hold."""
    import numpy as np

    T, C, lag = plan.interval_s, plan.block_s, plan.commit_lag_s
    cycle = T + C
    full = np.floor(run / cycle)
    blocked = full * C + np.clip(run - full * cycle - T, 0.0, None)
    compute = run - blocked
    durable = np.floor(np.clip(run - lag, 0.0, None) / cycle)
    kept = np.minimum(durable * T, compute)
    kept[-1] = compute[-1]  # the horizon ends the last segment, not a failure
    lost["checkpoint"] = lost.get("checkpoint", 0.0) + float(blocked.sum())
    lost["rework"] = lost.get("rework", 0.0) + float((compute - kept).sum())
    return float(kept.sum())


def _resilient(
    plan: Plan,
    t: npt.NDArray[np.float64],
    down: npt.NDArray[np.float64],
    run: npt.NDArray[np.float64],
    rework: npt.NDArray[np.float64],
    fallback: npt.NDArray[np.bool_],
    lost: dict[str, float],
) -> float:
    """In-memory strategies: progress carries across failures; fallbacks roll back to
    the last disk checkpoint, taken on a wall-clock schedule (every ``interval_s`` of
    training plus its block) and durable ``commit_lag_s`` later."""
    import numpy as np

    rate = plan.rate
    gross = run * rate
    ckpt_share = (1.0 - plan.overhead) * plan.block_s / (plan.interval_s + plan.block_s)
    lost["checkpoint"] = lost.get("checkpoint", 0.0) + float(run.sum() * ckpt_share)
    lost["overhead"] = lost.get("overhead", 0.0) + float(run.sum() * plan.overhead)
    local = np.where(fallback, 0.0, np.minimum(rework, gross[:-1]))
    net = gross[:-1] - local
    lost["rework"] = lost.get("rework", 0.0) + float(local.sum())
    # cum[k]: progress at the start of running segment k, before any fallback's loss.
    cum = np.concatenate([[0.0], np.cumsum(net)])
    seg_start = np.concatenate([[0.0], t + down])
    period = plan.interval_s + plan.block_s
    offset = restore = 0.0
    last_fallback = -math.inf
    for i in np.flatnonzero(fallback).tolist():
        taken = math.floor((float(t[i]) - plan.commit_lag_s) / period) * period
        if taken <= 0.0:
            durable = 0.0
        elif taken < last_fallback:
            durable = restore
        else:
            k = int(np.searchsorted(t, taken, side="right"))
            durable = float(cum[k]) - offset + rate * max(0.0, taken - float(seg_start[k]))
        before = float(cum[i + 1]) - offset
        durable = min(before, max(durable, restore))
        offset += before - durable
        restore, last_fallback = durable, float(t[i])
    if offset > 0.0:
        lost["fallback rework"] = offset
    return float(net.sum() + gross[-1] - offset)
