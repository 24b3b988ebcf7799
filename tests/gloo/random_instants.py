"""Kills at random instants (issue 39): SIGKILL and SIGSTOP the trainers of a user loop
(scripts/random_loop.py: scheduler, GradScaler, DistributedSampler over several epochs,
accumulation, clipping, logging, its own all-reduce and torch.save) at uniformly random
instants, and check that every run ends bitwise equal to its failure-free run.

    python tests/gloo/random_instants.py --runs 30 --kills 2 --seed 1

First the failure-free reference: its digests, its user checkpoints and its training
window (from the instant both ranks' trainers are up, ``RUN_DIR/pids/rank<R>.<pid>``, to
``training_done`` in the event log, on this harness's clock). Then each run ``i`` (seed
``S + i``: its instants, signals and rank choices) starts the same job and, at ``K``
instants drawn uniformly in a window as long, counted from the instant its own trainers
are up (a job's start-up, ~2 s here, varies by tenths of a second), picks a rank at
random among those whose live trainer (the newest pid file of the rank whose process
exists, is this run's, and is neither a zombie nor stopped) runs and was not signalled
before (a SIGKILLed process looks alive while it exits), and sends it SIGKILL or
SIGSTOP (2:1). A stopped trainer is left to leto (a hang, found after
``--hang-timeout``, then fenced); an instant with no rank to signal waits for one (a
rank is being replaced); once the job has logged ``training_done`` no signal is sent.
A run passes when:

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
import os
import random
import shutil
import signal
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
    planned: float  # seconds after the job's start
    sent: float
    rank: int
    pid: int
    sig: str  # "SIGKILL" or "SIGSTOP"

    def line(self) -> str:
        return f"{self.sig} rank {self.rank} pid {self.pid} at {self.sent:.3f} s"


@dataclass
class Reference:
    res: JobResult
    window: tuple[float, float]  # the training window, seconds after the job's start
    ckpts: dict[str, Any]  # the script's checkpoints by file name


@dataclass
class Run:
    seed: int
    res: JobResult
    signals: list[Signal]
    undelivered: int = 0  # instants past training_done
    trace_error: str | None = None
    problems: list[str] = field(default_factory=list)


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


def _done(run_dir: Path) -> bool:
    try:
        return '"event":"training_done"' in (run_dir / "events.jsonl").read_text()
    except OSError:
        return False


def _all_live(run_dir: Path) -> bool:
    return all(live_trainer(run_dir, r) is not None for r in range(RANKS))


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
    """The failure-free run, its training window timed on this harness's clock."""
    t0 = time.monotonic()
    t, box = _in_thread(_job(run_dir, timeout))
    start = end = None
    while t.is_alive():
        now = time.monotonic() - t0
        if start is None and _all_live(run_dir):
            start = now
        if start is not None and end is None and _done(run_dir):
            end = now
        time.sleep(POLL)
    res = _result(t, box)
    problems = verdict(res, [], None, None)
    if problems or start is None or end is None:
        raise RuntimeError(f"the failure-free run failed ({run_dir}): {problems}")
    return Reference(res, (start, end), load_ckpts(run_dir))


def random_run(run_dir: Path, ref: Reference, kills: int, seed: int) -> Run:
    """One job with ``kills`` signals at uniformly random instants of ``ref``'s training
    window (the draws from ``seed``); checked against ``ref``."""
    rng = random.Random(seed)
    lo, hi = ref.window
    plan = sorted(
        (
            rng.uniform(0, hi - lo),
            "SIGKILL" if rng.random() < KILL_SHARE else "SIGSTOP",
            rng.random(),
        )
        for _ in range(kills)
    )
    timeout = ref.res.seconds + 60.0 + kills * (HANG_TIMEOUT + 15.0)
    t0 = time.monotonic()
    t, box = _in_thread(_job(run_dir, timeout))
    while t.is_alive() and not _all_live(run_dir):
        time.sleep(POLL)
    up = time.monotonic() - t0  # this run's start of training: its instants count from it
    sent: list[Signal] = []
    undelivered = 0
    for offset, sig, pick in plan:
        at = up + offset
        while t.is_alive() and time.monotonic() - t0 < at:
            time.sleep(POLL)
        while t.is_alive() and not _done(run_dir):
            can = ready(run_dir, {s.pid for s in sent})
            if can:
                rank, pid = can[int(pick * len(can))]
                try:
                    os.kill(pid, getattr(signal, sig))
                except ProcessLookupError:
                    continue  # it died in between: look again
                sent.append(Signal(at, time.monotonic() - t0, rank, pid, sig))
                break
            time.sleep(POLL)
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
    if not res.ok:
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
    sig = "\n".join(f"  planned {s.planned:.3f} s: {s.line()}" for s in run.signals)
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
    lo, hi = ref.window
    print(
        f"reference: {ref.res.seconds:.1f} s, training from {lo:.2f} to {hi:.2f} s "
        f"({STEPS} steps), {len(ref.ckpts)} user checkpoints",
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
