"""A Hugging Face `transformers.Trainer` under leto (gloo, CPU): `leto.hf` (docs/trainers.md).

The script is an ordinary Trainer script: a `GPT2LMHeadModel` from a config built in
code (nothing is downloaded), the sonnets that ship with leto as fixed-length byte
sequences, `TrainingArguments` with AdamW's weight decay, a warm-up then cosine LR
schedule, gradient accumulation, clipping, logging, evaluation and `save_steps` checkpoints. What
leto changes is the import (`from leto.hf import Trainer, TrainingArguments`) and
`leto_config=`: the Trainer's loop is then leto's (its batches from leto's step
boundary, its optimizer step leto's transaction, its scheduler and data position
retained), and a trainer killed anywhere in a step recovers in place.

    leto launch --nproc-per-node 2 examples/hf_trainer.py --config examples/gloo-1node.toml

Needs ``pip install -e ".[examples]"`` (transformers, accelerate, torchdata).
"""

import argparse
import os
import tempfile
from importlib import resources

# the arguments first: `--help` answers before torch and transformers are imported
p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--config", default=os.environ.get("LETO_CONFIG"))
p.add_argument("--steps", type=int, default=20)
p.add_argument("--accum", type=int, default=2, help="micro-batches per step")
p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch per rank")
p.add_argument("--block", type=int, default=32, help="bytes per sequence")
p.add_argument("--layers", type=int, default=2)
p.add_argument("--width", type=int, default=64)
p.add_argument("--save-steps", type=int, default=0, help="a model checkpoint every N steps")
p.add_argument("--eval-steps", type=int, default=0, help="an evaluation every N steps")
p.add_argument("--output-dir", default=None, help="default: a temporary directory")
args = p.parse_args()

import torch
from torch.utils.data import Dataset

try:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from leto.hf import Trainer, TrainingArguments
except ImportError as e:  # one line, not a traceback
    raise SystemExit(
        f"examples/hf_trainer.py needs transformers and accelerate: "
        f'pip install -e ".[examples]" ({e})'
    ) from None

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()


class Sonnets(Dataset):
    """Fixed-length byte sequences of the sonnets; each item a dict, as a collator expects.
    The last ``held_out`` sequences are the evaluation set (``eval=True``)."""

    def __init__(self, block: int, held_out: int = 16, eval: bool = False) -> None:
        text = resources.files("leto.data").joinpath("sonnets.txt").read_text(encoding="utf-8")
        raw = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        n = raw.numel() // block
        seqs = raw[: n * block].view(n, block)
        self.seqs = seqs[n - held_out :] if eval else seqs[: n - held_out]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.seqs[i], "labels": self.seqs[i]}


training = TrainingArguments(
    output_dir=args.output_dir or tempfile.mkdtemp(prefix="hf-trainer-"),
    max_steps=args.steps,
    per_device_train_batch_size=args.batch,
    gradient_accumulation_steps=args.accum,
    learning_rate=3e-3,
    weight_decay=0.1,
    adam_beta2=0.95,
    lr_scheduler_type="cosine",
    warmup_steps=max(1, args.steps // 10),
    max_grad_norm=1.0,
    logging_steps=5,
    save_strategy="steps" if args.save_steps else "no",
    save_steps=args.save_steps or 500,
    eval_strategy="steps" if args.eval_steps else "no",
    eval_steps=args.eval_steps or None,
    per_device_eval_batch_size=8,
    report_to="none",
    disable_tqdm=True,
    use_cpu=True,
    seed=0,  # the Trainer seeds torch, random and NumPy
)
config = GPT2Config(
    vocab_size=256,  # bytes
    n_positions=args.block,
    n_embd=args.width,
    n_layer=args.layers,
    n_head=4,
    bos_token_id=0,
    eos_token_id=0,
)
torch.manual_seed(0)
model = GPT2LMHeadModel(config)  # the LM head is tied to the token embedding
trainer = Trainer(
    model=model,
    args=training,
    train_dataset=Sonnets(args.block),
    eval_dataset=Sonnets(args.block, eval=True) if args.eval_steps else None,
    leto_config=args.config,
)
out = trainer.train()

if trainer.is_world_process_zero():
    s = trainer.session
    print(
        f"step {s.step}, loss {out.training_loss:.4f}, recoveries {s.stats['recoveries']} (this process's)"
    )
