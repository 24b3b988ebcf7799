"""What the benchmark's baseline workers share (:mod:`leto.bench.worker`, and torchft's
:mod:`leto.bench.ftworker`): the events on the agent's pipe and the trainer's common
part."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

__all__ = ["Events", "Trainer", "on_usr1"]

fail_requested = False


def on_usr1(_sig: int, _frame: Any) -> None:
    global fail_requested
    fail_requested = True


class Events:
    """JSON lines on the agent's pipe (each line is one atomic write)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def emit(self, ev: str, t: float | None = None, **kw: Any) -> float:
        t = time.monotonic() if t is None else t
        line = json.dumps({"ev": ev, "t": t, **kw}) + "\n"
        os.write(self.fd, line.encode())
        return t


class Trainer:
    """What every baseline's worker does: its store, process group, data, the failure
    it is due to die of, its end."""

    def __init__(self, spec: dict[str, Any], out: Events) -> None:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from .workload import Workload

        self.spec, self.out = spec, out
        self.torch, self.dist = torch, dist
        self.rank, self.world = spec["rank"], spec["world"]
        self.gen = spec["gen"]
        self.wl = Workload.from_dict(spec["workload"])
        self.store = dist.TCPStore(  # type: ignore[attr-defined] # (torch's stubs: c10d)
            "127.0.0.1", spec["store_port"], is_master=False, timeout=timedelta(seconds=120)
        )
        self.x, self.y = self.wl.dataset()
        self.step = 0
        self.plan: dict[str, Any] = {}
        self.step_times: list[float] = []
        self.fwd_cpu = 0.0  # CPU seconds spent in forward passes

    def get_plan(self, key: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.store.get(key))
        return out

    def init_pg(self) -> None:
        from datetime import timedelta

        self.dist.init_process_group(
            "gloo",
            store=self.dist.PrefixStore(f"pg/{self.gen}", self.store),  # type: ignore[attr-defined]
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=60),
        )

    def should_fail(self, s: int, at: str = "forward") -> bool:
        """Is this rank due to die at point ``at`` of step ``s`` (``forward``: after
        its forward pass; ``update``: after its backward, the gradients reduced,
        before ``optimizer.step()``; :mod:`leto.bench.interval`)? A signal's request
        (``leto bench goodput``) is honoured after the forward."""
        if fail_requested and at == "forward":
            return True
        f = self.plan.get("fail")
        return (
            f is not None
            and f.get("at", "forward") == at
            and f["rank"] == self.rank
            and f["step"] == s
        )

    def die(self, s: int) -> None:
        self.out.emit("fail", step=s)
        os.kill(os.getpid(), signal.SIGKILL)

    def loss(self, model: Any, s: int) -> Any:
        import torch.nn.functional as F

        idx = self.wl.batch_indices(s, self.rank)
        return F.cross_entropy(model(self.x[idx]), self.y[idx])

    def finish(self) -> None:
        self.before_exit()
        self.out.emit("done", step=self.step)
        os._exit(0)

    def before_exit(self) -> None:
        """What a system finishes before its process exits (nothing by default)."""
