"""Retained bytes and step time of the FSDP2 + TP Llama example, with leto and without.

Four processes over gloo on 127.0.0.1 (a 2 x 2 ``("dp", "tp")`` mesh), each building
``examples/llama_fsdp_tp.py``'s model twice: plain FSDP2 + TP with torch's AdamW, and
retained by leto (``retain_shards``: memfd segments, leto's chunked AdamW with undo
copies, seals and checksums). Per rank (the largest over the ranks):

* bytes: FSDP2 alone's sharded parameters, gradients and AdamW moments (the tensors the
  plain run holds after a step; all-gathered parameters are transient in both and not
  counted) against leto's retained segments (parameters, gradients, AdamW moments as
  padded shards in whole chunks, the undo slot, the header); no parity is kept at this
  layer (tier 1 is not wired here yet);
* time: ``--rounds`` interleaved rounds (the order alternating), each ``--steps`` steps of
  each run (forward, backward, step); per round the slowest rank's time; the ratio
  leto / plain per round, reported as its median and its range; and the part of it in
  the optimizer step (torch's AdamW, on CPU its for-loop over the DTensors, against
  leto's chunked AdamW over plain local pieces, with undo copies and seals).

Run: python benchmarks/llama_retained.py [--rounds 7] [--steps 5] [--dim 256] [--layers 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import llama_fsdp_tp as ex  # noqa: E402

from leto.testing.llama import LlamaConfig  # noqa: E402

WORLD = 4


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def fsdp_bytes(run: ex.Run, grads: list[torch.Tensor]) -> dict[str, int]:
    states = [v.to_local() for st in run.opt.state.values() for k, v in st.items() if k != "step"]
    return {
        "params": _nbytes([p.to_local() for p in run.model.parameters()]),
        "grads": _nbytes(grads),
        "optimizer_states": _nbytes(states),
    }


def leto_bytes(run: ex.Run) -> dict[str, int]:
    assert run.rs is not None
    lay = run.rs.layout
    return {
        "params": _nbytes([lay.param_buffer]),
        "grads": _nbytes([lay.grad_buffer]),
        "optimizer_states": _nbytes([lay.state_buffer(s) for s in lay.states]),
        "undo": _nbytes([lay.undo.copies]),
        "header": _nbytes([lay.header.words]),
        "parity": 0,
    }


def _timed(run: ex.Run, steps: int) -> tuple[float, float]:
    """The slowest rank's time for ``steps`` steps, and in their optimizer steps."""
    opt0, t0 = run.opt_seconds, time.perf_counter()
    for _ in range(steps):
        run.train_step()
    t = torch.tensor([time.perf_counter() - t0, run.opt_seconds - opt0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


def _max(d: dict[str, int]) -> dict[str, int]:
    out = {}
    for k, v in d.items():
        t = torch.tensor([v], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[k] = int(t)
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cfg = LlamaConfig(dim=args.dim, n_layers=args.layers, multiple_of=args.dim // 2)
    mesh = ex.make_mesh("2x2")
    plain = ex.Run(mesh, plain=True, cfg=cfg)
    leto = ex.Run(mesh, plain=False, cfg=cfg, chunk_numel=args.chunk_numel, tag="bench")
    # one step each (warm-up, and the plain run's AdamW state exists), gradients kept once
    loss = ex.loss_of(plain.model, cfg, 0, ex.dp_rank(mesh))
    loss.backward()
    grads = [p.grad.to_local() for p in plain.model.parameters() if p.grad is not None]
    plain.opt.step()
    plain.opt.zero_grad(set_to_none=True)
    plain.sched.step()
    plain.step += 1
    leto.train_step()
    fsdp, ret = _max(fsdp_bytes(plain, grads)), _max(leto_bytes(leto))
    rounds = []
    for r in range(args.rounds):
        order = [("plain", plain), ("leto", leto)]
        if r % 2:
            order.reverse()
        rounds.append({name: _timed(run, args.steps) for name, run in order})
    ratios = [g["leto"][0] / g["plain"][0] for g in rounds]
    n_params = sum(p.numel() for p in ex.Llama(cfg).parameters())
    return {
        "params": n_params,
        "dim": args.dim,
        "layers": args.layers,
        "chunk_numel": args.chunk_numel,
        "chunks": leto.rs.layout.n_chunks if leto.rs else 0,
        "rounds": args.rounds,
        "steps": args.steps,
        "fsdp_bytes": fsdp,
        "leto_bytes": ret,
        "fsdp_total": sum(fsdp.values()),
        "leto_total": sum(ret.values()),
        "bytes_ratio": sum(ret.values()) / sum(fsdp.values()),
        "plain_step_ms": [1000 * g["plain"][0] / args.steps for g in rounds],
        "leto_step_ms": [1000 * g["leto"][0] / args.steps for g in rounds],
        "plain_opt_ms": [1000 * g["plain"][1] / args.steps for g in rounds],
        "leto_opt_ms": [1000 * g["leto"][1] / args.steps for g in rounds],
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def report(m: dict[str, Any]) -> str:
    lines = [
        f"Llama {m['params']:,} parameters (dim {m['dim']}, {m['layers']} layers), FSDP2 + TP"
        f" 2 x 2 over gloo; leto chunks of {m['chunk_numel']:,} ({m['chunks']} per rank)",
        "per-rank bytes (largest rank):",
    ]
    for k in ("params", "grads", "optimizer_states", "undo", "header", "parity"):
        f = m["fsdp_bytes"].get(k)
        lines.append(
            f"  {k:<17} fsdp2 {'-' if f is None else f'{f:,}':>12}   leto {m['leto_bytes'][k]:>12,}"
        )
    lines.append(
        f"  {'total':<17} fsdp2 {m['fsdp_total']:>12,}   leto {m['leto_total']:>12,}"
        f"   ratio {m['bytes_ratio']:.3f}"
    )
    med = statistics.median
    lines.append(
        f"step time, {m['rounds']} interleaved rounds of {m['steps']} steps: plain"
        f" {med(m['plain_step_ms']):.2f} ms, leto {med(m['leto_step_ms']):.2f} ms (medians);"
        f" leto / plain {m['ratio_median']:.3f} (range {m['ratio_min']:.3f} - {m['ratio_max']:.3f})"
    )
    lines.append(
        f"  of which the optimizer step: plain {med(m['plain_opt_ms']):.2f} ms (torch's AdamW"
        f" on the DTensors), leto {med(m['leto_opt_ms']):.2f} ms (chunked AdamW on the pieces,"
        " undo copies, seals)"
    )
    return "\n".join(lines)


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    m = measure(args)
    if rank == 0:
        print(json.dumps(m) if args.json else report(m), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="steps per run per round")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--chunk-numel", type=int, default=65536)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be at least 1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(worker, args=(args, port), nprocs=WORLD)


if __name__ == "__main__":
    main()
