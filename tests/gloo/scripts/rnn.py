"""A model with RNN modules (LSTM, GRU), whose parameters have weak references
(``RNNBase._flat_weight_refs``): its shadows must still be built warm. Every RNG seeded.

Environment: TOPO ("NxM", default 1x2), STEPS (6), SHADOW (trouble for the shadows:
"skeleton": their skeleton cannot be built, as RNN parameters could not be released
before: every ``torch.utils.swap_tensors`` raises, so every shadow dies in
``leto.wrap`` and only a process that keeps its parameters (a cold start) can be
promoted; "crash": every process started as a shadow raises before ``leto.wrap``, cold
starts too; "hang": every one of them sleeps there, forever).
"""

import os
import random
import time

import numpy
import torch
import torch.nn.functional as F
from torch import nn

import leto
from leto.retained.process_state import ResumableBatchSampler

SHADOW = os.environ.get("SHADOW", "")
if SHADOW == "skeleton":

    def _refuse(t1, t2):
        raise RuntimeError("Cannot swap t1 because it has weakref associated with it")

    torch.utils.swap_tensors = _refuse
if os.environ.get("LETO_ROLE") == "shadow":
    if SHADOW == "crash":
        raise RuntimeError("this script cannot run as a shadow")
    if SHADOW == "hang":
        time.sleep(3600)

torch.manual_seed(0)
random.seed(0)
numpy.random.seed(0)
cfg = leto.Config.from_dict(
    {
        "backend": "gloo",
        "topology": os.environ.get("TOPO", "1x2"),
        "chunk_size": 256,
        "tier2_interval": 2,
        "tier1_code": "parity",
    }
)
X, Y = torch.randn(32, 5, 4), torch.randn(32, 2)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x)
        y, _ = self.gru(y)
        return self.head(y[:, -1])


model = Net()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
sampler = ResumableBatchSampler(32, 8, seed=0)


def step_fn(m, idx):
    return F.mse_loss(m(X[idx]), Y[idx])


session = leto.wrap(model, opt, None, sampler, config=cfg)
session.train(step_fn, int(os.environ.get("STEPS", "6")))
print(f"done at step {session.step}")
