"""A tiny training job on the fake backend, shared by the tests in this folder."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from leto.backends.fake import FakeBackend
from leto.backends.fake.engine import Engine, EngineOptions, Replica
from leto.core.cluster import ClusterConfig
from leto.core.erasure import Topology
from leto.retained.checkpoint import Checkpointer, MemoryCheckpointer
from leto.retained.process_state import ResumableBatchSampler

_DEFAULT = object()


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.05)


def tiny_job(
    world: int, seed: int = 0, per_rank: int = 2, make_opt: Any = adam
) -> tuple[Replica, Any, Any]:
    """26 parameters (Linear 3->4, Linear 4->2), dropout, Adam (or ``make_opt(params)``),
    StepLR, a shuffled sampler."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Dropout(0.2), nn.Linear(4, 2))
    opt = make_opt(list(model.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    g = torch.Generator().manual_seed(7)
    X = torch.randn(64, 3, generator=g)
    Y = torch.randint(0, 2, (64,), generator=g)
    sampler = ResumableBatchSampler(64, world * per_rank, seed=seed)

    def step_fn(m: nn.Module, idx: list[int]) -> torch.Tensor:
        i = torch.tensor(idx)
        return F.cross_entropy(m(X[i]), Y[i])

    return Replica(model, opt, sched), sampler, step_fn


def make_engine(
    topology: Topology | None = None,
    *,
    chunk_numel: int = 8,
    tier1: bool = True,
    tier2: bool = True,
    k: int = 3,
    tier2_parity: int = 1,
    checkpointer: Any = _DEFAULT,
    core_config: ClusterConfig | None = None,
    seed: int = 0,
    make_opt: Any = adam,
    checkpoint_interval: int = 0,
    checkpoint_mtbf: float = 0.0,
    resume: Any = None,
) -> Engine:
    topology = topology or Topology((2, 2))
    replica, sampler, step_fn = tiny_job(topology.world_size, seed, make_opt=make_opt)
    ckpt: Checkpointer | None = MemoryCheckpointer() if checkpointer is _DEFAULT else checkpointer
    return Engine(
        FakeBackend(topology),
        replica,
        step_fn=step_fn,
        sampler=sampler,
        options=EngineOptions(
            chunk_numel=chunk_numel,
            tier1=tier1,
            tier2=tier2,
            tier2_interval=k,
            tier2_parity=tier2_parity,
            align_bytes=4,
            check=True,
            checkpoint_interval=checkpoint_interval,
            checkpoint_mtbf=checkpoint_mtbf,
        ),
        checkpointer=ckpt,
        core_config=core_config,
        resume=resume,
    )


def same_state(a: Engine, b: Engine) -> list[str]:
    """Where two engines' retained tensors or process states differ (empty: bitwise equal)."""
    out = []
    for r, (x, y) in enumerate(zip(a.retained_state(), b.retained_state(), strict=True)):
        for name in x:
            if not torch.equal(x[name], y[name]):
                out.append(f"rank {r} {name}")
    for r, (x, y) in enumerate(zip(a.process_states(), b.process_states(), strict=True)):
        for name in x:
            if x[name] != y[name]:
                out.append(f"rank {r} process state {name}")
    return out
