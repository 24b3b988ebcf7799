"""A Lightning Fabric training loop under leto (gloo, CPU): docs/trainers.md.

Fabric's loop is the script's own, so it is leto's user loop (docs/loop.md) with
Fabric's calls: `fabric.setup`, `fabric.backward`, `fabric.clip_gradients`. Fabric is
given one device (`devices=1`): to Fabric each rank is one process alone (no process
group, no DDP), and leto reduces the gradients; the batches come from
`session.batches`, not `fabric.setup_dataloaders`.

    leto launch --nproc-per-node 2 examples/fabric_loop.py --config examples/gloo-1node.toml

Needs ``pip install lightning``.
"""

import argparse
import contextlib
import os

# the arguments first: `--help` answers before torch and lightning are imported
p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--config", default=os.environ.get("LETO_CONFIG"))
p.add_argument("--steps", type=int, default=12)
p.add_argument("--accum", type=int, default=2, help="micro-batches per step")
args = p.parse_args()

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

import leto

try:
    from lightning.fabric import Fabric
except ImportError as e:  # one line, not a traceback
    raise SystemExit(
        f"examples/fabric_loop.py needs lightning: pip install lightning ({e})"
    ) from None

try:  # resumable: leto retains its position (a plain DataLoader is re-read and skipped)
    from torchdata.stateful_dataloader import StatefulDataLoader as DataLoader
except ImportError:
    from torch.utils.data import DataLoader

fabric = Fabric(accelerator="cpu", devices=1)  # one process to Fabric: leto reduces
fabric.seed_everything(0)  # torch, random and NumPy: a resumed run is the same run
X = torch.randn(1024, 16)
Y = (X @ torch.randn(16, 4)).argmax(1)
data = TensorDataset(X, Y)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, world, rank, seed=0))
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
session = leto.wrap(model, opt, sched, loader, config=args.config)  # the plain objects
fmodel, fopt = fabric.setup(model, opt)

for x, y in session.batches(args.steps):
    fopt.zero_grad()
    for i, (xm, ym) in enumerate(zip(x.chunk(args.accum), y.chunk(args.accum), strict=True)):
        with contextlib.nullcontext() if i == args.accum - 1 else session.no_sync():
            loss = F.cross_entropy(fmodel(xm), ym) / args.accum
            fabric.backward(loss)
    fabric.clip_gradients(fmodel, fopt, max_norm=1.0)
    fopt.step()  # Fabric steps the optimizer without a closure: leto's transaction
    sched.step()

if rank == 0:
    print(
        f"step {session.step}, loss {loss.item():.6f}, recoveries {session.stats['recoveries']} (this process's)"
    )
