"""What leaving a reduce at the recovery's abort costs a step: gloo's blocking
``work.wait()`` against leto's abortable wait (:func:`leto.backends.gloo.collective.wait_or_abort`,
which a step's gradient reduce uses: it blocks in slices, looking for the abort between
them), side by side in one run.

Two processes on 127.0.0.1 all-reduce a float32 buffer of ``--numel`` elements
(default 1M, the benchmark workload's size) ``--rounds`` times each way, alternating
the two in every round; medians of the wall time per reduce, and their ratio. Run:
python benchmarks/reduce_wait.py [--numel 1M] [--rounds 40] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from leto.backends.gloo.collective import wait_or_abort
from leto.bench.workload import parse_count


def _rank(rank: int, port: int, numel: int, rounds: int, out: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    buf = torch.ones(numel)
    times: dict[str, list[float]] = {"blocking": [], "abortable": []}
    for i in range(rounds + 2):  # two rounds of warm-up
        order = ("blocking", "abortable") if i % 2 else ("abortable", "blocking")
        for how in order:
            dist.barrier()
            t = time.perf_counter()
            work = dist.all_reduce(buf, async_op=True)
            if how == "blocking":
                work.wait()
            else:
                wait_or_abort(work, lambda: False, "benchmark")
            if i >= 2:
                times[how].append(time.perf_counter() - t)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", default="1M", help="elements reduced (default 1M)")
    ap.add_argument("--rounds", type=int, default=40, help="reduces each way (default 40)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    numel = parse_count(args.numel)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, numel, args.rounds, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    times = q.get(timeout=600)
    for p in procs:
        p.join()
    blocking = statistics.median(times["blocking"]) * 1e3
    abortable = statistics.median(times["abortable"]) * 1e3
    res = {
        "numel": numel,
        "rounds": args.rounds,
        # unrounded: a median of a few microseconds rounded to 4 places would put the ratio
        # of the rounded medians visibly off the ratio printed
        "blocking_ms_median": blocking,
        "abortable_ms_median": abortable,
        "abortable_over_blocking": abortable / blocking,
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(res))
        return
    print(f"all-reduce of {numel:,} float32 on 2 gloo ranks, {args.rounds} each way, medians:")
    print(f"  blocking work.wait()   {blocking:8.3f} ms")
    print(f"  abortable (in slices) {abortable:8.3f} ms")
    print(f"  ratio abortable/block. {abortable / blocking:8.3f}")


if __name__ == "__main__":
    main()
