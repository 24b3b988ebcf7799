"""``leto spec check``: the verification ladder in one command.

TLC on the TLA+ model-checking configs (by default the quick one, seconds; with
``--full`` the main one, minutes), the explicit-state checker on the Python core, and
every mutant through both; without ``--config``, also TLC on the side modules
(:data:`SIDE_SPECS`: one rule each, e.g. ``Mesh.tla``) and their mutants. Prints a
summary, or with ``--json`` one JSON object. TLC needs Java and ``tla2tools.jar``: without them the command stops with
one line that says so (exit status 2), unless ``--skip-tlc`` says to check without
TLC; a check that did not run is never reported as passed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from leto import argcheck
from leto.argcheck import BadInput, Bound, positive_int, refuse, seconds, show
from leto.spec.location import SPEC_DIR

# the main configuration: exhaustive at 2 steps and 2 faults (991,579 states, about 4 min
# on 2 cores), run by --full; by default the quick one (1 step, 1 fault), in seconds
MAIN_CONFIG = "MCLeto.cfg"
QUICK_CONFIG = "MCLetoSmall.cfg"
# every failure leads to training or to the job stopped: BoundedSpec, its own fairness
LIVENESS_CONFIG = "MCLetoLiveness.cfg"
# Mutants TLC catches with a temporal property, not an invariant (the core's checker
# catches them with its "Bounded" check): mutant -> what TLC must report violated in
# MCLeto_<mutant>.cfg
TEMPORAL_MUTANTS = {"no_timeout": "Liveness"}
# Side modules, each one rule checked in full in a few seconds, run with the default
# configs: module -> (config, the invariants TLC must report violated: () for a config
# that must pass; a mutant's, or a reachability check's, otherwise)
SIDE_SPECS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "Replay.tla": (
        ("MCReplay.cfg", ()),
        ("MCReplay_out_of_order.cfg", ("ReplayOK",)),
        ("MCReplay_own_rng.cfg", ("ReplayOK",)),
        ("MCReplay_stale_params.cfg", ("ReplayOK",)),
    ),
    "Mesh.tla": (
        ("MCMesh.cfg", ()),
        ("MCMesh_double.cfg", ()),
        ("MCMesh_reach.cfg", ("NoNodeLossAtTier1",)),
        ("MCMesh_parity_over_replicas.cfg", ("Promise",)),
        ("MCMesh_replica_on_own_node.cfg", ("Promise",)),
    ),
}

_CFG_KEYWORDS = {
    "SPECIFICATION", "INIT", "NEXT", "CONSTANT", "CONSTANTS", "INVARIANT", "INVARIANTS",
    "PROPERTY", "PROPERTIES", "SYMMETRY", "CONSTRAINT", "CONSTRAINTS", "VIEW",
    "CHECK_DEADLOCK", "ACTION_CONSTRAINT", "ACTION_CONSTRAINTS", "POSTCONDITION", "ALIAS",
}  # fmt: skip


class SpecInputError(Exception):
    """A config given to ``leto spec check`` is missing or malformed."""


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="spec_command", metavar="ACTION", required=True)
    p = sub.add_parser("check", help="run TLC, the core's checker and the mutants")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--config",
        action="append",
        metavar="CFG",
        help="TLC config(s): a path, or a name in the spec directory "
        f"(default: {QUICK_CONFIG} and {LIVENESS_CONFIG}; with --full {MAIN_CONFIG} "
        f"and {LIVENESS_CONFIG})",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help=f"TLC on the main configuration {MAIN_CONFIG} (minutes) instead of {QUICK_CONFIG}",
    )
    p.add_argument("--spec-dir", type=Path, default=SPEC_DIR, help="directory of Leto.tla")
    p.add_argument("--skip-tlc", action="store_true", help="do not run TLC")
    p.add_argument("--skip-core", action="store_true", help="do not run the Python checker")
    p.add_argument("--skip-mutants", action="store_true", help="do not run the mutants")
    p.add_argument("--workers", type=int, default=2, help="TLC worker threads (1..256)")
    p.add_argument(
        "--timeout", type=float, default=900.0, help="seconds per TLC run (at most a week)"
    )
    t = sub.add_parser(
        "trace",
        help="replay a run's event log through the core's model (trace validation)",
        description="Replay RUN_DIR/events.jsonl through the core's ClusterModel and check "
        "it after every record; exit 1 on the first divergence, 2 on bad input.",
    )
    t.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, or its events.jsonl")
    t.add_argument("--json", action="store_true", help="print one JSON object")
    t.add_argument(
        "--job",
        default=None,
        metavar="ID",
        help="the job to replay, by its id or a prefix of it, where RUN_DIR holds several "
        "(default: the latest)",
    )
    t.add_argument(
        "--tlc",
        action="store_true",
        help="also check the trace with TLC against Leto.tla (spec/TraceLeto.tla)",
    )


BOUNDS: dict[str, Bound] = {"workers": positive_int(256), "timeout": seconds()}


def check_args(args: argparse.Namespace) -> bool:
    """Refuse bad flags, a missing spec directory and (unless ``--skip-tlc``) a machine
    where TLC cannot run, before any check starts; whether TLC will run."""
    from leto.spec import tlc

    try:
        argcheck.check_args(args, BOUNDS)
    except BadInput as exc:
        raise SpecInputError(str(exc)) from None
    if not Path(args.spec_dir).is_dir():
        raise SpecInputError(f"--spec-dir {show(str(args.spec_dir))} is not a directory")
    if args.full and args.config:
        raise SpecInputError(f"--full runs {MAIN_CONFIG}: give it or --config, not both")
    if args.skip_tlc:
        return False
    try:
        tlc.find_java()
        tlc.find_jar()
    except tlc.TLCNotAvailable as exc:
        raise SpecInputError(f"TLC cannot run: {exc} (or --skip-tlc to check without it)") from None
    return True


def validate_cfg(path: Path) -> None:
    """Reject a missing or malformed TLC config before TLC sees it."""
    if not path.is_file():
        raise SpecInputError(f"config {path}: no such file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecInputError(f"config {path}: unreadable ({exc})") from None
    text = re.sub(r"\(\*.*?\*\)", " ", text, flags=re.S)
    seen: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("\\*", 1)[0].strip()
        if not line:
            continue
        word = line.split()[0]
        if word in _CFG_KEYWORDS:
            seen.add(word)
        elif not re.match(r"^[A-Za-z_][\w]*\s*(=|<-)\s*\S", line) and not re.match(
            r"^[A-Za-z_][\w]*$", line
        ):
            raise SpecInputError(f"config {path}:{lineno}: not TLC config syntax: {line!r}")
    if not seen & {"SPECIFICATION", "INIT"}:
        raise SpecInputError(f"config {path}: names neither SPECIFICATION nor INIT")


def _tlc(
    cfg: Path, spec_dir: Path, workers: int, timeout: float, spec: str = "MCLeto.tla"
) -> dict[str, Any]:
    from leto.spec import tlc

    try:
        res = tlc.run_tlc(cfg, spec=spec, spec_dir=spec_dir, workers=workers, timeout=timeout)
    except tlc.TLCNotAvailable as exc:
        raise SpecInputError(f"TLC cannot run: {exc}") from None
    if res.error:
        raise SpecInputError(f"config {cfg}: {res.error}")
    return {
        "config": cfg.name,
        "distinct_states": res.distinct_states,
        "violations": list(res.violations),
        "seconds": round(res.seconds, 1),
        "counterexample": res.counterexample,
    }


def run_checks(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    from leto.core.cluster import Mutant
    from leto.core.verify import MUTANTS, check_core, check_mutant

    spec_dir: Path = args.spec_dir
    run_tlc = check_args(args)
    # Configs named on the command line are always validated; the default one only
    # when TLC is going to read it.
    # a config named without a directory that is not here is one of the spec's own
    configs = [
        spec_dir / c if not Path(c).exists() and Path(c).name == c else Path(c)
        for c in (args.config or [MAIN_CONFIG if args.full else QUICK_CONFIG, LIVENESS_CONFIG])
    ]
    for cfg in configs if (args.config or run_tlc) else []:
        validate_cfg(cfg)
    out: dict[str, Any] = {
        "violations": 0,
        "tlc_distinct_states": None,
        "core_states": None,
        "unreached_sometimes": [],
        "forbidden_reached": [],
        "mutants_caught": 0,
        "mutants_total": 0,
        "tlc": [],
        "tlc_skipped": None if run_tlc else "--skip-tlc",
        "core": {},
        "mutants": {},
        "side": [],
        "side_failed": 0,
    }
    started = time.monotonic()
    if run_tlc:
        for cfg in configs:
            log(f"TLC {cfg.name} ...")
            r = _tlc(cfg, spec_dir, args.workers, args.timeout)
            out["tlc"].append(r)
            out["violations"] += len(r["violations"])
            log(
                f"  {r['distinct_states']} distinct states, {len(r['violations'])} violations, {r['seconds']} s"
            )
        out["tlc_distinct_states"] = out["tlc"][0]["distinct_states"]
        if not args.config:
            _side_specs(args, spec_dir, log, out)
    if not args.skip_core:
        report = check_core(on_config=lambda name: log(f"core checker: {name} ..."))
        out["core_states"] = report.states
        out["violations"] += report.violations
        out["unreached_sometimes"] = list(report.unreached)
        out["forbidden_reached"] = list(report.forbidden)
        for name, res in report.results.items():
            out["core"][name] = {
                "states": res.states,
                "transitions": res.transitions,
                "violations": [v.name for v in res.violations],
                "counterexamples": [v.describe() for v in res.violations],
                "reached": sorted(res.reached),
            }
            log(f"  {name}: {res.states} states, {len(res.violations)} violations")
    if not args.skip_mutants:
        for mutant in MUTANTS:
            entry: dict[str, Any] = {"core": None, "tlc": None}
            core = check_mutant(mutant)
            entry["core"] = list(core.caught_by)
            caught = core.caught
            mcfg = spec_dir / f"MCLeto_{mutant.value}.cfg"
            if run_tlc:
                if mcfg.is_file():
                    r = _tlc(mcfg, spec_dir, args.workers, args.timeout)
                    entry["tlc"] = r["violations"]
                    prop = TEMPORAL_MUTANTS.get(mutant.value)
                    caught = caught and (
                        bool(r["violations"]) if prop is None else r["violations"] == [prop]
                    )
                else:
                    entry["tlc"] = f"missing {mcfg.name}"
                    caught = False
            entry["caught"] = caught
            out["mutants"][mutant.value] = entry
            out["mutants_total"] += 1
            out["mutants_caught"] += int(caught)
            log(f"mutant {mutant.value}: core {entry['core']} tlc {entry['tlc']}")
        assert Mutant.NONE not in MUTANTS
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def _side_specs(args: argparse.Namespace, spec_dir: Path, log: Any, out: dict[str, Any]) -> None:
    """TLC on every side module's configs (its mutants unless --skip-mutants); a run
    fails where its violations are not exactly the expected ones."""
    for module, runs in SIDE_SPECS.items():
        for name, expected in runs:
            if expected and args.skip_mutants:
                continue
            cfg = spec_dir / name
            validate_cfg(cfg)
            log(f"TLC {module} {name} ...")
            r = _tlc(cfg, spec_dir, args.workers, args.timeout, spec=module)
            r.update(module=module, expected=list(expected))
            r["ok"] = r["violations"] == list(expected)
            out["side"].append(r)
            out["side_failed"] += int(not r["ok"])
            log(f"  {r['distinct_states']} distinct states, violations {r['violations']}")


def _summary(out: dict[str, Any]) -> str:
    lines = ["leto spec check"]
    if out["tlc_skipped"]:
        lines.append(f"  TLC: skipped ({out['tlc_skipped']})")
    for r in out["tlc"]:
        lines.append(
            f"  TLC {r['config']}: {r['distinct_states']} distinct states, "
            f"violations {r['violations'] or 'none'} ({r['seconds']} s)"
        )
    for r in out["side"]:
        want = f"must violate {r['expected']}" if r["expected"] else "must pass"
        lines.append(
            f"  TLC {r['module']} {r['config']}: {r['distinct_states']} distinct states, "
            f"violations {r['violations'] or 'none'} ({want}: {'ok' if r['ok'] else 'FAILED'}, "
            f"{r['seconds']} s)"
        )
    if out["core_states"] is not None:
        lines.append(f"  core checker: {out['core_states']} states over {len(out['core'])} configs")
        for name, c in out["core"].items():
            lines.append(
                f"    {name}: {c['states']} states, violations {c['violations'] or 'none'}"
            )
        unreached = ", ".join(out["unreached_sometimes"]) or "none"
        lines.append(f"  unreached 'sometimes' properties: {unreached}")
        forbidden = ", ".join(out["forbidden_reached"]) or "none"
        lines.append(f"  reached where forbidden (leto.core.verify.NEVER): {forbidden}")
    if out["mutants_total"]:
        lines.append(f"  mutants caught: {out['mutants_caught']}/{out['mutants_total']}")
        for name, m in out["mutants"].items():
            lines.append(f"    {name}: core {m['core'] or 'SURVIVED'}; tlc {m['tlc']}")
    lines.append(f"  violations: {out['violations']}")
    return "\n".join(lines)


def run_trace(args: argparse.Namespace) -> int:
    """``leto spec trace RUN_DIR``: one line (or JSON); 0 agrees, 1 diverges, 2 bad input."""
    from leto.spec.trace import InputError, check

    try:
        report = check(args.run_dir, args.job)
    except InputError as exc:
        return refuse("spec trace", exc)
    if not args.tlc:
        print(json.dumps(report.as_dict()) if args.json else report.line())
        return 0 if report.ok else 1
    from leto.spec.tlatrace import check_tlc
    from leto.spec.tlc import TLCNotAvailable

    try:
        tla = check_tlc(args.run_dir, job=args.job)
    except (InputError, TLCNotAvailable) as exc:
        return refuse("spec trace", exc)
    if args.json:
        print(json.dumps({**report.as_dict(), "tlc": {"ok": tla.ok, "line": tla.line()}}))
    else:
        print(report.line())
        print(tla.line())
    return 0 if report.ok and tla.ok else 1


def run(args: argparse.Namespace) -> int:
    if args.spec_command == "trace":
        return run_trace(args)
    quiet = args.json

    def log(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    try:
        out = run_checks(args, log)
    except SpecInputError as exc:
        return refuse("spec check", exc)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(_summary(out))
    ok = (
        out["violations"] == 0
        and not out["unreached_sometimes"]
        and out["mutants_caught"] == out["mutants_total"]
        and out["side_failed"] == 0
    )
    return 0 if ok else 1
