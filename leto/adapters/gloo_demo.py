"""The gloo demo: ``examples/gpt.py`` on real processes, killed at every phase of a step.

4 ranks as 2 nodes x 2 (two ``leto launch`` agents on 127.0.0.1), a character GPT
trained with AdamW. The fault plan SIGKILLs trainers at forward, backward, the
gradient all-reduce, prepare, both sides of the COMMIT, three points of a chunk's
apply and the tier-1 update, and finish; it kills a keeper (its memory is rebuilt
from tier 1: with gloo's default ``tier1_code``, copied from the other rank of its
node, which holds the same state; with ``tier1_code = "parity"`` in the
``--config`` file, decoded from the node's parity), hangs a trainer (the heartbeat
timeout finds it, the fence kills it), makes one raise, fails a rank during a
recovery (which restarts at the next generation) and SIGKILLs a whole node's agent
(a replacement node joins and the tier-2 snapshot is restored). Then the same job runs without faults and every
rank's parameters, optimizer state and process state (scheduler, RNG, sampler)
are compared bitwise (SHA-256 of each buffer).

Entry points: :func:`demo` (returns the summary dict) and :func:`run_cli` (``leto
demo``, whose default backend this is: prints the timeline, or ``--json``). The
summary has the fake demo's keys where they apply (``bitwise_equal``,
``every_failure_recovered``, ...), plus ``recovery_seconds``: one entry per failure,
in order, the wall-clock seconds from its detection until training resumed (a
failure during a recovery: until the restarted recovery ended; ``None`` for a
failure never recovered), and ``trace_ok``: both runs' event logs replay through the
core's protocol model (``leto spec trace``; a run that does not is not ok).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["STEPS", "demo", "example_script", "fault_plan", "failure_seconds", "run_cli"]

STEPS = 40  # the default: the fault plan of 2 nodes x 2 ranks needs 34


def example_script() -> Path:
    """``examples/gpt.py`` of this checkout."""
    here = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
    if not here.is_file():
        raise FileNotFoundError(
            f"the gloo demo runs examples/gpt.py, which is not at {here} (run it from a "
            "source checkout of leto)"
        )
    return here


def n_chunks_of(chunk_size: int) -> int:
    """Chunks per rank of examples/gpt.py's model (params packed, 256-byte aligned)."""
    import torch

    sys.path.insert(0, str(example_script().parent))
    try:
        import gpt  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    from importlib import resources

    text = (resources.files("leto") / "data" / "sonnets.txt").read_text(encoding="utf-8")
    with torch.device("meta"):
        model = gpt.GPT(len(set(text)))
    off, align = 0, 256 // 4
    for p in model.parameters():
        off = -(-off // align) * align + p.numel()
    return max(1, -(-off // chunk_size))


def fault_plan(
    *, steps: int, n_chunks: int, nodes: int, per_node: int, node_loss: bool = True
) -> list[dict[str, Any]]:
    """A fault at every point of a step, then memory, hang, exception, restart and node loss."""
    W = nodes * per_node
    last = n_chunks - 1
    points: list[dict[str, Any]] = [
        {"phase": "forward"},
        {"phase": "backward"},
        {"phase": "allreduce"},
        {"phase": "prepare"},
        {"phase": "decide", "where": "before"},
        {"phase": "decide", "where": "after"},
        {"phase": "apply", "chunk": 0, "where": "undo_saved"},
        {"phase": "apply", "chunk": min(1, last), "where": "mid_write"},
        {"phase": "apply", "chunk": last, "where": "written"},
        {"phase": "parity", "chunk": min(2, last)},
        {"phase": "finish"},
    ]
    # faults two steps apart: ranks run at most one step apart (the all-reduce holds them
    # together), so each failure strikes a job that runs, not one still recovering
    plan = []
    step = 2
    for i, pt in enumerate(points):
        plan.append({"kind": "crash", "rank": (i + 1) % W, "step": step, **pt})
        step += 2
    plan.append(
        {
            "kind": "lose_memory",
            "rank": 1 % W,
            "step": step,
            "phase": "apply",
            "chunk": min(1, last),
            "where": "written",
        }
    )
    step += 2
    plan.append({"kind": "hang", "rank": 2 % W, "step": step, "phase": "forward"})
    step += 2
    plan.append({"kind": "exception", "rank": 0, "step": step, "phase": "backward"})
    step += 2
    plan.append({"kind": "crash", "rank": 3 % W, "step": step, "phase": "backward"})
    plan.append(
        {"kind": "crash", "rank": 1 % W, "step": step, "phase": "recovery", "where": "Reconcile"}
    )
    step += 2
    if node_loss and nodes >= 2:
        plan.append({"kind": "lose_node", "rank": per_node, "step": step, "phase": "prepare"})
        step += 2
    if step > steps:
        raise ValueError(f"the fault plan needs at least {step} steps, got {steps}")
    return plan


def failure_seconds(events: list[dict[str, Any]]) -> list[float | None]:
    """Per ``failure`` event, in order: seconds from it to the end of the recovery that
    resumed training after it (``None`` where no recovery ended after it)."""
    ends = [e["t"] for e in events if e["event"] == "recovery_end"]
    out: list[float | None] = []
    for f in events:
        if f["event"] != "failure":
            continue
        end = next((t for t in ends if t >= f["t"]), None)
        out.append(None if end is None else round(end - f["t"], 6))
    return out


def _config(
    path: Path,
    *,
    nodes: int,
    per_node: int,
    chunk_size: int,
    tier2_interval: int,
    checkpoint_dir: str | None,
    tier1_code: str = "auto",
    verify_chunks: bool = True,
    tier1: bool = True,
    tier2: bool = True,
) -> Path:
    lines = [
        "[leto]",
        'backend = "gloo"',
        f'topology = "{nodes}x{per_node}"',
        f"chunk_size = {chunk_size}",
        f"tier2_interval = {tier2_interval}",
        f'tier1_code = "{tier1_code}"',
        f"verify_chunks = {'true' if verify_chunks else 'false'}",
        f"tier1 = {'true' if tier1 else 'false'}",
        f"tier2 = {'true' if tier2 else 'false'}",
    ]
    if checkpoint_dir:
        lines.append(f'checkpoint_dir = "{checkpoint_dir}"')
    path.write_text("\n".join(lines) + "\n")
    return path


def demo(
    *,
    steps: int = STEPS,
    nodes: int = 2,
    ranks_per_node: int = 2,
    chunk_size: int = 4096,
    tier2_interval: int = 10,
    checkpoint_dir: str | None = None,
    tier1_code: str = "auto",
    verify_chunks: bool = True,
    tier1: bool = True,
    tier2: bool = True,
    seed: int = 0,
    faults: bool = True,
    hang_timeout: float = 2.0,
    workdir: str | None = None,
    out: Any = None,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Run the faulted job and its failure-free twin; the summary (see the module docstring)."""
    from leto.backends.gloo.harness import run_local

    from .config import Config
    from .report import summarize, timeline_lines

    def say(msg: str) -> None:
        if out is not None:
            print(msg, file=out, flush=True)

    t_all = time.perf_counter()
    script = example_script()
    n_chunks = n_chunks_of(chunk_size)
    plan = (
        fault_plan(steps=steps, n_chunks=n_chunks, nodes=nodes, per_node=ranks_per_node)
        if faults
        else []
    )  # (before anything is created: too few steps is refused here)
    work = Path(workdir or tempfile.mkdtemp(prefix="leto-gloo-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = _config(
        work / "gloo.toml",
        nodes=nodes,
        per_node=ranks_per_node,
        chunk_size=chunk_size,
        tier2_interval=tier2_interval,
        checkpoint_dir=checkpoint_dir,
        tier1_code=tier1_code,
        verify_chunks=verify_chunks,
        tier1=tier1,
        tier2=tier2,
    )
    args = ["--config", str(cfg), "--steps", str(steps), "--seed", str(seed)]
    extra = ["--hang-timeout", str(hang_timeout), "--quiet", "--no-echo"]
    say(
        f"leto demo (gloo): examples/gpt.py, {steps} steps, {nodes} nodes x {ranks_per_node} ranks "
        f"(real processes on 127.0.0.1), {n_chunks} chunks per rank, {len(plan)} planned faults"
    )
    res = run_local(
        str(script),
        nnodes=nodes,
        nproc=ranks_per_node,
        run_dir=work / "faulted",
        faults=plan,
        extra=extra,
        script_args=args,
        timeout=timeout,
    )
    for line in timeline_lines(res.events):
        say(line)
    ref = run_local(
        str(script),
        nnodes=nodes,
        nproc=ranks_per_node,
        run_dir=work / "failure-free",
        extra=extra,
        script_args=args,
        timeout=timeout,
    )
    s, r = summarize(res.events), summarize(ref.events)
    a, b = s["digests"] or {}, r["digests"] or {}
    params_equal = bool(a) and all(a[k]["param"] == b.get(k, {}).get("param") for k in a)
    state_equal = bool(a) and all(
        v == b.get(k, {}).get(name)
        for k, d in a.items()
        for name, v in d.items()
        if name != "param"
    )
    bitwise = bool(a) and a == b and res.ok and ref.ok
    traces = [_trace(run.run_dir) for run in (res, ref)]
    recs = res.recoveries
    by_kind = s["recoveries_by_kind"]
    failure_events = res.of("failure")
    per_failure = failure_seconds(res.events)
    from leto.backends.gloo.faults import point

    covered = sorted({f"{f['kind']}: {point(f)}" for f in plan})
    kept_as = Config.load(cfg).tier1_kind  # this job's tier 1: parity, replicas or off
    grads_tier1 = sum(int(x.get("grads_repaired_tier1", 0)) for x in recs)
    result = {
        "backend": "gloo",
        "bitwise_equal": bitwise,
        "params_equal": params_equal,
        "optimizer_state_equal": state_equal,
        "failures_injected": len(failure_events),
        "failures_planned": len(plan),
        "every_failure_recovered": res.ok
        and s["status"] == "ok"
        and len(failure_events) == len(plan)
        and None not in per_failure,
        "recoveries": len(recs),
        "recoveries_by_kind": by_kind,
        "rolled_forward": sum(1 for x in recs if x.get("chunks_rolled_forward")),
        "rolled_back": sum(
            1 for x in recs if x.get("kind") == "back" or x.get("chunks_rolled_back")
        ),
        "chunks_rolled_forward": s["chunks_rolled_forward"],
        "tier1_kind": kept_as,
        "chunks_repaired_tier1": s["chunks_repaired_tier1"],
        "grad_blocks_repaired_tier1": grads_tier1,
        # the fake demo's keys: tier-1 repairs decoded from parity (none with replicas)
        "chunks_repaired_from_parity": s["chunks_repaired_tier1"] if kept_as == "parity" else 0,
        "grad_blocks_repaired_from_parity": grads_tier1 if kept_as == "parity" else 0,
        "copied_from_replicas": s["tier1_from_replicas"],
        "snapshot_restores": by_kind.get("tier2", 0),
        "checkpoint_restores": by_kind.get("ckpt", 0),
        "stale_processes_killed": sum(len(e.get("stale_killed", [])) for e in res.of("fence")),
        "recovery_restarts": s["recovery_restarts"],
        "promotions_warm": s["promotions_warm"],
        "promotions_cold": s["promotions_cold"],
        "phases_covered": covered,
        "steps": steps,
        "world_size": nodes * ranks_per_node,
        "topology": f"{nodes}x{ranks_per_node}",
        "n_chunks": n_chunks,
        "chunk_size": chunk_size,
        "tier2_interval": tier2_interval,
        "checkpoint": checkpoint_dir is not None,
        "recovery_seconds": per_failure,
        "recovery_ms_total": round(1e3 * sum(s["recovery_seconds"]), 3),  # each recovery once
        "seconds": {
            "with_failures": round(res.seconds, 3),
            "failure_free": round(ref.seconds, 3),
            "total": round(time.perf_counter() - t_all, 3),
        },
        "error": res.error or ref.error,
        # both runs replayed through the core's model (leto spec trace): it agrees
        "trace_ok": all(ok for ok, _ in traces),
        "trace": [line for _, line in traces],
        "run_dirs": {"with_failures": str(res.run_dir), "failure_free": str(ref.run_dir)},
        "faults": plan,
    }
    say("")
    say(
        f"{len(failure_events)} failures detected ({len(plan)} planned), {len(recs)} recoveries "
        f"{by_kind}, {s['recovery_restarts']} restart(s); shadows promoted warm "
        f"{s['promotions_warm']}, cold {s['promotions_cold']}"
    )
    say(
        f"tier 1 ({tier1}): {s['chunks_repaired_tier1']} chunk(s) and {grads_tier1} gradient "
        f"block(s) rebuilt, {s['tier1_from_replicas']} copied from replicas; "
        f"{s['chunks_rolled_forward']} chunk(s) rolled forward"
    )
    say(
        "recovery seconds, per failure: "
        + ", ".join("never" if x is None else f"{x:.3f}" for x in per_failure)
    )
    say(
        f"{res.seconds:.1f} s with failures, {ref.seconds:.1f} s without; leto report {res.run_dir}"
    )
    say(
        "bitwise equal to the failure-free run (every rank's parameters, optimizer state, "
        f"scheduler, RNG and sampler): {'YES' if bitwise else 'NO'}"
    )
    for _, line in traces:
        say(line)
    if result["error"]:
        say(f"error: {result['error']}")
    return result


def _trace(run_dir: Path) -> tuple[bool, str]:
    """Whether the run's event log replays through the core's model, and its line."""
    from leto.spec.trace import InputError, check

    try:
        report = check(run_dir)
    except InputError as e:
        return False, f"trace not checked: {e}"
    return report.ok, report.line()


def run_cli(args: Any, config: Any = None) -> int:
    """``leto demo`` on gloo (``args`` as parsed by ``leto.adapters.demo.configure``;
    ``config``: a loaded :class:`leto.Config` of backend gloo, which the flags override)."""
    from .config import Config, ConfigError

    base: dict[str, Any] = {
        "backend": "gloo",
        "nodes": 2,
        "ranks_per_node": 2,
        "chunk_size": 4096,
        "tier2_interval": 10,
    }
    if config is not None:
        base = config.as_dict()
    for name in ("nodes", "ranks_per_node", "chunk_size", "tier2_interval", "checkpoint_dir"):
        v = getattr(args, name, None)
        if v is not None:
            base[name] = v
    if getattr(args, "no_checkpoint", False):
        base["checkpoint_dir"] = None
    base["world_size"] = None
    try:
        cfg = Config.from_dict(base)
        if not getattr(args, "no_faults", False):
            # the fault plan loses a keeper (tier 1) and, with two nodes or more, a node
            for tier, needed in (("tier1", True), ("tier2", cfg.nodes >= 2)):
                if needed and not getattr(cfg, tier):
                    raise ConfigError(tier, f"the demo's faults need {tier} on")
        result = demo(
            steps=STEPS if getattr(args, "steps", None) is None else args.steps,
            nodes=cfg.nodes,
            ranks_per_node=cfg.ranks_per_node,
            chunk_size=cfg.chunk_size,
            tier2_interval=cfg.tier2_interval,
            checkpoint_dir=os.path.abspath(cfg.checkpoint_dir) if cfg.checkpoint_dir else None,
            tier1_code=cfg.tier1_code,
            verify_chunks=cfg.verify_chunks,
            tier1=cfg.tier1,
            tier2=cfg.tier2,
            seed=getattr(args, "seed", 0),
            faults=not getattr(args, "no_faults", False),
            out=None if getattr(args, "json", False) else sys.stdout,
        )
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"leto demo: {e}", file=sys.stderr)
        return 2
    if getattr(args, "json", False):
        print(json.dumps(result, indent=2))
    ok = result["bitwise_equal"] and (not result["faults"] or result["every_failure_recovered"])
    ok = ok and result["trace_ok"]
    return 0 if ok else 1
