"""The recovery strategies, each reduced to what it costs on a given trace.

A strategy is a :class:`Plan`: for every failure of the trace, the wall-clock seconds
of each recovery phase and the training progress lost, for each *tier* the failure
might be handled at (0 in place, 1 and 2 from redundant memory, 3 from the disk
checkpoint), the tier it gets on its own, and how overlapping failures escalate. The
event loop (:mod:`leto.sim.engine`) does the rest. The strategies:

``ckpt-sync``
    Periodic disk checkpoints that block training while written, at Daly's optimal
    interval for the job's MTBF; every failure restarts the job from the last one.
``ckpt-async``
    The same, but training blocks only to snapshot state to host memory; the write to
    storage proceeds in the background and a checkpoint counts once written.
``gemini``
    Gemini (SOSP'23): a checkpoint of every iteration in CPU memory, on the node and on
    ``gemini_replicas - 1`` peers of its group. The job restarts on every failure and
    reloads from CPU memory (local, or a peer's when the node is gone); losing every
    replica of a group falls back to disk.
``jit``
    Just-in-time checkpointing (EuroSys'24): after a failure, healthy data-parallel
    replicas write a checkpoint, the job restarts, loads it and replays one minibatch.
    No replica survives a node loss on a one-node job: disk fallback.
``torchft``
    Replica groups of whole nodes (``torchft_groups``, at most the job's nodes): the
    failed group restarts its processes, joins
    a quorum and heals from a live peer while the other groups train on, at
    ``(G - 1) / G`` of the job's throughput (or the fraction measured by ``leto bench
    recovery``). One group alone has no peer: the disk checkpoint.
``leto``
    In place: survivors keep their processes and retained state, a shadow takes the
    failed rank, the communicator is rebuilt. Memory losses go to tier 1 or tier 2 as
    the core's coverage analysis says (:mod:`leto.sim.coverage`); nodes that leave are
    replaced by warm spares; beyond both tiers, the disk checkpoint.

The three in-memory strategies keep asynchronous disk checkpoints as their fallback,
at Daly's interval for the rate of failures they cannot survive, at most every
``fallback_max_interval_h`` (Gemini's setting: about every 3 h).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

from leto.sim import theory
from leto.sim.calibration import FailureClass
from leto.sim.coverage import NODE, RANK, Element, core_tiers
from leto.sim.params import SimParams
from leto.sim.trace import Trace

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

TIERS = 4
FALLBACK = 3
STRATEGIES = ("ckpt-sync", "ckpt-async", "gemini", "jit", "torchft", "leto")
BASELINES = ("ckpt-sync", "ckpt-async")

Escalate = Callable[[Sequence[Element]], int]


@attrs.frozen(eq=False)
class Plan:
    """What one strategy does on one trace (arrays indexed ``[tier, failure]``)."""

    name: str
    periodic: bool  # restart from the last disk checkpoint on every failure (checkpoint/restart)
    interval_s: float  # training time between disk checkpoints
    block_s: float  # training blocked per disk checkpoint
    commit_lag_s: float  # wall time after the block until the checkpoint is durable
    overhead: float  # fraction of training time spent keeping in-memory redundancy
    base_tier: npt.NDArray[np.int8]  # the tier each failure gets on its own
    phases: dict[str, npt.NDArray[np.float64]]  # recovery seconds by phase, [tier, failure]
    rework_s: npt.NDArray[np.float64]  # progress lost (not to the disk checkpoint), [tier, failure]
    elements: list[Element | None] = attrs.field(factory=list)  # what each failure loses
    escalate: Escalate | None = None  # the tier of a set of overlapping losses
    window_s: float = 0.0  # after a recovery, how long until its redundancy is whole again

    @property
    def rate(self) -> float:
        """Training progress per second of running wall time (in-memory strategies)."""
        return (1.0 - self.overhead) * self.interval_s / (self.interval_s + self.block_s)


class _Costs:
    """Accumulates per-phase recovery costs for each tier."""

    def __init__(self, n: int) -> None:
        import numpy as np

        self.n = n
        self.phases: dict[str, npt.NDArray[np.float64]] = {}
        self.rework = np.zeros((TIERS, n))
        self._np = np

    def add(self, phase: str, tiers: Sequence[int], seconds: object) -> None:
        arr = self.phases.setdefault(phase, self._np.zeros((TIERS, self.n)))
        for tier in tiers:
            arr[tier] += seconds


def _restart_costs(costs: _Costs, p: SimParams, trace: Trace, tiers: Sequence[int]) -> None:
    """A whole-job restart that reloads the disk checkpoint (GPU resets overlap it)."""
    import numpy as np

    reset = np.where(trace.cls == FailureClass.DEVICE_MEMORY, p.gpu_reset_s, 0.0)
    costs.add("detect", tiers, p.detect_s)
    costs.add("restart", tiers, np.maximum(p.restart_s, reset))
    costs.add("load", tiers, p.ckpt_read_s)
    costs.add("spare wait", tiers, trace.spare_wait_s)


def _fallback_interval(p: SimParams, fallback_rate: float) -> float:
    """Daly's interval for the failures a strategy cannot survive (per second), capped."""
    cap = p.fallback_max_interval_h * 3600.0
    if fallback_rate > 0.0:
        cap = min(cap, theory.daly_interval(p.snapshot_s, 1.0 / fallback_rate))
    return max(cap, p.ckpt_write_s)


def _single_fallback_rate(p: SimParams, tier_of_class: Sequence[int]) -> float:
    share = sum(s for s, t in zip(p.class_shares, tier_of_class, strict=True) if t == FALLBACK)
    return share / p.mtbf_s


def _overlap_fallback_rate(
    p: SimParams,
    trace: Trace,
    down: npt.NDArray[np.float64],
    window_s: float,
    tier_of_class: Sequence[int],
    pair_fallback: Callable[[int, int], float],
) -> float:
    """To first order, how often a failure of class b strikes inside the window of an
    unrepaired class-a failure and the pair needs the disk, when neither alone would:
    sum of rate_a * window_a * rate_b * P(fallback | a, b). Windows are the mean
    recovery of each class on this trace plus ``window_s``."""
    import numpy as np

    rates = [s / p.mtbf_s for s in p.class_shares]
    total = 0.0
    for a in FailureClass:
        mask = trace.cls == a
        if not mask.any() or tier_of_class[a] == FALLBACK:
            continue
        window = float(np.mean(down[mask])) + window_s
        for b in FailureClass:
            if tier_of_class[b] != FALLBACK:
                total += rates[a] * window * rates[b] * pair_fallback(a, b)
    return total


def _in_memory_plan(
    name: str,
    p: SimParams,
    trace: Trace,
    costs: _Costs,
    tier_of_class: Sequence[int],
    *,
    base: npt.NDArray[np.int8],
    overhead: float,
    elements: list[Element | None] | None = None,
    escalate: Escalate | None = None,
    window_s: float = 0.0,
    pair_fallback: Callable[[int, int], float] | None = None,
) -> Plan:
    """A strategy that restores from memory, with asynchronous disk checkpoints behind,
    spaced for the failures it cannot survive: alone, or overlapping."""
    import numpy as np

    rate = _single_fallback_rate(p, tier_of_class)
    if pair_fallback is not None:
        n = len(trace)
        down = sum(costs.phases.values(), np.zeros((TIERS, n)))[base, np.arange(n)]
        rate += _overlap_fallback_rate(p, trace, down, window_s, tier_of_class, pair_fallback)
    return Plan(
        name=name,
        periodic=False,
        interval_s=_fallback_interval(p, rate),
        block_s=p.snapshot_s,
        commit_lag_s=p.ckpt_write_s,
        overhead=overhead,
        base_tier=base,
        phases=costs.phases,
        rework_s=costs.rework,
        elements=[] if elements is None else elements,
        escalate=escalate,
        window_s=window_s,
    )


def checkpoint_restart(p: SimParams, trace: Trace, *, asynchronous: bool) -> Plan:
    import numpy as np

    n = len(trace)
    costs = _Costs(n)
    _restart_costs(costs, p, trace, [FALLBACK])
    if asynchronous:
        block, lag = p.snapshot_s, p.ckpt_write_s
        interval = max(theory.daly_interval(block, p.mtbf_s), lag)
    else:
        block, lag = p.ckpt_fixed_s + p.ckpt_write_s, 0.0
        interval = theory.daly_interval(block, p.mtbf_s)
    return Plan(
        name="ckpt-async" if asynchronous else "ckpt-sync",
        periodic=True,
        interval_s=interval,
        block_s=block,
        commit_lag_s=lag,
        overhead=0.0,
        base_tier=np.full(n, FALLBACK, dtype=np.int8),
        phases=costs.phases,
        rework_s=costs.rework,
    )


def jit(p: SimParams, trace: Trace) -> Plan:
    import numpy as np

    n = len(trace)
    costs = _Costs(n)
    _restart_costs(costs, p, trace, [1, FALLBACK])
    costs.add("jit save", [1], p.ckpt_write_s)
    costs.rework[1] = trace.phase * p.step_time_s
    one_node = p.nodes == 1
    tier_of_class = [1, 1, FALLBACK if one_node else 1, FALLBACK if one_node else 1]
    base = np.asarray(tier_of_class, dtype=np.int8)[trace.cls]
    return _in_memory_plan("jit", p, trace, costs, tier_of_class, base=base, overhead=0.0)


def gemini(p: SimParams, trace: Trace) -> Plan:
    import numpy as np

    n = len(trace)
    costs = _Costs(n)
    for tier in (1, 2):
        costs.add("detect", [tier], p.detect_s)
        costs.add("restart", [tier], np.maximum(p.restart_s, _reset(p, trace)))
    costs.add("load", [1], p.state_per_gpu / (p.host_gb_s * 1e9))
    costs.add("load", [2], p.state_per_node / (p.net_node_gb_s * 1e9))
    costs.add("spare wait", [2], trace.spare_wait_s)
    _restart_costs(costs, p, trace, [FALLBACK])
    # The iteration in flight is lost, and so is the one before: its checkpoint is sent
    # to the peers during the next iteration.
    costs.rework[1] = costs.rework[2] = (1.0 + trace.phase) * p.step_time_s
    # Groups of `r` consecutive nodes hold each other's checkpoints; a remainder joins
    # the last group. Losing `r` nodes of a group before re-replication can take every
    # copy of some node's checkpoint: disk fallback (conservative for larger groups).
    r = min(p.gemini_replicas, p.nodes)
    groups = max(1, p.nodes // r)

    def escalate(elements: Sequence[Element]) -> int:
        lost: dict[int, set[int]] = {}
        for _, node, _ in elements:
            lost.setdefault(min(node // r, groups - 1), set()).add(node)
        if any(len(nodes) >= r for nodes in lost.values()):
            return FALLBACK
        return 2 if lost else 1

    node_tier = 2 if r >= 2 else FALLBACK
    tier_of_class = [1, 1, node_tier, node_tier]
    base = np.asarray(tier_of_class, dtype=np.int8)[trace.cls]
    elements: list[Element | None] = [
        (NODE, int(node), 0) if takes else None
        for node, takes in zip(trace.node.tolist(), trace.loses_node.tolist(), strict=True)
    ]
    same_group = (r - 1) / (p.nodes - 1) if p.nodes > 1 and r == 2 else 0.0

    def pair_fallback(a: int, b: int) -> float:
        both_nodes = a >= FailureClass.NODE_LOSS and b >= FailureClass.NODE_LOSS
        return same_group if both_nodes and node_tier == 2 else 0.0

    return _in_memory_plan(
        "gemini",
        p,
        trace,
        costs,
        tier_of_class,
        base=base,
        overhead=p.gemini_overhead,
        elements=elements,
        escalate=escalate,
        window_s=p.step_time_s,
        pair_fallback=pair_fallback,
    )


def _reset(p: SimParams, trace: Trace) -> npt.NDArray[np.float64]:
    import numpy as np

    return np.where(trace.cls == FailureClass.DEVICE_MEMORY, p.gpu_reset_s, 0.0)


def leto(p: SimParams, trace: Trace) -> Plan:
    import numpy as np

    n = len(trace)
    tiers = core_tiers(p.nodes, p.ranks_per_node, p.tier1, p.tier2, p.tier2_parity)
    costs = _Costs(n)
    in_memory = [0, 1, 2]
    costs.add("detect", in_memory, p.detect_s)
    costs.add("promote", in_memory, p.promote_s)
    costs.add("reconcile", in_memory, p.reconcile_at_scale_s)
    costs.add("rebuild", in_memory, p.rebuild_s)
    reset = _reset(p, trace)
    costs.add("reset", [1, 2], reset)
    costs.add("decode", [1], p.state_per_node / (p.host_gb_s * 1e9))
    takes = trace.loses_node
    costs.add("spare wait", [2], np.where(takes, trace.spare_wait_s, 0.0))
    costs.add("join", [2], np.where(takes, p.spare_join_s, 0.0))
    costs.add("decode", [2], p.tier2_restore_s)
    _restart_costs(costs, p, trace, [FALLBACK])
    partial = trace.phase * p.step_time_s
    costs.rework[0] = costs.rework[1] = partial
    costs.rework[2] = partial + trace.lag * p.tier2_every_steps * p.step_time_s
    rank_tier = tiers.tier([(RANK, 0, 0)])
    node_tier = tiers.tier([(NODE, 0, 0)])
    tier_of_class = [0, rank_tier, node_tier, node_tier]
    base = np.asarray(tier_of_class, dtype=np.int8)[trace.cls]
    elements: list[Element | None] = []
    for c, node, rank in zip(
        trace.cls.tolist(), trace.node.tolist(), trace.rank.tolist(), strict=True
    ):
        if c == FailureClass.IN_PLACE:
            elements.append(None)
        elif c == FailureClass.DEVICE_MEMORY:
            elements.append((RANK, node, rank))
        else:
            elements.append((NODE, node, 0))
    window = p.tier2_every_steps * p.step_time_s

    def element(c: int, node: int, local: int) -> list[Element]:
        if c == FailureClass.IN_PLACE:
            return []
        return [(RANK, node, local) if c == FailureClass.DEVICE_MEMORY else (NODE, node, 0)]

    def pair_fallback(a: int, b: int) -> float:
        same = 1.0 / p.nodes
        if p.nodes == 1:
            return float(tiers.tier(element(a, 0, 0) + element(b, 0, 1)) == FALLBACK)
        return same * (tiers.tier(element(a, 0, 0) + element(b, 0, 1)) == FALLBACK) + (
            1.0 - same
        ) * (tiers.tier(element(a, 0, 0) + element(b, 1, 1)) == FALLBACK)

    return _in_memory_plan(
        "leto",
        p,
        trace,
        costs,
        tier_of_class,
        base=base,
        overhead=p.leto_overhead_fraction,
        elements=elements,
        escalate=tiers.tier,
        window_s=window,
        pair_fallback=pair_fallback,
    )


def torchft(p: SimParams, trace: Trace) -> Plan:
    """torchft: the failed replica group restarts and heals from a live peer while the
    other groups train on. A heal of ``D`` wall seconds at a throughput ``f`` of nominal
    costs ``D (1 - f)`` of training: each phase is charged at that share. The step in
    flight is lost (the survivors drop it). One group (a one-node job) has no peer:
    disk fallback."""
    import numpy as np

    n = len(trace)
    costs = _Costs(n)
    stalled = 1.0 - p.torchft_survivor_fraction
    takes = trace.loses_node
    costs.add("detect", [0], p.detect_s * stalled)
    costs.add("reset", [0], _reset(p, trace) * stalled)
    costs.add("spare wait", [0], np.where(takes, trace.spare_wait_s, 0.0) * stalled)
    costs.add("join", [0], np.where(takes, p.spare_join_s, 0.0) * stalled)
    costs.add("group restart", [0], p.torchft_restart_s * stalled)
    costs.add("quorum", [0], p.torchft_quorum_s * stalled)
    costs.add("heal", [0], p.torchft_heal_s * stalled)
    _restart_costs(costs, p, trace, [FALLBACK])
    costs.rework[0] = trace.phase * p.step_time_s
    tier = 0 if p.torchft_replicas >= 2 else FALLBACK
    tier_of_class = [tier] * len(FailureClass)
    base = np.full(n, tier, dtype=np.int8)
    return _in_memory_plan("torchft", p, trace, costs, tier_of_class, base=base, overhead=0.0)


def plan(name: str, params: SimParams, trace: Trace) -> Plan:
    if name == "ckpt-sync":
        return checkpoint_restart(params, trace, asynchronous=False)
    if name == "ckpt-async":
        return checkpoint_restart(params, trace, asynchronous=True)
    if name == "gemini":
        return gemini(params, trace)
    if name == "jit":
        return jit(params, trace)
    if name == "leto":
        return leto(params, trace)
    if name == "torchft":
        return torchft(params, trace)
    raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
