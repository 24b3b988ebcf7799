"""A torchrun-style user loop for kills at random instants (tests/gloo/random_instants.py).

Everything a real loop has: every RNG seeded, an MLP with dropout, AdamW, a LambdaLR
warm-up then decay, a GradScaler, a DataLoader over a DistributedSampler (shuffled; leto
calls ``set_epoch`` at each epoch boundary, not this script) over several epochs,
accumulation over 2 micro-batches under ``session.no_sync()``, clipping, the loss
printed each step, the loss all-reduced as a metric (the script's own collective) and
its own ``torch.save`` of model, optimizer and scheduler every 3 steps, only
``if session.committed``, to ``RUN_DIR/user-ckpt/step<S>.pt`` (rank 0).

Once ``leto.wrap`` has returned (a shadow waits inside it: only the rank's trainer gets
past), the process writes an empty ``RUN_DIR/pids/rank<R>.<pid>``: a harness finds the
live trainer of each rank there. Arguments: --config (default LETO_CONFIG), --steps
(default STEPS or 180: 11 epochs of 16 steps, about 2.5 s of training here).
"""

import argparse
import contextlib
import os
import random

import numpy
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import leto

p = argparse.ArgumentParser()
p.add_argument("--config", default=os.environ.get("LETO_CONFIG"))
p.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", "180")))
args = p.parse_args()

torch.manual_seed(0)
random.seed(0)
numpy.random.seed(0)
ACCUM, EVERY = 2, 3
g = torch.Generator().manual_seed(1)
X = torch.randn(1024, 16, generator=g)
Y = (X @ torch.randn(16, 4, generator=g)).argmax(1)
data = TensorDataset(X, Y)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
run_dir = os.environ["LETO_RUN_DIR"]
# 1024 samples, 2 ranks, 32 a batch: 16 steps an epoch
sampler = DistributedSampler(data, world, rank, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=32, sampler=sampler)
H = 128
model = nn.Sequential(
    nn.Linear(16, H), nn.GELU(), nn.Dropout(0.1), nn.Linear(H, H), nn.GELU(), nn.Linear(H, 4)
)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
WARMUP = 10
sched = torch.optim.lr_scheduler.LambdaLR(
    opt, lambda s: (s + 1) / WARMUP if s < WARMUP else 0.99 ** (s - WARMUP)
)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
session = leto.wrap(model, opt, sched, loader, scaler=scaler, config=args.config)

os.makedirs(os.path.join(run_dir, "pids"), exist_ok=True)
open(os.path.join(run_dir, "pids", f"rank{rank}.{os.getpid()}"), "w").close()
ckpt_dir = os.path.join(run_dir, "user-ckpt")
os.makedirs(ckpt_dir, exist_ok=True)

for x, y in session.batches(args.steps):
    opt.zero_grad()
    total = torch.zeros(())
    for i, (xm, ym) in enumerate(zip(x.chunk(ACCUM), y.chunk(ACCUM), strict=True)):
        with contextlib.nullcontext() if i == ACCUM - 1 else session.no_sync():
            loss = F.cross_entropy(model(xm), ym) / ACCUM
            scaler.scale(loss).backward()
        total += loss.detach()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    sched.step()
    metric = total.clone()
    dist.all_reduce(metric)  # the script's own collective (a metric)
    if session.committed:
        print(
            f"rank {rank} step {session.step} loss {total.item():.6f} "
            f"mean {metric.item() / world:.6f} lr {sched.get_last_lr()[0]:.6f}",
            flush=True,
        )
        if rank == 0 and session.step % EVERY == 0:
            state = {
                "step": session.step,
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "scaler": scaler.state_dict(),
            }
            tmp = os.path.join(ckpt_dir, f".step{session.step}.pt.{os.getpid()}")
            torch.save(state, tmp)
            os.replace(tmp, os.path.join(ckpt_dir, f"step{session.step}.pt"))
