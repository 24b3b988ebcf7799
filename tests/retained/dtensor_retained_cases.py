"""A 4-rank worker for ``retain_shards`` (FSDP2 / 2-D shards as a chunked retained
layout), imported by ``test_dtensor_retained_ranks.py`` and by the processes it spawns.

Per mesh ("fsdp": 4-way FSDP2; "2d": dp x tp, as torchtitan parallelizes), each rank:

* trains plain FSDP2 with torch's Adam, and the same model retained (leto's chunked
  Adam over the pieces), and compares losses and shards bitwise;
* interrupts a step after one chunk and rolls it back (the bytes are the step
  before's), interrupts another after two chunks and rolls it forward, and ends equal
  to the uninterrupted run;
* encodes tier-1 parity of every rank's chunks over the 4 ranks (their shards differ),
  loses rank 2's bytes and decodes them, its checksums whole again;
* attaches a newly built model (same calls) to the retained segments with the process
  state, trains on, and ends equal to the run that was never interrupted.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dtensor_cases import batch, build, inside, join, make_mesh, same_bytes

from leto.retained.alloc import InMemorySegments
from leto.retained.dtensor_retained import RetainedShards, retain_shards
from leto.retained.parity import TorchDistCollective, decode, encode

CHUNK = 64
STEPS = 4


def _opt(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)


def _dp_rank(cfg: str, mesh: Any) -> int:
    return int(mesh["dp"].get_local_rank()) if cfg == "2d" else dist.get_rank()


def _loss(cfg: str, mesh: Any, model: torch.nn.Module, s: int) -> torch.Tensor:
    x, y = batch(s, _dp_rank(cfg, mesh))
    return F.mse_loss(model(x), y)


def plain(cfg: str, mesh: Any, steps: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model = build(cfg, mesh)
    opt = _opt(model)
    losses = []
    for s in range(steps):
        loss = _loss(cfg, mesh, model, s)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    return losses, {n: p.to_local().clone() for n, p in model.named_parameters()}


def retained(
    cfg: str,
    mesh: Any,
    steps: range,
    segs: InMemorySegments,
    *,
    attach: RetainedShards | None = None,
    cut: dict[int, tuple[int, str]] | None = None,
) -> tuple[list[torch.Tensor], torch.nn.Module, RetainedShards]:
    """Train ``steps`` retained in ``segs``; ``attach``: a new model bound to the bytes
    already there, with that run's process state. ``cut``: at step s, stop after k
    chunks and roll back ("back") or forward ("forward")."""
    model = build(cfg, mesh)
    opt = _opt(model)
    rs = retain_shards(model, opt, chunk_numel=CHUNK, alloc=segs, attach=attach is not None)
    ropt = rs.optimizer
    if attach is not None:
        ropt.load_process_state(attach.optimizer.process_state())
    losses = []
    for s in steps:
        loss = _loss(cfg, mesh, model, s)
        loss.backward()
        v = ropt.version + 1
        if cut and s in cut:
            k, how = cut[s]
            before = [b.clone() for b in rs.layout.data_buffers()]
            rs.present()
            ropt.prepare(v)
            ropt.begin(v)
            for c in range(k):  # one undo slot: every chunk but the last finished
                ropt.save_undo(c)
                ropt.apply_chunk(c)
                if c < k - 1:
                    ropt.finish_chunk(c)
            if how == "back":
                ropt.roll_back()
                assert all(
                    same_bytes(a, b) for a, b in zip(before, rs.layout.data_buffers(), strict=True)
                ), "a rolled-back step left bytes of its own"
                rs.step()
            else:
                ropt.roll_forward()
        else:
            rs.step()
        assert rs.layout.verify() == []
        rs.zero_grad()
        losses.append(loss.detach().clone())
    return losses, model, rs


def _shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.to_local().clone() for n, p in model.named_parameters()}


def case(cfg: str, mesh: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ref_losses, ref = plain(cfg, mesh, STEPS)
    segs = InMemorySegments()
    losses, model, rs = retained(cfg, mesh, range(STEPS), segs)
    out["as plain FSDP2"] = all(
        same_bytes(a, b) for a, b in zip(ref_losses, losses, strict=True)
    ) and all(same_bytes(ref[n], t) for n, t in _shards(model).items())
    out["shards in the layout"] = all(
        inside(rs.layout.param_buffer, p.to_local()) for p in model.parameters()
    )
    out["chunks"] = rs.layout.n_chunks
    # interrupted steps, rolled back and forward
    _, cut_model, _ = retained(
        cfg, mesh, range(STEPS), InMemorySegments(), cut={1: (1, "back"), 2: (2, "forward")}
    )
    out["cut steps end equal"] = all(same_bytes(ref[n], t) for n, t in _shards(cut_model).items())
    # tier-1 parity over the 4 ranks' different shards: rank 2's bytes lost and decoded
    coll = TorchDistCollective()
    data = rs.layout.data_buffers()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(4)]
    dist.all_gather(sizes, torch.tensor([rs.layout.n_chunks]))
    out["same chunks on every rank"] = len({int(t) for t in sizes}) == 1
    kept = [b.clone() for b in data]
    par = encode(coll, data, 0)
    if dist.get_rank() == 2:
        for b in data:
            b.zero_()
        out["loss seen"] = rs.layout.verify() != []
    decode(coll, data, 2, 0, par)
    out["decoded"] = all(same_bytes(a, b) for a, b in zip(kept, data, strict=True))
    out["checksums whole"] = rs.layout.verify() == []
    # a new model attached to the retained bytes trains on as if nothing happened
    segs2 = InMemorySegments()
    _, _, first = retained(cfg, mesh, range(2), segs2)
    _, attached, _ = retained(cfg, mesh, range(2, STEPS), segs2, attach=first)
    out["attached ends equal"] = all(same_bytes(ref[n], t) for n, t in _shards(attached).items())
    return out


def worker(rank: int, world: int, port: int, q: Any) -> None:
    join(rank, world, port)
    out: dict[str, Any] = {}
    for cfg in ("fsdp", "2d"):
        try:
            out[cfg] = case(cfg, make_mesh(cfg))
        except Exception:
            out[cfg] = traceback.format_exc()
    q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()
