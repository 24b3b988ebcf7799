"""The user's own loop, then code after it (an evaluation writing a file per rank).
AFTER: what rank 1 does there, once: "raise" (an exception), "kill" (SIGKILLed), or
nothing. RUN_DIR/after-rank<r> holds what each rank's code after the loop wrote."""

import os
import signal

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import leto

torch.manual_seed(0)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
X = torch.randn(128, 8)
ds = TensorDataset(X, X.sum(1, keepdim=True))
loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, world, rank, seed=0))
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
session = leto.wrap(model, opt, None, loader, config={"backend": "gloo", "topology": "1x2"})
for x, y in session.batches(3):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
after = os.environ.get("AFTER", "")
if rank == 1 and after == "raise":
    raise RuntimeError("evaluation failed")
if rank == 1 and after == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
with open(os.path.join(os.environ["LETO_RUN_DIR"], f"after-rank{rank}"), "w") as f:
    f.write(f"{model.weight.detach().sum().item():.6f}")
