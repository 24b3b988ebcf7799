"""leto's side of the benchmarks: the workload as a real ``leto launch`` job.

:class:`GlooJob` starts one ``leto launch`` agent per node on 127.0.0.1 (leto's
gloo backend: keepers, a zygote fork server, trainers, warm shadows, the
coordinator) running :mod:`leto.bench.letojob`, watches leto's event log
(``RUN_DIR/events.jsonl``), and stops the job: when it ends by itself, or when
the benchmark's budget is spent (SIGTERM to the agents, SIGKILL after a grace
period, then any process still carrying the run directory in its command line).

:func:`leto_breakdown` turns one failure into the phases of
:mod:`leto.bench.timeline`, from the failure stamp the dying trainer wrote and
the coordinator's own record of the recovery (``recovery_end``: its phases in
milliseconds, measured in the agent):

=============  =====================================================================
detection      the trainer's death -> the agent's ``failure`` record (deathwatch), + detect
process_state  fence (stale writers refused) + promote (the warm shadow takes the rank)
model_state    reconcile (integrity checks, roll forward/back, parity repair, parity
               and snapshot re-encoded), in every trainer process
communicator   the rest of the recovery: rejoin (every trainer joins the new
               generation's gloo group, attaches its retained state, reports it) and
               rebuild
lost_work      recovery end -> the step that was in flight is committed (0 when the
               recovery kept it: rolled forward, ``resumed_at`` >= the failed step)
=============  =====================================================================

A failure ``{"rank", "step", "at": "update"}`` (:mod:`leto.bench.interval`) is a
crash of leto's own fault plan (``leto launch --faults``) where the rank has the
step's COMMIT and has applied nothing yet (phase ``decide``, ``after``): after its
vote and the step's commit, the same point for every rank. Its time is the one the
trainer records before it dies (``RUN_DIR/faults.jsonl``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .workload import BenchError, Workload

__all__ = ["GlooJob", "leto_breakdown", "step_time"]

SCRIPT = str(Path(__file__).with_name("letojob.py"))


class GlooJob:
    """One leto job of ``wl`` on ``nodes`` x ``world/nodes`` ranks (see the module docstring)."""

    def __init__(
        self,
        wl: Workload,
        *,
        steps: int,
        failures: list[dict[str, Any]] | None = None,
        t0_after_step: int | None = None,
        nodes: int = 2,
        tier1: bool = True,
        tier1_code: str = "auto",
        tier2: bool = True,
        tier2_interval: int = 10,
        cpu_probe: tuple[int, int] | None = None,
        replica_check: int = 1,
        micro_batches: int = 1,
        parallel_replay: bool = True,
    ) -> None:
        if wl.world % nodes:
            nodes = 1
        self.wl, self.nodes = wl, nodes
        self.run_dir = Path(tempfile.mkdtemp(prefix="leto-bench-gloo-"))
        self.spec = {
            "workload": wl.as_dict(),
            "nodes": nodes,
            "steps": steps,
            "failures": failures or [],
            "t0_after_step": t0_after_step,
            "run_dir": str(self.run_dir),
            "tier1": tier1,
            "tier1_code": tier1_code,
            "tier2": tier2,
            "tier2_interval": tier2_interval,
            "replica_check": replica_check,
            "micro_batches": micro_batches,
            "parallel_replay": parallel_replay,
            "cpu_probe": list(cpu_probe) if cpu_probe else None,
        }
        # failures after the vote: crashes of leto's own plan, the COMMIT received
        self.fault_plan = [
            {"kind": "crash", "rank": f["rank"], "step": f["step"], "phase": "decide",
             "where": "after"}
            for f in failures or [] if f.get("at", "forward") == "update"
        ]  # fmt: skip
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stopping = False
        self._pos = 0
        self.events: list[dict[str, Any]] = []

    def start(self) -> None:
        from leto.backends.gloo.procs import free_port, tie_to_parent

        port = free_port()
        nproc = self.wl.world // self.nodes
        for n in range(self.nodes):
            cmd = [
                sys.executable, "-m", "leto.cli", "launch",
                "--nnodes", str(self.nodes), "--nproc-per-node", str(nproc),
                "--node-rank", str(n), "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--run-dir", str(self.run_dir), "--quiet", "--no-echo",
                *(["--faults", json.dumps(self.fault_plan)] if self.fault_plan else []),
                SCRIPT, json.dumps(self.spec),
            ]  # fmt: skip
            # Each agent leads its own process group (for the SIGKILL of a stop) but stays in
            # this session: a session of its own would put each simulated node in its own
            # scheduler autogroup (kernel.sched_autogroup_enabled), and the kernel's group
            # fairness over the machine's few cores lets one node's ranks fall up to a second
            # behind the other's in every step (measured: the ranks reached the all-reduce
            # 0.9-1.2 s apart, against 0.11 s in one session). Plain DDP's workers share the
            # benchmark's session; so do the nodes of a real machine's `leto launch`.
            with open(self.run_dir / f"agent{n}.out", "wb") as out:
                self.procs.append(
                    subprocess.Popen(
                        cmd,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        process_group=0,
                        env=tie_to_parent(dict(os.environ)),  # the agents die with the bench
                    )
                )
            if n == 0:
                time.sleep(0.2)  # node 0 serves the rendezvous

    def poll(self) -> list[dict[str, Any]]:
        """New records of leto's event log."""
        path = self.run_dir / "events.jsonl"
        if not path.exists():
            return []
        with open(path, "rb") as f:
            f.seek(self._pos)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._pos += end
        new = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        self.events.extend(new)
        for e in new:
            if e["event"] == "job_failed" and not self.stopping:
                raise BenchError(f"leto: the job failed: {e.get('error')}{self.tail()}")
        return new

    def ended(self) -> bool:
        return any(p.poll() is not None for p in self.procs[:1])

    def wait(self, until: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if until():
                return
            if self.ended() and not until():
                self.poll()
                if until():
                    return
                raise BenchError(f"leto: the job ended before {what}{self.tail()}")
            if time.monotonic() > deadline:
                last = ", ".join(e["event"] for e in self.events[-4:])
                raise BenchError(
                    f"leto: timed out after {timeout:.0f} s waiting for {what} "
                    f"(last events: {last or 'none'}){self.tail()}"
                )
            time.sleep(0.05)

    def seen(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]

    def stamps(self) -> list[dict[str, Any]]:
        """The failures the trainers stamped before dying, in the order they struck:
        ``letojob``'s and leto's fault plan's (``faults.jsonl``), each ``{"t", "rank",
        "step"}``."""
        out = []
        path = self.run_dir / "bench-failures.jsonl"
        if path.exists():
            out += [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        path = self.run_dir / "faults.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                f = json.loads(line)
                out.append({"t": f["time"], "rank": f["rank"], "step": f["step"]})
        return sorted(out, key=lambda s: s["t"])

    def cpu(self, first: int, last: int) -> dict[str, Any]:
        """CPU per step between the ``cpu_probe`` steps (:func:`leto.bench.cpu.leto_cpu_report`)."""
        from .cpu import leto_cpu_report

        path = self.run_dir / "bench-cpu.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return leto_cpu_report((json.loads(x) for x in lines), first, last)

    def t0(self) -> float | None:
        path = self.run_dir / "bench-t0"
        return float(path.read_text()) if path.exists() else None

    def tail(self) -> str:
        try:
            lines = (self.run_dir / "agent0.out").read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return f" (agent log: {' | '.join(lines[-3:])[-400:]})" if lines else ""

    def stop(self) -> None:
        from leto.backends.gloo.procs import processes_with

        self.stopping = True
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for pid in processes_with(str(self.run_dir)):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.poll()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> GlooJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _first(events: list[dict[str, Any]], name: str, after: float, **match: Any) -> dict[str, Any]:
    for e in events:
        if e["event"] == name and e["t"] >= after and all(e.get(k) == v for k, v in match.items()):
            return e
    raise BenchError(f"leto's event log has no {name!r} after t={after:.3f} {match or ''}")


def leto_breakdown(events: list[dict[str, Any]], stamp: dict[str, Any]) -> dict[str, Any]:
    """One failure's recovery, by phase (see the module docstring)."""
    t_fail, f = stamp["t"], stamp["step"]
    fail = _first(events, "failure", t_fail, rank=stamp["rank"])
    end = _first(events, "recovery_end", fail["t"])
    done: dict[str, Any] | None
    if (end.get("resumed_at") or 0) >= f:  # rolled forward: the step in flight was kept
        done = end
    else:
        done = next(
            (e for e in events if e["event"] == "step" and e["t"] >= end["t"] and e["step"] >= f),
            None,
        )
    if done is None:
        raise BenchError(f"leto: step {f} was never completed after the recovery")
    ms = end["phases_ms"]
    detect = fail["t"] - t_fail + ms.get("detect", 0.0) / 1e3
    process = (ms.get("fence", 0.0) + ms.get("promote", 0.0)) / 1e3
    model = ms.get("reconcile", 0.0) / 1e3
    comm = (end["t"] - t_fail) - detect - process - model
    return {
        "detection": detect,
        "process_state": process,
        "model_state": model,
        "communicator": comm,
        "lost_work": done["t"] - end["t"],
        "total": done["t"] - t_fail,
        "detail": {
            "failed_step": f,
            "resumed_at": end.get("resumed_at"),
            "kind": end.get("kind"),
            "steps_lost": end.get("steps_lost"),
            "leto_phases_ms": ms,
            "promoted": end.get("promoted"),
            # the survivors whose compute of the failed step the recovery kept (paused
            # inside it, not run again: leto.core.reconcile.keeps_compute)
            "computes_kept": sorted(
                e["rank"]
                for e in events
                if e["event"] == "compute_kept" and e["step"] == f and end["t"] <= e["t"]
            ),
            # who computed which micro-batches of the lost share (the parallel replay,
            # leto.core.replay): rank -> micro-batches; empty without it
            "replayed": {
                str(e["rank"]): e["micro_batches"]
                for e in events
                if e["event"] == "replayed" and e["step"] == f and end["t"] <= e["t"]
            },
        },
    }


def step_time(events: list[dict[str, Any]], first: int, last: int | None = None) -> float:
    """Mean wall time per committed step over steps ``first..last`` (leto's log)."""
    steps = [
        (int(e["step"]), float(e["t"]))
        for e in events
        if e["event"] == "step" and e["step"] >= first
    ]
    if last is not None:
        steps = [s for s in steps if s[0] <= last]
    if len(steps) < 2:
        raise BenchError(f"leto: fewer than two steps logged from step {first}")
    (s0, t0), (s1, t1) = steps[0], steps[-1]
    return (t1 - t0) / (s1 - s0)
