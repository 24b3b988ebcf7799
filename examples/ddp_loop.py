"""A plain torchrun DDP training loop converted to leto (from examples/ddp_plain.py;
`diff examples/ddp_plain.py examples/ddp_loop.py` is the whole conversion, docs/loop.md).

    leto launch --nproc-per-node 2 examples/ddp_loop.py --config examples/gloo-1node.toml
"""

import argparse
import contextlib
import os
import random

import numpy
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

import leto

try:  # resumable: leto retains its position (a plain DataLoader is re-read and skipped)
    from torchdata.stateful_dataloader import StatefulDataLoader as DataLoader
except ImportError:
    from torch.utils.data import DataLoader

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--config", default=os.environ.get("LETO_CONFIG"))
p.add_argument("--steps", type=int, default=12)
p.add_argument("--accum", type=int, default=2, help="micro-batches per step")
p.add_argument("--scaler", action="store_true", help="a GradScaler (loss scaling)")
args = p.parse_args()

torch.manual_seed(0)  # every RNG seeded: a resumed run is bitwise the one that never failed
random.seed(0)
numpy.random.seed(0)
X = torch.randn(1024, 16)
Y = (X @ torch.randn(16, 4)).argmax(1)
data = TensorDataset(X, Y)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, world, rank, seed=0))
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=args.scaler)
session = leto.wrap(model, opt, sched, loader, scaler=scaler, config=args.config)

for x, y in session.batches(args.steps):
    opt.zero_grad()
    for i, (xm, ym) in enumerate(zip(x.chunk(args.accum), y.chunk(args.accum), strict=True)):
        with contextlib.nullcontext() if i == args.accum - 1 else session.no_sync():
            loss = F.cross_entropy(model(xm), ym) / args.accum
            scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    sched.step()

if rank == 0:
    print(
        f"step {session.step}, loss {loss.item():.6f}, recoveries {session.stats['recoveries']} (this process's)"
    )
