"""leto's engine on the fake backend, and plain data parallelism, in this process.

The fake backend runs every rank of a job in one process, one after the other;
:class:`PlainDP` runs the same ranks the same way without leto (forward and
backward per rank, gradients summed in rank order and averaged, ``torch.optim``
AdamW per rank), so the two differ by exactly what leto adds to a step: the
retained layout, the chunk transactions (undo copies, checksums), tier-1 parity
of chunks and gradients, the tier-2 snapshots, process state as JSON and the
protocol core's bookkeeping.

:class:`TimedEngine` is the engine with clocks on its events, so a recovery's
state-side work (integrity scan, reconcile: roll forward/back, parity repair,
re-encoding the redundancy) is told apart from the events whose real cost lives
in processes (detect, fence, promote, rebuild, resume: the fake backend does
them in memory, so the real-process harness measures them instead).
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from leto.adapters.engine import Engine

    from .workload import Workload

__all__ = [
    "PROCESS_EVENTS",
    "PlainDP",
    "StepBatches",
    "build_engine",
    "engine_recovery",
]

# Events whose work a real backend does with processes and sockets (measured in
# real processes by the harness); everything else in a recovery is state-side.
PROCESS_EVENTS = ("Detect", "Fence", "Promote", "EndPromote", "Rebuild", "Resume", "ShadowWarm")


class StepBatches:
    """Global batch ``s`` of :meth:`Workload.batch_indices`, as a resumable sampler."""

    def __init__(self, wl: Workload) -> None:
        self.wl = wl
        self.step = 0

    def global_batch(self, s: int) -> list[int]:
        import torch

        g = torch.Generator().manual_seed(self.wl.seed * 1_000_003 + s)
        from .workload import SAMPLES

        out: list[int] = torch.randint(
            0, SAMPLES, (self.wl.world * self.wl.batch,), generator=g
        ).tolist()
        return out

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            self.step += 1
            yield self.global_batch(self.step)

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def _step_fn(wl: Workload) -> Any:
    import torch
    import torch.nn.functional as F

    x, y = wl.dataset()

    def step_fn(model: torch.nn.Module, idx: list[int]) -> torch.Tensor:
        i = torch.as_tensor(idx)
        return F.cross_entropy(model(x[i]), y[i])

    return step_fn


def _timed_engine_class() -> type[Engine]:
    from leto.adapters.engine import Engine

    class TimedEngine(Engine):
        """The engine with a clock on every event: ``step_event_s`` accumulates the
        events of failure-free steps, ``event_s`` those of the last :meth:`recover`."""

        in_recovery = False
        recover_s = 0.0

        def __init__(self, *a: Any, **kw: Any) -> None:
            self.step_event_s: dict[str, float] = defaultdict(float)
            self.event_s: dict[str, float] = defaultdict(float)
            super().__init__(*a, **kw)

        def feed(self, e: Any) -> None:
            acc = self.event_s if self.in_recovery else self.step_event_s
            t = time.perf_counter()
            try:
                super().feed(e)
            finally:
                acc[type(e).__name__] += time.perf_counter() - t

        def recover(self) -> None:
            self.event_s = defaultdict(float)
            self.in_recovery = True
            t = time.perf_counter()
            try:
                super().recover()
            finally:
                self.recover_s = time.perf_counter() - t
                self.in_recovery = False

    return TimedEngine


def build_engine(
    wl: Workload,
    *,
    tier1: bool = True,
    tier2: bool = True,
    tier2_interval: int = 10,
    nodes: int = 2,
) -> Any:
    """leto's engine over the fake backend for ``wl`` (``nodes`` x world/nodes ranks)."""
    import torch

    from leto.adapters.engine import EngineOptions, Replica
    from leto.backends.fake import FakeBackend
    from leto.core.erasure import Topology

    torch.set_num_threads(1)
    if wl.world % nodes:
        nodes = 1
    model = wl.build_model()
    opt = wl.build_optimizer(model)
    backend = FakeBackend(Topology.uniform(nodes, wl.world // nodes))
    cls = _timed_engine_class()
    return cls(
        backend,
        Replica(model, opt, None),
        step_fn=_step_fn(wl),
        sampler=StepBatches(wl),
        options=EngineOptions(
            chunk_numel=wl.chunk_numel,
            tier1=tier1,
            tier2=tier2,
            tier2_interval=tier2_interval,
        ),
    )


def engine_recovery(engine: Any, phase: str = "forward", rank: int = 1) -> dict[str, Any]:
    """Fail ``rank`` at ``phase`` of the next step; what the recovery cost, by kind of work."""
    s = engine.state.committed + 1
    engine.injector.fail_at(rank=rank, step=s, phase=phase)
    lost = engine.run_step()
    if lost is not None:
        raise RuntimeError(f"the fault at step {s} ({phase}) did not fire")
    proc = sum(engine.event_s.get(n, 0.0) for n in PROCESS_EVENTS)
    rec = engine.recoveries[-1]
    return {
        "model_state_s": engine.recover_s - proc,
        "recover_s": engine.recover_s,
        "in_memory_process_events_s": proc,
        "kind": rec["kind"],
        "chunks_rolled_forward": rec["chunks_rolled_forward"],
        "events_s": dict(engine.event_s),
    }


class PlainDP:
    """``world`` ranks of plain data parallelism, one after the other, in this process."""

    def __init__(self, wl: Workload) -> None:
        import torch

        torch.set_num_threads(1)
        self.wl = wl
        base = wl.build_model()
        self.models = [copy.deepcopy(base) for _ in range(wl.world)]
        self.opts = [wl.build_optimizer(m) for m in self.models]
        self.batches = StepBatches(wl)
        self.step_fn = _step_fn(wl)
        self.step = 0

    def run_step(self) -> float:
        import torch

        self.step += 1
        batch = self.batches.global_batch(self.step)
        W = self.wl.world
        flats: list[torch.Tensor] = []
        loss = 0.0
        for r, m in enumerate(self.models):
            for p in m.parameters():
                p.grad = None
            out = self.step_fn(m, batch[r::W])
            out.backward()
            loss += float(out.detach())
            flats.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))  # type: ignore[union-attr]
        total = flats[0]
        for f in flats[1:]:
            total = total + f
        total.div_(W)
        for m, opt in zip(self.models, self.opts, strict=True):
            off = 0
            for p in m.parameters():
                n = p.numel()
                p.grad.copy_(total[off : off + n].view_as(p))  # type: ignore[union-attr]
                off += n
            opt.step()
        return loss / W
