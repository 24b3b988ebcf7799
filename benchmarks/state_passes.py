"""The passes leto's step makes over a rank's retained state, apart and fused: the
bytes each reads and writes over the bytes of state, and its CPU time, side by side.

In one process, on the benchmark workload's model (1.06M parameters, AdamW, the chunk
size ``leto bench`` uses: 2 chunks), steps alternate between two ranks that run what a
gloo trainer runs from its reduced gradients to the end of its step (tier 1 as
replicas: no parity bytes), the same gradients into both:

* apart (before part 4 of issue 44): PREPARE's checksum pass over every chunk, the
  gradients' seal, the first chunk's undo copy staged (during DECIDE's wait), then chunk
  by chunk the undo copy, the chunked AdamW, the seal of the new bytes;
* fused: the first chunk's undo copy made by PREPARE's pass, each block hashed just
  after it is copied (``UndoSlots.stage_checked``), the other chunks checked by the pass
  alone; the gradients' checksums computed as their mean is written into retained
  memory, each block hashed just after it is written (``GradBuffer.write_mean``), so
  their seal only records them; the rest as apart.

Both ranks end every step bitwise equal (checked). Caches are flushed before every step
(a forward and backward pass ran in between in a real job). The byte table counts, per
step, what each pass reads and writes of the state S (parameters and optimizer states:
what a chunk holds) and of the gradients G, and gives the protocol's total (every pass
but the optimizer's own) over S; "in cache" counts a block read again just after it was
written (the fused checks'), which costs no trip to memory. Rows in brackets are work
both ranks do that is not a pass of the protocol's (the gradients' division, which DDP
does too; header writes): no bytes of theirs are counted, their CPU time is, in the
protocol's total. CPU time is ``time.thread_time`` around each pass, median over the
steps. Run:
python benchmarks/state_passes.py [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from leto.bench.workload import Workload
from leto.retained import RetainedLayout
from leto.retained.optim import RetainedOptimizer, required_states, to_retained

WORLD = 4  # the gradients' sum over 4 ranks, divided into retained memory
Mark = Callable[..., None]  # mark(pass, read=..., written=..., cached=...) ends a pass


class Rank:
    """A retained layout and its chunked AdamW, stepped as the gloo transaction does."""

    def __init__(self, wl: Workload, fused: bool) -> None:
        model = wl.build_model()
        opt = wl.build_optimizer(model)
        self.lay = RetainedLayout.create(
            model, chunk_numel=wl.chunk_numel, states=required_states(opt)
        )
        self.ropt: RetainedOptimizer = to_retained(opt, self.lay)
        self.fused = fused
        self.name = "fused" if fused else "apart"
        lay = self.lay
        self.S = (1 + len(lay.states)) * lay.numel * lay.dtype.itemsize  # state bytes
        self.G = lay.numel * lay.dtype.itemsize  # gradient bytes
        self.C = self.S // lay.n_chunks  # one chunk's state bytes

    def step(self, V: int, summed: torch.Tensor, mark: Mark) -> None:
        lay, ropt, C = self.lay, self.ropt, self.C
        n = lay.n_chunks
        first = 0  # local rank 0's
        lay.clear_prepared()
        sums = None
        if self.fused:
            sums = lay.grads.write_mean(summed, WORLD, V)
            mark("(mean gradients in) + their checksums", cached=self.G)
        else:
            torch.div(summed, WORLD, out=lay.grad_buffer)
            mark("(mean gradients in)")
        if self.fused:
            ok = lay.undo.stage_checked(first)
            mark("check + undo copy, first chunk", read=C, written=C, cached=C)
            bad = lay.verify(intact=[first]) + ([] if ok else [first])
            mark("check, other chunks", read=C * (n - 1))
        else:
            bad = lay.verify()
            mark("check, every chunk", read=self.S)
        if bad:
            raise RuntimeError(f"chunks {bad} fail their checksums")
        lay.seal_grads(V, [True] * len(lay.params), sums)
        mark("seal of the gradients", grads=0 if self.fused else self.G)
        if not self.fused:
            lay.undo.stage(first)
            mark("undo copy, first chunk (DECIDE)", read=C, written=C)
        ropt.begin(V)
        for c in [(first + i) % n for i in range(n)]:
            ropt.save_undo(c, staged=c == first)
            if c != first:
                mark("undo copy, other chunks", read=C, written=C)
            ropt.apply_chunk(c, seal=False)
            mark("optimizer (AdamW)", read=C, written=C, grads=C // (1 + len(lay.states)))
            lay.seal_chunk(c, V)
            mark("seal of the new bytes", read=C)
            ropt.finish_chunk(c)
        ropt.end()
        mark("(headers, the rest)")


class Ledger:
    """Per pass: CPU time per step, and bytes per step (the same every step)."""

    def __init__(self) -> None:
        self.cpu: dict[str, list[float]] = defaultdict(list)
        self.bytes: dict[str, tuple[int, int, int, int]] = {}
        self._step: dict[str, float] = defaultdict(float)
        self._seen: dict[str, list[int]] = {}
        self.t0 = time.thread_time()

    def mark(
        self, name: str, *, read: int = 0, written: int = 0, cached: int = 0, grads: int = 0
    ) -> None:
        now = time.thread_time()
        self._step[name] += now - self.t0
        acc = self._seen.setdefault(name, [0, 0, 0, 0])
        for k, v in enumerate((read, written, cached, grads)):
            acc[k] += v
        self.t0 = time.thread_time()

    def end_step(self, keep: bool) -> None:
        if keep:
            for k, v in self._step.items():
                self.cpu[k].append(v)
            self.bytes = {k: (v[0], v[1], v[2], v[3]) for k, v in self._seen.items()}
        self._step = defaultdict(float)
        self._seen = {}


def table(rank: Rank, ledger: Ledger) -> tuple[float, float]:
    """Print one rank's passes; its protocol bytes (from memory, and touched) over S."""
    S, G = rank.S, rank.G
    print(f"{rank.name}: S = {S / 1e6:.2f} MB of state, G = {G / 1e6:.2f} MB of gradients")
    print(
        f"  {'pass':38} {'read/S':>7} {'write/S':>8} {'in cache':>9} {'grads/G':>8} {'ms CPU':>7}"
    )
    mem = touched = 0.0
    for name, (r, w, c, g) in ledger.bytes.items():
        ms = statistics.median(ledger.cpu[name]) * 1e3
        print(f"  {name:38} {r / S:7.2f} {w / S:8.2f} {c / S:9.2f} {g / G:8.2f} {ms:7.2f}")
        if name != "optimizer (AdamW)":
            mem += (r + w + g) / S
            touched += (r + w + c + g) / S
    proto = sum(
        statistics.median(v) for k, v in ledger.cpu.items()
        if k != "optimizer (AdamW)"
    )  # fmt: skip
    print(f"  protocol (every row but the optimizer's): {mem:.2f} x S from memory "
          f"({touched:.2f} x S touched), {proto * 1e3:.2f} ms CPU")  # fmt: skip
    return mem, proto


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="measured steps per configuration")
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be at least 1 and --warmup at least 0")
    torch.set_num_threads(1)
    wl = Workload(width=512, batch=512)
    ranks = [Rank(wl, fused=False), Rank(wl, fused=True)]
    ledgers = [Ledger() for _ in ranks]
    gen = torch.Generator().manual_seed(0)
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    for V in range(1, args.warmup + args.steps + 1):
        summed = torch.randn(ranks[0].lay.numel, generator=gen) * 1e-2
        for rank, ledger in zip(ranks, ledgers, strict=True):
            flush.add_(1)
            ledger.t0 = time.thread_time()
            rank.step(V, summed, ledger.mark)
            ledger.end_step(V > args.warmup)
        a, b = (r.lay for r in ranks)
        if not torch.equal(a.records.stored_checksums(), b.records.stored_checksums()):
            raise RuntimeError(f"step {V}: the fused rank's checksums differ from the other's")
    print(f"one rank's protocol passes per step, model {wl.label} params, AdamW, "
          f"{ranks[0].lay.n_chunks} chunks, {args.steps} steps each (median)")  # fmt: skip
    (m0, p0), (m1, p1) = (table(r, g) for r, g in zip(ranks, ledgers, strict=True))
    print(f"fused / apart: bytes from memory {m1 / m0:.2f}, protocol CPU {p1 / p0:.2f} "
          f"({(p1 - p0) * 1e3:+.2f} ms per step)")  # fmt: skip


if __name__ == "__main__":
    main()
