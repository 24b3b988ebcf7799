"""Does nvidia-resiliency-ext's in-process restart (``inprocess.Wrapper``) recover
a 2-rank gloo job on CPU?

Configured as the package's ``examples/inprocess/optimal_example.py`` with
``--device cpu``: the wrapper's own ``TCPStore`` at ``MASTER_PORT + 2``, the
application's at ``MASTER_PORT + 1`` (multi-tenant), ``CudaHealthCheck`` (a no-op
without CUDA), the default ``AbortTorchDistributed`` abort and
``ActivateAllRanks``/``ShiftRanks`` rank assignment; model and optimizer built once
outside the wrapped function, a gloo process group (10 s timeout) and DDP built
inside it on each restart iteration.

Rank ``--fail-rank`` fails at step ``--fail-step`` of the first iteration, by
``--fault exc`` (raises ``RuntimeError``) or ``--fault kill`` (SIGKILLs itself).
Each process prints JSON lines: ``enter`` (the wrapped function entered, with the
restart ``iteration``, ``rank`` and ``world``), ``fault``, ``done`` (returned, with a
parameter checksum). The driver exits 0 when every surviving process returned.

    PYTHONPATH=<nvidia_resiliency_ext 0.4.1> python docs/research/nvre/repro.py --fault exc
"""

import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any


def emit(ev: str, **kw: Any) -> None:
    print(json.dumps({"ev": ev, "t": time.time(), **kw}), flush=True)


def worker(args: argparse.Namespace) -> None:
    import nvidia_resiliency_ext.inprocess as inprocess
    import torch
    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"])

    @inprocess.Wrapper(
        store_kwargs={"port": port + 2},
        health_check=inprocess.health_check.CudaHealthCheck(),
    )
    def train(
        base_store: Any,
        model: Any,
        opt: Any,
        call_wrapper: inprocess.CallWrapper | None = None,  # an object: the wrapper reads it
    ) -> float:
        assert call_wrapper is not None
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        emit("enter", iteration=call_wrapper.iteration, rank=rank, world=world)
        store = dist.PrefixStore(str(call_wrapper.iteration), base_store)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=10),
        )
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        g = torch.Generator().manual_seed(rank)
        for step in range(args.steps):
            if call_wrapper.iteration == 0 and rank == args.fail_rank and step == args.fail_step:
                emit("fault", step=step, kind=args.fault)
                if args.fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected fault at {step=} on {rank=}")
            inp = torch.rand(8, 64, generator=g)
            opt.zero_grad()
            ddp(inp).square().mean().backward()
            opt.step()
            time.sleep(0.01)
        dist.destroy_process_group()
        return float(sum(p.sum() for p in model.parameters()))

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    base_store = dist.TCPStore(
        host_name="127.0.0.1",
        port=port + 1,
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=int(os.environ["RANK"]) == 0,
        multi_tenant=True,
        wait_for_workers=True,
        use_libuv=True,
    )
    out = train(base_store, model, opt)
    emit("done", checksum=out)


def free_port() -> int:
    """A port with the next two also free (the example's MASTER_PORT + 1, + 2)."""
    while True:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
        s.close()
        try:
            for p in (port + 1, port + 2):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", choices=("exc", "kill"), default="exc")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--fail-step", type=int, default=20)
    ap.add_argument("--fail-rank", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    port = free_port()
    procs = []
    for r in range(args.world):
        env = dict(
            os.environ,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(args.world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        cmd = [sys.executable, __file__, "--worker", *sys.argv[1:]]
        procs.append(subprocess.Popen(cmd, env=env))
    deadline = time.monotonic() + args.timeout
    rcs = []
    for p in procs:
        try:
            rcs.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            rcs.append(p.wait())
    print(json.dumps({"ev": "exit", "rcs": rcs}), flush=True)
    survivors = [
        rc for r, rc in enumerate(rcs) if not (args.fault == "kill" and r == args.fail_rank)
    ]
    return 0 if all(rc == 0 for rc in survivors) else 1


if __name__ == "__main__":
    sys.exit(main())
