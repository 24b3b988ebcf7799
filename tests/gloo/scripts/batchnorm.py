"""The user's own loop over a model with BatchNorm (its running statistics change in
every forward): leto keeps them with each step's process state, so a rank killed
anywhere resumes with the committed step's statistics."""

import argparse
import os
import random

import numpy
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import leto

p = argparse.ArgumentParser()
p.add_argument("--config", default=os.environ.get("LETO_CONFIG"))
p.add_argument("--steps", type=int, default=8)
args = p.parse_args()

torch.manual_seed(0)  # every RNG seeded (docs/loop.md)
random.seed(0)
numpy.random.seed(0)
X = torch.randn(512, 8)
Y = (X @ torch.randn(8, 3)).argmax(1)
data = TensorDataset(X, Y)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, world, rank, seed=0))
model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
session = leto.wrap(model, opt, None, loader, config=args.config)

for x, y in session.batches(args.steps):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
