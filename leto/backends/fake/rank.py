"""One simulated rank of the fake backend, and what the engine and its executors share.

A :class:`RankProc` is a simulated trainer process (its torch objects, its retained
state once bound, its per-step scratch); :class:`RecoveryRecord` is what one recovery
did, for the timeline.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from leto.backends.base import Work
from leto.retained import recovery as rx
from leto.retained.layout import RetainedLayout
from leto.retained.optim import RetainedOptimizer
from leto.retained.process_state import capture_buffers, restore_buffers, scheduler_state

StepFn = Callable[[nn.Module, Any], torch.Tensor]


class UnrecoverableError(RuntimeError):
    """The loss is beyond both tiers and no checkpoint is configured: training stops."""


class InjectedFault(Exception):
    """A planned fault struck inside an event's effects (carried out by the driver)."""

    def __init__(self, faults: list[Any], adopt: bool) -> None:
        super().__init__(", ".join(f.label for f in faults))
        self.faults = faults
        self.adopt = adopt  # does the event's transition count as done?


class _Interrupted(Exception):
    """A step was interrupted by a failure: recover."""


@dataclass
class Replica:
    """One trainer's torch objects: model, its optimizer, its scheduler."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None


@dataclass
class RankProc:
    """One rank's trainer process (simulated): its objects and per-step scratch."""

    rank: int
    gen: int
    replica: Replica
    ropt: RetainedOptimizer | None = None
    rng: dict[str, Any] | None = None
    sampler_state: dict[str, Any] | None = None
    work: Work | None = None
    pwork: Work | None = None
    present: list[bool] | None = None
    gdelta: torch.Tensor | None = None
    loss: float | None = None

    @property
    def layout(self) -> RetainedLayout:
        return rx.layout_of(self.ropt, f"rank {self.rank}")

    def ps_json(self, step: int) -> str:
        """The process state at ``step`` as the node agent keeps it (JSON: it survives
        the rank's memory loss, and goes into the tier-2 snapshot and checkpoints)."""
        assert self.ropt is not None
        return json.dumps(
            {
                "step": step,
                "optimizer": self.ropt.process_state(),
                "scheduler": scheduler_state(self.replica.scheduler),
                "sampler": self.sampler_state,
                "rng": self.rng,
                "buffers": capture_buffers(self.replica.model),
            }
        )

    def load_ps(self, text: str) -> None:
        """Restore what :meth:`ps_json` wrote."""
        ps = json.loads(text)
        assert self.ropt is not None
        self.ropt.load_process_state(ps["optimizer"])
        if self.replica.scheduler is not None:
            self.replica.scheduler.load_state_dict(ps["scheduler"])
        self.rng = ps["rng"]
        self.sampler_state = ps["sampler"]
        if "buffers" in ps:  # absent in the process state of an older leto
            restore_buffers(self.replica.model, ps["buffers"])


@dataclass
class EngineOptions:
    chunk_numel: int
    tier1: bool = True
    tier2: bool = True
    tier2_interval: int = 10
    tier2_parity: int = 1  # m: lost nodes the snapshot survives (m >= 2: leto.retained.rs)
    verify: bool = True
    align_bytes: int = 256
    master_weights: bool = False  # float32 master weights for bf16/fp16 parameters
    max_steps: int = 10**9
    check: bool = False  # after each recovery: real state vs the core's, parity bytes exact
    # periodic disk checkpoints every this many steps (0: only step 0's); with
    # checkpoint_mtbf > 0 and no interval, Young/Daly's for the measured save cost
    checkpoint_interval: int = 0
    checkpoint_mtbf: float = 0.0  # seconds


def copy_replica(rep: Replica, *, clear_state: bool = False) -> Replica:
    """A deep copy of model, optimizer and scheduler that keeps their links."""
    model, opt, sched = copy.deepcopy((rep.model, rep.optimizer, rep.scheduler))
    if clear_state:
        opt.state.clear()
    return Replica(model, opt, sched)


@dataclass
class RecoveryRecord:
    """What one recovery did (for the timeline and the counters)."""

    from_step: int
    started: float
    generation: int = 0
    restarts: int = 0
    failed: list[str] = field(default_factory=list)
    promoted: list[int] = field(default_factory=list)
    kind: str = ""
    target: int = -1
    loss: int = 0
    tier1_chunks: int = 0
    tier1_grads: int = 0
    forward_chunks: int = 0
    dropped: bool = False
    integrity: list[str] = field(default_factory=list)
    stale_refused: int = 0
    reason: str = ""
