"""A step function over micro-batches (``micro_batches``), for the parallel replay's tests.

Environment: TOPO ("1x3"), STEPS (8), MB (micro-batches, 4), REPLAY ("1": parallel_replay
on, "0": off), DROPOUT ("1": the model draws random numbers), SLOW ("ranks:step:seconds":
those ranks' last micro-batch of that step waits that long in its forward first, so a
peer's death finds them inside their compute). Each rank writes the micro-batches it ran
per step (``RUN_DIR/calls-rank<r>-<pid>``: JSON ``{step: count}``).
"""

import json
import os
import random
import time

import numpy
import torch
import torch.nn.functional as F
from torch import nn

import leto
from leto.retained.process_state import ResumableBatchSampler

torch.manual_seed(0)
random.seed(0)
numpy.random.seed(0)
MB = int(os.environ.get("MB", "4"))
cfg = leto.Config.from_dict(
    {
        "backend": "gloo",
        "topology": os.environ.get("TOPO", "1x3"),
        "chunk_size": 64,
        "tier2": False,
        "micro_batches": MB,
        "parallel_replay": os.environ.get("REPLAY", "1") == "1",
    }
)
X, Y = torch.randn(96, 8), torch.randn(96, 2)
layers: list[nn.Module] = [nn.Linear(8, 16), nn.Tanh()]
if os.environ.get("DROPOUT") == "1":
    layers.append(nn.Dropout(0.1))
model = nn.Sequential(*layers, nn.Linear(16, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sampler = ResumableBatchSampler(96, 24, seed=0)
calls: dict[int, int] = {}
slow = os.environ.get("SLOW", "")


def step_fn(m, idx):
    step = session.step + 1
    calls[step] = calls.get(step, 0) + 1
    for spec in filter(None, slow.split(";")):  # ranks:step:seconds[:micro-batch, 1..MB]
        ranks, at, seconds, *nth = spec.split(":")
        if (
            os.environ["RANK"] in ranks.split(",")
            and step == int(at)
            and calls[step] == int(nth[0] if nth else MB)
        ):
            time.sleep(float(seconds))
    return F.mse_loss(m(X[idx]), Y[idx]) / MB


session = leto.wrap(model, opt, None, sampler, config=cfg)
session.train(step_fn, int(os.environ.get("STEPS", "8")))
out = os.path.join(os.environ["LETO_RUN_DIR"], f"calls-rank{os.environ['RANK']}-{os.getpid()}")
with open(out, "w") as f:
    json.dump(calls, f)
print(f"done at step {session.step}")
