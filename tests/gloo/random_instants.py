"""Kills at random instants (issue 39): SIGKILL and SIGSTOP the trainers of a user loop
(scripts/random_loop.py: scheduler, GradScaler, DistributedSampler over several epochs,
accumulation, clipping, logging, its own all-reduce and torch.save) at uniformly random
instants, and check that every run ends bitwise equal to its failure-free run.

    python tests/gloo/random_instants.py --runs 30 --kills 2 --seed 1

First the failure-free reference (its digests, its user checkpoints, its step time).
Then each run ``i`` (seed ``S + i``: its instants, signals and rank choices) starts the
same job and sends ``K`` signals, each at an instant drawn uniformly over the training:
a point ``u * STEPS`` of its progress, ``u`` uniform in [0, 1), reached once the job has
committed step ``floor(u * STEPS)`` (its event log) and a further fraction ``frac(u *
STEPS)`` of its current step time has passed (the median of its last 10 steps). The
instants follow the job's own progress, not the reference's clock: on these shared
CPUs a job's start-up and pace vary by tens of percent, and offsets taken from the
reference's wall time fell past the end of training (a run's 2 signals, twice in
31 runs). At that instant it picks a rank at random among those whose live trainer
(the newest pid file ``RUN_DIR/pids/rank<R>.<pid>`` of the rank whose process exists,
is this run's, and is neither a zombie nor stopped) runs and was not signalled before
(a SIGKILLed process looks alive while it exits), and sends it SIGKILL or SIGSTOP
(2:1). A stopped trainer is left to leto (a hang, found after ``--hang-timeout``, then
fenced); an instant with no rank to signal waits for one (a rank is being replaced);
once the job has logged ``training_done`` no signal is sent. A run passes when:

* the job exits 0 and leaves no process behind; its event log replays through the
  core's model (``leto spec trace``);
* its digests (every rank's parameters + optimizer state, and process state) equal the
  reference's, and every rank's parameter digest is the same (the replicas agree);
* every delivered signal is a failure in the event log, of that rank and pid: a
  SIGKILL as a crash, a SIGSTOP as a hang;
* every checkpoint the script saved (``user-ckpt/step<S>.pt``) equals the reference's
  of that step, tensor for tensor.

One line per run, then a summary; a run that fails prints its seed and keeps its run
directory (``--out``), with the failures and recoveries in order and the signals sent.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # jobs.py
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402
from jobs import assert_trace, story  # noqa: E402

from leto.backends.gloo.harness import JobResult, run_local  # noqa: E402

SCRIPT = str(HERE / "scripts" / "random_loop.py")
STEPS = 180
RANKS = 2
HANG_TIMEOUT = 3.0
KILL_SHARE = 2 / 3  # SIGKILL : SIGSTOP = 2 : 1
POLL = 0.01


@dataclass
class Signal:
    planned: float  # the point of the training's progress, in steps
    sent: float  # seconds after the job's start
    rank: int
    pid: int
    sig: str  # "SIGKILL" or "SIGSTOP"

    def line(self) -> str:
        return f"{self.sig} rank {self.rank} pid {self.pid} at {self.sent:.3f} s"


@dataclass
class Reference:
    res: JobResult
    step_time: float  # seconds, the median of its steps
    ckpts: dict[str, Any]  # the script's checkpoints by file name


@dataclass
class Run:
    seed: int
    res: JobResult
    signals: list[Signal]
    undelivered: int = 0  # instants past training_done
    problems: list[str] = field(default_factory=list)


class Progress:
    """A job's progress, from its event log as it is written: the highest committed step
    (and when this harness saw it), its step time, whether training is done."""

    def __init__(self, run_dir: Path, step_time: float) -> None:
        self.path = run_dir / "events.jsonl"
        self.pos = 0
        self.rest = b""
        self.step = 0
        self.seen = time.monotonic()
        self.times: list[float] = []  # t_rel of each new highest step
        self.default = step_time
        self.done = False

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except OSError:
            return
        self.pos += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        for raw in lines:
            if b'"event":"training_done"' in raw:
                self.done = True
            elif b'"event":"step"' in raw:
                e = json.loads(raw)
                if e["step"] > self.step:
                    self.step, self.seen = e["step"], time.monotonic()
                    self.times = [*self.times[-10:], e["t_rel"]]

    def step_time(self) -> float:
        if len(self.times) < 2:
            return self.default
        return statistics.median(b - a for a, b in itertools.pairwise(self.times))


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, D, T, Z, ...), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _ours(pid: int, run_dir: Path) -> bool:
    """The process belongs to this run (a trainer's command line is its launcher's)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return str(run_dir).encode() in f.read()
    except OSError:
        return False


def live_trainer(run_dir: Path, rank: int) -> tuple[int, str] | None:
    """The rank's live trainer and its state: the newest pid file of the rank whose
    process exists, belongs to this run and is not a zombie."""
    files = []
    for p in (run_dir / "pids").glob(f"rank{rank}.*"):
        try:
            files.append((p.stat().st_mtime_ns, int(p.suffix[1:])))
        except (OSError, ValueError):
            continue
    for _, pid in sorted(files, reverse=True):
        st = _state(pid)
        if st is not None and st not in "ZX" and _ours(pid, run_dir):
            return pid, st
    return None


def ready(run_dir: Path, signalled: set[int] | None = None) -> list[tuple[int, int]]:
    """(rank, pid) of each rank whose live trainer runs and was not ``signalled``: one
    stopped is left to leto, and one SIGKILLed may still look alive while it exits."""
    out = []
    for r in range(RANKS):
        live = live_trainer(run_dir, r)
        if live is not None and live[1] not in "tT" and live[0] not in (signalled or set()):
            out.append((r, live[0]))
    return out


def _in_thread(fn: Callable[[], JobResult]) -> tuple[threading.Thread, list[Any]]:
    box: list[Any] = []

    def body() -> None:
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 (reported by the caller)
            box.append(e)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, box


def _job(run_dir: Path, timeout: float) -> Callable[[], JobResult]:
    return lambda: run_local(
        SCRIPT,
        nproc=RANKS,
        run_dir=run_dir,
        env={"STEPS": str(STEPS)},
        extra=["--quiet", "--hang-timeout", str(HANG_TIMEOUT), "--heartbeat", "0.25"],
        timeout=timeout,
    )


def _result(t: threading.Thread, box: list[Any]) -> JobResult:
    t.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    res: JobResult = box[0]
    return res


def load_ckpts(run_dir: Path) -> dict[str, Any]:
    d = run_dir / "user-ckpt"
    if not d.exists():
        return {}
    return {p.name: torch.load(p, weights_only=True) for p in sorted(d.glob("step*.pt"))}


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of two loaded checkpoints (tensors: dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def reference(run_dir: Path, timeout: float = 120.0) -> Reference:
    """The failure-free run."""
    res = _job(run_dir, timeout)()
    problems = verdict(res, [], None, None)
    steps = [e["t_rel"] for e in res.of("step")]
    if problems or len(steps) != STEPS:
        raise RuntimeError(f"the failure-free run failed ({run_dir}): {problems}")
    step_time = statistics.median(b - a for a, b in itertools.pairwise(steps))
    return Reference(res, step_time, load_ckpts(run_dir))


def random_run(run_dir: Path, ref: Reference, kills: int, seed: int) -> Run:
    """One job with ``kills`` signals at uniformly random instants of its training (the
    draws from ``seed``); checked against ``ref``."""
    rng = random.Random(seed)
    plan = sorted(
        (
            rng.random() * STEPS,
            "SIGKILL" if rng.random() < KILL_SHARE else "SIGSTOP",
            rng.random(),
        )
        for _ in range(kills)
    )
    timeout = ref.res.seconds + 60.0 + kills * (HANG_TIMEOUT + 15.0)
    t0 = time.monotonic()
    t, box = _in_thread(_job(run_dir, timeout))
    prog = Progress(run_dir, ref.step_time)
    while t.is_alive() and len(ready(run_dir)) < RANKS:
        time.sleep(POLL)
    prog.seen = time.monotonic()  # step 0 begins when the trainers are up
    prog.poll()
    sent: list[Signal] = []
    undelivered = 0
    for point, sig, pick in plan:
        while t.is_alive() and not prog.done and prog.step < int(point):
            time.sleep(POLL)
            prog.poll()
        # into step int(point) + 1 by the fraction; from now if the job is past it already
        base = prog.seen if prog.step == int(point) else time.monotonic()
        at = base + (point - int(point)) * prog.step_time()
        while t.is_alive() and not prog.done and time.monotonic() < at:
            time.sleep(min(POLL, max(0.0, at - time.monotonic())))
            prog.poll()
        while t.is_alive() and not prog.done:
            can = ready(run_dir, {s.pid for s in sent})
            if can:
                rank, pid = can[int(pick * len(can))]
                try:
                    os.kill(pid, getattr(signal, sig))
                except ProcessLookupError:
                    continue  # it died in between: look again
                sent.append(Signal(point, time.monotonic() - t0, rank, pid, sig))
                break
            time.sleep(POLL)
            prog.poll()
        else:
            undelivered += 1
    res = _result(t, box)
    run = Run(seed, res, sent, undelivered)
    run.problems = verdict(res, sent, ref, load_ckpts(run_dir))
    return run


def verdict(
    res: JobResult,
    signals: list[Signal],
    ref: Reference | None,
    ckpts: dict[str, Any] | None,
) -> list[str]:
    """What is wrong with this run (nothing: an empty list)."""
    out = []
    if not res.ok and res.codes.get(0, [None])[-1] == -signal.SIGKILL:
        # (only run_local's deadline SIGKILLs the launcher here)
        out.append(f"the job did not end: its launcher was killed after {res.seconds:.0f} s")
    elif not res.ok:
        out.append(f"the job failed: codes {res.codes}, error {res.error}")
    if res.leftovers:
        out.append(f"processes left running after the job: {res.leftovers}")
    try:
        assert_trace(res.run_dir)
    except AssertionError as e:
        out.append(f"the event log does not replay: {e}")
    d = res.digests
    if d is None:
        out.append("no digests (no training_done)")
    else:
        params = {r: x["param"] for r, x in d.items()}
        if len(set(params.values())) != 1 or len(params) != RANKS:
            out.append(f"the replicas differ: {params}")
        if ref is not None and d != ref.res.digests:
            ranks = sorted(r for r in d if d[r] != (ref.res.digests or {}).get(r))
            out.append(f"not bitwise the failure-free run (ranks {ranks} differ)")
    failures = res.of("failure")
    used: set[int] = set()
    for s in signals:
        kind = "crash" if s.sig == "SIGKILL" else "hang"
        hit = next(
            (
                i
                for i, f in enumerate(failures)
                if i not in used and f.get("pid") == s.pid and f.get("rank") == s.rank
            ),
            None,
        )
        if hit is None:
            out.append(f"{s.line()}: no failure of that process in the event log")
            continue
        used.add(hit)
        if failures[hit].get("kind") != kind:
            out.append(f"{s.line()}: logged as a {failures[hit].get('kind')}, not a {kind}")
    if ref is not None and ckpts is not None:
        for name, state in ckpts.items():
            if name not in ref.ckpts:
                out.append(f"user-ckpt/{name}: the failure-free run saved no such step")
            elif not same(state, ref.ckpts[name]):
                out.append(f"user-ckpt/{name} differs from the failure-free run's")
    return out


def extra_failures(run: Run) -> list[dict[str, Any]]:
    """Failures in the log that no signal of the harness caused."""
    pids = {s.pid for s in run.signals}
    return [f for f in run.res.of("failure") if f.get("pid") not in pids]


def where(run: Run, s: Signal) -> str:
    """Where the signal found its trainer, from the failure it caused (phase@step)."""
    for f in run.res.of("failure"):
        if f.get("pid") == s.pid:
            return f"{f.get('in_phase')}@{f.get('at_step')}"
    return "?"


def line(i: int, run: Run) -> str:
    kinds = [f"{s.sig[3:].lower()} r{s.rank} {where(run, s)}" for s in run.signals]
    extra = extra_failures(run)
    return (
        f"run {i:3d} seed {run.seed}: {'ok ' if not run.problems else 'BAD'} "
        f"{len(run.res.recoveries)} recoveries, signals [{', '.join(kinds) or '-'}]"
        + (f" (+{run.undelivered} after training)" if run.undelivered else "")
        + (f", {len(extra)} other failures" if extra else "")
        + f", {run.res.seconds:.1f} s"
    )


def report(run: Run) -> str:
    """What a failing run prints: its seed, run directory, signals and story."""
    sig = "\n".join(f"  at progress {s.planned:.3f} steps: {s.line()}" for s in run.signals)
    probs = "\n".join(f"  {p}" for p in run.problems)
    return (
        f"seed {run.seed}, run directory {run.res.run_dir} (kept)\n{probs}\n"
        f"signals:\n{sig}\nfailures and recoveries:{story(run.res)}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--kills", type=int, default=2, help="signals per run")
    p.add_argument("--seed", type=int, default=1, help="run i uses seed SEED + i")
    p.add_argument("--out", help="where the run directories go (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the passing runs' directories")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="leto-random-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ref = reference(out / "ref")
    print(
        f"reference: {ref.res.seconds:.1f} s, {STEPS} steps of {ref.step_time * 1e3:.1f} ms, "
        f"{len(ref.ckpts)} user checkpoints",
        flush=True,
    )
    runs = []
    for i in range(args.runs):
        run = random_run(out / f"run{i}", ref, args.kills, args.seed + i)
        runs.append(run)
        print(line(i, run), flush=True)
        if run.problems:
            print(report(run), flush=True)
        elif not args.keep:
            shutil.rmtree(run.res.run_dir, ignore_errors=True)
    sigs = [s for r in runs for s in r.signals]
    kills = sum(s.sig == "SIGKILL" for s in sigs)
    bad = [r for r in runs if r.problems]
    phases = Counter(where(r, s).split("@")[0] for r in runs for s in r.signals)
    print("signals by phase:", ", ".join(f"{k} {n}" for k, n in phases.most_common()))
    print(
        f"summary: {len(runs)} runs, {len(sigs)} signals delivered ({kills} kills, "
        f"{len(sigs) - kills} stops, {sum(r.undelivered for r in runs)} past training), "
        f"{sum(len(r.res.recoveries) for r in runs)} recoveries, "
        f"{sum(len(extra_failures(r)) for r in runs)} other failures, "
        f"all bitwise: {'yes' if not bad else 'no'}"
        + (f" (failed seeds {[r.seed for r in bad]})" if bad else "")
        + f", wall {time.monotonic() - t0:.0f} s",
        flush=True,
    )
    if not bad and not args.keep:
        shutil.rmtree(out / "ref", ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
