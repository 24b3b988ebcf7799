"""``leto demo``: train a small GPT, fail it at every phase of a step, recover in place.

By default ``leto demo`` runs on the gloo backend: real processes, 4 ranks as 2
nodes x 2 under ``leto launch``, SIGKILLed at every phase
(:mod:`leto.adapters.gloo_demo`). ``--backend fake`` runs the in-process demo
below, which covers more failure kinds (memory corruption, losses beyond both tiers).

A character-level GPT (two blocks, ~30k parameters) trains on the public-domain
verse shipped in ``leto/data/sonnets.txt`` with AdamW, a warm-up LR schedule,
dropout and a shuffled sampler, on simulated ranks of the fake backend (default 2
nodes x 2 ranks). The fault plan strikes at least once at every point of a step:
forward, backward, the gradient all-reduce, prepare, decide (before and after the
COMMIT), every chunk of apply (after the undo copy, mid-write, after the write),
the tier-1 parity update and finish; it also hangs a rank (fenced; its stale write
refused), loses a rank's retained memory (rebuilt from tier-1 parity, gradients
too), flips a bit in retained memory (caught by the chunk's checksum), loses a
node (the tier-2 snapshot), crashes a rank during a recovery (which restarts), and
loses both nodes (beyond both tiers: the disk checkpoint, or, with
``--no-checkpoint``, a clear error). Then it trains the same seed without faults
and compares every rank's parameters and optimizer state bitwise.

``--json`` prints one JSON object (``bitwise_equal``, ``failures_injected``,
``recoveries``, ``rolled_forward``, ``rolled_back``, ``chunks_repaired_from_parity``,
``phases_covered``, ...) instead of the timeline.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import tempfile
import time
from importlib import resources
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from leto.adapters.config import ConfigError, check_count
from leto.argcheck import (
    BadInput,
    Bound,
    check_args,
    dir_to_create,
    positive_int,
    refuse,
    show,
)

__all__ = ["TinyGPT", "configure", "demo", "fault_plan", "run"]

DATA = "sonnets.txt"


# ------------------------------------------------------------------------- model


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int, block: int, dropout: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.heads = heads
        self.drop = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(block, block, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, block, block), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.heads
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, h, C // h).transpose(1, 2)
        k = k.view(B, T, h, C // h).transpose(1, 2)
        v = v.view(B, T, h, C // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // h))
        mask: torch.Tensor = self.mask  # type: ignore[assignment]
        att = att.masked_fill(~mask[:, :, :T, :T], float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        out: torch.Tensor = self.drop(self.proj(y))
        return out


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, block: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = _Attention(d, heads, block, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))
        return out


class TinyGPT(nn.Module):
    """A character-level GPT: token + position embeddings, pre-norm blocks, a head."""

    def __init__(
        self,
        vocab: int,
        *,
        d: int = 32,
        heads: int = 4,
        layers: int = 2,
        block: int = 32,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.block = block
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(_Block(d, heads, block, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T))
        for b in self.blocks:
            x = b(x)
        out: torch.Tensor = self.head(self.ln(x))
        return out


def load_text() -> str:
    return (resources.files("leto") / "data" / DATA).read_text(encoding="utf-8")


def build(seed: int, world: int, *, per_rank: int = 4, block: int = 32) -> dict[str, Any]:
    """Model, optimizer, scheduler, sampler and step function of the demo (seeded)."""
    from leto.retained.process_state import ResumableBatchSampler

    torch.manual_seed(seed)
    random.seed(seed)
    text = load_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(ch) for ch in text], dtype=torch.long)
    model = TinyGPT(len(chars), block=block)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = 10

    def lr_at(step: int) -> float:
        return min(1.0, (step + 1) / warmup)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    sampler = ResumableBatchSampler(len(data) - block - 1, world * per_rank, seed=seed)
    offsets = torch.arange(block)

    def step_fn(m: nn.Module, idx: list[int]) -> torch.Tensor:
        starts = torch.tensor(idx).unsqueeze(1)
        x = data[starts + offsets]
        y = data[starts + offsets + 1]
        logits = m(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))

    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "sampler": sampler,
        "step_fn": step_fn,
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": len(chars),
        "chars": len(text),
    }


# --------------------------------------------------------------------- the faults


def fault_plan(
    inj: Any, *, steps: int, n_chunks: int, nodes: int, ranks_per_node: int, checkpoint: bool
) -> None:
    """At least one failure at every point of a step, and the memory/node losses."""
    from leto.backends.fake import APPLY_WHERE

    W = nodes * ranks_per_node
    # One group of faults per step; each group shares its step.
    groups: list[list[tuple[str, dict[str, Any]]]] = []
    # Beyond both tiers (both nodes lost, the second during the recovery from the
    # first): with a checkpoint, first (the fallback restarts from step 0); without,
    # last (the run stops there with an error).
    beyond: list[list[tuple[str, dict[str, Any]]]] = []
    if nodes >= 2:
        beyond.append(
            [
                ("lose_node", {"node": 0, "phase": "finish"}),
                ("lose_node", {"node": 1, "phase": "recovery", "where": "Promote", "rank": 0}),
            ]
        )
    if checkpoint:
        groups += beyond
    groups += [
        [("fail_at", {"phase": "forward"})],
        [("fail_at", {"phase": "backward"})],
        [("fail_at", {"phase": "allreduce"})],
        [("fail_at", {"phase": "prepare"})],
        [("fail_at", {"phase": "decide", "where": "before"})],
        [("fail_at", {"phase": "decide", "where": "after"})],
    ]
    for c in range(max(n_chunks, len(APPLY_WHERE))):
        where = APPLY_WHERE[c % len(APPLY_WHERE)]
        groups.append([("fail_at", {"phase": "apply", "chunk": c % n_chunks, "where": where})])
    groups += [
        [("fail_at", {"phase": "parity", "chunk": 0})],
        [("fail_at", {"phase": "parity", "chunk": n_chunks - 1})],
        [("fail_at", {"phase": "finish"})],
        [("fail_at", {"phase": "tail"})],
        [("fail_at", {"phase": "forward", "kind": "hang"})],
        [("lose_memory", {"phase": "apply", "chunk": min(1, n_chunks - 1), "where": "mid_write"})],
        [("lose_memory", {"phase": "decide", "where": "after"})],
        [("corrupt", {"chunk": 0, "phase": "finish"})],
    ]
    if nodes >= 2:
        groups.append(
            [("lose_node", {"node": nodes - 1, "phase": "apply", "chunk": 0, "where": "written"})]
        )
    # a crash, and another one while it is being recovered (the recovery restarts)
    groups.append(
        [
            ("fail_at", {"phase": "apply", "chunk": 0, "where": "written"}),
            ("fail_at", {"phase": "recovery", "where": "Reconcile", "next_rank": 1}),
        ]
    )
    if not checkpoint:
        groups += beyond
    first, last = 3, steps - 3
    if last - first < len(groups) - 1:
        raise ValueError(
            f"steps: {steps} is too few to give each of the {len(groups)} failure groups its own "
            f"step; use at least {len(groups) + 5}"
        )
    for i, group in enumerate(groups):
        step = first + (i * (last - first)) // max(1, len(groups) - 1)
        base_rank = i % W
        for what, kw in group:
            kw = dict(kw)
            rank = kw.pop("rank", (base_rank + kw.pop("next_rank", 0)) % W)
            if what == "fail_at":
                inj.fail_at(rank=rank, step=step, **kw)
            elif what == "lose_memory":
                inj.lose_memory(rank=rank, step=step, **kw)
            elif what == "corrupt":
                inj.corrupt(rank=rank, step=step, **kw)
            else:
                trigger = rank if kw.get("phase") == "recovery" else None
                inj.lose_node(step=step, rank=trigger, **kw)


def _covered(inj: Any) -> list[str]:
    out = set()
    for f in inj.faults:
        if not f.fired:
            continue
        if f.kind in ("lose_memory", "lose_node", "corrupt", "hang"):
            out.add(f.kind)
        label = f.phase
        if f.chunk is not None:
            label += f"[{f.chunk}]"
        if f.where:
            label += f"/{f.where}"
        out.add(label)
    return sorted(out)


def _all_phases(inj: Any, n_chunks: int) -> bool:
    from leto.backends.fake import APPLY_WHERE, PHASES

    fired = [f for f in inj.faults if f.fired]
    phases = {f.phase for f in fired}
    wheres = {f.where for f in fired if f.phase == "apply"}
    chunks = {f.chunk for f in fired if f.phase == "apply"}
    decide = {f.where for f in fired if f.phase == "decide"}
    return (
        set(PHASES) <= phases
        and set(APPLY_WHERE) <= wheres
        and set(range(n_chunks)) <= chunks
        and {"before", "after"} <= decide
    )


# --------------------------------------------------------------------------- run


DEFAULTS = {"nodes": 2, "ranks_per_node": 2, "chunk_size": 4096, "tier2_interval": 10}


def demo(
    *,
    steps: int = 200,
    nodes: int | None = None,
    ranks_per_node: int | None = None,
    chunk_size: int | None = None,
    tier2_interval: int | None = None,
    checkpoint_dir: str | None = None,
    seed: int = 0,
    faults: bool = True,
    config: Any = None,
    out: Any = None,
) -> dict[str, Any]:
    """Run the demo (and its failure-free twin); the summary as a dict.

    Settings come from ``config`` (a :class:`leto.Config`, dict or TOML path) or,
    without one, from :data:`DEFAULTS` (2 nodes x 2 ranks, chunks of 4096, K = 10);
    the keyword arguments that are not None override either. ``out``: a stream for
    the human-readable timeline (None: silent).
    """
    import leto
    from leto.backends.fake.engine import UnrecoverableError

    def say(msg: str) -> None:
        if out is not None:
            print(msg, file=out, flush=True)

    base: dict[str, Any] = {"backend": "fake", **DEFAULTS}
    if config is not None:
        base = leto.Config.load(config).as_dict()
    given = {
        "nodes": nodes,
        "ranks_per_node": ranks_per_node,
        "chunk_size": chunk_size,
        "tier2_interval": tier2_interval,
    }
    base.update({k: v for k, v in given.items() if v is not None})
    base.update(checkpoint_dir=checkpoint_dir, world_size=None)
    cfg = leto.Config.from_dict(base)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny simulated ranks: intra-op threads would only contend
    try:
        return _demo(cfg, steps, seed, faults, say)
    except UnrecoverableError as e:
        say(f"\nSTOPPED: {e}")
        raise
    finally:
        torch.set_num_threads(threads)


def _train(
    cfg: Any, steps: int, seed: int, plan: bool, say: Any
) -> tuple[Any, dict[str, Any], float]:
    import leto

    job = build(seed, cfg.ranks)
    session = leto.wrap(
        job["model"], job["optimizer"], job["scheduler"], job["sampler"], config=cfg, check=plan
    )
    if plan:
        fault_plan(
            session.faults,
            steps=steps,
            n_chunks=session.engine.n_chunks,
            nodes=cfg.nodes,
            ranks_per_node=cfg.ranks_per_node,
            checkpoint=cfg.checkpoint_dir is not None,
        )
    t0 = time.perf_counter()
    shown = 0
    eng = session.engine
    while session.step < steps:
        loss = session.run_step(job["step_fn"])
        for entry in eng.timeline[shown:]:
            say(_line(entry))
        shown = len(eng.timeline)
        if loss is not None and plan and (session.step % 25 == 0 or session.step == steps):
            say(f"step {session.step:5d}  loss {loss:.4f}")
    return session, job, time.perf_counter() - t0


def _line(e: dict[str, Any]) -> str:
    ev = e["event"]
    if ev == "fault":
        return f"step {e['step']:5d}  FAULT     {e['detail']}"
    if ev == "integrity":
        return f"            CHECKSUM  rank {e['rank']}: {e['detail']}"
    if ev == "recovered":
        what = {
            "inplace": "nothing to repair",
            "back": "rolled back the uncommitted step",
            "forward": f"rolled {e['chunks_rolled_forward']} chunk(s) forward",
            "tier1": (
                f"{e['chunks_repaired_from_parity']} chunk(s) + {e['grad_blocks_repaired_from_parity']} "
                f"gradient block(s) from tier-1 parity, {e['chunks_rolled_forward']} rolled forward"
            ),
            "tier2": f"tier-2 snapshot restored ({e['steps_lost']} step(s) to recompute)",
            "ckpt": f"disk checkpoint loaded ({e['steps_lost']} step(s) to recompute)",
        }.get(e["kind"], e["kind"])
        extra = []
        if e["restarts"]:
            extra.append(f"recovery restarted {e['restarts']}x")
        if e["stale_writes_refused"]:
            extra.append(f"{e['stale_writes_refused']} stale write(s) refused")
        tail = f" ({'; '.join(extra)})" if extra else ""
        return (
            f"            RECOVERED {e['kind']:<7} gen {e['generation']:<3} promoted {e['promoted']}: "
            f"{what}; resumed at step {e['resumed_at']} in {e['ms']:.1f} ms{tail}"
        )
    if ev == "unrecoverable":
        return f"            STOP      {e['detail']}"
    return f"            {ev:<9} {e.get('detail', '')}"


def _failure_seconds(timeline: list[dict[str, Any]]) -> list[float | None]:
    """Per injected fault, in order: seconds from it until the recovery that resumed
    training after it ended (``None`` if none did), as the gloo demo reports them."""
    ends = [e["t_ms"] for e in timeline if e["event"] == "recovered"]
    out: list[float | None] = []
    for e in timeline:
        if e["event"] == "fault":
            end = next((t for t in ends if t >= e["t_ms"]), None)
            out.append(None if end is None else round((end - e["t_ms"]) / 1e3, 6))
    return out


def _demo(cfg: Any, steps: int, seed: int, faults: bool, say: Any) -> dict[str, Any]:
    t_all = time.perf_counter()
    job = build(seed, cfg.ranks)
    say(
        f"leto demo: a character GPT ({job['params']:,} parameters, vocabulary {job['vocab']}) on "
        f"leto/data/{DATA} ({job['chars']:,} characters), {steps} steps, {cfg.ranks} simulated ranks"
    )
    session, _, secs = _train(cfg, steps, seed, faults, say)
    eng = session.engine
    inj = session.faults
    ref, _, ref_secs = _train(
        attrs_evolve(cfg, checkpoint_dir=None), steps, seed, False, lambda m: None
    )
    a, b = session.retained_state(), ref.retained_state()
    params_equal = all(torch.equal(x["param"], y["param"]) for x, y in zip(a, b, strict=True))
    state_equal = all(
        torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x if k != "param"
    )
    ps_equal = eng.process_states() == ref.engine.process_states()
    bitwise = params_equal and state_equal and ps_equal
    by_kind: dict[str, int] = {}
    for r in eng.recoveries:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + 1
    counters = inj.counters()
    st = eng.stats
    result = {
        "bitwise_equal": bitwise,
        "params_equal": params_equal,
        "optimizer_state_equal": state_equal and ps_equal,
        "failures_injected": counters["fired"],
        "failures_planned": counters["planned"],
        "every_failure_recovered": counters["recovered"]
        == counters["fired"]
        == counters["planned"],
        "recoveries": st["recoveries"],
        "recoveries_by_kind": dict(sorted(by_kind.items())),
        "rolled_forward": st["rolled_forward"],
        "rolled_back": st["rolled_back"],
        "chunks_rolled_forward": st["chunks_rolled_forward"],
        "chunks_repaired_from_parity": st["chunks_repaired_from_parity"],
        "grad_blocks_repaired_from_parity": st["grad_blocks_repaired_from_parity"],
        "snapshot_restores": st["snapshot_restores"],
        "checkpoint_restores": st["checkpoint_restores"],
        "checksum_failures_caught": st["integrity_failures"],
        "stale_writes_refused": st["stale_writes_refused"],
        "recovery_restarts": st["recovery_restarts"],
        "phases_covered": _covered(inj),
        "all_phases_covered": _all_phases(inj, eng.n_chunks),
        "steps": steps,
        "uninterrupted_steps": st["steps_run"],
        "world_size": cfg.ranks,
        "topology": f"{cfg.nodes}x{cfg.ranks_per_node}",
        "n_chunks": eng.n_chunks,
        "chunk_size": cfg.chunk_size,
        "tier2_interval": cfg.tier2_interval,
        "checkpoint": cfg.checkpoint_dir is not None,
        "real_state_matches_core": not eng.mismatches() and not eng.parity_exact(),
        "final_loss": eng.losses.get(steps),
        "reference_final_loss": ref.engine.losses.get(steps),
        "recovery_seconds": _failure_seconds(eng.timeline),
        "recovery_ms_total": round(sum(r["ms"] for r in eng.recoveries), 3),
        "seconds": {
            "with_failures": round(secs, 3),
            "failure_free": round(ref_secs, 3),
            "total": round(time.perf_counter() - t_all, 3),
        },
        "faults": [f.as_dict() for f in inj.faults],
    }
    say("")
    say(
        f"{counters['fired']} failures injected ({counters['planned']} planned), {st['recoveries']} "
        f"recoveries {dict(sorted(by_kind.items()))}; {st['rolled_forward']} rolled forward "
        f"({st['chunks_rolled_forward']} chunks), {st['rolled_back']} rolled back, "
        f"{st['chunks_repaired_from_parity']} chunks + {st['grad_blocks_repaired_from_parity']} gradient "
        f"blocks repaired from tier-1 parity, {st['snapshot_restores']} tier-2 restore(s), "
        f"{st['checkpoint_restores']} checkpoint restore(s), {st['integrity_failures']} checksum "
        f"failure(s) caught, {st['stale_writes_refused']} stale write(s) refused"
    )
    say(f"phases covered: {', '.join(result['phases_covered'])}")
    say(
        f"final loss {result['final_loss']:.4f} (failure-free run: {result['reference_final_loss']:.4f}); "
        f"{secs:.1f} s with failures, {ref_secs:.1f} s without"
    )
    say(
        "bitwise equal to the failure-free run (every rank's parameters, optimizer state, "
        f"scheduler and RNG): {'YES' if bitwise else 'NO'}"
    )
    return result


def attrs_evolve(cfg: Any, **changes: Any) -> Any:
    import attrs

    return attrs.evolve(cfg, **changes)


# --------------------------------------------------------------------------- CLI


# The demo's own flags (leto.argcheck); those that are config settings (nodes, ranks
# per node, chunk size, tier-2 interval) are checked by leto.Config, which names the
# setting. The demo runs every rank on this machine.
DEMO_BOUNDS: dict[str, Bound] = {
    "steps": positive_int(100_000),
    "seed": Bound(lo=0, hi=2**32 - 1, integer=True),
}
MAX_DEMO_RANKS = 256


def check_flags(args: argparse.Namespace) -> None:
    """Refuse bad flags before anything is loaded or started (BadInput, one line)."""
    if args.backend not in (None, "gloo", "fake"):
        raise BadInput(
            f"--backend: unknown backend {show(args.backend)} (the demo runs on gloo or fake)"
        )
    check_args(args, DEMO_BOUNDS)
    for field in ("nodes", "ranks_per_node", "chunk_size", "tier2_interval"):
        if getattr(args, field) is not None:
            try:
                check_count(field, getattr(args, field))
            except ConfigError as e:
                raise BadInput(f"{field}: {e.message}") from None
    nodes = DEFAULTS["nodes"] if args.nodes is None else args.nodes
    per = DEFAULTS["ranks_per_node"] if args.ranks_per_node is None else args.ranks_per_node
    if nodes * per > MAX_DEMO_RANKS:
        raise BadInput(
            f"--nodes x --ranks-per-node = {nodes * per} ranks, more than the demo's limit of "
            f"{MAX_DEMO_RANKS} (it runs every rank on this machine)"
        )
    if args.checkpoint_dir is not None:
        dir_to_create("--checkpoint-dir", args.checkpoint_dir)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        default=None,
        help="gloo (the default: real processes under leto launch, 2 nodes x 2 ranks on "
        "127.0.0.1) or fake (simulated ranks in one process)",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="a leto TOML config (instead of the demo's defaults; flags override it)",
    )
    parser.add_argument(
        "--steps", type=int, help="training steps (default: 40 on gloo, 200 on fake)"
    )
    parser.add_argument("--nodes", type=int, help="nodes (default 2)")
    parser.add_argument("--ranks-per-node", type=int, help="ranks per node (default 2)")
    parser.add_argument("--chunk-size", type=int, help="elements per chunk (default 4096)")
    parser.add_argument("--tier2-interval", type=int, help="steps between tier-2 snapshots (10)")
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="checkpoint directory (default: a temporary one on fake, none on gloo)",
    )
    parser.add_argument(
        "--no-checkpoint",
        action="store_true",
        help="no disk checkpoint: the loss beyond both tiers then stops the run with an error",
    )
    parser.add_argument("--no-faults", action="store_true", help="train without injecting failures")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object, no timeline")


def run(args: argparse.Namespace) -> int:
    from leto.adapters.config import Config, ConfigError
    from leto.backends.fake.engine import UnrecoverableError

    try:
        check_flags(args)
    except BadInput as e:
        return refuse("demo", e)
    loaded = None
    if args.config is not None:
        try:
            loaded = Config.load(args.config)
        except ConfigError as e:
            print(f"leto demo: {e}", file=sys.stderr)
            return 2
        if args.backend is not None and args.backend != loaded.backend:
            print(
                "leto demo: give the backend in the config file or as --backend, not both",
                file=sys.stderr,
            )
            return 2
    backend = loaded.backend if loaded is not None else (args.backend or "gloo")
    if backend == "gloo":
        from leto.adapters import gloo_demo

        return gloo_demo.run_cli(args, config=loaded)

    tmp = None
    ckpt = args.checkpoint_dir
    if ckpt is None and not args.no_checkpoint:
        tmp = tempfile.mkdtemp(prefix="leto-demo-ckpt-")
        ckpt = tmp
    try:
        config: Any = loaded if loaded is not None else {"backend": backend, **DEFAULTS}
        result = demo(
            steps=200 if args.steps is None else args.steps,
            nodes=args.nodes,
            ranks_per_node=args.ranks_per_node,
            chunk_size=args.chunk_size,
            tier2_interval=args.tier2_interval,
            checkpoint_dir=None if args.no_checkpoint else ckpt,
            seed=args.seed,
            faults=not args.no_faults,
            config=config,
            out=None if args.json else sys.stdout,
        )
    except (ConfigError, NotImplementedError, ValueError) as e:
        print(f"leto demo: {e}", file=sys.stderr)
        return 2
    except UnrecoverableError as e:
        if args.json:
            print(json.dumps({"bitwise_equal": False, "stopped": str(e)}))
        return 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    ok = result["bitwise_equal"] and (args.no_faults or result["every_failure_recovered"])
    return 0 if ok else 1
