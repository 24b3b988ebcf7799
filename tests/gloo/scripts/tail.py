"""A torchrun-style loop whose trainer may SIGKILL itself in its loop's tail: after
``optimizer.step()`` (KILL_AT=step) or after ``scheduler.step()`` (KILL_AT=sched), in
step KILL_STEP on rank KILL_RANK, once per job (a marker file in the run directory).
SLOW_STEP: rank 1 sleeps SLOW_S seconds before that step's forward, in every process.
USER_COLL=1: the script all-reduces its loss after optimizer.step() (its own collective).
PLANT_STEP: after that step's scheduler step, rank 1 alone scales its learning rate
(a planted divergence of the replicas that no checksum sees); PLANT_ALL=1: after every
step from there on (a divergence that is the program's: a repair cannot end it).
PLANT_GRAD_STEP: in that step, rank 1 alone scales its reduced gradients before
optimizer.step() (a new user's trial: its clip_grad_norm_ on one rank).
Issue 39's reproduction: such a death split the replicas (the replaced rank's
scheduler one step behind)."""

import os
import random
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import leto

torch.manual_seed(0)
random.seed(0)
np.random.seed(0)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
X = torch.randn(512, 8)
Y = X.sum(1, keepdim=True)
ds = TensorDataset(X, Y)
loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, world, rank, seed=0))
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
session = leto.wrap(model, opt, sched, loader)
at = os.environ.get("KILL_AT")
kill_step, kill_rank = int(os.environ.get("KILL_STEP", "3")), int(os.environ.get("KILL_RANK", "1"))
mark = os.path.join(os.environ["LETO_RUN_DIR"], "tail-kill-fired")


def maybe_die(where: str) -> None:
    if at == where and rank == kill_rank and session.step == kill_step:
        if not os.path.exists(mark):
            open(mark, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


for x, y in session.batches(int(os.environ.get("STEPS", "8"))):
    print(f"rank {rank} step {session.step + 1} lr {sched.get_last_lr()[0]:.4f}", flush=True)
    opt.zero_grad()
    if rank == 1 and str(session.step + 1) == os.environ.get("SLOW_STEP"):
        time.sleep(float(os.environ.get("SLOW_S", "4")))
    loss = F.mse_loss(model(x), y)
    loss.backward()
    if rank == 1 and str(session.step + 1) == os.environ.get("PLANT_GRAD_STEP"):
        for q in model.parameters():  # its reduced gradients, changed on this rank alone
            q.grad.mul_(1.5)
    opt.step()
    maybe_die("step")
    if os.environ.get("USER_COLL") == "1":
        metric = loss.detach().clone()
        dist.all_reduce(metric)  # the script's own collective
        if session.committed:
            print(f"rank {rank} step {session.step} mean loss {metric.item() / world:.5f}")
    sched.step()
    maybe_die("sched")
    plant = int(os.environ.get("PLANT_STEP", "-1"))
    again = os.environ.get("PLANT_ALL") == "1"  # and at every step after it
    if rank == 1 and plant >= 0 and (session.step == plant or (again and session.step > plant)):
        for g in opt.param_groups:
            g["lr"] *= 1.5
