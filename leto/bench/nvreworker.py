"""One process of an ``nvre`` job: ``python -m leto.bench.nvreworker SPEC_JSON``.

nvidia-resiliency-ext's in-process restart (``inprocess.Wrapper``), configured as
its ``examples/inprocess/optimal_example.py`` runs on CPU: the wrapper's own
``TCPStore`` and the application's, ``CudaHealthCheck`` (a no-op without CUDA), the default
``AbortTorchDistributed`` and timeouts; model and optimizer built once, outside the
wrapped function, which builds the gloo process group (a 10 s timeout, as the
example's CPU mode) on a ``PrefixStore`` of the restart iteration, and DDP. Both
stores are hosted by the benchmark (:mod:`leto.bench.nvrejob`), as torchrun's agent
hosts its own: the wrapper's ``TCPStore`` falls back to a client when its rank 0
cannot bind the port, so rank 0 may die like any other rank.

A SIGKILLed process cannot restart in-process: the wrapper's answer is a reserve
rank (its ``RankFilter`` docstring: "a pool of static, preallocated and
preinitialized reserve ranks"). The job starts one reserve process per scheduled
failure, and ``rank_assignment=Compose(MaxActiveWorldSize(world), FillGaps())``
activates one in the dead rank's place, so every restart iteration trains the
same world size. The wrapper restores no state (its examples reload a checkpoint
file): on each restart the active ranks broadcast the model and optimizer from the
lowest rank that trained in the previous iteration, the reserve's copy having been
preinitialized (its AdamW state made) before the wrapper started.

Events, JSON lines appended to ``spec["events"]`` (``time.monotonic()``, shared by
the machine's processes), each with this process's ``proc`` (its initial rank),
``pid`` and restart iteration ``it``: ``main``, ``torch``, ``model``; per iteration
``abort`` (the wrapper's monitor thread starting its abort: the fault is known
here), ``enter`` (the wrapped function entered, with its ``rank``), ``pg`` (process
group and DDP built), ``loaded`` (the state restored, ``step``), ``step``, ``fail``
(this rank SIGKILLs itself), ``trained`` (the wrapped function's end: the step and
a SHA-256 of model and optimizer), ``done``. Failure ``i`` of ``spec["schedule"]`` strikes
in restart iteration ``i`` only, so each comes after the previous recovery.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import signal
import sys
import time
from typing import Any

__all__ = ["main"]


class _Events:
    def __init__(self, path: str, proc: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.proc, self.iteration = proc, 0

    def emit(self, ev: str, t: float | None = None, **kw: Any) -> float:
        t = time.monotonic() if t is None else t
        rec = {"ev": ev, "t": t, "proc": self.proc, "pid": os.getpid(), "it": self.iteration}
        os.write(self.fd, (json.dumps({**rec, **kw}) + "\n").encode())
        return t


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    from leto.backends.gloo.procs import die_with_parent, steady_heap

    die_with_parent(spec.get("parent"))
    logging.basicConfig(level=logging.WARNING)  # the wrapper logs only where it is set up
    steady_heap()  # as every system's trainers (leto.bench.worker)
    out = _Events(spec["events"], int(os.environ["RANK"]))
    out.emit("main", t=t0)
    from .workload import worker_torch

    worker_torch()
    out.emit("torch")
    _run(spec, out)
    out.emit("done")
    return 0


def _run(spec: dict[str, Any], out: _Events) -> None:
    import nvidia_resiliency_ext.inprocess as inprocess
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    from .workload import Workload

    wl = Workload.from_dict(spec["workload"])
    world = wl.world
    schedule: list[dict[str, Any]] = spec["schedule"]
    stop = int(spec["stop_step"])
    model = wl.build_model()
    opt = wl.build_optimizer(model)
    x, y = wl.dataset()
    params = list(model.parameters())
    trained = {"step": 0, "has_state": out.proc < world}
    if not trained["has_state"]:  # a reserve: preinitialized, its AdamW state made
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
    out.emit("model")

    class StampAbort(inprocess.abort.Abort):  # type: ignore[misc] # (nvre: untyped)
        def __call__(self, state: Any) -> Any:
            out.iteration = state.iteration
            out.emit("abort")
            return state

    def state_tensors() -> list[Any]:
        ts = [p.data for p in params]
        for p in params:
            st = opt.state[p]
            ts += [st[k] for k in sorted(st)]
        return ts

    def restore(rank: int) -> None:
        """Everyone's state from the lowest rank that trained in the last iteration."""
        have = torch.tensor([trained["step"] if trained["has_state"] else -1])
        got = [torch.zeros_like(have) for _ in range(world)]
        dist.all_gather(got, have)
        src = min(r for r in range(world) if int(got[r]) >= 0)
        ts = state_tensors()
        flat = _flatten_dense_tensors(ts)  # type: ignore[no-untyped-call]
        dist.broadcast(flat, src)
        if rank != src:
            new = _unflatten_dense_tensors(flat, ts)  # type: ignore[no-untyped-call]
            for t, v in zip(ts, new, strict=True):
                t.copy_(v)
        trained["step"], trained["has_state"] = int(got[src]), True

    def train(base_store: Any, call_wrapper: Any = None) -> int:
        assert call_wrapper is not None
        it = out.iteration = call_wrapper.iteration
        rank = int(os.environ["RANK"])
        out.emit("enter", rank=rank)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(str(it), base_store),  # type: ignore[attr-defined]
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=10),
        )
        ddp = torch.nn.parallel.DistributedDataParallel(model, init_sync=False)
        out.emit("pg", rank=rank)
        restore(rank)
        out.emit("loaded", rank=rank, step=trained["step"])
        fail = schedule[it] if it < len(schedule) else None
        while trained["step"] < stop:
            s = trained["step"] + 1
            opt.zero_grad(set_to_none=True)
            idx = wl.batch_indices(s, rank)
            loss: Any = F.cross_entropy(ddp(x[idx]), y[idx])
            at = None
            if fail is not None and fail["rank"] == rank and s >= fail["step"]:
                at = fail.get("at", "forward")
            if at == "forward":
                _die(out, s, rank)
            loss.backward()
            if at == "update":
                _die(out, s, rank)
            opt.step()
            trained["step"] = s
            out.emit("step", rank=rank, step=s)
        digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in state_tensors()))
        out.emit("trained", rank=rank, step=trained["step"], sha256=digest.hexdigest())
        return trained["step"]

    # the wrapper passes itself to the parameter annotated CallWrapper, and checks
    # every annotation with issubclass: objects, not this module's strings
    train.__annotations__ = {"call_wrapper": inprocess.CallWrapper | None}
    wrapped = inprocess.Wrapper(
        store_kwargs={"port": spec["wrapper_port"]},
        health_check=inprocess.health_check.CudaHealthCheck(),
        abort=inprocess.Compose(inprocess.abort.AbortTorchDistributed(), StampAbort()),
        rank_assignment=inprocess.Compose(
            inprocess.rank_assignment.MaxActiveWorldSize(world),
            inprocess.rank_assignment.FillGaps(),
        ),
    )(train)

    base_store = dist.TCPStore(  # type: ignore[attr-defined] # (torch's stubs: c10d)
        host_name="127.0.0.1", port=spec["app_port"], is_master=False, use_libuv=True
    )
    wrapped(base_store)


def _die(out: _Events, s: int, rank: int) -> None:
    out.emit("fail", step=s, rank=rank)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
