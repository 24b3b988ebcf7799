"""The baselines' agent: starts a job's worker processes, watches them, restarts them.

One :class:`Job` runs one checkpoint/restart system (``ckpt-disk``,
``ckpt-disk-async``, ``gemini``, or ``plain`` DDP) on one workload, the way its
users run it: like torchrun's elastic agent, when a worker dies every other worker
is stopped (SIGTERM, then SIGKILL) and a new process per rank is started
(``python`` + ``import torch`` + ``init_process_group`` on gloo over 127.0.0.1),
which reloads the newest checkpoint. (leto's jobs run under ``leto launch``:
:mod:`leto.bench.gloojob`.) A ``torchft`` job's replica groups are separate jobs, each
under its own agent as torchft runs them: a death restarts the dead rank's group only
(one rank per group here, :mod:`leto.bench.ftjob`), and the other groups train on.

The agent hosts the job's ``TCPStore`` (a port from the OS) and each rank's host
memory (a memfd created here and passed to the rank's processes, so it outlives
them and nothing can leak in ``/dev/shm``); it sees a worker's death at once
through a pidfd. Every worker reports JSON lines on its own pipe; the agent adds
rank, generation and pid, and keeps them all in :attr:`Job.events` for the
measurements (:mod:`leto.bench.timeline`).

The agent knows nothing about what is measured: the benchmarks drive it with
:meth:`Job.pump` and inject failures with :meth:`Job.signal_failure` or through
the plans (``plan/<gen>`` in the store) that every generation reads.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .workload import BenchError, Workload

__all__ = ["Job", "Proc", "RESTART_SYSTEMS"]

RESTART_SYSTEMS = ("ckpt-disk", "ckpt-disk-async", "gemini")
_REPO = str(Path(__file__).resolve().parents[2])


@dataclass(eq=False)
class Proc:
    rank: int
    gen: int
    popen: subprocess.Popen[bytes]
    pidfd: int
    events_fd: int
    log: Path
    buf: bytes = b""
    seen: set[str] = field(default_factory=set)
    exited: bool = False
    code: int | None = None
    expected_exit: bool = False
    last_step: int | None = None  # the step its state is at (trained, loaded or reconciled)
    done_step: int | None = None  # the last step it completed
    fail_step: int | None = None  # the step it reported failing in

    @property
    def pid(self) -> int:
        return self.popen.pid


def _peer_lost(error: str) -> bool:
    """A collective failed because a peer died (expected after a failure), not a bug."""
    return "gloo" in error or "Connection" in error


class Job:
    """One running job of ``system`` (see the module docstring)."""

    def __init__(
        self,
        system: str,
        workload: Workload,
        *,
        plan_for: Callable[[int], dict[str, Any]],
        max_failures: int = 1000,
        workdir: str | None = None,
        extra_spec: dict[str, Any] | None = None,
    ) -> None:
        if system not in RESTART_SYSTEMS and system not in ("plain", "torchft"):
            raise BenchError(f"unknown system {system!r}")
        import torch.distributed as dist

        self.system, self.wl = system, workload
        self.plan_for = plan_for
        self.dir = Path(tempfile.mkdtemp(prefix=f"leto-bench-{system}-", dir=workdir))
        self.ckpt_dir = self.dir / "ckpt"
        self.ckpt_dir.mkdir()
        self.store = dist.TCPStore(  # type: ignore[attr-defined] # (torch's stubs: c10d)
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True
        )
        self.sel = selectors.DefaultSelector()
        self.procs: list[Proc] = []
        self.trainers: dict[int, Proc] = {}
        self.gen = 0
        self.events: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.finished = False
        self.recover_target: int | None = None  # every trainer completes it: recovered
        self.mem_fds: dict[int, int] = {}
        self.max_failures = max_failures
        self.extra_spec = extra_spec or {}
        # torchft: each rank is its own replica group, restarted alone (torchrun per group)
        self.group_restart = system == "torchft"
        self._make_memory()

    # ------------------------------------------------------------------ set-up

    def _make_memory(self) -> None:
        from leto.backends.gloo import segments

        from .hostmem import gemini_bytes

        if self.system != "gemini":
            return
        size = gemini_bytes(3 * self.wl.params)
        for r in range(self.wl.world):
            self.mem_fds[r] = segments.create(f"leto-bench-{self.system}-r{r}", size)

    def set_plan(self, key: str, plan: dict[str, Any]) -> None:
        self.store.set(key, json.dumps(plan))

    def start(self) -> None:
        self.set_plan("plan/0", self.plan_for(0))
        for r in range(self.wl.world):
            self.trainers[r] = self._spawn(r, resume=False)

    def _spawn(self, rank: int, *, resume: bool) -> Proc:
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        spec: dict[str, Any] = {
            "system": self.system,
            "rank": rank,
            "world": self.wl.world,
            "gen": self.gen,
            "store_port": self.store.port,
            "events_fd": wfd,
            "workload": self.wl.as_dict(),
            "ckpt_dir": str(self.ckpt_dir),
            "resume": resume,
            "parent": os.getpid(),
            **self.extra_spec,
        }
        fds = [wfd]
        if rank in self.mem_fds:
            spec["mem_fd"] = self.mem_fds[rank]
            fds.append(self.mem_fds[rank])
        log = self.dir / f"r{rank}-g{self.gen}-{len(self.procs)}.log"
        env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(log, "wb") as lf:
            popen = subprocess.Popen(
                [sys.executable, "-m", "leto.bench.worker", json.dumps(spec)],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
                stdout=lf,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(self.dir),
            )
        os.close(wfd)
        proc = Proc(rank, self.gen, popen, os.pidfd_open(popen.pid), rfd, log)
        self.procs.append(proc)
        self.sel.register(proc.pidfd, selectors.EVENT_READ, ("exit", proc))
        self.sel.register(rfd, selectors.EVENT_READ, ("events", proc))
        return proc

    # ------------------------------------------------------------------ the loop

    def pump(self, until: Callable[[], bool], timeout: float, what: str = "") -> None:
        """Process events and exits until ``until()`` holds (or fail after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(
                    f"{self.system}: timed out after {timeout:.0f} s waiting for {what or 'the job'}"
                    f"{self._log_hint()}"
                )
            self._select(min(left, 0.5))

    def run_for(self, seconds: float) -> None:
        """Process events and exits for ``seconds``."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self._select(left)

    def _select(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            kind, proc = key.data
            if kind == "events" and proc.events_fd >= 0:
                self._read(proc)
            elif kind == "exit" and not proc.exited:
                self._exited(proc)

    def _read(self, proc: Proc) -> None:
        try:
            chunk = os.read(proc.events_fd, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            self.sel.unregister(proc.events_fd)
            os.close(proc.events_fd)
            proc.events_fd = -1
            return
        proc.buf += chunk
        *lines, proc.buf = proc.buf.split(b"\n")
        for line in lines:
            ev = json.loads(line)
            ev.update(rank=proc.rank, pid=proc.pid, gen=proc.gen)
            proc.seen.add(ev["ev"])
            self.events.append(ev)
            if "step" in ev and ev["ev"] in ("step", "loaded", "reconciled", "attached"):
                proc.last_step = ev["step"]
                if ev["ev"] == "step":
                    proc.done_step = ev["step"]
            elif ev["ev"] == "fail":
                proc.fail_step = ev["step"]
            if ev["ev"] == "error" and not _peer_lost(ev["error"]):
                raise BenchError(f"{self.system}: rank {proc.rank} failed: {ev['error']}")

    def _drain(self, proc: Proc) -> None:
        """Read what a dead process wrote (its write end is closed: EOF comes)."""
        if proc.events_fd >= 0:
            os.set_blocking(proc.events_fd, True)
        while proc.events_fd >= 0:
            self._read(proc)

    def _exited(self, proc: Proc) -> None:
        t = time.monotonic()
        self.sel.unregister(proc.pidfd)
        os.close(proc.pidfd)
        proc.code = proc.popen.wait()
        proc.exited = True
        self._drain(proc)
        if proc.expected_exit:
            return
        if self.trainers.get(proc.rank) is not proc:
            return  # a process of an older generation
        if proc.code == 0 and "done" in proc.seen:
            if all(p.exited for p in self.trainers.values()):
                self.finished = True
            return
        self._failure(proc, t)

    def _failure(self, proc: Proc, t_detect: float) -> None:
        """A trainer died: stop the others, start a new generation (torchrun).

        The first exit seen may be a survivor's (its collective failed when the
        peer died); the failure is the process that reported one, if any did. A
        ``torchft`` job restarts the dead process's replica group only.
        """
        old = [] if self.group_restart else [p for p in self.trainers.values() if p is not proc]
        for p in old:
            if not p.exited:
                p.expected_exit = True
                p.popen.send_signal(signal.SIGTERM)
        for p in old:
            try:
                p.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
            p.expected_exit = True
            self._drain(p)
        dead = next((p for p in [proc, *old] if p.fail_step is not None), proc)
        done = [p.done_step or 0 for p in [proc, *old]]
        failure: dict[str, Any] = {
            "rank": dead.rank,
            "pid": dead.pid,
            "gen": dead.gen,
            "t_detect": t_detect,
            "code": dead.popen.returncode,
            "step": dead.fail_step if dead.fail_step is not None else max(done) + 1,
        }
        self.failures.append(failure)
        if len(self.failures) > self.max_failures:
            raise BenchError(
                f"{self.system}: {len(self.failures)} failures, more than planned: "
                f"the job keeps failing{self._log_hint(proc)}"
            )
        self.recover_target = max(failure["step"], self.recover_target or 0)
        self.gen += 1
        self.set_plan(f"plan/{self.gen}", self.plan_for(self.gen))
        failure.update(new_gen=self.gen, t_respawn=time.monotonic())
        for r in [proc.rank] if self.group_restart else range(self.wl.world):
            self.trainers[r] = self._spawn(r, resume=True)

    # ---------------------------------------------------------------- queries

    def recovered(self) -> bool:
        """Every current trainer has completed the step the last failure interrupted."""
        target = self.recover_target
        return target is None or all(
            p.done_step is not None and p.done_step >= target for p in self.trainers.values()
        )

    def progress(self) -> int | None:
        """The step the job's state is at (None while a restarted rank has not loaded)."""
        steps = [p.last_step for p in self.trainers.values()]
        if any(s is None for s in steps) or len(steps) < self.wl.world:
            return None
        return min(s for s in steps if s is not None)

    def seen(self, ev: str, *, gen: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["ev"] == ev and (gen is None or e["gen"] == gen)]

    def signal_failure(self, rank: int) -> bool:
        """Ask rank ``rank``'s trainer to fail at its next failure point (False: not now)."""
        p = self.trainers.get(rank)
        if p is None or p.exited or "main" not in p.seen:
            return False
        p.popen.send_signal(signal.SIGUSR1)
        return True

    def _log_hint(self, proc: Proc | None = None) -> str:
        procs = [proc] if proc is not None else [p for p in self.procs if p.exited and p.code]
        for p in procs[-1:]:
            try:
                tail = p.log.read_text(errors="replace").strip().splitlines()[-3:]
            except OSError:
                continue
            if tail:
                return f" (rank {p.rank} log: {' | '.join(tail)[-400:]})"
        return ""

    # ---------------------------------------------------------------- teardown

    def close(self) -> None:
        for p in self.procs:
            if not p.exited:
                p.expected_exit = True
                try:
                    p.popen.kill()
                except ProcessLookupError:
                    pass
        for p in self.procs:
            if not p.exited:
                p.popen.wait()
                p.exited = True
                try:
                    self.sel.unregister(p.pidfd)
                except (KeyError, ValueError):
                    pass
                os.close(p.pidfd)
            if p.events_fd >= 0:
                try:
                    self.sel.unregister(p.events_fd)
                except (KeyError, ValueError):
                    pass
                os.close(p.events_fd)
                p.events_fd = -1
        self.sel.close()
        for fd in self.mem_fds.values():
            os.close(fd)
        self.mem_fds.clear()
        del self.store
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
