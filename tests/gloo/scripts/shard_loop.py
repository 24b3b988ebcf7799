"""The user's own loop (examples/ddp_loop.py's) for sharded state and master weights.

Arguments: --config, --steps, --clip {session,torch,none}: clip with
session.clip_grad_norm_, with torch.nn.utils.clip_grad_norm_ (refused when sharded), or
not at all; --bf16: the model in bfloat16 (with master_weights = true in the config:
float32 masters); --fp16-scaler: in float16 with a GradScaler whose first scale
overflows (its first steps are skipped). The model's parameters' SHA-256 goes to
RUN_DIR/params-rank<r> at the end (with --fp16-scaler, the final scale to scale-rank<r>).
"""

import argparse
import contextlib
import hashlib
import os
import random

import numpy
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import leto

p = argparse.ArgumentParser()
p.add_argument("--config")
p.add_argument("--steps", type=int, default=12)
p.add_argument("--clip", default="session")
p.add_argument("--bf16", action="store_true")
p.add_argument("--fp16-scaler", action="store_true", help="fp16 with a GradScaler")
args = p.parse_args()

torch.manual_seed(0)
random.seed(0)
numpy.random.seed(0)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(512, 12, generator=g), torch.randint(0, 3, (512,), generator=g))
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
sampler = DistributedSampler(data, world, rank, seed=0)
loader = DataLoader(data, batch_size=16, sampler=sampler)
model = nn.Sequential(nn.Linear(12, 48), nn.GELU(), nn.Dropout(0.1), nn.Linear(48, 3))
dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16_scaler else torch.float32
model = model.to(dtype)
opt = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.01)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
# a scale that overflows fp16 at first: the first steps are skipped, every rank alike
scaler = torch.amp.GradScaler(
    "cpu", init_scale=2.0**21, growth_interval=3, enabled=args.fp16_scaler
)
session = leto.wrap(model, opt, sched, loader, scaler=scaler, config=args.config)

for x, y in session.batches(args.steps):
    opt.zero_grad()
    for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
        with contextlib.nullcontext() if i == 1 else session.no_sync():
            loss = F.cross_entropy(model(xm.to(dtype)).float(), ym) / 2
            scaler.scale(loss).backward()
    scaler.unscale_(opt)
    if args.clip == "session":
        session.clip_grad_norm_(0.5)
    elif args.clip == "torch":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(opt)
    scaler.update()
    sched.step()

blob = b"".join(
    q.detach().reshape(-1).view(torch.uint8).numpy().tobytes() for q in model.parameters()
)
with open(os.path.join(os.environ["LETO_RUN_DIR"], f"params-rank{rank}"), "w") as f:
    f.write(hashlib.sha256(blob).hexdigest())
if args.fp16_scaler:
    with open(os.path.join(os.environ["LETO_RUN_DIR"], f"scale-rank{rank}"), "w") as f:
        f.write(repr(scaler.get_scale()))
