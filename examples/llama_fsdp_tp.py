"""A torchtitan-shaped Llama trained with FSDP2 + tensor parallel on a dp x tp mesh over
gloo, its state retained by leto (``retain_shards``), with DCP checkpoints.

Run it with ``torchrun --nproc-per-node 4 examples/llama_fsdp_tp.py --steps 3``: a 2 x 2
``("dp", "tp")`` mesh from ``init_device_mesh``, torchtitan's TP plan, then ``fully_shard``
per block and on the root over ``"dp"`` (:mod:`leto.testing.llama`), AdamW with a warmup
``LambdaLR``, synthetic tokens per step and dp rank. Each rank's parameters, gradients
and AdamW moments live in a chunked retained layout in memfd segments (keeper-like
memory) and leto's chunked AdamW steps them, chunk by chunk with undo copies and seals;
``--plain`` runs the same loop with torch's AdamW on plain FSDP2 + TP. Rank 0 prints
each step's loss (``float.hex``, to compare bitwise) and a digest of the whole state
(every parameter and optimizer state gathered to full tensors): the two runs print the
same lines. ``--save DIR`` writes a DCP checkpoint after the last step, keyed as
torchtitan keys one (model FQNs, ``get_state_dict``'s optimizer state, the scheduler,
the step); ``--load DIR`` resumes from one, on any ``--mesh`` (``4x1``, ``1x4``...: DCP
reshards). ``--bf16``: ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``, fp32 master state retained.

Why not torchtitan's own Llama (torchtitan 0.3.0, tried with torch 2.13 CPU): its
``Llama3Model`` builds and ``parallelize_llama`` applies TP and FSDP2 on a CPU/gloo mesh
once ``torchtitan.distributed.parallel_dims.device_type`` is patched to ``"cpu"`` (its
``ParallelDims.build_mesh`` otherwise calls ``torch.cuda.set_device``), but it cannot
train here: its language models refuse the ``sdpa`` attention backend ("positions are
always available so use flex, flex_flash, or varlen"), FlexAttention has no backward on
CPU ("FlexAttention does not support backward on CPU"), and varlen calls
``aten::_flash_attention_forward``, CUDA only. It also needs ``spmd_types``, ``tyro``,
``einops``, ``torch_checkpointing`` and ``triton`` installed. So the model here is a small
copy of its structure.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from leto.retained import dtensor_checkpoint as ckpt
from leto.retained.dtensor_retained import RetainedShards, retain_shards
from leto.testing.llama import (
    Llama,
    LlamaConfig,
    dp_rank,
    keeper_memory,
    loss_of,
    parallelize_llama,
)

CFG = LlamaConfig()
WARMUP = 3
CHUNK_NUMEL = 4096


def make_mesh(shape: str) -> DeviceMesh:
    dp, tp = (int(n) for n in shape.split("x"))
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


class Run:
    """The model, its AdamW and scheduler on ``mesh``; retained by leto unless ``plain``."""

    def __init__(
        self,
        mesh: DeviceMesh,
        *,
        plain: bool,
        bf16: bool = False,
        tag: str = "llama",
        cfg: LlamaConfig = CFG,
        chunk_numel: int = CHUNK_NUMEL,
    ):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        self.mesh = mesh
        self.cfg = cfg
        self.model = parallelize_llama(Llama(cfg), mesh, mp=mp if bf16 else None)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / WARMUP)
        )
        self.rs: RetainedShards | None = None
        if not plain:
            self.rs = retain_shards(
                self.model, self.opt, chunk_numel=chunk_numel, alloc=keeper_memory(tag)
            )
        self.step = 0
        self.opt_seconds = 0.0  # time in the optimizer step (benchmarks/llama_retained.py)

    def train_step(self) -> torch.Tensor:
        loss = loss_of(self.model, self.cfg, self.step, dp_rank(self.mesh))
        loss.backward()
        t0 = time.perf_counter()
        if self.rs is not None:
            self.rs.step()
            self.rs.zero_grad()
        else:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.opt_seconds += time.perf_counter() - t0
        self.sched.step()
        self.step += 1
        return loss.detach()

    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optimizer"}`` as ``get_state_dict`` gives them (leto: views of the
        retained buffers)."""
        if self.rs is not None:
            return ckpt.state_dict(self.rs, self.model, self.opt)
        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optimizer": osd}

    def extra(self) -> dict[str, Any]:
        return {"lr_scheduler": self.sched.state_dict(), "train_state": {"step": self.step}}

    def save(self, path: str) -> None:
        dcp.save({**self.state_dict(), **self.extra()}, checkpoint_id=path)

    def load(self, path: str) -> None:
        if self.rs is not None:
            got = ckpt.load(self.rs, self.model, self.opt, path, **self.extra())
        else:  # torchtitan's way: get_state_dict, dcp.load, set_state_dict
            got = {**self.state_dict(), **self.extra()}
            dcp.load(got, checkpoint_id=path)
            set_state_dict(
                self.model,
                self.opt,
                model_state_dict=got["model"],
                optim_state_dict=got["optimizer"],
            )
        self.sched.load_state_dict(got["lr_scheduler"])
        self.step = int(got["train_state"]["step"])

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and optimizer state gathered to a full tensor, by flat key
        (a collective: every rank calls it)."""
        sd = self.state_dict()
        out = {f"model.{k}": v for k, v in sd["model"].items()}
        for fqn, st in sd["optimizer"]["state"].items():
            out.update({f"optimizer.{fqn}.{k}": v for k, v in st.items()})
        return {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in sorted(out.items())
        }


def digest(full: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k, v in full.items():
        h.update(k.encode())
        h.update(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--mesh", default="2x2", help="dp x tp, their product the world size")
    p.add_argument("--plain", action="store_true", help="without leto: torch's AdamW")
    p.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 reduce")
    p.add_argument("--save", help="a DCP checkpoint directory to write after the last step")
    p.add_argument("--load", help="a DCP checkpoint directory to resume from")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo")
    run = Run(make_mesh(args.mesh), plain=args.plain, bf16=args.bf16)
    if args.load:
        run.load(args.load)
    for _ in range(args.steps):
        loss = run.train_step()
        if dist.get_rank() == 0:
            print(f"step {run.step} loss {loss.item():.6f} {loss.item().hex()}", flush=True)
    if args.save:
        run.save(args.save)
    d = digest(run.full_state())
    if dist.get_rank() == 0:
        print(f"state digest {d} ({'plain' if args.plain else 'leto'}, mesh {args.mesh})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
