"""The training job every system runs: one model, one data stream, one size.

An MLP of ``layers`` GELU blocks of width ``width`` and a classifier, trained with
AdamW on a fixed synthetic classification set (inputs from a seeded generator,
labels from a random linear teacher, so the loss falls). Its parameter count is
``layers * (width**2 + width) + width * classes + classes``, so a size such as
``16M`` picks the width (a multiple of 64) whose count is nearest.

The data stream is a function of the step: global batch ``s`` is drawn from a
generator seeded with ``(seed, s)``, and rank ``r`` of ``W`` takes rows
``r::W``. A process that restarts at step ``s`` therefore sees exactly the
batches the failed one would have seen, with no sampler state to restore.

This module imports torch only inside the functions that build tensors, so the
command line can validate sizes and memory before any process starts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "BenchError",
    "StepBatches",
    "Workload",
    "available_memory",
    "worker_torch",
    "parse_count",
    "format_count",
]

LAYERS = 4
CLASSES = 16
SAMPLES = 2048
_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}


class BenchError(ValueError):
    """Bad benchmark input, or a run that cannot go on; the message is one line."""


def parse_count(text: str) -> int:
    """``"16M"`` -> 16000000 (suffixes K, M, G; case-insensitive; decimals allowed)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)\s*", str(text))
    if not m:
        raise BenchError(f"model size {text!r} is not a parameter count such as 4M or 250K")
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value < 1:
        raise BenchError(f"model size {text!r} must be a positive parameter count")
    return int(round(value))


def format_count(n: int) -> str:
    for suffix, scale in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def params_of(width: int, layers: int = LAYERS, classes: int = CLASSES) -> int:
    return layers * (width * width + width) + width * classes + classes


@dataclass(frozen=True)
class Workload:
    """Model and data of one benchmark run (JSON-able: it is sent to every worker)."""

    width: int
    layers: int = LAYERS
    classes: int = CLASSES
    batch: int = 32  # rows per rank per step
    world: int = 4
    seed: int = 0
    lr: float = 1e-3
    chunk_numel: int = 0  # leto's chunk size (elements); 0: see chunk_for
    device: str = "cpu"  # where every system's model and state live (cuda: the ranks share it)

    def __post_init__(self) -> None:
        if self.chunk_numel <= 0:
            object.__setattr__(self, "chunk_numel", self.chunk_for())

    def chunk_for(self) -> int:
        """leto's default chunk (2**20 elements), evened out over the state.

        A model just over a multiple of the chunk size would carry a nearly empty,
        zero-padded last chunk through every step and every recovery (1.06M params
        in 1M-element chunks: twice the state); a user sets ``chunk_size`` to avoid
        that, and so does the benchmark: the fewest chunks of at most 2**20
        elements, equal in size, with room for each tensor's 64-element alignment.
        """
        tensors = 2 * (self.layers + 1)
        numel = self.params + 64 * tensors
        n = -(-numel // (1 << 20))
        return -(-numel // n // 1024) * 1024

    @classmethod
    def for_params(cls, target: int, **kw: Any) -> Workload:
        """The workload whose model has the parameter count nearest ``target``."""
        layers = kw.get("layers", LAYERS)
        w = max(64, int(round(math.sqrt(target / layers) / 64.0)) * 64)
        best = min((w - 64, w, w + 64), key=lambda x: abs(params_of(max(64, x), layers) - target))
        return cls(width=max(64, best), **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Workload:
        return cls(**d)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def params(self) -> int:
        return params_of(self.width, self.layers, self.classes)

    @property
    def label(self) -> str:
        return format_count(self.params)

    @property
    def state_bytes(self) -> int:
        """Parameters and AdamW's two moments, fp32: what a checkpoint holds per replica."""
        return 12 * self.params

    # ------------------------------------------------------------------ memory

    def memory_estimate(self, system: str, *, tier2: bool = True) -> int:
        """Peak bytes of the whole machine while ``system`` runs (all its processes).

        Deliberately generous: every torch process costs ~350 MB before any
        tensor; a plain replica holds params, grads and two AdamW moments
        (16 B/param) plus DDP's gradient buckets (4 B/param). ``tier2``: leto's
        job keeps its tier-2 snapshot (``leto bench scaling --no-tier2``: not).
        """
        P, W = self.params, self.world
        proc = 350 * 2**20
        data = SAMPLES * self.width * 4
        if self.device != "cpu":  # the state on the device: host memory holds the processes
            return W * (2 * proc + data)
        replica = 20 * P + data
        if system == "torchft":  # + a peer's state staged to send (or received) in a heal
            return W * (proc + replica + 12 * P)
        if system == "nvre":  # + its reserve processes (at most 8), each a replica
            return (W + 8) * (proc + replica + 12 * P)
        if system in ("plain", "ckpt-disk"):
            return W * (proc + replica + 12 * P)  # DCP write buffers
        if system == "ckpt-disk-async":
            return W * (proc + replica + 24 * P)  # + the staged copy
        if system == "gemini":
            return W * (proc + replica + 12 * P + 48 * P)  # + 2 slots x (own + peer) in host memory
        if system in ("leto", "leto-serial"):
            # leto launch (GlooJob: 2 nodes when the ranks split evenly): per rank a
            # trainer and a warm shadow (forks of a zygote that imported torch); the
            # retained state in its keeper (16 B/param, + one chunk's undo copy); the
            # trainer's own gradients and all-reduce buffer (8 B/param); a shadow's model
            # before it becomes a skeleton (4 B/param); with tier 2, the node's two
            # snapshot slots, each with the rank's state (12 B/param; tier 1 as replicas,
            # the default of 2 ranks per node, stores no parity share: each is computed
            # from the rank's own bytes when a restore needs it)
            undo = 3 * 4 * self.chunk_numel
            own = 2 * proc + data + 28 * P + undo
            snap = 2 * 12 * P if tier2 else 0
            return W * (own + snap)
        raise BenchError(f"unknown system {system!r}")

    # ------------------------------------------------------------- torch parts

    def build_model(self, device: str | None = None) -> nn.Module:
        import torch
        from torch import nn

        device = self.device if device is None else device
        torch.manual_seed(self.seed)
        blocks: list[nn.Module] = []
        for _ in range(self.layers):
            blocks += [nn.Linear(self.width, self.width, device=device), nn.GELU()]
        blocks.append(nn.Linear(self.width, self.classes, device=device))
        return nn.Sequential(*blocks)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        import torch

        return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.01)

    def dataset(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        g = torch.Generator().manual_seed(self.seed + 1)
        x = torch.randn(SAMPLES, self.width, generator=g)
        teacher = torch.randn(self.width, self.classes, generator=g)
        return x.to(self.device), (x @ teacher).argmax(dim=1).to(self.device)

    def global_batch(self, step: int) -> torch.Tensor:
        """Rows of global batch ``step`` (steps count from 1)."""
        import torch

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, SAMPLES, (self.world * self.batch,), generator=g)

    def batch_indices(self, step: int, rank: int) -> torch.Tensor:
        """Rows of rank ``rank``'s share of global batch ``step``."""
        return self.global_batch(step)[rank :: self.world]


def device_error(device: object) -> str | None:
    """Why ``device`` cannot hold a benchmark's state here (None: it can)."""
    if device == "cpu":
        return None
    kind, _, index = device.partition(":") if isinstance(device, str) else ("", "", "")
    if kind != "cuda" or (index and not index.isdigit()):
        return "choose cpu, cuda or cuda:N"
    import torch

    if not torch.cuda.is_available():
        return "this machine has no CUDA (torch.cuda.is_available() is False)"
    if index and int(index) >= torch.cuda.device_count():
        return f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def worker_torch() -> None:
    """torch as every system's training process has it, set before the model is built
    (and before leto starts a thread, which inherits the floating-point mode): one
    intra-op thread (the ranks share the machine's cores), and subnormal numbers flushed
    to zero. From about step 9 this MLP's backward meets subnormal values, whose
    arithmetic on this CPU is many times slower: at 89.8M its backward went from 1.3 s
    to 4 s of CPU by step 11 on every rank, so a system's lost work depended on when in
    the run its death came, not on the system. A GPU computes them at full speed."""
    import torch

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)


class StepBatches:
    """:meth:`Workload.global_batch` as the resumable sampler ``leto.wrap`` takes
    (``step`` is the step whose batch was drawn last)."""

    def __init__(self, wl: Workload) -> None:
        self.wl = wl
        self.step = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            self.step += 1
            yield self.wl.global_batch(self.step)  # a tensor: leto shards it as DDP's workers do

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def available_memory() -> int:
    """``MemAvailable`` of this machine in bytes (0 when unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0
