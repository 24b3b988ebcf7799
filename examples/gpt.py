"""A small character-level GPT trained with leto: the same script on every backend.

Only the config changes between a single-process simulation and real processes::

    python examples/gpt.py --config examples/fake.toml           # 4 simulated ranks, one process

    # 4 real ranks as 2 nodes x 2 (gloo, CPU); one command per node:
    leto launch --nnodes 2 --nproc-per-node 2 --node-rank 0 --rdzv-endpoint 127.0.0.1:29400 \\
        examples/gpt.py --config examples/gloo.toml
    leto launch --nnodes 2 --nproc-per-node 2 --node-rank 1 --rdzv-endpoint 127.0.0.1:29400 \\
        examples/gpt.py --config examples/gloo.toml

Everything leto needs is in the ``leto.wrap`` call: the model, its optimizer (AdamW),
an LR schedule, a resumable sampler of global batches and the config. The step
function is one rank's forward on its shard of the batch; leto runs backward, the
gradient all-reduce and the chunked optimizer step as a transaction, and recovers
in place from failures.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
from importlib import resources

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import leto
from leto.retained.process_state import ResumableBatchSampler


class Attention(nn.Module):
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
        q, k, v = (t.view(B, T, h, C // h).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // h)
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        y = self.drop(F.softmax(att, dim=-1)) @ v
        return self.drop(self.proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, block: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, block, dropout)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab: int,
        d: int = 48,
        heads: int = 4,
        layers: int = 2,
        block: int = 32,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.Sequential(*(Block(d, heads, block, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.environ.get("LETO_CONFIG"), help="leto TOML config")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-rank-batch", type=int, default=4)
    args = p.parse_args()

    cfg = leto.Config.load(args.config)  # backend, topology, chunking, tiers, checkpoint
    torch.manual_seed(args.seed)  # every RNG the process carries is seeded: leto retains all
    random.seed(args.seed)  # three, and a resumed run is bitwise the run that never failed
    np.random.seed(args.seed)
    text = (resources.files("leto") / "data" / "sonnets.txt").read_text(encoding="utf-8")
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    block = 32
    model = GPT(len(chars), block=block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    sampler = ResumableBatchSampler(
        len(data) - block - 1, cfg.ranks * args.per_rank_batch, seed=args.seed
    )
    offsets = torch.arange(block)

    def step_fn(m: nn.Module, idx: list[int]) -> torch.Tensor:
        starts = torch.tensor(idx).unsqueeze(1)
        logits = m(data[starts + offsets])
        return F.cross_entropy(
            logits.view(-1, logits.shape[-1]), data[starts + offsets + 1].view(-1)
        )

    session = leto.wrap(model, optimizer, scheduler, sampler, config=cfg)
    session.train(step_fn, args.steps)

    m = session.model
    m.eval()
    with torch.no_grad():
        loss = float(step_fn(m, list(range(0, 64 * 97, 97))))
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    rank = os.environ.get("RANK", "0")
    if cfg.backend != "gloo" or rank == "0":
        print(
            f"{cfg.backend}: {cfg.ranks} ranks, step {session.step}, eval loss {loss:.4f}, "
            f"parameters sha256 {digest}"
        )


if __name__ == "__main__":
    main()
