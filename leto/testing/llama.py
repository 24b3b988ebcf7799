"""A small torchtitan-shaped Llama, parallelized as torchtitan does it (TP, then FSDP2).

Shared by ``examples/llama_fsdp_tp.py``, its tests and ``benchmarks/llama_retained.py``.
The model follows torchtitan's ``llama3`` (``torchtitan/models/llama3``): RMSNorm, rotary
embeddings as complex ``freqs_cis``, grouped-query attention (``n_kv_heads`` key/value
heads repeated), a SwiGLU feed-forward (``w2(silu(w1(x)) * w3(x))``, the hidden size
torchtitan's ``compute_ffn_hidden_dim``), an untied output projection; a few layers of
small width. :func:`parallelize_llama` applies torchtitan's tensor-parallel plan on the
mesh's ``"tp"`` dimension (embedding rowwise, attention and feed-forward colwise in,
rowwise out, norms as sequence parallel) and then ``fully_shard`` on each block and on
the root over ``"dp"``. Why not torchtitan's own model: see the example's docstring.

Data is synthetic and deterministic: :func:`batch` depends on the step and the data
parallel rank only, so a run on another mesh shape with the same ``dp`` size sees the
same tokens.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from leto.backends.gloo import segments

__all__ = [
    "Llama",
    "LlamaConfig",
    "batch",
    "dp_rank",
    "keeper_memory",
    "loss_of",
    "parallelize_llama",
]


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes; ``n_heads`` and ``n_kv_heads`` divisible by the tensor-parallel degree."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 256
    multiple_of: int = 32
    seq_len: int = 16
    batch_size: int = 2
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """torchtitan's ``compute_ffn_hidden_dim(dim, multiple_of)``."""
        hidden = int(2 * 4 * self.dim / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


def precompute_freqs_cis(head_dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    t = torch.arange(end, dtype=torch.float32)
    return torch.polar(torch.ones(end, head_dim // 2), torch.outer(t, freqs))


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    k = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis.view(1, q.shape[1], 1, q.shape[-1])
    return (
        torch.view_as_real(q * f).flatten(3).type_as(xq),
        torch.view_as_real(k * f).flatten(3).type_as(xk),
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention; head counts are read from the (tensor-parallel local)
    projections' outputs, as torchtitan's does (``view(bs, seqlen, -1, head_dim)``)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys = xk.repeat_interleave(self.n_rep, dim=2)
        values = xv.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), is_causal=True
        )
        y: torch.Tensor = self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))
        return y


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return y


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out


class Llama(nn.Module):
    """Built under ``torch.manual_seed(seed)``: every rank starts from the same weights."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(cfg.head_dim, cfg.seq_len, cfg.rope_theta),
            persistent=False,
        )
        std = 0.02 / math.sqrt(2 * cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.trunc_normal_(
                    p, std=std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        out: torch.Tensor = self.output(self.norm(h))
        return out


def parallelize_llama(
    model: Llama, mesh: DeviceMesh, *, mp: MixedPrecisionPolicy | None = None
) -> Llama:
    """torchtitan's ``apply_tp`` on ``mesh["tp"]`` (sequence parallel norms, logits
    replicated: no loss parallel), then ``fully_shard`` per block and on the root over
    ``mesh["dp"]`` (``reshard_after_forward`` on the blocks, off on the root)."""
    tp = mesh["tp"]
    parallelize_module(
        model,
        tp,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None),
                desired_input_layouts=(Replicate(), None),
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(block, tp, plan)
    dp = mesh["dp"]
    policy = mp or MixedPrecisionPolicy()
    for block in model.layers.values():
        fully_shard(block, mesh=dp, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=dp, mp_policy=policy, reshard_after_forward=False)
    return model


def dp_rank(mesh: DeviceMesh) -> int:
    return int(mesh["dp"].get_local_rank())


def batch(cfg: LlamaConfig, step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s tokens and targets for data-parallel rank ``dp`` (every tensor
    parallel rank of it gets the same)."""
    g = torch.Generator().manual_seed(1_000_003 * step + dp)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, cfg: LlamaConfig, step: int, dp: int) -> torch.Tensor:
    x, y = batch(cfg, step, dp)
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def keeper_memory(tag: str) -> Callable[[str, int], torch.Tensor]:
    """An allocator of zeroed memfd segments mapped as tensors, as a keeper's (in this
    process; nothing left in ``/dev/shm``): ``retain_shards``' ``alloc``."""

    def alloc(name: str, nbytes: int) -> torch.Tensor:
        fd = segments.create(f"{tag}.{name}", nbytes)
        try:
            return segments.as_tensor(fd, nbytes)
        finally:
            os.close(fd)

    return alloc
