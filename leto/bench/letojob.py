"""The benchmark's training script under ``leto launch`` (leto's gloo backend).

``leto launch ... leto/bench/letojob.py SPEC_JSON`` trains the benchmark's workload
(:class:`leto.bench.workload.Workload`, the same model, data and ranks the
baselines train) through ``leto.wrap`` with ``backend = "gloo"``.

Failures strike at the same point as in the baselines' workers
(:mod:`leto.bench.worker`): after a rank's forward pass, before its backward (with
``micro_batches = k``, after the forward of micro-batch ``(k - 1) // 3``, the same third
of the compute; a failure ``"at": "update"`` is not this script's: :class:`leto.bench.gloojob.GlooJob`
plans it as a crash of leto's own fault plan, once the rank has the step's COMMIT). The step
function does it: when its rank is due, it stamps the time (``time.time()``,
the clock of leto's event log) in ``RUN_DIR/bench-failures.jsonl`` and SIGKILLs its
own process. A failure is claimed with an exclusive marker file first, so it fires
once, not again in the shadow that takes the rank's place. Due means either

* ``{"rank": r, "step": s}``: rank ``r`` computing step ``s`` (``leto bench recovery``), or
* ``{"rank": r, "t": t}``: the first forward of rank ``r`` at least ``t`` seconds
  after the budget's start, and after the previous failure fired (one at a time;
  ``leto bench goodput``). Rank 0 starts the budget when it begins step
  ``spec["t0_after_step"] + 1`` (``RUN_DIR/bench-t0``).

With ``spec["cpu_probe"] = [a, b]`` every rank appends its CPU time at the forward
of steps ``a`` and ``b`` to ``RUN_DIR/bench-cpu.jsonl``: the process total and its
CPU and wall time by protocol phase (``GlooSession.phase_cpu_s`` and
``phase_wall_s``); rank 0 adds the CPU time of every process of the job (agents,
coordinator, keepers, zygote, shadows: their command lines carry the run
directory). :func:`leto.bench.cpu.leto_cpu_report` reads it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _claim(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


class _Faults:
    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        self.run = Path(spec["run_dir"])
        self.rank = rank
        self.plan: list[dict[str, Any]] = spec.get("failures", [])
        self.t0_after = spec.get("t0_after_step")
        self.t0: float | None = None

    def _t0(self, step: int) -> float | None:
        if self.t0 is None:
            path = self.run / "bench-t0"
            if self.rank == 0 and self.t0_after is not None and step == self.t0_after + 1:
                if _claim(self.run / "bench-t0.claim"):
                    tmp = self.run / "bench-t0.tmp"
                    tmp.write_text(repr(time.time()))
                    tmp.replace(path)
            if path.exists():
                self.t0 = float(path.read_text())
        return self.t0

    def check(self, step: int) -> None:
        now = time.time()
        for i, f in enumerate(self.plan):
            if f["rank"] != self.rank or f.get("at", "forward") != "forward":
                continue
            if "step" in f:
                due = f["step"] == step
            else:
                t0 = self._t0(step)
                due = (
                    t0 is not None
                    and now >= t0 + f["t"]
                    and (i == 0 or (self.run / f"bench-fail-{i - 1}").exists())
                )
            if due and _claim(self.run / f"bench-fail-{i}"):
                line = json.dumps({"i": i, "t": time.time(), "rank": self.rank, "step": step})
                fd = os.open(
                    self.run / "bench-failures.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600
                )
                os.write(fd, (line + "\n").encode())
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
        if self.rank == 0:
            self._t0(step)


class _CpuProbe:
    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        self.run = Path(spec["run_dir"])
        self.rank = rank
        self.steps = set(spec.get("cpu_probe") or ())
        self.session: Any = None

    def at(self, step: int) -> None:
        if step not in self.steps or self.session is None:
            return
        self.steps.discard(step)  # once (a recomputed step is not probed again)
        rec: dict[str, Any] = {
            "rank": self.rank,
            "step": step,
            "pid": os.getpid(),
            "cpu": time.process_time(),
            "phases": self.session.phase_cpu_s(),
            "phases_wall": self.session.phase_wall_s(),
        }
        if self.rank == 0:
            from leto.bench.cpu import cpu_seconds_of

            rec["job"] = cpu_seconds_of(str(self.run))
        fd = os.open(self.run / "bench-cpu.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps(rec) + "\n").encode())
        finally:
            os.close(fd)


def main() -> None:
    import torch
    import torch.nn.functional as F

    import leto

    # a script: absolute imports
    from leto.bench.workload import StepBatches, Workload, worker_torch

    spec = json.loads(sys.argv[1])
    wl = Workload.from_dict(spec["workload"])
    rank = int(os.environ["RANK"])
    cfg = leto.Config(
        backend="gloo",
        nodes=spec["nodes"],
        ranks_per_node=wl.world // spec["nodes"],
        chunk_size=wl.chunk_numel,
        tier1=spec.get("tier1", True),
        tier1_code=spec.get("tier1_code", "auto"),
        tier2=spec.get("tier2", True),
        tier2_interval=spec.get("tier2_interval", 10),
        replica_check=spec.get("replica_check", 1),
        micro_batches=spec.get("micro_batches", 1),
        parallel_replay=spec.get("parallel_replay", True),
        device=wl.device,
    )
    worker_torch()
    model = wl.build_model()
    optimizer = wl.build_optimizer(model)
    sampler = StepBatches(wl)
    x, y = wl.dataset()
    faults = _Faults(spec, rank)
    probe = _CpuProbe(spec, rank)

    k = cfg.micro_batches
    # with micro-batches the death comes after the forward of micro-batch (k - 1) // 3,
    # which ends a third into the share's compute (a forward ~1/3 of a forward and
    # backward), where the death after the forward of a whole share comes without
    calls: dict[int, int] = {}

    def step_fn(m: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(m(x[idx]), y[idx])
        if k > 1:
            loss = loss / k
        n = calls[sampler.step] = calls.get(sampler.step, 0) + 1
        if n - 1 == (k - 1) // 3:
            faults.check(sampler.step)
        probe.at(sampler.step)
        return loss

    session = leto.wrap(model, optimizer, None, sampler, config=cfg)
    probe.session = session
    session.train(step_fn, spec["steps"])


if __name__ == "__main__":
    main()
