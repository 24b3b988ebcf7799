"""``leto bench``: leto against checkpoint-based recovery, side by side on this machine.

::

    leto bench recovery [--params 1M] [--repeats 5] [--mtbf 60] [--no-tier2] [--fail-at forward] [--json]
    leto bench overhead [--params 1M] [--batch 16384] [--rounds 5] [--json]
    leto bench overhead --batches 1024,4096,16384 [--rounds 3] [--json]   # against step time
    leto bench goodput  [--params 1M] [--batch 16384] [--budget 240] [--mtbf 30] [--rounds 3] [--json]
    leto bench scaling  [--sizes 1M,4M,16M] [--repeats 3] [--layers 4] [--no-tier2] [--fail-at forward] [--accum 1] [--json]
    leto bench control  [--ranks 1024] [--chunks 4096] [--per-node 8] [--json]
    leto bench tier2    [--nodes 4] [--mib 64] [--parities 2] [--rounds 5] [--json]

Systems (``--systems``, comma-separated): ``ckpt-disk`` (torch.distributed.checkpoint
to local disk, restart), ``ckpt-disk-async`` (DCP ``async_save``), ``gemini`` (a
checkpoint of every step in host memory, restart), ``torchft`` (PyTorch's
fault-tolerance library: the other replica groups train on while the failed one
restarts and heals from a live peer; recovery and scaling only, and by default only
where ``import torchft`` works), ``nvre`` (nvidia-resiliency-ext's in-process restart:
the wrapped training function restarted in each surviving process, a reserve process
in the dead rank's place; likewise recovery and scaling only, where it imports, with
at most 8 recoveries), ``leto`` (in place, through ``leto launch`` on the
gloo backend), ``leto-serial`` (not in the default list: leto with ``parallel_replay =
false``, beside ``leto`` with ``--accum K``, whose steps are K micro-batches: the step in
flight's lost share computed by its replacement alone, against by every rank). Each
benchmark prints a table, and writes its JSON and a PNG plot to ``--out``
(default ``bench-results``); ``--json`` prints the JSON instead of the table.
Bad input (an unknown system, a non-positive MTBF or budget, a model too large
for this machine's memory) is one line ``leto bench: error: ...`` and exit
status 2, before anything starts. ``--no-tier2`` runs leto's job without its tier-2
snapshot (two host-memory copies of the state and their cross-node parity, about four
times the state per rank), which a recovery of intact memory does not read: what lets
1 GiB of state per rank fit a 24 GiB machine. See ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from leto.argcheck import (
    BadInput,
    Bound,
    check_args,
    dir_to_create,
    positive_int,
    refuse,
    seconds,
    show,
)

from .ftjob import missing
from .interval import FAIL_AT
from .nvrejob import MAX_RESERVES
from .nvrejob import missing as nvre_missing
from .workload import (
    LAYERS,
    BenchError,
    Workload,
    available_memory,
    device_error,
    format_count,
    parse_count,
)

MAX_LAYERS = 256

__all__ = ["configure", "run"]

SYSTEMS = ("ckpt-disk", "ckpt-disk-async", "gemini", "torchft", "nvre", "leto-serial", "leto")
# not in the default list: leto with parallel_replay = false, beside leto with --accum
# the benchmarks torchft and nvre are measured by (goodput's failures come from a clock,
# not steps: torchft takes them as a signal, nvre's in-process restart has no such hook)
BENCHES_OF = {"torchft": ("recovery", "scaling", "goodput"), "nvre": ("recovery", "scaling")}
# the systems of other projects, each measured where it imports (else: why not)
OPTIONAL = ("torchft", "nvre")

# Rows per rank per step. Recovery and scaling use short steps (512 rows, ~0.1 s),
# so a recovery is mostly the machinery under test, not the recomputed step. The
# failure-free overhead and goodput use the per-replica batch of real training
# (tens of thousands of tokens per data-parallel rank per step): leto's per-step
# work is proportional to the state, the step's compute to state x batch, so a
# toy batch would measure a ratio no training job has (docs/benchmarks.md). Both use
# the same batch, so the goodput run trains the workload whose overhead is measured.
TRAINING_BATCH = 16384
# The goodput budget compresses a job's life into minutes: at a step of ~2.3 s, 30 s
# is a failure every ~13 steps (7 in the default 240-s budget, seed 0). With only 3
# (MTBF 60) the systems' recovery costs differ by ~20 s in all, less than the
# machine's drift between one system's run and the next (docs/benchmarks.md).
GOODPUT_MTBF_S = 30.0
MEMORY_FRACTION = 0.8


def _common(
    p: argparse.ArgumentParser, *, systems: bool = True, size: bool = True, batch: int = 512
) -> None:
    if size:
        p.add_argument("--params", default="1M", help="model size in parameters (default 1M)")
    p.add_argument("--world", type=int, default=4, help="ranks (processes) per job (default 4)")
    p.add_argument(
        "--batch", type=int, default=batch, help=f"rows per rank per step (default {batch})"
    )
    p.add_argument("--seed", type=int, default=0)
    if systems:
        p.add_argument(
            "--systems",
            default=None,
            help=f"comma-separated, from {', '.join(SYSTEMS)} (default: all; torchft and "
            "nvre where they are installed: torchft for recovery, scaling and goodput, nvre for "
            "recovery and scaling)",
        )
    p.add_argument("--out", default="bench-results", help="directory for JSON and PNG output")
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _no_tier2(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-tier2",
        action="store_true",
        help="leto's job without its tier-2 snapshot (about 4x the state per rank in host "
        "memory), which an in-place recovery does not read",
    )


def _device(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        default="cpu",
        help="where every system keeps the model, its gradients and optimizer state: cpu "
        "(default), cuda or cuda:N (the ranks share that one device; leto's keepers hold "
        "its retained state there)",
    )


def _fail_at(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fail-at",
        choices=FAIL_AT,
        default="forward",
        help="where in its step a rank dies: after its forward pass (default; the step is "
        "computed again by every system) or at the update, after the step's vote and "
        "commit (leto rolls it forward; a baseline dies before optimizer.step())",
    )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("::", 1)[1] if __doc__ else None
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    p = sub.add_parser("recovery", help="one recovery of each system, broken down (medians)")
    _common(p)
    p.add_argument("--repeats", type=int, default=5, help="recoveries per system (default 5)")
    p.add_argument(
        "--mtbf",
        type=float,
        default=60.0,
        help="MTBF in seconds, for the checkpoint interval (default 60)",
    )
    p.add_argument(
        "--gap", type=float, default=10.0, help="seconds of training between failures (default 10)"
    )
    _no_tier2(p)
    _fail_at(p)
    _device(p)
    p = sub.add_parser(
        "overhead",
        help="failure-free step time: plain DDP vs leto (its defaults: tier 1 as replicas on gloo), "
        "the same with tier 2 off, and with tier 1 as parity",
    )
    _common(p, systems=False, batch=TRAINING_BATCH)
    p.add_argument("--rounds", type=int, default=5, help="rounds of interleaved jobs (default 5)")
    p.add_argument(
        "--batches",
        default=None,
        help="comma-separated batch sizes: the overhead against step time, plain DDP vs "
        "leto at each (writes overhead-curve.json/.png)",
    )
    p.add_argument(
        "--periods", type=int, default=2, help="tier-2 periods measured per job (default 2)"
    )
    p.add_argument(
        "--tier2-interval", type=int, default=10, help="K: steps between tier-2 snapshots"
    )
    p.add_argument(
        "--configs",
        default=None,
        help="comma-separated configurations, plain first (default "
        "plain,leto,leto-no-tier2,leto-parity; also leto-no-replica-check: leto with "
        "replica_check = 0)",
    )
    p = sub.add_parser(
        "goodput", help="productive training time in a wall-clock budget with failures"
    )
    _common(p, batch=TRAINING_BATCH)
    p.add_argument(
        "--budget", type=float, default=240.0, help="seconds of training per system (default 240)"
    )
    p.add_argument(
        "--mtbf",
        type=float,
        default=GOODPUT_MTBF_S,
        help=f"mean time between failures, seconds (default {GOODPUT_MTBF_S:g})",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds, each running every system once in a rotated order (default 3)",
    )
    p = sub.add_parser("scaling", help="the recovery benchmark across model sizes")
    _common(p, size=False)
    p.add_argument("--sizes", default="1M,4M,16M", help="model sizes (default 1M,4M,16M)")
    p.add_argument(
        "--repeats", type=int, default=3, help="recoveries per system and size (default 3)"
    )
    p.add_argument("--mtbf", type=float, default=60.0)
    p.add_argument("--gap", type=float, default=10.0)
    p.add_argument(
        "--layers",
        type=int,
        default=LAYERS,
        help=f"the MLP's hidden layers (default {LAYERS}): a size's state grows with "
        "layers x width^2, the compute of one layer (what a survivor finishes before it "
        f"stops for a recovery) with width^2; at most {MAX_LAYERS}",
    )
    _no_tier2(p)
    _fail_at(p)
    p.add_argument(
        "--accum",
        type=int,
        default=1,
        help="leto's steps in this many micro-batches (micro_batches; default 1): a death "
        "before the vote then has the lost share's micro-batches computed by every rank "
        "(parallel_replay); --systems leto-serial,leto measures it without and with",
    )
    _device(p)
    p = sub.add_parser(
        "control",
        help="the coordinator's protocol-model CPU per step, per recovery plan and per "
        "adoption of the trainers' reports (in process, no training), aggregated vs "
        "chunk-level",
    )
    p.add_argument("--ranks", type=int, default=1024, help="ranks (default 1024)")
    p.add_argument("--chunks", type=int, default=4096, help="chunks per rank (default 4096)")
    p.add_argument("--per-node", type=int, default=8, help="ranks per node (default 8)")
    p.add_argument("--steps", type=int, default=5, help="steps fed per size (default 5)")
    p.add_argument(
        "--reference-sizes",
        default="8x256,32x256",
        help="RANKSxCHUNKS,... where the chunk-level path runs too (default 8x256,32x256)",
    )
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p = sub.add_parser(
        "tier2",
        help="the tier-2 encode cost with m parities (Reed-Solomon) against m = 1, "
        "one gloo process per node",
    )
    p.add_argument("--nodes", type=int, default=4, help="nodes, one process each (default 4)")
    p.add_argument("--mib", type=float, default=64.0, help="snapshot MiB per node (default 64)")
    p.add_argument("--parities", default="2", help="m values besides 1, e.g. 2,3 (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the table")


# ------------------------------------------------------------------ validation


# Every flag finite and bounded (leto.argcheck); the model size is bounded by this
# machine's memory (check_memory).
BOUNDS: dict[str, Bound] = {
    "world": Bound(lo=2, hi=256, integer=True, unit="ranks", why_hi="one process each"),
    "batch": positive_int(1 << 20),
    "seed": Bound(lo=0, hi=2**32 - 1, integer=True),
    "repeats": positive_int(1000),
    "rounds": positive_int(1000),
    "periods": positive_int(1000),
    "tier2_interval": positive_int(1_000_000),
    "mtbf": seconds(),
    "budget": seconds(),
    "gap": Bound(lo=0, hi=86_400.0, unit="s", why_hi="a day"),
    "ranks": positive_int(1 << 20),
    "chunks": positive_int(1 << 24),
    "per_node": positive_int(1 << 12),
    "steps": Bound(lo=2, hi=1000, integer=True),
    "nodes": Bound(lo=2, hi=64, integer=True, unit="nodes", why_hi="one process each"),
    "mib": Bound(lo=1 / 1024, hi=4096.0, unit="MiB", why_hi="memory of this machine"),
    "accum": Bound(lo=1, hi=64, integer=True, unit="micro-batches"),
}
MAX_SIZES = 16


def _why_not(name: str) -> str | None:
    """Why optional system ``name`` cannot run here (None: it can)."""
    return missing() if name == "torchft" else nvre_missing()


def _systems(text: str | None, bench: str, notes: list[str] | None = None) -> list[str]:
    """``--systems``; its default: every system, torchft and nvre where this benchmark
    measures them and they import (else left out, with one line saying why in
    ``notes``, printed once every argument was found good)."""
    if text is None:
        names = [s for s in SYSTEMS if s not in OPTIONAL and s != "leto-serial"]
        for name in OPTIONAL:
            if bench in BENCHES_OF[name]:
                why = _why_not(name)
                if why is None:
                    names.append(name)
                elif notes is not None:
                    notes.append(f"leto bench: {name} left out: {why}")
        return [s for s in SYSTEMS if s in names]
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise BenchError("--systems names no system")
    for n in names:
        if n not in SYSTEMS:
            raise BenchError(f"unknown system {n!r} (choose from {', '.join(SYSTEMS)})")
    for name in OPTIONAL:
        if name in names:
            if bench not in BENCHES_OF[name]:
                raise BenchError(
                    f"--systems {name}: measured by {', '.join(BENCHES_OF[name])} only"
                )
            why = _why_not(name)
            if why is not None:
                raise BenchError(f"--systems {name}: {why}")
    return names


def _batches(text: str) -> list[int]:
    """``--batches``: at least two different batch sizes, each within ``--batch``'s bounds."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if len(items) > MAX_SIZES:
        raise BenchError(f"--batches names {len(items)} sizes, more than the limit of {MAX_SIZES}")
    out: list[int] = []
    for x in items:
        try:
            b = int(x)
        except ValueError:
            raise BenchError(f"--batches: not a batch size: {show(x)}") from None
        problem = BOUNDS["batch"].problem(b)
        if problem is not None:
            raise BenchError(f"--batches: {problem}")
        out.append(b)
    if len(set(out)) < 2:
        raise BenchError("--batches must name at least two different batch sizes")
    return sorted(set(out))


def _workload(args: argparse.Namespace, params: str) -> Workload:
    try:
        count = parse_count(params)
    except OverflowError:
        raise BenchError(f"model size {show(params)} is not a parameter count") from None
    layers = getattr(args, "layers", LAYERS)
    if not 1 <= layers <= MAX_LAYERS:
        raise BenchError(f"--layers {layers}: choose 1 to {MAX_LAYERS} hidden layers")
    device = getattr(args, "device", "cpu")
    why = device_error(device)
    if why:
        raise BenchError(f"--device {show(device)}: {why}")
    return Workload.for_params(
        count, batch=args.batch, world=args.world, seed=args.seed, layers=layers, device=device
    )


def check_memory(
    wl: Workload, systems: list[str], available: int | None = None, *, tier2: bool = True
) -> None:
    """Refuse a model that does not fit this machine's memory (systems run one at a time)."""
    avail = available_memory() if available is None else available
    if avail <= 0:
        return
    usable = MEMORY_FRACTION * avail
    need, worst = max((wl.memory_estimate(s, tier2=tier2), s) for s in systems)
    if need > usable:
        raise BenchError(
            f"model size {format_count(wl.params)} params x {wl.world} ranks needs about "
            f"{need / 2**30:.1f} GiB ({worst}), but only {usable / 2**30:.1f} GiB of this "
            f"machine's memory is usable ({avail / 2**30:.1f} GiB available, "
            f"{MEMORY_FRACTION:.0%} used at most); choose a smaller model size"
        )


def _validate(args: argparse.Namespace) -> tuple[list[Workload], list[str]]:
    notes: list[str] = []
    systems = _systems(args.systems, args.bench, notes) if hasattr(args, "systems") else ["leto"]
    if "nvre" in systems and getattr(args, "repeats", 0) > MAX_RESERVES:
        raise BenchError(
            f"--repeats {args.repeats}: nvre needs a reserve process per recovery, "
            f"at most {MAX_RESERVES}"
        )
    try:
        check_args(args, BOUNDS)
        dir_to_create("--out", args.out)
    except BadInput as e:
        raise BenchError(str(e)) from None
    sizes = args.sizes.split(",") if args.bench == "scaling" else [args.params]
    if len(sizes) > MAX_SIZES:
        raise BenchError(f"--sizes names {len(sizes)} sizes, more than the limit of {MAX_SIZES}")
    wls = [_workload(args, s) for s in sizes if s.strip()]
    if not wls:
        raise BenchError("--sizes names no model size")
    wls.sort(key=lambda w: w.params)
    if getattr(args, "accum", 1) > min(w.batch for w in wls):
        raise BenchError(f"--accum {args.accum}: more micro-batches than rows per rank")
    if args.bench == "scaling" and len({w.params for w in wls}) < 2:
        raise BenchError("--sizes must name at least two different model sizes to show growth")
    if getattr(args, "batches", None) is not None:
        wls = [dataclasses.replace(wls[0], batch=b) for b in _batches(args.batches)]
    if getattr(args, "configs", None) is not None:
        from .overhead import CONFIGS

        names = args.configs.split(",")
        bad = [n for n in names if n not in CONFIGS]
        if bad or names[0] != "plain" or len(set(names)) != len(names):
            raise BenchError(
                f"--configs {show(args.configs)}: plain first, then distinct ones of "
                f"{', '.join(CONFIGS[1:])}"
            )
    mem_systems = systems if args.bench != "overhead" else ["plain", "leto"]
    tier2 = not getattr(args, "no_tier2", False)
    for wl in wls:
        check_memory(wl, mem_systems, tier2=tier2)
    for line in notes:  # a refusal above is its one line alone
        print(line, file=sys.stderr)
    return wls, systems


# ------------------------------------------------------------------------- run


def _write(out: Path, name: str, res: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(res, indent=1, default=float) + "\n")
    return path


def run(args: argparse.Namespace) -> int:
    if getattr(args, "bench", None) is None:
        print(
            "leto bench: error: choose a benchmark: recovery, overhead, goodput, scaling, control, tier2",
            file=sys.stderr,
        )
        return 2
    if args.bench == "control":
        return _run_control(args)
    if args.bench == "tier2":
        return _run_tier2(args)
    try:
        wls, systems = _validate(args)
    except BenchError as e:
        return refuse("bench", e)
    progress = not args.no_progress
    try:
        res, table, plot = _run(args, wls, systems, progress)
    except BenchError as e:
        return refuse("bench", e, 1)
    except KeyboardInterrupt:
        print("leto bench: interrupted", file=sys.stderr)
        return 130
    out = Path(args.out)
    name = "overhead-curve" if res.get("benchmark") == "overhead-curve" else args.bench
    path = _write(out, name, res)
    png = plot(res, out / f"{name}.png")
    if args.json:
        print(json.dumps(res, default=float))
    else:
        print(table(res))
        print(f"wrote {path} and {png}")
    return 0


def _run_tier2(args: argparse.Namespace) -> int:
    from .tier2 import run_tier2, tier2_table

    try:
        check_args(args, BOUNDS)
        ms = sorted({int(x) for x in args.parities.split(",") if x.strip()})
        if not ms or ms[0] < 1 or ms[-1] >= args.nodes:
            raise BadInput(
                f"--parities: every m must be >= 1 and below --nodes ({args.nodes}), got "
                f"{show(args.parities)}"
            )
    except BadInput as e:
        return refuse("bench", e)
    except ValueError:
        return refuse("bench", f"--parities: not a list of integers: {show(args.parities)}")
    res = run_tier2(args.nodes, args.mib, ms, args.rounds)
    print(json.dumps(res) if args.json else tier2_table(res))
    return 0


def _run_control(args: argparse.Namespace) -> int:
    from .control import control_table, parse_sizes, run_control

    try:
        check_args(args, BOUNDS)
        sizes = parse_sizes(args.reference_sizes)
        if any(r < 1 or c < 1 for r, c in sizes):
            raise BadInput("--reference-sizes: every size is RANKSxCHUNKS, both >= 1")
    except BadInput as e:
        return refuse("bench", e)
    except ValueError:
        why = f"--reference-sizes: not RANKSxCHUNKS,...: {show(args.reference_sizes)}"
        return refuse("bench", why)
    say = None if args.json or args.no_progress else (lambda line: print(line, file=sys.stderr))
    res = run_control(
        args.ranks,
        args.chunks,
        per_node=args.per_node,
        steps=args.steps,
        reference_sizes=sizes,
        progress=say,
    )
    print(json.dumps(res) if args.json else control_table(res))
    return 0


def _run(args: argparse.Namespace, wls: list[Workload], systems: list[str], progress: bool) -> Any:
    from . import plots, report

    if args.bench == "recovery":
        from .recovery import run_recovery

        res = run_recovery(
            systems,
            wls[0],
            mtbf_s=args.mtbf,
            repeats=args.repeats,
            gap_s=args.gap,
            progress=progress,
            tier2=not args.no_tier2,
            fail_at=args.fail_at,
        )
        return res, report.recovery_table, plots.plot_recovery
    if args.bench == "overhead" and args.batches is not None:
        from .curve import run_curve

        res = run_curve(
            wls,
            rounds=args.rounds,
            periods=args.periods,
            tier2_interval=args.tier2_interval,
            progress=progress,
        )
        return res, report.curve_table, plots.plot_curve
    if args.bench == "overhead":
        from .overhead import run_overhead

        res = run_overhead(
            wls[0],
            rounds=args.rounds,
            periods=args.periods,
            tier2_interval=args.tier2_interval,
            progress=progress,
            **({"configs": args.configs.split(",")} if args.configs else {}),
        )
        return res, report.overhead_table, plots.plot_overhead
    if args.bench == "goodput":
        from .goodput import run_goodput

        res = run_goodput(
            systems,
            wls[0],
            budget_s=args.budget,
            mtbf_s=args.mtbf,
            seed=args.seed,
            rounds=args.rounds,
            progress=progress,
        )
        return res, report.goodput_table, plots.plot_goodput
    from .recovery import run_scaling

    res = run_scaling(
        systems,
        wls,
        mtbf_s=args.mtbf,
        repeats=args.repeats,
        gap_s=args.gap,
        progress=progress,
        tier2=not args.no_tier2,
        fail_at=args.fail_at,
        accum=args.accum,
    )
    return res, report.scaling_table, plots.plot_scaling
