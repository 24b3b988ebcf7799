"""Models, meshes and a 4-rank worker for the mesh-aware layout's tests (CPU, gloo).

Imported by the tests and, by name, by the processes they spawn. The MLP's hidden size
(34) shards unevenly (17 per tensor-parallel rank, then 9/8 over data parallel; 9/9/9/7
over 4), so padded shards are covered.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from leto.backends.gloo import segments
from leto.retained import dtensor_layout as dl

IN, DIM, HID = 8, 16, 34
STEPS = 3


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HID)
        self.w2 = nn.Linear(HID, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.layers = nn.ModuleList([MLP(), MLP()])
        self.out = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


def make_mesh(cfg: str) -> DeviceMesh:
    shapes = {
        "fsdp": ((4,), ("dp",)),
        "hsdp": ((2, 2), ("rep", "shard")),
        "2d": ((2, 2), ("dp", "tp")),
        "pp": ((2, 2), ("pp", "dp")),
    }
    shape, names = shapes[cfg]
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def build(
    cfg: str,
    mesh: DeviceMesh,
    *,
    mp: MixedPrecisionPolicy | None = None,
    src_data_rank: int | None = 0,
    **kw: Any,
) -> nn.Module:
    """``parallelize_module`` on "tp" (2d), then ``fully_shard`` per layer and on the root.
    ``src_data_rank=None``: each rank shards its own copy (the same seed), no scatter: a
    replacement process builds it alone while the others are not building."""
    torch.manual_seed(0)
    model = Model()
    dp = mesh
    if cfg == "2d":
        for i in range(len(model.layers)):
            plan = {f"layers.{i}.w1": ColwiseParallel(), f"layers.{i}.w2": RowwiseParallel()}
            parallelize_module(model, mesh["tp"], plan, src_data_rank=src_data_rank)
        dp = mesh["dp"]
    elif cfg == "pp":
        dp = mesh["dp"]
    mp = mp or MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=dp, mp_policy=mp, **kw)
    fully_shard(model, mesh=dp, mp_policy=mp, **kw)
    return model


def memfd_segment(name: str, nbytes: int) -> torch.Tensor:
    """A zeroed memfd segment mapped as a tensor, as a keeper's (no keeper process)."""
    fd = segments.create(name, nbytes)
    try:
        return segments.as_tensor(fd, nbytes)
    finally:
        os.close(fd)


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(4, 6, IN, generator=g), torch.randn(4, 6, 1, generator=g)


@contextlib.contextmanager
def one_rank_group() -> Iterator[DeviceMesh]:
    """A world of one in this process (no other process): enough for ``fully_shard``."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (dist.get_world_size(),))
    finally:
        if made:
            dist.destroy_process_group()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.numel() == 0 or torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def inside(buf: torch.Tensor, t: torch.Tensor) -> bool:
    lo = buf.data_ptr()
    return t.numel() == 0 or lo <= t.data_ptr() < lo + buf.numel() * buf.element_size()


Opt = Callable[[nn.Module], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Opt] = {
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, amsgrad=True, foreach=False),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, nesterov=True),
}


def train(
    cfg: str, mesh: DeviceMesh, opt_name: str, mp: MixedPrecisionPolicy | None, bound: bool
) -> dict[str, Any]:
    """``cfg`` "...+accum": each step two microbatches, the gradients of the second added
    to the first's (FSDP2's ``grad += new``); "hsdp+accum": the first without all-reduce
    (HSDP keeps its reduce-scatter output as a partial sum)."""
    model = build(cfg.removesuffix("+accum"), mesh, mp=mp)
    opt = OPTIMIZERS[opt_name](model)
    shards = dl.bind(model, opt, memfd_segment) if bound else None
    dp_rank = mesh["dp"].get_local_rank() if cfg == "2d" else dist.get_rank()
    losses, grads, views = [], {}, True
    for s in range(STEPS):
        if cfg.endswith("+accum"):
            assert isinstance(model, FSDPModule)
            model.set_requires_all_reduce(not cfg.startswith("hsdp"))
            F.mse_loss(model(batch(s + 100, dp_rank)[0]), batch(s, dp_rank)[1]).backward()
            model.set_requires_all_reduce(True)
        x, y = batch(s, dp_rank)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        if shards is not None:
            gbuf, pbuf = shards.buffers["grad"], shards.buffers["param"]
            for p in model.parameters():
                assert isinstance(p.grad, DTensor) and isinstance(p, DTensor)
                views &= inside(gbuf, p.grad._local_tensor) and inside(pbuf, p._local_tensor)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return {
        "model": model,
        "opt": opt,
        "shards": shards,
        "losses": losses,
        "grads": grads,
        "views": views,
    }


def compare(
    cfg: str, mesh: DeviceMesh, opt_name: str, mp: MixedPrecisionPolicy | None
) -> dict[str, bool]:
    a = train(cfg, mesh, opt_name, mp, bound=False)
    b = train(cfg, mesh, opt_name, mp, bound=True)
    shards: dl.BoundShards = b["shards"]
    pa, pb = dict(a["model"].named_parameters()), dict(b["model"].named_parameters())
    states = dl.optimizer_states(b["opt"])
    out = {
        "losses": all(same_bytes(x, y) for x, y in zip(a["losses"], b["losses"], strict=True)),
        "params": all(same_bytes(pa[n].to_local(), pb[n].to_local()) for n in pa),
        "grads": all(same_bytes(a["grads"][n], b["grads"][n]) for n in pa),
        "states": all(
            same_bytes(a["opt"].state[pa[n]][k].to_local(), b["opt"].state[pb[n]][k].to_local())
            for n in pa
            for k in states
        ),
        "views": b["views"],
        "grad_regions_used": all(c.hits == STEPS for c in shards.reduce_scatters),
        "uneven": any(s.padded_shape != s.local_shape for s in shards.layout.slots()),
    }
    buf_ok = True
    for n in pa:
        for key, want in [("param", pa[n].to_local())] + [
            (k, a["opt"].state[pa[n]][k].to_local()) for k in states
        ]:
            buf = shards.buffers[key]
            s = shards.layout.slot(n)
            padded = dl.shard_view(shards.layout, buf, n, padded=True)
            length = s.local_shape[s.shard_dim]
            pad = padded.narrow(s.shard_dim, length, s.padded_shape[s.shard_dim] - length)
            buf_ok &= same_bytes(dl.shard_view(shards.layout, buf, n), want)
            buf_ok &= bool((pad == 0).all())
    out["buffer_bytes"] = buf_ok
    return out


def refuse_pipeline() -> str:
    model = build("pp", make_mesh("pp"))
    try:
        dl.plan_layout(model)
    except dl.UnsupportedParallelismError as e:
        return str(e)
    return "not refused"


CASES = [
    ("fsdp", "adam", None),
    ("hsdp", "adam", None),
    ("hsdp+accum", "adam", None),
    ("fsdp+accum", "sgd", None),
    ("2d", "adam", None),
    ("2d", "sgd", None),
    ("fsdp", "adamw", None),
    ("2d", "adam", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
]


def join(rank: int, world: int, port: int) -> None:
    """A spawned rank joins the test's world (gloo on 127.0.0.1)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )


def spawn_ranks(target: Callable[..., None], world: int = 4) -> dict[int, dict[str, Any]]:
    """Run ``target(rank, world, port, queue)`` on ``world`` spawned processes; what each
    put on the queue, by rank."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, q)) for r in range(world)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    try:
        res: dict[int, dict[str, Any]] = dict(q.get(timeout=240) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    print(f"{world} ranks: {time.monotonic() - t0:.1f} s")
    return res


def worker(rank: int, world: int, port: int, q: Any, cases: int = len(CASES)) -> None:
    join(rank, world, port)
    out: dict[str, Any] = {}
    meshes = {c: make_mesh(c) for c in ("fsdp", "hsdp", "2d")}
    for cfg, opt_name, mp in CASES[:cases]:
        tag = f"{cfg}/{opt_name}/{'bf16' if mp else 'fp32'}"
        try:
            out[tag] = compare(cfg, meshes[cfg.removesuffix("+accum")], opt_name, mp)
        except Exception:
            out[tag] = traceback.format_exc()
    try:
        out["pipeline refused"] = refuse_pipeline()
    except Exception:
        out["pipeline refused"] = traceback.format_exc()
    q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
