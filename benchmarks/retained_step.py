"""One rank's retained-state work per training step, by checksum algorithm, against the
optimizer step plain DDP pays anyway.

In one process, on the benchmark workload's model (1.06M parameters, AdamW, the chunk
size `leto bench` uses), steps alternate between three configurations:

* plain: ``torch.optim.AdamW.step`` on the model's own tensors (what DDP runs);
* leto/fletcher and leto/xxh3: what a leto trainer does from the reduced gradients to
  the end of its step, with a tier-1 parity group of 2 on memfd segments: the copy
  into the flat buffer (DDP copies into its buckets too), the gradient parity delta
  and the copy into retained memory, PREPARE (verify every chunk, seal the gradients,
  add the delta), then chunk by chunk the undo copy, the chunked AdamW, the seal and
  the parity update;
* leto/replica: the same with xxh3 and tier 1 as replicas (``tier1_code =
  "replica"``): no gradient delta, no parity bytes, only each chunk's record.
* leto/generic: leto/replica with the optimizer a user's ``AdamW`` subclass, which
  takes the generic path (``WholeStepOptimizer``: a before copy at ``begin``, the
  optimizer's own ``step()`` once on a scratch copy, chunk by chunk copied out) instead
  of the chunked AdamW: the cost of "any optimizer" against the fast path.

Caches are flushed before every step (a forward and backward pass ran in between in
a real job). Prints per-phase medians, each leto configuration's extra time over
plain, and the ratio of the two algorithms' extras. Run:
python benchmarks/retained_step.py [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from leto.backends.gloo import segments
from leto.backends.gloo.parity_block import ParityBlock, block_bytes
from leto.bench.workload import Workload
from leto.retained import RetainedLayout
from leto.retained.optim import RetainedOptimizer, required_states, to_retained
from leto.retained.parity import as_bytes

MEMBERS = 2


class UserAdamW(torch.optim.AdamW):
    """A user's subclass: leto cannot assume its step is AdamW's, so it replays it."""


class LetoRank:
    """One member of a tier-1 group: a retained layout, its optimizer, the parity blocks."""

    def __init__(
        self, wl: Workload, algorithm: str, *, replica: bool = False, generic: bool = False
    ) -> None:
        model = wl.build_model()
        opt = wl.build_optimizer(model)
        if generic:  # the same AdamW, as a class leto has no chunked version of
            g = opt.param_groups[0]
            keys = ("lr", "betas", "eps", "weight_decay")
            opt = UserAdamW(model.parameters(), **{k: g[k] for k in keys})
        lay = RetainedLayout.create(
            model,
            chunk_numel=wl.chunk_numel,
            states=required_states(opt),
            checksum_algorithm=algorithm,
        )
        self.name = (
            "leto/generic" if generic else "leto/replica" if replica else f"leto/{algorithm}"
        )
        self.replica = replica
        self.lay = lay
        self.ropt: RetainedOptimizer = to_retained(opt, lay)
        item = 0 if replica else lay.dtype.itemsize  # replicas: the records only
        cbytes = (1 + len(lay.states)) * lay.chunk_numel * item
        self.parity = [self._block(cbytes) for _ in range(lay.n_chunks)]
        self.gparity = self._block(lay.numel * item)
        self.gdelta = torch.empty(lay.numel * lay.dtype.itemsize, dtype=torch.uint8)
        self.flat = torch.empty(lay.numel, dtype=lay.dtype)

    @staticmethod
    def _block(nbytes: int) -> ParityBlock:
        block = ParityBlock(segments.create("bench", block_bytes(MEMBERS, nbytes)), MEMBERS, nbytes)
        block.write_full(None, [0] * MEMBERS, [0] * MEMBERS)
        return block

    def step(self, V: int, grads: list[torch.Tensor], lap: Callable[[str], None]) -> None:
        lay, ropt = self.lay, self.ropt
        for s, g in zip(lay.slots, grads, strict=True):  # the reduced gradients
            self.flat[s.offset : s.offset + s.numel].copy_(g.reshape(-1))
        if not self.replica:
            torch.sub(as_bytes(self.flat), as_bytes(lay.grad_buffer), out=self.gdelta)
        lay.clear_prepared()
        lay.grad_buffer.copy_(self.flat)
        lap("gradients")
        if lay.verify():
            raise RuntimeError("a chunk fails its checksum")
        lap("verify")
        lay.seal_grads(V, [True] * len(lay.params))
        lap("seal grads")
        if self.replica:
            self.gparity.record(0, V)
        else:
            self.gparity.add_delta(0, self.gdelta, V)
        lap("grad parity")
        ropt.begin(V)
        for c in range(lay.n_chunks):
            ropt.save_undo(c)
            lap("undo")
            ropt.apply_chunk(c, seal=False)
            lap("adamw")
            lay.seal_chunk(c, V)
            lap("seal")
            if self.replica:
                self.parity[c].record(0, V, lay.stored_checksum(c))
            else:
                self.parity[c].update(
                    0, lay.undo_data(c), lay.chunk_data(c), V, lay.stored_checksum(c)
                )
            ropt.finish_chunk(c)
            lap("parity")
        ropt.end()
        lap("adamw")


class Plain:
    name = "plain"

    def __init__(self, wl: Workload) -> None:
        self.model = wl.build_model()
        self.opt = wl.build_optimizer(self.model)

    def step(self, V: int, grads: list[torch.Tensor], lap: Callable[[str], None]) -> None:
        for p, g in zip(self.model.parameters(), grads, strict=True):
            p.grad = g
        self.opt.step()
        lap("adamw")


class Laps:
    """Wall time per phase of one step: ``lap(phase)`` ends the phase under way."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.start = self.t0 = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.spent[phase] += now - self.t0
        self.t0 = now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="measured steps per configuration")
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    wl = Workload(width=512, batch=16384)
    systems = [
        Plain(wl),
        LetoRank(wl, "fletcher"),
        LetoRank(wl, "xxh3"),
        LetoRank(wl, "xxh3", replica=True),
        LetoRank(wl, "xxh3", replica=True, generic=True),
    ]
    gen = torch.Generator().manual_seed(0)
    shapes = [p.shape for p in systems[0].model.parameters()]
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    phases: dict[str, dict[str, list[float]]] = {s.name: defaultdict(list) for s in systems}
    totals: dict[str, list[float]] = {s.name: [] for s in systems}
    for V in range(1, args.warmup + args.steps + 1):
        grads = [torch.randn(sh, generator=gen) * 1e-2 for sh in shapes]
        for s in systems:
            flush.add_(1)
            watch = Laps()
            s.step(V, grads, watch.lap)
            if V > args.warmup:
                totals[s.name].append(time.perf_counter() - watch.start)
                for k, v in watch.spent.items():
                    phases[s.name][k].append(v)
    med = {n: statistics.median(v) * 1e3 for n, v in totals.items()}
    print(f"one rank's step work, model {wl.label} params, {args.steps} steps each (median ms)")
    for n, per in phases.items():
        detail = "  ".join(f"{k} {statistics.median(v) * 1e3:.2f}" for k, v in per.items())
        print(f"{n:14} {med[n]:7.2f}   {detail}")
    extra = {n: med[n] - med["plain"] for n in med if n != "plain"}
    for n, e in extra.items():
        print(f"{n:14} extra over plain: {e:.2f} ms")
    print(f"xxh3 / fletcher (extra over plain): {extra['leto/xxh3'] / extra['leto/fletcher']:.2f}")
    print(f"replica / xxh3 (extra over plain): {extra['leto/replica'] / extra['leto/xxh3']:.2f}")
    print(
        "generic / chunked path (extra over plain, both with replicas): "
        f"{extra['leto/generic'] / extra['leto/replica']:.2f}; generic step / plain step: "
        f"{med['leto/generic'] / med['plain']:.2f}, chunked step / plain step: "
        f"{med['leto/replica'] / med['plain']:.2f}"
    )


if __name__ == "__main__":
    main()
