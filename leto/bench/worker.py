"""One training process of a benchmark job: ``python -m leto.bench.worker SPEC_JSON``.

The agent (:mod:`leto.bench.agent`) starts these, one per rank, and reads what
they report on a pipe (JSON lines with ``time.monotonic()`` stamps, a clock every
process of the machine shares). The first stamp is taken before ``import torch``,
so a restart's cost is measured from the interpreter's start.

Systems (``spec["system"]``):

``plain``
    ``DistributedDataParallel`` on gloo, AdamW, no checkpoints.
``ckpt-disk`` / ``ckpt-disk-async``
    the same, with ``torch.distributed.checkpoint`` ``save`` (or ``async_save`` on
    its own gloo group) of model and optimizer every ``interval`` steps to local
    disk; a restarted process loads the newest complete checkpoint (one with DCP's
    ``.metadata``, written last) and recomputes the steps since.
``gemini``
    the same, with a checkpoint of every step in host memory that outlives the
    process (the agent's memfd): this rank's copy, and a copy sent over gloo to
    the next rank's host memory; a restarted process reloads from it.

``torchft``
    torchft's fault-tolerant DDP, each rank its own replica group
    (:mod:`leto.bench.ftworker`).

(leto runs through ``leto launch`` instead: :mod:`leto.bench.letojob`.)

Failures strike at one point of a step, the same for every system: after the
forward pass, before the backward (so no gradient of the step has been
exchanged): where ``plan["fail"]`` says, or at the first such point after a
``SIGUSR1`` from the agent; or, for a failure ``"at": "update"``
(:mod:`leto.bench.interval`), after the backward (the gradients reduced), before
``optimizer.step()``. The process then reports ``fail`` and SIGKILLs itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

from .worker_base import Events, Trainer, on_usr1

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    signal.signal(signal.SIGUSR1, on_usr1)
    from leto.backends.gloo.procs import die_with_parent, steady_heap

    die_with_parent(spec.get("parent"))
    # the allocator as leto's trainers have it: the comparison is of the protocol's
    # work, not of glibc's heuristic (docs/benchmarks.md, "What is measured how")
    steady_heap()
    out = Events(spec["events_fd"])
    out.emit("main", t=t0)
    from leto.bench.workload import worker_torch

    worker_torch()  # imports torch
    out.emit("torch")
    try:
        if spec["system"] == "torchft":
            from .ftworker import FTTrainer

            FTTrainer(spec, out).run()
        else:
            _DDPTrainer(spec, out).run()
    except BaseException as e:  # report, then die the way a crashed trainer does
        if not isinstance(e, SystemExit):
            out.emit("error", error=f"{type(e).__name__}: {e}"[:1500])
        raise
    return 0


# ------------------------------------------------------------------- DDP baselines


class _DDPTrainer(Trainer):
    def run(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        system = self.spec["system"]
        model = self.wl.build_model()
        self.opt = self.wl.build_optimizer(model)
        self.out.emit("model")
        self.init_pg()
        self.ddp = DDP(model)
        self.side = None
        if system in ("gemini", "ckpt-disk-async"):
            self.side = self.dist.new_group(backend="gloo")
        self.out.emit("pg")
        self.gem = None
        if system == "gemini":
            from .hostmem import GeminiSlots

            self.gem = GeminiSlots(self.spec["mem_fd"], 3 * self.wl.params)
            self._gem_views()
        self.pending: Any = None
        if self.spec.get("resume"):
            self.restore()
        elif self.gem is not None:
            self.gem.clear()
        self.out.emit("loaded", step=self.step)
        self.plan = self.get_plan(f"plan/{self.gen}")
        cal = self.plan.get("calibrate")
        if cal:
            self.train_until(cal["steps"])
            self.calibrate(cal["saves"])
            self.plan = self.get_plan(f"plan/{self.gen}/run")
        self.train_until(self.plan["stop_step"])
        self.finish()

    def train_until(self, stop: int) -> None:
        while self.step < stop:
            s = self.step + 1
            t = time.monotonic()
            self.opt.zero_grad(set_to_none=True)
            c0 = time.process_time()
            loss = self.loss(self.ddp, s)
            self.fwd_cpu += time.process_time() - c0
            if self.should_fail(s):
                self.die(s)
            loss.backward()
            if self.should_fail(s, "update"):
                self.die(s)
            self.opt.step()
            self.step = s
            # this process's CPU seconds so far, and in forward passes: the overhead
            # benchmark's CPU per step and its gauge of the machine's speed
            stamp = self.out.emit("step", step=s, cpu=time.process_time(), fwd=self.fwd_cpu)
            self.step_times.append(stamp - t)
            self.after_step(s)

    # --- checkpoints ---------------------------------------------------------------

    def _state(self, s: int) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.ddp, self.opt)
        return {"model": msd, "optim": osd, "step": self.torch.tensor(s)}

    def _path(self, s: int) -> str:
        return os.path.join(self.spec["ckpt_dir"], f"step-{s:08d}")

    def save(self, s: int, path: str) -> float:
        """One checkpoint; the seconds training was blocked."""
        from torch.distributed.checkpoint.state_dict_saver import async_save, save

        t = time.monotonic()
        if self.spec["system"] == "ckpt-disk":
            save(self._state(s), checkpoint_id=path)
        elif self.spec["system"] == "ckpt-disk-async":
            if self.pending is not None:  # a new save waits for the previous one
                self.pending[1].result()
                self._durable()
            fut = async_save(self._state(s), checkpoint_id=path, process_group=self.side)
            self.pending = (s, fut, time.monotonic())
        else:
            self.gemini_snapshot(s)
        return time.monotonic() - t

    def _durable(self) -> None:
        assert self.pending is not None
        s, _fut, t = self.pending
        self.out.emit("durable", step=s, write_s=time.monotonic() - t)
        self.pending = None

    def after_step(self, s: int) -> None:
        system = self.spec["system"]
        if self.pending is not None and self.pending[1].done():
            self.pending[1].result()
            self._durable()
        if system == "gemini":
            self.gemini_snapshot(s)
        elif system.startswith("ckpt-disk") and s % self.plan["interval"] == 0:
            block = self.save(s, self._path(s))
            self.out.emit("ckpt", step=s, block_s=block)
            if self.rank == 0:
                self._prune(s)

    def _prune(self, s: int) -> None:
        """Keep the two newest checkpoints (the newest may still be in flight)."""
        import shutil

        d = self.spec["ckpt_dir"]
        steps = sorted(int(n[5:]) for n in os.listdir(d) if n.startswith("step-"))
        for old in steps[:-2]:
            shutil.rmtree(os.path.join(d, f"step-{old:08d}"), ignore_errors=True)

    def calibrate(self, saves: int) -> None:
        """Step time and the cost of this system's checkpoint, measured in the job."""
        steps = sorted(self.step_times[1:]) or self.step_times
        blocks, writes = [], []
        for _ in range(saves):
            if self.spec["system"] == "gemini":
                blocks.append(self.save(self.step, ""))
                continue
            path = os.path.join(self.spec["ckpt_dir"], "calibrate")
            blocks.append(self.save(self.step, path))
            if self.pending is not None:
                t = self.pending[2]
                self.pending[1].result()
                writes.append(time.monotonic() - t)
                self.pending = None
        self.out.emit(
            "calibrated",
            step_s=steps[len(steps) // 2] if steps else 0.0,
            save_s=sorted(blocks)[len(blocks) // 2] if blocks else 0.0,
            write_s=sorted(writes)[len(writes) // 2] if writes else 0.0,
        )

    def restore(self) -> None:
        system = self.spec["system"]
        if system == "gemini":
            self._gemini_restore()
            return
        from torch.distributed.checkpoint.state_dict import set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        d = self.spec["ckpt_dir"]
        done = sorted(
            n
            for n in os.listdir(d)
            if n.startswith("step-") and os.path.exists(os.path.join(d, n, ".metadata"))
        )
        if not done:
            return  # no checkpoint yet: start over
        sd = self._state(0)
        load(sd, checkpoint_id=os.path.join(d, done[-1]))
        set_state_dict(
            self.ddp, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )
        self.step = int(sd["step"])

    # --- Gemini ------------------------------------------------------------------------

    def _gem_views(self) -> None:
        P = self.wl.params
        self.gviews: list[list[Any]] = []
        for i in range(4):
            flat = self.gem.slot(i)  # type: ignore[union-attr]
            views, off = [], 0
            for p in self.ddp.module.parameters():
                n = p.numel()
                views.append([flat[k * P + off : k * P + off + n].view_as(p) for k in range(3)])
                off += n
            self.gviews.append(views)
        self.peer_ops: list[Any] = []
        self.peer_step = -1

    def gemini_snapshot(self, s: int) -> None:
        gem = self.gem
        assert gem is not None
        self._gemini_wait()
        i = s % 2
        gem.set_step(i, -1)
        with self.torch.no_grad():
            for p, (vp, va, vb) in zip(self.ddp.module.parameters(), self.gviews[i], strict=True):
                st = self.opt.state[p]
                vp.copy_(p)
                va.copy_(st["exp_avg"])
                vb.copy_(st["exp_avg_sq"])
        gem.set_step(i, s)
        W, r = self.world, self.rank
        if W > 1:  # and a copy in the next rank's host memory (overlaps the next step)
            gem.set_step(2 + i, -1)
            self.peer_ops = [
                self.dist.isend(gem.slot(i), dst=(r + 1) % W, group=self.side),
                self.dist.irecv(gem.slot(2 + i), src=(r - 1) % W, group=self.side),
            ]
            self.peer_step = s

    def before_exit(self) -> None:
        # Gemini's copy to the next rank overlaps the next step; after the last step
        # there is none: finish the exchange before exiting, or a peer still posting
        # its half finds this process gone and dies ("Connection closed by peer"),
        # which the agent would count as an unscheduled failure
        if getattr(self, "peer_ops", None):
            self._gemini_wait()

    def _gemini_wait(self) -> None:
        if self.peer_ops:
            for op in self.peer_ops:
                op.wait()
            self.gem.set_step(2 + self.peer_step % 2, self.peer_step)  # type: ignore[union-attr]
            self.peer_ops = []

    def _gemini_restore(self) -> None:
        gem = self.gem
        assert gem is not None
        mine = max(gem.step_of(0), gem.step_of(1))
        t = self.torch.tensor([mine], dtype=self.torch.int64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        common = int(t.item())
        if common < 0:
            gem.clear()
            return
        slot = next(i for i in (0, 1) if gem.step_of(i) == common)
        with self.torch.no_grad():
            for p, (vp, va, vb) in zip(
                self.ddp.module.parameters(), self.gviews[slot], strict=True
            ):
                p.copy_(vp)
                self.opt.state[p] = {
                    "step": self.torch.tensor(float(common)),
                    "exp_avg": va.clone(),
                    "exp_avg_sq": vb.clone(),
                }
        self.step = common


if __name__ == "__main__":
    sys.exit(main())
