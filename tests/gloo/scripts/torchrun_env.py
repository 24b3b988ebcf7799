"""Prints the torchrun variables a trainer sees, then calls leto.wrap with the config
named by its argument (a TOML path; none: a dict naming no topology, no backend)."""

import os
import sys

import torch

import leto

names = ("RANK", "TORCHELASTIC_RUN_ID", "ROLE_NAME", "TORCHELASTIC_MAX_RESTARTS")
print("torchrun", *(os.environ[n] for n in names), flush=True)
model = torch.nn.Linear(4, 2)
config = sys.argv[1] if len(sys.argv) > 1 else {"chunk_size": 64}
session = leto.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)
cfg = session.cfg  # type: ignore[union-attr]  # the gloo session
print("wrapped", cfg.backend, cfg.nodes, cfg.ranks_per_node)
