"""Bad input to every command is refused in one line, before anything starts.

For each command Hypothesis draws one flag (or config key, or environment variable)
and a value that must be refused: nan, inf, a negative, zero where a count starts at
one, a value past the ceiling, a word where a number goes, a path that cannot serve,
an event log of random bytes. The command runs in this process (``leto.cli.main``)
in an empty directory, with every entry point that would start real work (the launch
agent, a benchmark, a simulation, the demo, the checkers) replaced by a tripwire.
Each case asserts: a non-zero exit; exactly one line on stderr, which names the flag
(or key, or variable) and holds no traceback; nothing on stdout; and nothing left
behind (no new file in the directory, no child process, no memfd, no /dev/shm entry).

The issue's own list of bad inputs is tested one by one in ``test_bad_input.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import attrs
import pytest
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from leto.adapters.config import BACKENDS, Config, ConfigError
from leto.cli import main

WEEK = 7 * 86400.0
FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)


class Started(Exception):
    """Raised by a tripwire: bad input reached the code that starts real work."""


def _tripwire(*args: Any, **kwargs: Any) -> Any:
    raise Started("bad input was not refused: real work would start here")


# What starts work in each command: none of these may be reached by bad input.
TRIPWIRES = (
    "leto.backends.gloo.agent.Agent",
    "leto.bench.cli._run",
    "leto.sim.experiment.run",
    "leto.sim.sweep.run_sweep",
    "leto.adapters.demo.demo",
    "leto.adapters.gloo_demo.run_cli",
    "leto.core.verify.check_core",
    "leto.core.verify.check_mutant",
    "leto.spec.cli._tlc",
)


# ------------------------------------------------------------------ the workspace


def _children() -> set[int]:
    out: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
            out |= {int(p) for p in f.read().split()}
    return out


def _memfds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if "memfd:" in link:
                out.add(link)
    return out


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _held_elsewhere(name: str) -> bool:
    """Whether a process other than this one holds /dev/shm/NAME (another test's)."""
    target = f"/dev/shm/{name}"
    me = str(os.getpid())
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid == me:
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return True
    return False


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


EVENTS_OK = [
    {"t": 1.0, "t_rel": 0.0, "event": "job_start", "nodes": 1, "nproc_per_node": 1},
    {"t": 2.0, "t_rel": 1.0, "event": "step", "step": 1},
    {"t": 3.0, "t_rel": 2.0, "event": "job_end", "status": "ok"},
]


@contextlib.contextmanager
def workspace() -> Iterator[Path]:
    """An empty directory as the working directory, with a few things to point at:
    ``train.py``, ``afile`` (empty), ``adir/``, ``run/events.jsonl`` (a good log)."""
    root = Path(tempfile.mkdtemp(prefix="leto-fuzz-"))
    (root / "train.py").write_text("raise SystemExit('bad input reached the script')\n")
    (root / "afile").write_text("")
    (root / "adir").mkdir()
    (root / "run").mkdir()
    (root / "run" / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS_OK))
    old = os.getcwd()
    os.chdir(root)
    try:
        yield root
    finally:
        os.chdir(old)
        shutil.rmtree(root, ignore_errors=True)


def run_cli(argv: Sequence[str]) -> tuple[int | str | None, str, str]:
    """``leto ARGV`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        for target in TRIPWIRES:
            stack.enter_context(mock.patch(target, _tripwire))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            code: int | str | None = main(list(argv))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


CASES = {"n": 0}


def _note(text: str) -> None:
    if currently_in_test_context():
        note(text)


def assert_refused(
    argv: Sequence[str], names: Sequence[str], before: set[str] | None = None
) -> str:
    """Run ``leto ARGV`` in a fresh workspace (or the current one, whose listing was
    ``before``); assert it is refused as the module docstring says; the line."""
    CASES["n"] += 1
    _note(f"argv: {list(argv)!r}")
    children, memfds, shm = _children(), _memfds(), _shm()
    ctx = workspace() if before is None else contextlib.nullcontext(Path.cwd())
    with ctx as root:
        listing = _tree(root) if before is None else before
        code, out, err = run_cli(argv)
        left = _tree(root) - listing
    _note(f"exit {code!r}, stderr {err!r}")
    assert code not in (0, None), f"accepted: {list(argv)!r}"
    assert len(err.splitlines()) == 1, f"{list(argv)!r}: not one line: {err!r}"
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, f"not one line: {err!r}"
    line = lines[0]
    assert line.startswith("leto"), line
    assert any(n in line for n in names), f"{line!r} names none of {list(names)}"
    assert out == "", out
    assert not left, f"left behind: {sorted(left)}"
    assert _children() <= children, "a process was started"
    assert _memfds() <= memfds, "a memfd was left open"
    new_shm = {n for n in _shm() - shm if not _held_elsewhere(n)}
    assert not new_shm, f"left in /dev/shm: {sorted(new_shm)}"
    return line


# ------------------------------------------------------------------ numeric flags


@attrs.frozen
class Num:
    """A numeric flag: integers or finite numbers in [lo, hi] ((lo, hi] if lo_open)."""

    flag: str
    integer: bool
    lo: float
    hi: float
    lo_open: bool = False
    also_bad: tuple[str, ...] = ()  # values refused for a reason of their own
    names: tuple[str, ...] = ()  # other words the refusal may name it by

    @property
    def words(self) -> tuple[str, ...]:
        return (self.flag, *self.names)

    def edges(self) -> list[str]:
        """The bad values every such flag is tried with, whatever Hypothesis draws."""
        first_bad_below = (int(self.lo) - (0 if self.lo_open else 1)) if self.integer else None
        below = str(first_bad_below) if self.integer else repr(self.lo if self.lo_open else -1.0)
        above = str(int(self.hi) + 1) if self.integer else repr(self.hi * 2 + 1)
        kind = ["1.5", "2.0"] if self.integer else ["1,5"]
        return ["nan", "inf", "-inf", "x", "", below, above, *kind, *self.also_bad]


WORDS = ["nan", "NaN", "inf", "-inf", "Infinity", "1e400", "-1e400", "x", "", "1,5", "0x10"]
WORDS += ["none", "true", "½", " ", "1 2", "--", "٫"]


def bad_numbers(f: Num) -> st.SearchStrategy[str]:
    parts: list[st.SearchStrategy[str]] = [st.sampled_from(WORDS)]
    if f.integer:
        smallest = int(f.lo) + (1 if f.lo_open else 0)
        parts.append(st.integers(max_value=smallest - 1).map(str))
        parts.append(st.integers(min_value=int(f.hi) + 1).map(str))
        parts.append(st.sampled_from(["1.5", "2.0", "1e3", "3e0", "10**3"]))
    else:
        lo, lo_open, hi = f.lo, f.lo_open, f.hi
        below = st.floats(max_value=lo, allow_nan=False, allow_infinity=False)
        parts.append(below.filter(lambda v: v <= lo if lo_open else v < lo).map(repr))
        above = st.floats(min_value=hi, allow_nan=False, allow_infinity=False)
        parts.append(above.filter(lambda v: v > hi).map(repr))
    if f.also_bad:
        parts.append(st.sampled_from(f.also_bad))
    return st.one_of(parts)


@attrs.frozen
class Command:
    """How a command is run here: its words before and after the flag under test."""

    name: str
    before: tuple[str, ...]
    after: tuple[str, ...] = ()

    def argv(self, *flags: str) -> list[str]:
        return [*self.before, *flags, *self.after]


LAUNCH = Command("launch", ("launch", "--quiet", "--no-echo"), ("train.py",))
SIMULATE = Command("simulate", ("simulate", "--gpus", "64", "--days", "1", "--seeds", "1"))
SPEC = Command("spec", ("spec", "check", "--skip-tlc", "--skip-core", "--skip-mutants"))
DEMO = Command("demo", ("demo", "--backend", "fake", "--no-faults", "--steps", "30"))


def bench(name: str) -> Command:
    return Command(f"bench {name}", ("bench", name, "--no-progress", "--out=out"))


NUMERIC: list[tuple[Command, Num]] = [
    (LAUNCH, Num("--nproc-per-node", True, 1, 1024)),
    (LAUNCH, Num("--nnodes", True, 1, 65_536)),
    (LAUNCH, Num("--node-rank", True, 0, 0)),  # one node: only rank 0
    # not shorter than the hang timeout (10 s): every trainer would look hung
    (LAUNCH, Num("--heartbeat", False, 0, 3600, True, also_bad=("10", "11.5", "3600"))),
    # not longer than the heartbeat (0.5 s)
    (LAUNCH, Num("--hang-timeout", False, 0, WEEK, True, also_bad=("0.5", "0.25"))),
    (LAUNCH, Num("--collective-timeout", False, 0, WEEK, True)),
    (LAUNCH, Num("--rdzv-timeout", False, 0, WEEK, True)),
    (LAUNCH, Num("--spare-timeout", False, 0, WEEK, True)),
    (LAUNCH, Num("--recovery-timeout", False, 0, WEEK, True)),
    (LAUNCH, Num("--shadow-memory-budget", False, 0, float(1 << 30))),
    (LAUNCH, Num("--threads", True, 1, 1024)),
    (LAUNCH, Num("--progress-every", False, 0, WEEK, True)),
    (LAUNCH, Num("--spares", True, 0, 256)),
    (LAUNCH, Num("--max-restarts", True, 0, 1000)),
    (SIMULATE, Num("--gpus", True, 1, 10_000_000, names=("gpus",))),
    (SIMULATE, Num("--gpus-per-node", True, 1, 1024, names=("gpus_per_node",))),
    (SIMULATE, Num("--days", False, 0, 36_500, True, names=("days",))),
    (SIMULATE, Num("--model-params", False, 0, 1e15, True, names=("model_params",))),
    (SIMULATE, Num("--step-time", False, 0, 1e9, True, names=("step_time_s",))),
    (SIMULATE, Num("--mtbf-hours", False, 0, 1e9, True, names=("mtbf_hours",))),
    (SIMULATE, Num("--hof-fraction", False, 0, 1, names=("hof_fraction",))),
    (SIMULATE, Num("--spares", True, 0, 1_000_000, names=("spares",))),
    (SIMULATE, Num("--tier2-parity", True, 1, 1024, names=("tier2_parity",))),
    (SIMULATE, Num("--tier2-every", True, 1, 1_000_000, names=("tier2_every_steps",))),
    (SIMULATE, Num("--leto-overhead", False, 0, 1, names=("leto_overhead",))),
    (SIMULATE, Num("--seeds", True, 1, 10_000, names=("seeds",))),
    (SIMULATE, Num("--seed", True, 0, 2**63 - 1, names=("seed",))),
    (bench("recovery"), Num("--world", True, 2, 256)),
    (bench("goodput"), Num("--batch", True, 1, 1 << 20)),
    (bench("scaling"), Num("--seed", True, 0, 2**32 - 1)),
    (bench("recovery"), Num("--repeats", True, 1, 1000)),
    (bench("scaling"), Num("--mtbf", False, 0, WEEK, True)),
    (bench("recovery"), Num("--gap", False, 0, 86_400.0)),
    (bench("overhead"), Num("--rounds", True, 1, 1000)),
    (bench("overhead"), Num("--periods", True, 1, 1000)),
    (bench("overhead"), Num("--tier2-interval", True, 1, 1_000_000)),
    (bench("goodput"), Num("--budget", False, 0, WEEK, True)),
    (bench("goodput"), Num("--rounds", True, 1, 1000)),
    (SPEC, Num("--workers", True, 1, 256)),
    (SPEC, Num("--timeout", False, 0, WEEK, True)),
    (DEMO, Num("--steps", True, 1, 100_000)),
    # at most 256 ranks, and the other of the two is 2 by default
    (DEMO, Num("--nodes", True, 1, 128, names=("nodes",))),
    (DEMO, Num("--ranks-per-node", True, 1, 128, names=("ranks_per_node",))),
    (DEMO, Num("--chunk-size", True, 1, 1 << 30, names=("chunk_size",))),
    (DEMO, Num("--tier2-interval", True, 1, 1_000_000, names=("tier2_interval",))),
    (DEMO, Num("--seed", True, 0, 2**32 - 1)),
]
_ids = [f"{c.name} {f.flag}" for c, f in NUMERIC]


@pytest.mark.parametrize(("command", "flag"), NUMERIC, ids=_ids)
def test_numeric_flag_refuses_its_edges(command: Command, flag: Num) -> None:
    for value in flag.edges():
        assert_refused(command.argv(f"{flag.flag}={value}"), flag.words)


@pytest.mark.parametrize(("command", "flag"), NUMERIC, ids=_ids)
@settings(FUZZ, max_examples=5)
@given(data=st.data())
def test_numeric_flag_refuses_drawn_values(
    command: Command, flag: Num, data: st.DataObject
) -> None:
    value = data.draw(bad_numbers(flag), label="value")
    assert_refused(command.argv(f"{flag.flag}={value}"), flag.words)


# ------------------------------------------------------------ words, paths, plans


BAD_DIRS = ("afile", "afile/sub", "", "x" * 300, "adir/" + "y" * 256)
BAD_OUT_FILES = ("adir", "nodir/plot.png", "afile/plot.png", "z" * 300)
ENDPOINTS = (
    "localhost",
    ":29400",
    "127.0.0.1:",
    "127.0.0.1:0",
    "127.0.0.1:65536",
    "127.0.0.1:x",
    "127.0.0.1:-1",
    "127.0.0.1:٣",
    "127.0.0.1:1e3",
    "nosuchhost.invalid:29400",
    "192.0.2.1:29400",  # TEST-NET-1: never an address of this machine
    "[::1:5",
)
FAULT_PLANS = ("x", "[", "{}", "[1]", '[{"rank": 0}]', "nofile.json", "adir", "", "null")
FAULT_PLANS += ('[{"rank": 9, "step": 1, "kind": "crash", "phase": "forward"}]',)
BAD_PARAMS = ("lots", "0", "-1M", "", "1e400", "9" * 400, "3G", "1.5.5M", "M")

WORDY: list[tuple[list[str], tuple[str, ...]]] = [
    *[(LAUNCH.argv(f"--rdzv-endpoint={e}"), ("--rdzv-endpoint",)) for e in ENDPOINTS],
    *[(LAUNCH.argv(f"--run-dir={d}"), ("--run-dir",)) for d in BAD_DIRS],
    *[(LAUNCH.argv(f"--metrics={e}"), ("--metrics",)) for e in ENDPOINTS if e != "127.0.0.1:0"],
    *[(LAUNCH.argv(f"--tensorboard={d}"), ("--tensorboard",)) for d in BAD_DIRS],
    *[(LAUNCH.argv(f"--faults={p}"), ("--faults",)) for p in FAULT_PLANS],
    *[
        (["launch", "--quiet", script], ("script",))
        for script in ("nothere.py", "adir", "", "afile/x", "q" * 300)
    ],
    (LAUNCH.argv("--nnodes=2"), ("--rdzv-endpoint",)),
    *[(["launch", "--quiet", "-m", m], ("-m",)) for m in ("nosuchmodule", "a..b", "", "x.py")],
    (LAUNCH.argv("--no-python"), ("--no-python",)),
    *[
        (LAUNCH.argv(f"--nnodes={n}"), ("--nnodes",))
        for n in ("3:2", "0:1", ":", "1:", "a:2", "1:2:3")
    ],
    (LAUNCH.argv("--nnodes=2:4", "--node-rank=2"), ("--node-rank", "--nnodes")),
    # --rdzv-backend etcd: the members, the job's id, this node's address
    *[(LAUNCH.argv(f"--rdzv-backend={b}"), ("--rdzv-backend",)) for b in ("", "zk", "ETCD")],
    (LAUNCH.argv("--rdzv-backend=etcd"), ("--rdzv-endpoint",)),
    (LAUNCH.argv("--rdzv-backend=etcd", "--rdzv-endpoint=127.0.0.1:2379"), ("--rdzv-id",)),
    *[
        (
            LAUNCH.argv("--rdzv-backend=etcd", f"--rdzv-endpoint={e}", "--rdzv-id=j"),
            ("--rdzv-endpoint",),
        )  # fmt: skip
        for e in (
            *ENDPOINTS[:9],
            "127.0.0.1:2379,",
            "127.0.0.1:1,127.0.0.1:1",
            ",".join(f"127.0.0.1:{p}" for p in range(1, 18)),
        )
    ],
    *[
        (
            LAUNCH.argv("--rdzv-backend=etcd", "--rdzv-endpoint=127.0.0.1:2379", f"--rdzv-id={i}"),
            ("--rdzv-id",),
        )  # fmt: skip
        for i in ("", "a/b", "-a", "x" * 65, "a b", "é")
    ],
    *[
        (
            LAUNCH.argv(
                "--rdzv-backend=etcd",
                "--rdzv-endpoint=127.0.0.1:2379",
                "--rdzv-id=j",
                f"--local-addr={h}",
            ),
            ("--local-addr",),
        )  # fmt: skip
        for h in ("", "nosuchhost.invalid", "192.0.2.1", "h" * 300)
    ],
    *[(LAUNCH.argv(f"--rdzv-id={i}"), ("--rdzv-id",)) for i in ("", "a/b", "x" * 65)],
    (LAUNCH.argv("--local-addr=127.0.0.1"), ("--local-addr", "etcd")),
    # IPv6 is refused as such (not as a port in use), a directory /proc will not take
    # as such (not as a server that cannot start)
    *[(LAUNCH.argv(f"--rdzv-endpoint={e}"), ("--rdzv-endpoint",)) for e in ("[::1]:29400",)],
    (LAUNCH.argv("--master-addr=::1"), ("--master-addr",)),
    *[(LAUNCH.argv(f"{f}=/proc/x"), (f, "/proc")) for f in ("--tensorboard", "--run-dir")],
    # torchrun's flags: refused ones, and values leto cannot take
    (LAUNCH.argv("--monitor-interval=1"), ("--monitor-interval",)),
    (LAUNCH.argv("--nproc-per-node=gpu"), ("--nproc-per-node",)),
    *[(LAUNCH.argv(f"--redirects={r}"), ("--redirects",)) for r in ("1", "4", "0:3,", "x")],
    (LAUNCH.argv("--rdzv-conf=timeout=3"), ("--rdzv-conf",)),
    # the spare pool: a spare has no node rank, starts no spares, needs a job of nodes to
    # replace and node 0's endpoint; only node 0 starts spares
    (LAUNCH.argv("--spare", "--node-rank=1", "--nnodes=2"), ("--spare",)),
    (LAUNCH.argv("--spare", "--node-rank=0"), ("--spare",)),
    (LAUNCH.argv("--spare", "--spares=1", "--nnodes=2"), ("--spare",)),
    (LAUNCH.argv("--spare"), ("--spare",)),
    (LAUNCH.argv("--spares=2"), ("--spares",)),
    (LAUNCH.argv("--spare", "--nnodes=2", "--standalone"), ("--spare", "--rdzv-endpoint")),
    (
        LAUNCH.argv("--spares=1", "--nnodes=2", "--node-rank=1", "--rdzv-endpoint=127.0.0.1:29400"),
        ("--spares",),
    ),
    *[
        (SIMULATE.argv(f"--set={f}={v}"), (f,))
        for f in ("gpus", "days", "hof_fraction")
        for v in ("nan", "x", "-1", "")
    ],
    *[(SIMULATE.argv(f"--set={f}=maybe"), (f,)) for f in ("tier1", "tier2")],
    (SIMULATE.argv("--set=spares=1.5"), ("spares",)),
    (SIMULATE.argv("--set=calibration=x"), ("calibration",)),
    (SIMULATE.argv("--set=nonsense=1"), ("nonsense",)),
    (SIMULATE.argv("--set=gpus"), ("gpus",)),
    *[
        (SIMULATE.argv(f"--sweep={sweep}", f"--values={values}"), ("--values", "sweep"))
        for sweep, values in [
            ("hof", "2"),
            ("hof", "-0.5"),
            ("hof", "x"),
            ("hof", ""),
            ("hof", "nan"),
            ("gpus", "1.5"),
            ("gpus", "inf"),
            ("gpus", "0"),
            ("gpus", "1e12"),
            ("mtbf", "0"),
            ("mtbf", "1e-9"),  # too many failures to simulate
            ("hof", ",".join(["0.5"] * 101)),
        ]
    ],
    (SIMULATE.argv("--values=1,2"), ("--values",)),
    (SIMULATE.argv("--strategies=magic"), ("magic",)),
    (SIMULATE.argv("--strategies=,"), ("strategy",)),
    (SIMULATE.argv("--calibration=x"), ("--calibration",)),
    (SIMULATE.argv("--sweep=days"), ("--sweep",)),
    *[(SIMULATE.argv(f"--bench={b}"), ("bench",)) for b in ("nothere.json", "adir", "afile")],
    *[(SIMULATE.argv(f"--plot={d}"), ("--plot",)) for d in BAD_DIRS],
    *[(bench(b).argv(f"--out={d}"), ("--out",)) for b in ("recovery", "goodput") for d in BAD_DIRS],
    *[(bench("recovery").argv(f"--params={p}"), ("--params", "model size")) for p in BAD_PARAMS],
    *[
        (bench("scaling").argv(f"--sizes=1M,{p}" if p else "--sizes=1M"), ("--sizes", "model size"))
        for p in BAD_PARAMS
    ],
    *[(bench("goodput").argv(f"--systems={s}"), ("system",)) for s in ("nvre", "", ",", "leto,x")],
    (bench("overhead").argv("--systems=leto"), ("--systems",)),  # overhead takes no systems
    (["bench", "nosuch"], ("nosuch",)),
    *[(SPEC.argv(f"--spec-dir={d}"), ("--spec-dir",)) for d in ("afile", "nothere")],
    *[
        (SPEC.argv(f"--config={c}"), ("config", c))
        for c in ("nothere.cfg", "afile", "adir", "train.py")
    ],
    *[(DEMO.argv(f"--checkpoint-dir={d}"), ("--checkpoint-dir",)) for d in BAD_DIRS],
    *[(DEMO.argv(f"--backend={b}"), ("--backend",)) for b in ("nccl", "", "GLOO", "mpi")],
    *[(DEMO.argv(f"--config={c}"), ("config", c)) for c in ("nothere.toml", "adir", "afile")],
    (["report", "nothere", "--no-plot"], ("nothere",)),
    (["report", "adir", "--no-plot"], ("adir",)),
    (["report", "afile", "--no-plot"], ("afile",)),
    *[(["report", "run", f"--out={o}"], ("--out",)) for o in BAD_OUT_FILES],
]


@pytest.mark.parametrize(("argv", "names"), WORDY, ids=[" ".join(a)[:60] for a, _ in WORDY])
def test_bad_words_and_paths_are_refused(argv: list[str], names: tuple[str, ...]) -> None:
    assert_refused(argv, names)


@FUZZ
@given(
    st.sampled_from(["endpoint", "backend", "strategies", "systems"]),
    st.text(max_size=16),
)
def test_free_text_is_refused(where: str, text: str) -> None:
    if where == "endpoint":  # any text without a port is not HOST:PORT
        text = text.replace(":", "")
        assert_refused(LAUNCH.argv(f"--rdzv-endpoint={text}"), ("--rdzv-endpoint",))
    elif where == "backend":
        assume(text not in ("gloo", "fake"))
        assert_refused(DEMO.argv(f"--backend={text}"), ("--backend",))
    elif where == "strategies":
        names = ("strategy", "--strategies")
        assert_refused(SIMULATE.argv(f"--strategies=magic,{text}"), names)
    else:
        assert_refused(bench("recovery").argv(f"--systems=x{text}"), ("system",))


# ------------------------------------------------------------------------- config

INT64 = 2**63 - 1
_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x7f"),
    max_size=12,
)
_ints = st.integers(min_value=-INT64 - 1, max_value=INT64)
_floats = st.floats(allow_nan=True, allow_infinity=True)
_non_bool = st.one_of(_ints, _floats, _text)
_count_bad = {
    "nodes": 65_536,
    "ranks_per_node": 1_024,
    "chunk_size": 1 << 30,
    "tier2_interval": 1_000_000,
    "tier2_parity": 1,  # the default topology has one node: m >= 2 needs more than m
    "micro_batches": 4_096,
}


_zero_ok = {
    "batch_parts": 1 << 20,
    "checkpoint_interval": 1_000_000,
    "checkpoint_mtbf": 10 * 365 * 86_400,
    "replica_check": 1_000_000,
}


# the config's true/false settings
BOOL_KEYS = (
    "tier1",
    "tier2",
    "verify_chunks",
    "master_weights",
    "shard",
    "parallel_replay",
    "checkpoint_async",
    "keep_global_batch",
)


def bad_setting(key: str) -> st.SearchStrategy[Any]:
    """Values of the config key ``key`` that a Config must refuse (the other keys at
    their defaults: the fake backend, one rank)."""
    if key == "backend":
        return st.one_of(_text.filter(lambda t: t not in BACKENDS), _ints, st.booleans())
    if key == "tier1_code":
        good = ("auto", "parity")  # 'replica' is refused on the fake backend
        return st.one_of(_text.filter(lambda t: t not in good), _ints, st.booleans())
    if key in BOOL_KEYS:
        return _non_bool
    if key == "device":  # the fake backend keeps host memory: any GPU is refused too
        return st.one_of(_text.filter(lambda t: t not in ("auto", "cpu")), _ints, st.booleans())
    if key == "checksum":
        good = ("auto", "xxh3", "fletcher")
        return st.one_of(_text.filter(lambda t: t not in good), _ints, st.booleans())
    if key == "topology":
        return st.one_of(
            st.sampled_from(["0x1", "1x0", "99999x1", "1x99999", "2x", "x", "1x1x1", "²x1", ""]),
            st.sampled_from([[0, 1], [1], [1, 2, 3], [True, 1], 5, 1.5]),
            _text.filter(lambda t: "x" not in t.lower()),
        )
    if key == "world_size":  # the default topology has one rank
        return st.one_of(_ints.filter(lambda v: v != 1), _floats, _text, st.booleans())
    if key == "checkpoint_dir":
        return st.one_of(st.sampled_from(["", "afile", "afile/sub"]), _ints, st.booleans())
    if key == "resume":
        return st.one_of(st.sampled_from(["", "afile", "no/such/dir"]), _ints, st.booleans())
    if key in _zero_ok:  # 0 is off: only negatives and values past the bound are refused
        return st.one_of(
            st.integers(min_value=-INT64 - 1, max_value=-1),
            st.integers(min_value=_zero_ok[key] + 1, max_value=INT64),
            _floats,
            _text,
            st.booleans(),
        )
    hi = _count_bad[key]
    return st.one_of(
        st.integers(min_value=-INT64 - 1, max_value=0),
        st.integers(min_value=hi + 1, max_value=INT64),
        _floats,
        _text,
        st.booleans(),
    )


KEYS = sorted(a.name for a in attrs.fields(Config) if a.name not in ("nodes", "ranks_per_node"))
KEYS += ["nodes", "ranks_per_node", "topology"]
_key_names = {"world_size": ("world_size", "topology"), "nodes": ("nodes",)}


@st.composite
def config_case(draw: st.DrawFn) -> tuple[dict[str, Any], tuple[str, ...]]:
    if draw(st.integers(0, 9)) == 0:
        key = draw(_text.filter(lambda t: t not in KEYS and t != "leto"))
        return {key: draw(_non_bool)}, ("unknown setting",)
    key = draw(st.sampled_from(KEYS))
    return {key: draw(bad_setting(key))}, _key_names.get(key, (key,))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if v != v:
            return "nan"
        if abs(v) == float("inf"):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    return "[" + ", ".join(_toml_value(x) for x in v) + "]"


@FUZZ
@given(config_case())
def test_config_refuses_bad_settings(case: tuple[dict[str, Any], tuple[str, ...]]) -> None:
    data, names = case
    CASES["n"] += 1
    # as a dict
    with workspace(), pytest.raises(ConfigError) as e:
        Config.from_dict(data)
    assert len(str(e.value).splitlines()) == 1
    assert any(n in str(e.value) for n in names), (str(e.value), names)
    # as a TOML file given to `leto demo --config`
    ((key, value),) = data.items()
    with workspace() as root:
        toml = f"{json.dumps(key, ensure_ascii=False)} = {_toml_value(value)}\n"
        (root / "bad.toml").write_text(toml, encoding="utf-8")
        before = _tree(root)
        assert_refused(["demo", "--no-faults", "--config", "bad.toml"], names, before)


def bad_variable(key: str) -> st.SearchStrategy[str]:
    if key in BOOL_KEYS:
        return st.sampled_from(["maybe", "2", "-1", "truth", "nan", "yes please", "0.0"])
    if key in ("backend", "tier1_code"):
        return st.sampled_from(["mpi", "", "GLOO", "replica" if key == "tier1_code" else "x"])
    if key == "topology":
        return st.sampled_from(["0x1", "2", "axb", "99999x1", "", "1x1x1", "²x1"])
    if key == "checkpoint_dir":
        return st.sampled_from(["afile", "afile/sub"])
    if key == "resume":  # as for checkpoint_dir, an empty variable is an unset one
        return st.sampled_from(["afile", "afile/sub", "no/such/dir", "0"])
    if key in _zero_ok:  # 0 is off: refused are negatives, non-integers, past the bound
        return st.one_of(
            st.sampled_from(["-3", "1e12", "nan", "inf", "x", "", "1.5", "9" * 5000]),
            st.integers(min_value=_zero_ok[key] + 1).map(str),
        )
    return st.one_of(
        st.sampled_from(["0", "-3", "1e12", "nan", "inf", "x", "", "1.5", "9" * 5000]),
        st.integers(min_value=_count_bad.get(key, 1) + 1).map(str),
    )


@st.composite
def env_case(draw: st.DrawFn) -> tuple[dict[str, str], tuple[str, ...]]:
    if draw(st.integers(0, 9)) == 0:
        name = "LETO_" + draw(st.sampled_from(["TEIR2", "CHUNKSIZE", "X", "BACKEND_"]))
        return {name: "1"}, (name[5:].lower(),)
    key = draw(st.sampled_from(KEYS))
    return {"LETO_" + key.upper(): draw(bad_variable(key))}, _key_names.get(key, (key,))


@FUZZ
@given(env_case())
def test_environment_refuses_bad_variables(case: tuple[dict[str, str], tuple[str, ...]]) -> None:
    env, names = case
    CASES["n"] += 1
    # the variables `leto launch` sets for its trainers are not settings, and pass
    env = {**env, "LETO_ROLE": "trainer", "LETO_INCARNATION": "3", "LETO_JOB": "j"}
    with workspace(), pytest.raises(ConfigError) as e:
        Config.from_env(env)
    assert len(str(e.value).splitlines()) == 1
    assert any(n in str(e.value) for n in names), (str(e.value), names)


# ------------------------------------------------------------------------- report


RECORD_FIELDS = ["event", "t_rel", "step", "seconds", "phases_ms", "promoted", "restarts"]
RECORD_FIELDS += ["steps_lost", "kind", "error", "traceback", "reason", "node", "generation"]
EVENTS = ["step", "failure", "recovery_end", "job_failed", "shadow", "node_joined", "job_end"]
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _text,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_text, kids, max_size=3),
    max_leaves=6,
)


@st.composite
def record(draw: st.DrawFn) -> dict[str, Any]:
    rec = {"event": draw(st.sampled_from(EVENTS)), "t_rel": 1.0}
    for key in draw(st.lists(st.sampled_from(RECORD_FIELDS), max_size=3, unique=True)):
        rec[key] = draw(_json)
    return rec


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=200),
        st.lists(record(), min_size=1, max_size=4).map(
            lambda rs: "".join(json.dumps(r) + "\n" for r in rs).encode()
        ),
    )
)
def test_report_never_crashes_on_a_bad_log(data: bytes) -> None:
    """Any log: a report (exit 0), or one line naming what is wrong (exit 2)."""
    CASES["n"] += 1
    with workspace() as root:
        (root / "run" / "events.jsonl").write_bytes(data)
        before = _tree(root)
        code, out, err = run_cli(["report", "run", "--no-plot"])
        assert _tree(root) == before
    note(f"exit {code}, stderr {err!r}")
    assert "Traceback" not in err
    if code != 0:
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith("leto report: ")


@FUZZ
@given(
    st.sampled_from(
        [
            ({"t_rel": 1.0}, '"event"'),
            ({"event": "step", "t_rel": 1.0, "step": "3"}, "step"),
            ({"event": "step", "t_rel": "x", "step": 3}, "t_rel"),
            ({"event": 5, "t_rel": 1.0}, '"event"'),
            ({"event": "step", "step": 1}, "t_rel"),
            ({"event": "recovery_end", "t_rel": 1, "phases_ms": []}, "phases_ms"),
            ({"event": "recovery_end", "t_rel": 1, "phases_ms": {"fence": "a"}}, "phases_ms"),
            ({"event": "recovery_end", "t_rel": 1, "promoted": [1]}, "promoted"),
            ({"event": "recovery_end", "t_rel": 1, "seconds": -1}, "seconds"),
            ({"event": "recovery_end", "t_rel": 1, "restarts": 1.5}, "restarts"),
            ({"event": "node_joined", "t_rel": 1}, "node"),
            ([1, 2], "JSON object"),
        ]
    ),
    st.integers(0, 2),
    st.sampled_from(["run", "run/events.jsonl"]),
)
def test_report_refuses_a_record_it_cannot_read(bad: tuple[Any, str], at: int, target: str) -> None:
    rec, name = bad
    lines = [json.dumps(e) for e in EVENTS_OK]
    lines.insert(at, json.dumps(rec))
    with workspace() as root:
        (root / "run" / "events.jsonl").write_text("\n".join(lines) + "\n")
        line = assert_refused(["report", target, "--no-plot"], (name,), _tree(root))
    assert f"line {at + 1}" in line


def test_the_fuzz_ran_its_cases() -> None:
    """The count of refusals checked so far (``pytest -s`` prints it); the test can fail
    only if the module ran none."""
    print(f"\ncli fuzz: {CASES['n']} cases")
    assert CASES["n"] > 0
