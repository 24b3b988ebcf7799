"""Periodic checkpoints on a gloo rank: DCP saves beyond the retained tiers, and resuming.

A checkpoint is the last resort (every tier lost) and the way a job starts again from
disk. Its interval is the user's, or Young/Daly's for the measured save cost and step
time, agreed once by every rank.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from leto.errors import ConfigError
from leto.retained import recovery as rx
from leto.retained.checkpoint import CheckpointError, CheckpointStore
from leto.retained.dcp_state import (
    load_model_state,
    load_retained_optimizer_state,
    load_training_state,
    read_checkpoint,
    training_state,
    young_daly_interval,
)

from . import messages as M
from .collective import coll as _coll

if TYPE_CHECKING:
    from .runtime import GlooSession

__all__ = ["Checkpoints"]


class Checkpoints:
    """One rank's part of the job's checkpoints (see the module docstring)."""

    def __init__(self, session: GlooSession) -> None:
        self.s = session
        self.save_s = 0.0  # the last checkpoint's save cost here
        self.step_t0 = 0.0  # when the start's checkpoint was done
        self.yd: int | None = None  # Young/Daly's checkpoint interval, once agreed
        self.first: int | None = None  # the job's first step (its time is Young/Daly's)

    def interval(self, V: int) -> int:
        """The user's ``checkpoint_interval``; or, with ``checkpoint_mtbf`` only, Young/
        Daly's for the slowest rank's measured save cost (the start's checkpoint) and
        step time (the job's first step), agreed at that step by one collective of every
        rank (a promoted shadow, which measured neither, adds zeros), and kept in the
        job's store for the shadows promoted later."""
        s = self.s
        n = int(getattr(s.cfg, "checkpoint_interval", 0) or 0)
        mtbf = int(getattr(s.cfg, "checkpoint_mtbf", 0) or 0)
        if n or not mtbf or s.cfg.checkpoint_dir is None:
            return n
        if self.yd is None:
            key = f"leto/{s.spec['job']}/checkpoint_interval"
            if self.first is None:
                self.first = int(s.store.get(f"leto/{s.spec['job']}/first_step"))
            first = self.first
            if V == first:
                step_s = time.perf_counter() - self.step_t0 if self.step_t0 else 0.0
                t = torch.tensor([self.save_s, step_s], dtype=torch.float64)
                _coll(dist.all_reduce, t, op=dist.ReduceOp.MAX)
                self.yd = young_daly_interval(max(float(t[0]), 1e-6), mtbf, max(float(t[1]), 1e-6))
                if s.rank == 0:
                    s.store.set(key, str(self.yd))
            elif s.store.check([key]):
                self.yd = int(s.store.get(key))
            else:
                return 0
        return self.yd

    def reseed(self, store: Any) -> None:
        """The job's TCPStore moved (its coordinator failed over, and the store with it):
        what this rank knows of the keys a promoted shadow reads there, put back."""
        job = self.s.spec["job"]
        if self.first is not None:
            store.set(f"leto/{job}/first_step", str(self.first))
        if self.yd is not None:
            store.set(f"leto/{job}/checkpoint_interval", str(self.yd))

    def write(self, V: int, *, first: bool = False, resumed: bool = False) -> None:
        """``SaveCheckpoint`` of step ``V``: this rank's part of one collective DCP save of
        the model's and optimizer's own state dicts (DCP's planner writes each replicated
        tensor once: once per data-parallel replica group, not W copies), then its
        process state and checksums beside it; its report feeds ``WriteShard``, and the
        coordinator feeds ``CheckpointDurable`` once every rank reported. ``first``: the
        job's start (durable in the model from the start): a job resumed from this
        directory's checkpoint of ``V`` keeps it; a fresh one drops what a former run left
        in the directory."""
        s = self.s
        if s.cfg.checkpoint_dir is None:
            return
        store = CheckpointStore(s.cfg.checkpoint_dir)
        latest = store.latest()
        if not first and latest is not None and latest >= V:
            return  # a recovery went back before the durable checkpoint: it still holds
        if first and resumed and latest == V:
            s.ch.send(M.CheckpointWritten(rank=s.rank, step=V, gen=s.gen))
            return
        if s.rank == 0:
            store.prune(V if first else latest, newer=first)
        assert s.ropt is not None
        t0 = time.perf_counter()
        _coll(store.write, V, training_state(s.model, s.ropt), no_dist=False)
        self.save_s = time.perf_counter() - t0
        lay = s.layout
        store.write_rank_meta(
            V,
            s.rank,
            {
                "step": V,
                "world_size": s.W,
                "chunk_numel": lay.chunk_numel,
                "checksums": [lay.stored_checksum(c) for c in range(lay.n_chunks)],
                "ps": s.ps.to_json(V),
            },
        )
        s.ch.send(M.CheckpointWritten(rank=s.rank, step=V, gen=s.gen))

    def resume(self) -> int:
        """Start from the DCP checkpoint ``resume`` names (leto's, or any of this model):
        the model's and optimizer's state and, from a leto checkpoint of this world
        size, this rank's process state, checked bitwise; its step."""
        s = self.s
        src = str(s.cfg.resume)
        try:
            state, meta = read_checkpoint(src)
            assert s.ropt is not None
            if meta is None:
                load_training_state(s.model, s.ropt, state, src)
                s.ropt.set_version(0)
                return 0
            step = int(meta["step"])
            load_model_state(s.model, state, src)
            load_retained_optimizer_state(s.layout, state, src)
            s.ropt.set_version(step)
            ranks = meta["process_states"]
            same = meta.get("world_size") == s.W
            s.ps.load(ranks[str(s.rank) if same else "0"])
            if same and meta.get("chunk_numel") == s.layout.chunk_numel:
                rx.seal_checked(
                    s.layout, step, meta["checksums"][str(s.rank)], src, f"rank {s.rank}"
                )
        except CheckpointError as e:
            raise ConfigError("resume", str(e)) from None
        s.cursor.restore(s.sampler_state)
        return step
