"""``leto bench control``: the coordinator's protocol-model cost per step and per plan.

In process, no training: a :class:`~leto.core.cluster.ClusterModel` as the gloo
coordinator builds it (:class:`~leto.spec.trace.CoreSetup`), fed one step at a time
the way the coordinator feeds it, and timed in CPU seconds (``time.process_time``):

* aggregated (today): every rank's ``Close`` of its loop tail as one ``CloseRanks``,
  then ``CommitStep(V)`` once every rank voted; each rank's ``finished(V)`` judged on arrival by the guard of ``ApplyStep(V, [rank])``; one
  ``ApplyStep(V, ranks)``. Then the reconcile plan after a loss
  (``ClusterModel.plan``: a rank's memory lost -> tier 1; a node lost -> tier 2; a
  rank crashed after COMMIT of the next step, before any rank applied it -> every
  rank rolls every chunk forward, one run of chunks per rank).
* chunk-level (the reference semantics, what the coordinator fed before): every
  rank's Close, Compute, Reduce, Prepare, Decide, then every chunk's BeginChunk, EndChunk,
  ParityChunk and Finish of every rank (:func:`leto.core.aggregate.expand`); the plan
  read chunk by chunk, one repair per chunk (``plan(..., compress=False)``). Only at
  the sizes it can still do.

Both paths must end in the same model state (checked; ``same_state``) and plan the
same repairs (the runs expanded; ``same_plans``); the ratios are measured side by side
in one run. ``adopt``: the roll-forward recovery's adoption of the trainers' reports
(:func:`leto.core.adopt.adopt`), the reports as runs of chunk states through JSON, as
the gloo coordinator decodes them, beside reports listing every chunk (the former
report: a fresh tuple per rank), both adopting to the same state and plan (checked,
``same_adoption``); and the adoption's record (its JSON size).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from leto.core import events as ev
from leto.core.adopt import Retained, adopt
from leto.core.aggregate import expand
from leto.core.cluster import ClusterModel, ClusterState
from leto.core.reconcile import Plan, expand_repairs, plan
from leto.core.runs import row_from_runs, runs_json
from leto.core.txn import TxnState
from leto.spec.trace import CoreSetup

__all__ = ["control_table", "parse_sizes", "run_control"]

TARGET_STEP_MS = 5.0
TARGET_PLAN_MS = 100.0
TARGET_ADOPT_MS = 20.0
TARGET_RECORD_BYTES = 1 << 20
_OBJECTS = ("state", "planned")  # compared, not reported


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


def _closed(m: ClusterModel, s: ClusterState, aggregated: bool = True) -> ClusterState:
    """Every rank's loop tail of the step before closed, as the coordinator feeds it
    before the next step's votes (``leto.backends.gloo.model_feed.closes``: one
    ``CloseRanks``), or chunk-level: each rank's ``Close``."""
    tail = [r for r in range(m.config.ranks) if s.pc[r] is TxnState.TAIL]
    if tail:
        for e in [ev.CloseRanks(tail)] if aggregated else expand(m, ev.CloseRanks(tail)):
            s, _ = m.step(s, e)
    return s


def _aggregated_step(m: ClusterModel, s: ClusterState, v: int) -> ClusterState:
    s, _ = m.step(_closed(m, s), ev.CommitStep(v))
    for r in range(m.config.ranks):  # each finished(V), judged on arrival
        if m.why_not(s, ev.ApplyStep(v, (r,))) is not None:
            raise AssertionError(f"rank {r} refused")
    s, _ = m.step(s, ev.ApplyStep(v, range(m.config.ranks)))
    return s


def _chunk_level_step(m: ClusterModel, s: ClusterState, v: int) -> ClusterState:
    s = _closed(m, s, aggregated=False)
    events = [*expand(m, ev.CommitStep(v)), *expand(m, ev.ApplyStep(v, range(m.config.ranks)))]
    for e in events:
        s, _ = m.step(s, e)
    return s


def _roll_forward(m: ClusterModel, s: ClusterState, v: int, aggregated: bool) -> ClusterState:
    """COMMIT(v) recorded, then rank 0 crashes before any rank applied it: the recovery
    up to its plan (every rank rolls forward)."""
    commit = [ev.CommitStep(v)] if aggregated else list(expand(m, ev.CommitStep(v)))
    s = _closed(m, s, aggregated)
    for e in (*commit, ev.Crash(0), ev.Detect(), ev.Fence(), ev.Promote(0), ev.EndPromote()):
        s, _ = m.step(s, e)
    return s


def _wire(rows: Sequence[Sequence[int]], as_runs: bool) -> list[Any]:
    """Each rank's row as its trainer puts it in its report (runs, or every chunk
    listed: the former report), through JSON as on the wire."""
    return [json.loads(json.dumps(runs_json(r) if as_runs else list(r))) for r in rows]


def _decoded(s: ClusterState, data: list[Any], undo: list[Any], as_runs: bool) -> Retained:
    """The coordinator's reading of the reports (``RecoveryDriver._truth``): runs decode
    to shared rows; listed ones to a fresh tuple per rank."""
    if as_runs:
        d = tuple(row_from_runs(x) for x in data)
        u = tuple(row_from_runs(x) for x in undo)
    else:
        d = tuple(tuple(map(int, x)) for x in data)
        u = tuple(tuple(map(int, x)) for x in undo)
    return Retained(data=d, undo=u, grad=s.grad, par=s.par, gpar=s.gpar, t2=s.t2, t2lost=s.t2lost)


def _listed_record(r: Retained) -> dict[str, Any]:
    """The adoption's record as it was, every chunk's value listed (what
    :meth:`Retained.from_record` still reads)."""
    rec = r.to_record()
    return {
        **{k: v for k, v in rec.items() if not k.endswith("_runs")},
        "data": [list(d) for d in r.data],
        "undo": [list(u) for u in r.undo],
        "par": [None if p is None else [list(x) for x in p] for p in r.par],
    }


def _adoption(m: ClusterModel, s: ClusterState, as_runs: bool) -> dict[str, Any]:
    """Adopting the trainers' reports of ``s`` and recording the adoption: reports as
    runs (today) or listed (the reference); CPU ms of the coordinator's part (decode and
    adopt; the record's JSON) and the record's size."""
    data, undo = _wire(s.data, as_runs), _wire(s.undo, as_runs)
    ms, (r, adopted) = _cpu_ms(lambda: _adopt(m, s, data, undo, as_runs))
    rec_ms, text = _cpu_ms(
        lambda: json.dumps(r.to_record() if as_runs else _listed_record(r), separators=(",", ":"))
    )
    assert Retained.from_record(json.loads(text)) == r  # the record replays to the same
    plan_ms, p = _cpu_ms(functools.partial(m.plan, adopted))
    return {
        "ms": ms,
        "record_ms": rec_ms,
        "record_bytes": len(text),
        "plan_ms": plan_ms,
        "runs": len(p.repairs),
        "state": adopted,
        "planned": p,
    }


def _adopt(
    m: ClusterModel, s: ClusterState, data: list[Any], undo: list[Any], as_runs: bool
) -> tuple[Retained, ClusterState]:
    r = _decoded(s, data, undo, as_runs)
    return r, adopt(m, s, r)


def _plan_row(ms: float, p: Plan) -> dict[str, Any]:
    return {
        "ms": ms,
        "kind": p.kind.value,
        "target": p.target,
        "repairs": sum(x.count for x in p.repairs),  # chunk-level repairs
        "runs": len(p.repairs),  # as planned: runs of chunks
    }


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
    planned: dict[str, Plan] = {}
    node = m.config.topology.nodes - 1
    forward = _roll_forward(m, s, steps + 1, aggregated)
    for name, before in (
        ("lose_memory", m.step(s, ev.LoseMemory(0))[0]),
        ("lose_node", m.step(s, ev.LoseNode(node))[0]),
        ("roll_forward", forward),
    ):
        surv = m.survivors(before)
        ms, p = _cpu_ms(functools.partial(plan, surv, compress=aggregated))
        plans[name] = _plan_row(ms, p)
        planned[name] = p
    out: dict[str, Any] = {}
    if aggregated:  # the reports as runs, and listed (the reference), side by side
        runs, listed = _adoption(m, forward, True), _adoption(m, forward, False)
        out["adopt"] = {k: v for k, v in runs.items() if k not in _OBJECTS}
        out["adopt_listed"] = {k: v for k, v in listed.items() if k not in _OBJECTS}
        out["same_adoption"] = (
            runs["state"] == listed["state"] and runs["planned"] == listed["planned"]
        )
    warm = times[1:] or times
    return {
        "step_ms": sorted(warm)[len(warm) // 2],
        "step_ms_all": times,
        "plan": plans,
        **out,
        "state": s,
        "planned": planned,
    }


def _same_plans(agg: dict[str, Plan], ref: dict[str, Plan]) -> bool:
    """The aggregated plans' runs expand to the chunk-level plans."""
    return all(attrs.evolve(agg[k], repairs=expand_repairs(agg[k].repairs)) == ref[k] for k in agg)


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
            "aggregated": {k: v for k, v in agg.items() if k not in _OBJECTS},
        }
        if reference:
            say(f"{r} ranks x {c} chunks: chunk-level")
            ref = _run_path(r, c, min(per_node, r), steps, aggregated=False)
            row["chunk_level"] = {k: v for k, v in ref.items() if k not in _OBJECTS}
            row["same_state"] = ref["state"] == agg["state"]
            row["step_ratio"] = ref["step_ms"] / max(agg["step_ms"], 1e-6)
            row["plan_ratio"] = {
                k: ref["plan"][k]["ms"] / max(agg["plan"][k]["ms"], 1e-6) for k in agg["plan"]
            }
            row["same_plans"] = _same_plans(agg["planned"], ref["planned"])
        rows.append(row)
    main = rows[-1]["aggregated"]
    plan_ms = max(p["ms"] for p in main["plan"].values())
    return {
        "benchmark": "control",
        "ranks": ranks,
        "chunks": chunks,
        "per_node": per_node,
        "steps": steps,
        "rows": rows,
        "targets": {
            "step_ms": TARGET_STEP_MS,
            "plan_ms": TARGET_PLAN_MS,
            "adopt_ms": TARGET_ADOPT_MS,
            "record_bytes": TARGET_RECORD_BYTES,
        },
        "met": {
            "step": main["step_ms"] <= TARGET_STEP_MS,
            "plan": plan_ms <= TARGET_PLAN_MS,
            "adopt": main["adopt"]["ms"] <= TARGET_ADOPT_MS,
            "record": main["adopt"]["record_bytes"] <= TARGET_RECORD_BYTES,
        },
    }


def control_table(res: dict[str, Any]) -> str:
    lines = [
        f"leto bench control: the coordinator's model CPU (ms), {res['per_node']} ranks per node",
        f"{'ranks x chunks':>16} {'path':<12} {'step':>10} {'plan tier1':>11} "
        f"{'plan node':>10} {'plan fwd':>10} {'ratio step':>11} {'ratio plan':>11} "
        f"{'adopt':>9} {'its plan':>9}",
    ]
    for row in res["rows"]:
        size = f"{row['ranks']} x {row['chunks']}"
        for path in ("chunk_level", "aggregated"):
            if path not in row:
                continue
            d = row[path]
            ratio_s = ratio_p = adopt_ms = adopted_plan = ""
            if path == "aggregated" and "step_ratio" in row:
                ratio_s = f"{row['step_ratio']:.0f}x"
                ratio_p = f"{max(row['plan_ratio'].values()):.0f}x"
            if "adopt" in d:
                adopt_ms = f"{d['adopt']['ms']:.2f}"
                adopted_plan = f"{d['adopt']['plan_ms']:.2f}"
            plans = d["plan"]
            lines.append(
                f"{size:>16} {path.replace('_', '-'):<12} {d['step_ms']:>10.2f} "
                f"{plans['lose_memory']['ms']:>11.2f} {plans['lose_node']['ms']:>10.2f} "
                f"{plans['roll_forward']['ms']:>10.2f} {ratio_s:>11} {ratio_p:>11} "
                f"{adopt_ms:>9} {adopted_plan:>9}"
            )
    checked = [r for r in res["rows"] if "same_state" in r]
    if checked:
        same = all(r["same_state"] and r["same_plans"] for r in checked)
        lines.append(
            "both paths end in the same model state and plan the same repairs: "
            + ("yes" if same else "NO")
        )
    lines.append(
        "adopting the trainers' reports (decode + adopt, CPU ms) and its record, reports "
        "as runs beside reports listing every chunk (the reference):"
    )
    lines.append(
        f"{'ranks x chunks':>16} {'runs ms':>9} {'record':>10} {'listed ms':>10} "
        f"{'record':>10} {'ratio':>7}  same adoption"
    )
    for row in res["rows"]:
        d = row["aggregated"]
        a, b = d["adopt"], d["adopt_listed"]
        lines.append(
            f"{row['ranks']} x {row['chunks']:<8}".rjust(16)
            + f" {a['ms']:>9.2f} {_size(a['record_bytes']):>10} {b['ms']:>10.2f} "
            f"{_size(b['record_bytes']):>10} {b['ms'] / max(a['ms'], 1e-6):>6.0f}x  "
            + ("yes" if d["same_adoption"] else "NO")
        )
    t, met = res["targets"], res["met"]

    def said(key: str) -> str:
        return "met" if met[key] else "NOT met"

    lines.append(
        f"targets at {res['ranks']} x {res['chunks']}: step <= {t['step_ms']:g} ms "
        f"({said('step')}), plan <= {t['plan_ms']:g} ms ({said('plan')}), adoption <= "
        f"{t['adopt_ms']:g} ms ({said('adopt')}), its record <= "
        f"{_size(t['record_bytes'])} ({said('record')})"
    )
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
