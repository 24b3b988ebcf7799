"""A torchrun script that keeps its own ``dist.init_process_group("gloo")`` before
``leto.wrap`` and builds its DistributedSampler with default arguments (the rank and
world from the process group). KILL_STEP: rank 1 SIGKILLs itself in that step's
forward, once (its shadow, which also ran init_process_group, takes its place)."""

import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import leto

torch.manual_seed(0)
dist.init_process_group("gloo")
ds = TensorDataset(torch.randn(128, 4), torch.randn(128, 1))
loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, seed=1), drop_last=True)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
session = leto.wrap(model, opt, None, loader)
mark = os.path.join(os.environ["LETO_RUN_DIR"], "keeps-init-kill")
for x, y in session.batches(int(os.environ.get("STEPS", "6"))):
    opt.zero_grad()
    if dist.get_rank() == 1 and str(session.step + 1) == os.environ.get("KILL_STEP"):
        if not os.path.exists(mark):
            open(mark, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    F.mse_loss(model(x), y).backward()
    opt.step()
