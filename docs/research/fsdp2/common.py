"""Shared pieces of the FSDP2 / TP / HSDP feasibility prototype (CPU, gloo).

- models: a 2-layer MLP and a tiny transformer (2 blocks), with a TP plan
- build(): parallelize_module on "tp" + fully_shard on "dp" (torchtitan order),
  or 1-D FSDP, or HSDP (2-D mesh given to fully_shard)
- ExternalStore: flat external buffers (memfd + mmap, as leto does) for params,
  grads and Adam state; FSDP2's sharded params / grads / optimizer state are
  made views into them.
"""

from __future__ import annotations

import mmap
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

IN, DIM, HID = 8, 16, 34  # HID=34: 17 per tp rank -> uneven dp shards (9/8): padding


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def init_pg(rank: int, world: int, port: int, timeout_s: float = 120) -> None:
    import datetime

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


# ------------------------------------------------------------------ models


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HID)
        self.w2 = nn.Linear(HID, DIM)

    def forward(self, x):
        return self.w2(F.relu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, heads: int = 4):
        super().__init__()
        self.hd = DIM // heads
        self.norm1 = nn.LayerNorm(DIM)
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.norm2 = nn.LayerNorm(DIM)
        self.ff = MLP()

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)
        # -1: local number of heads (TP shards the heads)
        q = self.wq(h).view(b, t, -1, self.hd).transpose(1, 2)
        k = self.wk(h).view(b, t, -1, self.hd).transpose(1, 2)
        v = self.wv(h).view(b, t, -1, self.hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.ff(self.norm2(x))


class Model(nn.Module):
    """kind='mlp': in-proj, MLP, head.  kind='tf': in-proj, 2 transformer blocks, head."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(IN, DIM)
        self.layers = nn.ModuleList([MLP()] if kind == "mlp" else [Block(), Block()])
        self.out = nn.Linear(DIM, 1)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x) if self.kind == "tf" else x + layer(x)
        return self.out(x)


def tp_plan(kind: str, i: int) -> dict:
    p = f"layers.{i}."
    ff = p if kind == "mlp" else p + "ff."
    plan = {ff + "w1": ColwiseParallel(), ff + "w2": RowwiseParallel()}
    if kind == "tf":
        for n in ("wq", "wk", "wv"):
            plan[p + n] = ColwiseParallel()
        plan[p + "wo"] = RowwiseParallel()
    return plan


# ------------------------------------------------------------------ build


def make_mesh(cfg: str):
    """cfg: '2d' (dp=2 x tp=2), '4x1' (dp=4 x tp=1), 'fsdp' (dp=4), 'hsdp' (rep=2 x shard=2)."""
    if cfg == "2d":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    if cfg == "4x1":
        return init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    if cfg == "fsdp":
        return init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    if cfg == "hsdp":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    raise ValueError(cfg)


def build(kind: str, cfg: str, mesh, *, mp=None, reshard=True, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    model = Model(kind)
    mp = mp or MixedPrecisionPolicy()
    if cfg in ("2d", "4x1"):
        for i in range(len(model.layers)):
            parallelize_module(model, mesh["tp"], tp_plan(kind, i))
        dp_mesh = mesh["dp"]
    elif cfg == "fsdp":
        dp_mesh = mesh
    else:  # hsdp: 2-D mesh (replicate, shard) given to fully_shard
        dp_mesh = mesh
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def dp_rank(cfg: str, mesh) -> int:
    if cfg in ("2d", "4x1"):
        return mesh["dp"].get_local_rank()
    return dist.get_rank()


def batch(step: int, dpr: int):
    g = torch.Generator().manual_seed(1000 * step + dpr)
    x = torch.randn(4, 6, IN, generator=g)
    y = torch.randn(4, 6, 1, generator=g)
    return x, y


def train(model, opt, cfg, mesh, steps, start=0):
    losses = []
    dpr = dp_rank(cfg, mesh)
    for s in range(start, start + steps):
        x, y = batch(s, dpr)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    return losses


# ------------------------------------------------------------------ external memory


def fsdp_param_groups(model):
    """(FSDPModule, FSDPParamGroup) pairs.  PRIVATE: FSDPModule._get_fsdp_state(),
    FSDPState._fsdp_param_groups."""
    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for g in m._get_fsdp_state()._fsdp_param_groups:
                out.append((m, g))
    return out


def memfd_tensor(name: str, numel: int, dtype=torch.float32) -> torch.Tensor:
    """A memfd segment mapped MAP_SHARED and wrapped as a tensor, like leto's as_tensor."""
    nbytes = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    t = torch.frombuffer(mm, dtype=torch.uint8)  # keeps mm alive
    return t.view(dtype)[:numel], mm


class ExtRS(ReduceScatter):
    """Custom reduce-scatter (public FSDPModule.set_custom_reduce_scatter) whose
    OUTPUT buffer is the group's region of the external grad buffer.  FSDP2 then
    makes each sharded grad an as_strided view of it: zero copy."""

    def __init__(self, region: torch.Tensor, sharded_params=None):
        self.region = region
        self.calls = 0
        self.hits = 0
        # guard: if a grad already exists FSDP2 does `grad._local_tensor += new`;
        # new must then NOT alias the region (it would add the region to itself)
        self.sharded_params = sharded_params

    def allocate(self, size, *, dtype, device):
        self.calls += 1
        # 1st allocate of a reduce = RS input (world*numel), 2nd = RS output
        free = self.sharded_params is None or all(p.grad is None for p in self.sharded_params)
        if (
            free
            and self.calls % 2 == 0
            and tuple(size) == (self.region.numel(),)
            and dtype == self.region.dtype
        ):
            self.hits += 1
            return self.region
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


class ExternalStore:
    """One flat buffer per kind (param, grad, exp_avg, exp_avg_sq).  Each FSDPParam
    gets a region of padded_sharded_param_size.numel() elements; a group's
    regions are contiguous and in fsdp_params order, which is exactly the layout of
    FSDP2's reduce-scatter output, so the same offsets serve params, grads, states."""

    ALIGN = 16

    def __init__(self, model, *, attach: tuple | None = None):
        self.model = model
        self.groups = fsdp_param_groups(model)
        self.slots = {}  # id(sharded_param) -> (fsdp_param, offset, numel)
        self.group_span = []  # (module, group, offset, numel)
        off = 0
        for m, g in self.groups:
            start = off
            for fp in g.fsdp_params:
                n = fp.padded_sharded_param_size.numel()
                self.slots[id(fp.sharded_param)] = (fp, off, n)
                off += n
            self.group_span.append((m, g, start, off - start))
            off = -(-off // self.ALIGN) * self.ALIGN
        self.numel = off
        if attach is not None:
            self.buf, self.mm = attach  # existing (buffers, mmaps): re-bind without copy
        else:
            self.buf, self.mm = {}, {}
            for k in ("param", "grad", "exp_avg", "exp_avg_sq"):
                self.buf[k], self.mm[k] = memfd_tensor(k, self.numel)
            for v in self.buf.values():
                v.zero_()

    def own_storage(self, kind, off, n):
        """Elements [off, off+n) of buffer `kind` as a tensor with its OWN storage
        starting there (storage_offset 0), over the same mmap: no copy.  Needed for
        the reduce-scatter output because FSDP2 cuts it with torch.as_strided(...,
        storage_offset=k), which is absolute in the storage, not relative to a view."""
        t = torch.frombuffer(
            self.mm[kind],
            dtype=self.buf[kind].dtype,
            count=n,
            offset=off * self.buf[kind].element_size(),
        )
        assert t.data_ptr() == self.buf[kind][off:].data_ptr() and t.storage_offset() == 0
        return t

    def region(self, kind, fp_off, n, fp):
        return self.buf[kind][fp_off : fp_off + n].view(fp.padded_sharded_param_size)

    # -- params
    @torch.no_grad()
    def bind_params(self, copy_in: bool = True):
        """PRIVATE attrs written: FSDPParam._sharded_param_data, DTensor._local_tensor
        (of FSDPParam.sharded_param).  copy_in=False: attach to existing bytes."""
        for fp, off, n in self.slots.values():
            ext = self.region("param", off, n, fp)
            if copy_in:
                ext.copy_(fp._sharded_param_data.view(fp.padded_sharded_param_size))
            d = fp.fsdp_placement.dim
            fp._sharded_param_data = ext.view(-1)
            fp.sharded_param._local_tensor = ext.narrow(d, 0, fp.sharded_size[d])
            # reset_sharded_param() is a no-op now (same storage): call it to show that
            fp.reset_sharded_param()
            assert fp._sharded_param_data.data_ptr() == ext.data_ptr()

    # -- grads
    def bind_grads(self, guard: bool = True):
        """Public API: FSDPModule.set_custom_reduce_scatter(ExtRS(region))."""
        self.rs = []
        for m, g, off, n in self.group_span:
            comm = ExtRS(
                self.own_storage("grad", off, n),
                [fp.sharded_param for fp in g.fsdp_params] if guard else None,
            )
            if len(m._get_fsdp_state()._fsdp_param_groups) != 1:
                raise RuntimeError("one param group per module expected")
            m.set_custom_reduce_scatter(comm)
            self.rs.append(comm)

    # -- optimizer state
    def precreate_adam_state(self, opt):
        """Public API only: DTensor.from_local over views + opt.state[p] = {...}."""
        for group in opt.param_groups:
            for p in group["params"]:
                fp, off, n = self.slots[id(p)]
                d = fp.fsdp_placement.dim
                st = {"step": torch.tensor(0.0)}
                for k in ("exp_avg", "exp_avg_sq"):
                    v = self.region(k, off, n, fp).narrow(d, 0, fp.sharded_size[d])
                    st[k] = DTensor.from_local(
                        v,
                        p.device_mesh,
                        p.placements,
                        run_check=False,
                        shape=p.shape,
                        stride=p.stride(),
                    )
                opt.state[p] = st

    # -- checks
    def inside(self, kind, t: torch.Tensor) -> bool:
        b = self.buf[kind]
        lo, hi = b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()
        return t.numel() == 0 or lo <= t.data_ptr() < hi

    def check_views(self, opt=None, grads=False) -> dict:  # empty shards: numel 0, skip
        r = {"param": True, "grad": True, "state": True}
        for fp, off, n in self.slots.values():
            p = fp.sharded_param
            ext = self.region("param", off, n, fp)
            r["param"] &= fp._sharded_param_data.data_ptr() == ext.data_ptr()
            r["param"] &= (
                p._local_tensor.numel() == 0 or p._local_tensor.data_ptr() == ext.data_ptr()
            )
            if grads:
                r["grad"] &= p.grad is not None and self.inside("grad", p.grad._local_tensor)
            if opt is not None:
                st = opt.state[p]
                r["state"] &= all(
                    self.inside(k, st[k]._local_tensor) for k in ("exp_avg", "exp_avg_sq")
                )
        return r


def local_shards(model) -> dict:
    return {n: p._local_tensor.detach().clone() for n, p in model.named_parameters()}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
