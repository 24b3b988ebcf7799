"""``leto bench control``: the coordinator's protocol-model cost per step and per plan.

In process, no training: a :class:`~leto.core.cluster.ClusterModel` as the gloo
coordinator builds it (:class:`~leto.spec.trace.CoreSetup`), fed one step at a time
the way the coordinator feeds it, and timed in CPU seconds (``time.process_time``):

* aggregated (today): ``CommitStep(V)`` once every rank voted; each rank's
  ``finished(V)`` judged on arrival by the guard of ``ApplyStep(V, [rank])``; one
  ``ApplyStep(V, ranks)``. Then the reconcile plan after a loss
  (``ClusterModel.plan``: a rank's memory lost -> tier 1; a node lost -> tier 2).
* chunk-level (the reference semantics, what the coordinator fed before): every
  rank's Compute, Reduce, Prepare, Decide, then every chunk's BeginChunk, EndChunk,
  ParityChunk and Finish of every rank (:func:`leto.core.aggregate.expand`); the plan
  read chunk by chunk (``plan(..., compress=False)``). Only at the sizes it can still do.

Both paths must end in the same model state (checked; ``same_state``); the ratios are
measured side by side in one run.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

from leto.core import events as ev
from leto.core.aggregate import expand
from leto.core.cluster import ClusterModel, ClusterState
from leto.core.reconcile import plan
from leto.spec.trace import CoreSetup

__all__ = ["control_table", "parse_sizes", "run_control"]

TARGET_STEP_MS = 5.0
TARGET_PLAN_MS = 100.0


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``"8x256,32x256"`` -> ``[(8, 256), (32, 256)]`` (ranks x chunks)."""
    out = []
    for part in text.split(","):
        if part.strip():
            r, _, c = part.strip().partition("x")
            out.append((int(r), int(c)))
    return out


def _cpu_ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.process_time()
    got = fn()
    return 1000 * (time.process_time() - t), got


def _setup(ranks: int, chunks: int, per_node: int) -> tuple[ClusterModel, ClusterState]:
    nodes = [per_node] * (ranks // per_node) + ([ranks % per_node] if ranks % per_node else [])
    setup = CoreSetup(nodes=tuple(nodes), chunks=chunks, k=None)
    model = setup.model()
    return model, setup.initial(model)


def _aggregated_step(m: ClusterModel, s: ClusterState, v: int) -> ClusterState:
    s, _ = m.step(s, ev.CommitStep(v))
    for r in range(m.config.ranks):  # each finished(V), judged on arrival
        if m.why_not(s, ev.ApplyStep(v, (r,))) is not None:
            raise AssertionError(f"rank {r} refused")
    s, _ = m.step(s, ev.ApplyStep(v, range(m.config.ranks)))
    return s


def _chunk_level_step(m: ClusterModel, s: ClusterState, v: int) -> ClusterState:
    events = [*expand(m, ev.CommitStep(v)), *expand(m, ev.ApplyStep(v, range(m.config.ranks)))]
    for e in events:
        s, _ = m.step(s, e)
    return s


def _run_path(
    ranks: int, chunks: int, per_node: int, steps: int, aggregated: bool
) -> dict[str, Any]:
    m, s = _setup(ranks, chunks, per_node)
    feed = _aggregated_step if aggregated else _chunk_level_step
    times = []
    for v in range(1, steps + 1):
        ms, s = _cpu_ms(functools.partial(feed, m, s, v))
        times.append(ms)
    plans: dict[str, Any] = {}
    node = m.config.topology.nodes - 1
    for name, fault in (("lose_memory", ev.LoseMemory(0)), ("lose_node", ev.LoseNode(node))):
        lost, _ = m.step(s, fault)
        surv = m.survivors(lost)
        ms, p = _cpu_ms(functools.partial(plan, surv, compress=aggregated))
        plans[name] = {
            "ms": ms,
            "kind": p.kind.value,
            "target": p.target,
            "repairs": len(p.repairs),
        }
    warm = times[1:] or times
    return {
        "step_ms": sorted(warm)[len(warm) // 2],
        "step_ms_all": times,
        "plan": plans,
        "state": s,
    }


def run_control(
    ranks: int,
    chunks: int,
    *,
    per_node: int = 8,
    steps: int = 5,
    reference_sizes: Sequence[tuple[int, int]] = ((8, 256), (32, 256)),
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    say = progress or (lambda _line: None)
    rows = []
    sizes = [*dict.fromkeys([*reference_sizes, (ranks, chunks)])]
    for r, c in sizes:
        reference = (r, c) in reference_sizes
        say(f"{r} ranks x {c} chunks: aggregated")
        agg = _run_path(r, c, min(per_node, r), steps, aggregated=True)
        row: dict[str, Any] = {
            "ranks": r,
            "chunks": c,
            "aggregated": {k: v for k, v in agg.items() if k != "state"},
        }
        if reference:
            say(f"{r} ranks x {c} chunks: chunk-level")
            ref = _run_path(r, c, min(per_node, r), steps, aggregated=False)
            row["chunk_level"] = {k: v for k, v in ref.items() if k != "state"}
            row["same_state"] = ref["state"] == agg["state"]
            row["step_ratio"] = ref["step_ms"] / max(agg["step_ms"], 1e-6)
            row["plan_ratio"] = {
                k: ref["plan"][k]["ms"] / max(agg["plan"][k]["ms"], 1e-6) for k in agg["plan"]
            }
            row["same_plans"] = all(
                {**ref["plan"][k], "ms": 0} == {**agg["plan"][k], "ms": 0} for k in agg["plan"]
            )
        rows.append(row)
    main = rows[-1]["aggregated"]
    plan_ms = max(p["ms"] for p in main["plan"].values())
    return {
        "ranks": ranks,
        "chunks": chunks,
        "per_node": per_node,
        "steps": steps,
        "rows": rows,
        "targets": {"step_ms": TARGET_STEP_MS, "plan_ms": TARGET_PLAN_MS},
        "met": {"step": main["step_ms"] <= TARGET_STEP_MS, "plan": plan_ms <= TARGET_PLAN_MS},
    }


def control_table(res: dict[str, Any]) -> str:
    lines = [
        f"leto bench control: the coordinator's model CPU (ms), {res['per_node']} ranks per node",
        f"{'ranks x chunks':>16} {'path':<12} {'step':>10} {'plan tier1':>11} "
        f"{'plan node':>10} {'ratio step':>11} {'ratio plan':>11}",
    ]
    for row in res["rows"]:
        size = f"{row['ranks']} x {row['chunks']}"
        for path in ("chunk_level", "aggregated"):
            if path not in row:
                continue
            d = row[path]
            ratio_s = ratio_p = ""
            if path == "aggregated" and "step_ratio" in row:
                ratio_s = f"{row['step_ratio']:.0f}x"
                ratio_p = f"{max(row['plan_ratio'].values()):.0f}x"
            lines.append(
                f"{size:>16} {path.replace('_', '-'):<12} {d['step_ms']:>10.2f} "
                f"{d['plan']['lose_memory']['ms']:>11.2f} {d['plan']['lose_node']['ms']:>10.2f} "
                f"{ratio_s:>11} {ratio_p:>11}"
            )
    checked = [r for r in res["rows"] if "same_state" in r]
    if checked:
        same = all(r["same_state"] and r["same_plans"] for r in checked)
        lines.append(
            "both paths end in the same model state and plan the same repairs: "
            + ("yes" if same else "NO")
        )
    t, met = res["targets"], res["met"]
    lines.append(
        f"targets at {res['ranks']} x {res['chunks']}: step <= {t['step_ms']:g} ms "
        f"({'met' if met['step'] else 'NOT met'}), plan <= {t['plan_ms']:g} ms "
        f"({'met' if met['plan'] else 'NOT met'})"
    )
    return "\n".join(lines)
