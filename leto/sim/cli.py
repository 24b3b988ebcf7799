"""``leto simulate``: the goodput simulator on the command line.

Forms::

    leto simulate [OPTIONS]                      one experiment: a table, or --json
    leto simulate --sweep {gpus,hof,mtbf} [--values V,V,...] [--plot DIR]
    leto simulate --plot DIR                     the three standard sweeps, as PNGs

Every model parameter has a default with a source (``docs/simulate.md``); the common
ones have flags, any other is set with ``--set NAME=VALUE``; ``--bench FILE`` loads
measured phase costs from ``leto bench recovery``. Precedence: defaults, then the
bench file, then flags and ``--set``. Kept light: numpy and matplotlib are imported
only when a simulation runs.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from leto.argcheck import BadInput, dir_to_create, refuse, show

FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--gpus", "gpus", int, "GPUs in the job (default 16384)"),
    ("--gpus-per-node", "gpus_per_node", int, "GPUs per node (default 8)"),
    ("--days", "days", float, "length of the job in days (default 30)"),
    ("--model-params", "model_params", float, "parameters (default: Llama 3's per GPU, <= 405e9)"),
    ("--step-time", "step_time_s", float, "seconds per training step (default 6)"),
    ("--mtbf-hours", "mtbf_hours", float, "job MTBF in hours (default: from the calibration)"),
    ("--hof-fraction", "hof_fraction", float, "fraction of failures recoverable in place, 0..1"),
    ("--spares", "spares", int, "spare nodes (default: sized to the nodes away)"),
    ("--tier2-parity", "tier2_parity", int, "nodes tier 2 survives (default 1)"),
    ("--tier2-every", "tier2_every_steps", int, "steps between tier-2 snapshots (default 1)"),
    ("--leto-overhead", "leto_overhead", float, "leto's steady-state overhead (fraction)"),
    ("--seeds", "seeds", int, "number of traces (default 5)"),
    ("--seed", "seed", int, "first seed (default 0)"),
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = __doc__.split("\n\n")[1] if __doc__ else None
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for flag, dest, typ, help_ in FLAGS:
        parser.add_argument(flag, dest=dest, type=typ, default=None, help=help_)
    parser.add_argument(
        "--calibration",
        choices=("llama3", "meta"),
        default=None,
        help="failure-rate level: llama3 (default) or meta",
    )
    parser.add_argument(
        "--no-tier1",
        dest="tier1",
        action="store_false",
        default=None,
        help="leto without tier-1 (in-node) parity",
    )
    parser.add_argument(
        "--no-tier2",
        dest="tier2",
        action="store_false",
        default=None,
        help="leto without tier-2 (cross-node) snapshots",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set any model parameter (repeatable)",
    )
    parser.add_argument(
        "--bench",
        metavar="FILE",
        action="append",
        default=[],
        help="measured figures from `leto bench` JSON (recovery, scaling, tier2, control); "
        "repeatable, later files win",
    )
    parser.add_argument(
        "--strategies",
        default=None,
        help="comma-separated subset of ckpt-sync,ckpt-async,gemini,jit,torchft,leto",
    )
    parser.add_argument(
        "--sweep",
        choices=("gpus", "hof", "mtbf"),
        default=None,
        help="vary one parameter over --values (default: 20 points)",
    )
    parser.add_argument("--values", default=None, help="comma-separated values for --sweep")
    parser.add_argument(
        "--plot",
        metavar="DIR",
        default=None,
        help="write PNG plots of the sweep (all three sweeps without --sweep)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _coerce(name: str, text: str, current: Any, kind: str) -> Any:
    """``text`` as the value of the field ``name`` (``current``: its default, ``kind``:
    its annotation)."""
    if isinstance(current, bool) or text.lower() in ("true", "false"):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected true or false, got {show(text)}")
        return text.lower() in ("true", "1")
    if isinstance(current, str):
        return text
    if current is None and text.lower() == "none":
        return None
    if isinstance(current, int) or kind.startswith("int"):
        digits = text.removeprefix("-")
        if not (digits.isascii() and digits.isdecimal()) or len(digits) > 30:
            raise ValueError(f"expected an integer, got {show(text)}")
        return int(text)
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {show(text)}") from None


def build_params(args: argparse.Namespace) -> tuple[Any, Any]:
    """The parameters (defaults, then the bench files, then flags and ``--set``) and
    the provenance of every measurable figure."""
    import attrs

    from leto.sim.measured import calibrate, with_flags
    from leto.sim.params import SimInputError, SimParams

    fields = {f.name: f for f in attrs.fields(SimParams)}
    explicit: dict[str, Any] = {}
    for _, dest, _, _ in FLAGS:
        if getattr(args, dest) is not None:
            explicit[dest] = getattr(args, dest)
    for dest in ("calibration", "tier1", "tier2"):
        if getattr(args, dest) is not None:
            explicit[dest] = getattr(args, dest)
    defaults = SimParams()
    for item in args.overrides:
        name, sep, text = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in fields:
            raise SimInputError(
                f"--set {show(item)}: expected NAME=VALUE with NAME one of SimParams' fields"
            )
        try:
            explicit[name] = _coerce(
                name, text.strip(), getattr(defaults, name), str(fields[name].type)
            )
        except ValueError as exc:
            raise SimInputError(f"--set {show(item)}: {exc}") from None
    cal = with_flags(calibrate(args.bench, SimParams(**explicit)), explicit)
    return SimParams(**cal.values, **explicit), cal


def _names(args: argparse.Namespace) -> tuple[str, ...]:
    from leto.sim.params import SimInputError
    from leto.sim.strategies import STRATEGIES

    if not args.strategies:
        return STRATEGIES
    names = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    bad = [n for n in names if n not in STRATEGIES]
    if bad or not names:
        raise SimInputError(
            f"unknown strategy {', '.join(bad) or '(none)'}; choose from {', '.join(STRATEGIES)}"
        )
    return names


MAX_SWEEP_POINTS = 100


def _values(args: argparse.Namespace) -> list[float] | None:
    from leto.sim.params import SimInputError

    if args.values is None:
        return None
    if args.sweep is None:
        raise SimInputError("--values needs --sweep NAME (the parameter the values are for)")
    texts = [v.strip() for v in args.values.split(",") if v.strip()]
    if not texts:
        raise SimInputError("--values names no value")
    if len(texts) > MAX_SWEEP_POINTS:
        raise SimInputError(
            f"--values: {len(texts)} points, more than the limit of {MAX_SWEEP_POINTS}"
        )
    out = []
    for text in texts:
        try:
            out.append(float(text))
        except ValueError:
            raise SimInputError(f"--values: {show(text)} is not a number") from None
    return out


def _check_points(params: Any, sweeps: list[str], values: list[float] | None) -> None:
    """Every point of every sweep is a valid experiment, and all of them together stay
    within the simulator's work limit, before the first one runs."""
    import attrs

    from leto.sim.params import MAX_FAILURES, SimInputError
    from leto.sim.sweep import SWEEPS, default_values

    total = 0.0
    for name in sweeps:
        field = SWEEPS[name][0]
        for value in values if values is not None else default_values(name):
            point: Any = value
            if field == "gpus":
                if not value.is_integer():
                    raise SimInputError(f"--values: gpus must be integers, got {value:g}")
                point = int(value)
            try:
                total += attrs.evolve(params, **{field: point}).expected_failures
            except SimInputError as exc:
                raise SimInputError(f"sweep {name} at {value:g}: {exc}") from None
    if total > MAX_FAILURES:
        raise SimInputError(
            f"the sweep{'s' if len(sweeps) > 1 else ''} would simulate about {total:,.0f} "
            f"failures in all, more than the limit of {MAX_FAILURES:,}: fewer points, "
            "days or seeds"
        )


def run(args: argparse.Namespace) -> int:
    from leto.sim.params import SimInputError

    try:
        return _run(args)
    except (SimInputError, BadInput) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return refuse("simulate", message)


def _run(args: argparse.Namespace) -> int:
    from leto.sim import experiment, report
    from leto.sim.sweep import SWEEPS, run_sweep

    params, cal = build_params(args)
    names = _names(args)
    values = _values(args)
    if args.plot is not None:
        dir_to_create("--plot", args.plot)
    if args.sweep is None and args.plot is None:
        start = time.perf_counter()
        result = experiment.run(params, names)
        elapsed = time.perf_counter() - start
        if args.json:
            out = result.as_dict()
            out["calibration"] = [f.as_dict() for f in cal.figures]
            out["measured"] = {n: cal.measured(n)[0] for n in names if n in ("leto", "torchft")}
            out["elapsed_s"] = elapsed
            print(json.dumps(out, indent=2, sort_keys=False))
        else:
            print(report.header(result))
            print(report.table(result))
            print(report.inputs(result, cal))
            print(report.headline(result, cal))
            print(f"({elapsed:.2f} s)")
        return 0

    from leto.sim.plots import plot_sweep

    sweeps = [args.sweep] if args.sweep else list(SWEEPS)
    _check_points(params, sweeps, values)
    outputs = []
    for name in sweeps:
        sweep = run_sweep(
            params, name, values if args.sweep else None, names, progress=not args.json
        )
        entry = sweep.as_dict()
        if args.plot:
            entry["plot"] = str(plot_sweep(sweep, f"{args.plot}/ettr_vs_{name}.png"))
        outputs.append(entry)
        if not args.json:
            print(f"ETTR vs {name}:")
            print(report.sweep_table(sweep))
            if args.plot:
                print(f"plot: {entry['plot']}")
    if args.json:
        print(json.dumps(outputs[0] if len(outputs) == 1 else {"sweeps": outputs}, indent=2))
    return 0
