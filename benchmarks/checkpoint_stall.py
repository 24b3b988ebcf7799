"""How long a disk checkpoint stalls the training loop: the synchronous save
(``checkpoint_async = false``) against the asynchronous one (``checkpoint_async = true``),
side by side in one run.

Two processes on 127.0.0.1 train the benchmark workload's model (``--params``, AdamW,
gradients all-reduced on the world's gloo group) and checkpoint every ``--every``
steps, alternating the two kinds, with the calls the gloo backend makes
(:mod:`leto.backends.gloo.checkpoints`): synchronous, one collective DCP save on the
training group, then the rank's metadata beside it (synced); asynchronous, a wait for
the save in flight, the state staged in host buffers
(:class:`leto.retained.staged_save.HostStage`), and the DCP save of the copy on a thread
(:class:`~leto.retained.staged_save.BackgroundSave`), on a group of its own, the
metadata after it. The stall is the wall time the loop spends in the checkpoint call, on rank 0; medians
of each kind, and their ratio. Also reported: the background write's own time, how
much of it was left when the next checkpoint came (waited for outside the sync stall,
so that the two kinds do not charge each other), and the time of the first step after
each kind (an asynchronous write runs beside it and shares the CPUs with it). Run:
python benchmarks/checkpoint_stall.py [--params 4M] [--checkpoints 8] [--every 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from leto.bench.workload import Workload, parse_count, worker_torch
from leto.retained.checkpoint import CheckpointStore
from leto.retained.dcp_state import training_state
from leto.retained.staged_save import BackgroundSave, HostStage


def _step(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> None:
    opt.zero_grad()
    F.cross_entropy(model(x[idx]), y[idx]).backward()
    for p in model.parameters():  # data-parallel: gradients reduced on the world's group
        dist.all_reduce(p.grad)
        p.grad.div_(2)
    opt.step()


def _rank(rank: int, port: int, args: dict[str, Any], where: str, out: Any) -> None:
    worker_torch()  # one intra-op thread, as a gloo trainer has (leto launch's default)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    ckpt_group = dist.new_group([0, 1])  # the asynchronous writer's own
    world = dist.group.WORLD
    wl = Workload.for_params(args["params"], world=2)
    model = wl.build_model()
    opt = wl.build_optimizer(model)
    x, y = wl.dataset()
    stores = {k: CheckpointStore(os.path.join(where, k)) for k in ("sync", "async")}
    stage = HostStage()
    inflight: BackgroundSave | None = None
    res: dict[str, list[float]] = {
        "sync": [], "async": [], "stage": [], "write": [], "left": [], "step_sync": [], "step_async": []
    }  # fmt: skip
    step = 0
    last = "async"
    for i in range(2 * args["checkpoints"] + 2):  # one of each kind to warm up
        for k in range(args["every"]):
            step += 1
            t = time.perf_counter()
            _step(model, opt, x, y, wl.batch_indices(step, rank))
            if i >= 2 and k == 0:  # the step right after a checkpoint (an async write's)
                res[f"step_{last}"].append(time.perf_counter() - t)
        kind = "sync" if i % 2 == 0 else "async"
        st = stores[kind]
        if kind == "sync" and inflight is not None:  # the async write still going: its own
            t = time.perf_counter()
            inflight.wait()
            if i >= 2:
                res["left"].append(time.perf_counter() - t)
            inflight = None
        dist.barrier(world)
        t = time.perf_counter()
        if kind == "sync":
            st.write(step, training_state(model, opt), process_group=world, no_dist=False)
            st.write_rank_meta(step, rank, {"step": step})
        else:
            if inflight is not None:
                inflight.wait()
            staged = stage.stage(training_state(model, opt))
            w0 = time.perf_counter()
            if i >= 2:
                res["stage"].append(w0 - t)

            def write(
                st: CheckpointStore = st,
                n: int = step,
                s: Any = staged,
                kept: bool = i >= 2,
                w0: float = w0,
            ) -> None:
                st.write(n, s, process_group=ckpt_group, no_dist=False)
                if kept:
                    res["write"].append(time.perf_counter() - w0)

            def finish(st: CheckpointStore = st, n: int = step) -> None:
                st.write_rank_meta(n, rank, {"step": n})

            inflight = BackgroundSave(step, write=write, finish=finish, abort=lambda: None)
        stall = time.perf_counter() - t
        if i >= 2:
            res[kind].append(stall)
        last = kind
    if inflight is not None:
        inflight.wait()
    dist.barrier(world)
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def _ms(xs: list[float]) -> float | None:
    return statistics.median(xs) * 1e3 if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="4M", help="model size in parameters (default 4M)")
    ap.add_argument(
        "--checkpoints", type=int, default=8, help="checkpoints of each kind (default 8)"
    )
    ap.add_argument("--every", type=int, default=4, help="steps between checkpoints (default 4)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    if args.checkpoints < 1 or args.every < 1:
        ap.error("--checkpoints and --every must be at least 1")
    params = parse_count(args.params)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    where = tempfile.mkdtemp(prefix="leto-ckpt-stall-")
    try:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        conf = {"params": params, "checkpoints": args.checkpoints, "every": args.every}
        procs = [ctx.Process(target=_rank, args=(r, port, conf, where, q)) for r in (0, 1)]
        for p in procs:
            p.start()
        got = q.get(timeout=1800)
        for p in procs:
            p.join()
    finally:
        shutil.rmtree(where, ignore_errors=True)
    sync, asyn = _ms(got["sync"]), _ms(got["async"])
    assert sync is not None and asyn is not None
    res = {
        "params": Workload.for_params(params).params,
        "checkpoints": args.checkpoints,
        "every": args.every,
        "sync_stall_ms_median": sync,
        "async_stall_ms_median": asyn,
        "sync_over_async": sync / asyn,
        "async_staging_ms_median": _ms(got["stage"]),
        "async_write_ms_median": _ms(got["write"]),
        "async_left_ms_median": _ms(got["left"]),
        "step_ms_median_after_sync": _ms(got["step_sync"]),
        "step_ms_median_after_async": _ms(got["step_async"]),
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(res))
        return
    print(
        f"checkpoint stall of the training loop, {res['params']:,} parameters (AdamW), "
        f"2 gloo ranks, {args.checkpoints} checkpoints of each kind every {args.every} steps, "
        "medians:"
    )
    print(f"  synchronous save        {sync:9.2f} ms")
    print(f"  asynchronous (staging)  {asyn:9.2f} ms")
    print(f"  ratio sync/async        {sync / asyn:9.2f}")
    print(f"  of it the copy          {res['async_staging_ms_median'] or 0:9.2f} ms")
    print(f"  async background write  {res['async_write_ms_median'] or 0:9.2f} ms")
    print(f"  of it left at the next  {res['async_left_ms_median'] or 0:9.2f} ms")
    print(
        f"  1st step after sync/async {res['step_ms_median_after_sync'] or 0:9.2f} / "
        f"{res['step_ms_median_after_async'] or 0:.2f} ms"
    )


if __name__ == "__main__":
    main()
