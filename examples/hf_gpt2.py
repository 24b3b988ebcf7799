"""A Hugging Face `transformers` GPT-2 trained by its own loop under leto (gloo, CPU).

The model is `GPT2LMHeadModel` from a config built in code (nothing is downloaded),
trained character by character on the sonnets that ship with leto: AdamW with weight
decay, a warm-up then cosine LR schedule, gradient accumulation over micro-batches
(no all-reduce until the last one, ``session.no_sync()``), gradient clipping, and a
resumable `StatefulDataLoader` over a `DistributedSampler`. What leto adds is the
``leto.wrap`` line, ``session.batches`` and ``session.clip_grad_norm_`` (FSDP's: the
norm of the gradients leto holds, float32 masters' or this rank's shard's); the loop is
the user's.

    leto launch --nproc-per-node 2 examples/hf_gpt2.py --config examples/gloo-1node.toml
    # bf16 parameters with float32 master weights, gradients and AdamW state:
    LETO_MASTER_WEIGHTS=1 leto launch --nproc-per-node 2 examples/hf_gpt2.py --bf16 \
        --config examples/gloo-1node.toml
    # ZeRO-style sharded state (each rank retains 1/W of it; tier 1 as parity):
    LETO_SHARD=1 LETO_TIER1_CODE=parity leto launch --nproc-per-node 2 examples/hf_gpt2.py \
        --config examples/gloo-1node.toml
    # both: each rank retains its 1/W shard of the float32 masters, gradients and state
    LETO_MASTER_WEIGHTS=1 LETO_SHARD=1 LETO_TIER1_CODE=parity leto launch \
        --nproc-per-node 2 examples/hf_gpt2.py --bf16 --config examples/gloo-1node.toml

Needs ``pip install transformers`` (the ``examples`` extra).
"""

import argparse
import contextlib
import math
import os
import random
from importlib import resources

# the arguments first: `--help` answers before torch and transformers are imported
p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--config", default=os.environ.get("LETO_CONFIG"))
p.add_argument("--steps", type=int, default=20)
p.add_argument("--accum", type=int, default=2, help="micro-batches per step")
p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
p.add_argument("--block", type=int, default=32, help="characters per sequence")
p.add_argument("--layers", type=int, default=2)
p.add_argument("--width", type=int, default=64)
p.add_argument("--bf16", action="store_true", help="bfloat16 parameters (with master_weights)")
args = p.parse_args()

import numpy
import torch
from torch.utils.data import DistributedSampler, TensorDataset

import leto

try:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging
except ImportError as e:  # one line, not a traceback
    raise SystemExit(
        f"examples/hf_gpt2.py needs transformers: pip install transformers ({e})"
    ) from None

try:  # resumable: leto retains its position (a plain DataLoader is re-read and skipped)
    from torchdata.stateful_dataloader import StatefulDataLoader as DataLoader
except ImportError:
    from torch.utils.data import DataLoader

hf_logging.set_verbosity_error()
torch.manual_seed(0)  # every RNG seeded: a resumed run is bitwise the one that never failed
random.seed(0)
numpy.random.seed(0)

text = resources.files("leto.data").joinpath("sonnets.txt").read_text(encoding="utf-8")
raw = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
n = (raw.numel() - 1) // args.block
seqs = raw[: n * args.block + 1]
X = seqs[:-1].view(n, args.block)
data = TensorDataset(X)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
sampler = DistributedSampler(data, world, rank, seed=0)
loader = DataLoader(data, batch_size=args.batch, sampler=sampler)

config = GPT2Config(
    vocab_size=256,  # bytes
    n_positions=args.block,
    n_embd=args.width,
    n_layer=args.layers,
    n_head=4,
    bos_token_id=0,
    eos_token_id=0,
)
model = GPT2LMHeadModel(config)  # the LM head is tied to the token embedding
if args.bf16:
    model = model.to(torch.bfloat16)
decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
opt = torch.optim.AdamW(
    [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
    lr=3e-3,
    betas=(0.9, 0.95),
)
warmup = max(1, args.steps // 10)


def lr_at(step: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))


sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
session = leto.wrap(model, opt, sched, loader, config=args.config)

model.train()
for (x,) in session.batches(args.steps):
    opt.zero_grad()
    for i, xm in enumerate(x.chunk(args.accum)):
        with contextlib.nullcontext() if i == args.accum - 1 else session.no_sync():
            loss = model(input_ids=xm, labels=xm).loss / args.accum
            loss.backward()
    session.clip_grad_norm_(1.0)
    opt.step()
    sched.step()

if rank == 0:
    print(
        f"step {session.step}, loss {loss.item() * args.accum:.4f}, recoveries {session.stats['recoveries']} (this process's)"
    )
