"""A tiny training job on the fake backend, shared by the tests in this folder."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from leto.backends.fake import FakeBackend
from leto.backends.fake.engine import Engine, EngineOptions, Replica
from leto.core.cluster import ClusterConfig
from leto.core.erasure import Topology
from leto.core.faultpoints import APPLY_WHERE, DECIDE_WHERE, PHASES
from leto.retained.checkpoint import Checkpointer, MemoryCheckpointer
from leto.retained.process_state import ResumableBatchSampler

_DEFAULT = object()


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.05)


def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Dropout(0.2), nn.Linear(4, 2))


def tiny_job(
    world: int, seed: int = 0, per_rank: int = 2, make_opt: Any = adam, make_model: Any = tiny_model
) -> tuple[Replica, Any, Any]:
    """26 parameters (Linear 3->4, Linear 4->2; or ``make_model()``: float32 in and
    out), dropout, Adam (or ``make_opt(params)``), StepLR, a shuffled sampler."""
    torch.manual_seed(seed)
    model = make_model()
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
    make_model: Any = tiny_model,
    master_weights: bool = False,
    checkpoint_interval: int = 0,
    checkpoint_mtbf: float = 0.0,
    resume: Any = None,
) -> Engine:
    topology = topology or Topology((2, 2))
    replica, sampler, step_fn = tiny_job(
        topology.world_size, seed, make_opt=make_opt, make_model=make_model
    )
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
            master_weights=master_weights,
            check=True,
            checkpoint_interval=checkpoint_interval,
            checkpoint_mtbf=checkpoint_mtbf,
        ),
        checkpointer=ckpt,
        core_config=core_config,
        resume=resume,
    )


def fault_points(n_chunks: int) -> list[dict[str, Any]]:
    """Every phase of a step (each ``where``; the first and the last chunk)."""
    wheres = {"decide": DECIDE_WHERE, "apply": APPLY_WHERE}
    out: list[dict[str, Any]] = []
    for phase in PHASES:
        if phase == "recovery":
            continue  # not a phase of a step
        chunks = [0, n_chunks - 1] if phase in ("apply", "parity") else [None]
        for where in wheres.get(phase, (None,)):
            for chunk in chunks:
                out.append({"phase": phase, "where": where, "chunk": chunk})
    return out


def every_fault_point(
    make: Callable[[], Engine], ref: Engine, steps: int, name: str
) -> Iterator[tuple[Engine, str]]:
    """One run of ``make()`` per fault point (step 2, ranks in turn), each checked: the
    fault fired and was recovered, the state refines the core's, and it is bitwise the
    failure-free run ``ref`` (trained to ``steps``). Yields each run and its label."""
    for k, point in enumerate(fault_points(ref.n_chunks)):
        eng = make()
        inj = eng.injector
        inj.fail_at(rank=k % eng.W, step=2, **point)
        eng.train(steps)
        label = f"{name} at {point}"
        assert inj.unfired() == [] and inj.unrecovered() == [], label
        assert eng.mismatches() == [] and eng.parity_exact() == [], label
        assert same_state(eng, ref) == [], f"{label}: not bitwise the failure-free run"
        yield eng, label


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
