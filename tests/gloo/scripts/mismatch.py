"""Trainers started later (incarnation > 4) build a wider model than the retained one."""

import os

import torch
import torch.nn.functional as F
from torch import nn

import leto
from leto.retained.process_state import ResumableBatchSampler

torch.manual_seed(0)
cfg = leto.Config.from_dict({"backend": "gloo", "topology": "1x2", "chunk_size": 64})
width = 16 if int(os.environ["LETO_INCARNATION"]) <= 4 else 24
X, Y = torch.randn(64, 8), torch.randn(64, 2)
model = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 2))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
session = leto.wrap(model, opt, None, ResumableBatchSampler(64, 8, seed=0), config=cfg)
session.train(lambda m, idx: F.mse_loss(m(X[idx]), Y[idx]), 6)
