"""A plain torchrun DDP script (no leto.wrap): it forms its process group, as torchrun
gives it one (MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE), and trains STEPS steps."""

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
dist.init_process_group("gloo")
model = DDP(nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(int(os.environ.get("STEPS", "3"))):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
print(f"rank {dist.get_rank()} done")
dist.destroy_process_group()
