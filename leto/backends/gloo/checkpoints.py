"""Periodic checkpoints on a gloo rank: DCP saves beyond the retained tiers, and resuming.

A checkpoint is the last resort (every tier lost) and the way a job starts again from
disk. Its interval is the user's, or Young/Daly's for the measured save cost and step
time, agreed once by every rank. Sharded state (``shard = true``) is written and read
by each rank for its own shard (:mod:`leto.retained.dcp_shard`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from leto.errors import ConfigError
from leto.retained import recovery as rx
from leto.retained.checkpoint import CheckpointError, CheckpointStore, read_meta
from leto.retained.dcp_shard import (
    check_same_plan,
    has_optimizer_state,
    load_shard_state,
    shard_training_state,
)
from leto.retained.dcp_state import (
    checkpoint_path,
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

    def maybe_write(self, V: int) -> None:
        """The periodic checkpoint of step ``V``, if the interval says so."""
        interval = self.interval(V)
        if interval and V % interval == 0:
            self.write(V)

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
        if s.full is not None:  # sharded: each rank its own shard
            state = shard_training_state(
                s.model, s.ropt, s.full.plan, s.rank, s.memory.shard_groups
            )
        else:
            state = training_state(s.model, s.ropt)
        _coll(store.write, V, state, no_dist=False)
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
            if s.full is not None:
                step = self._resume_shard(src)
            else:
                state, meta = read_checkpoint(src)
                assert s.ropt is not None
                if meta is None:
                    load_training_state(s.model, s.ropt, state, src)
                    s.ropt.set_version(0)
                    return 0
                step = int(meta["step"])
                load_model_state(s.model, state, src)
                load_retained_optimizer_state(s.layout, state, src)
                self._seal(step, meta, src)
        except CheckpointError as e:
            raise ConfigError("resume", str(e)) from None
        s.cursor.restore(s.sampler_state)
        return step

    def _resume_shard(self, src: str) -> int:
        """``resume`` with sharded state: this rank's shard of a leto checkpoint of this
        world size and chunk size; from a DCP checkpoint leto did not write, the model
        only (its optimizer state, by parameter, has none of leto's per-piece scalars)."""
        s = self.s
        assert s.full is not None and s.ropt is not None
        path = checkpoint_path(src)
        meta = read_meta(path)
        if meta is None:
            if has_optimizer_state(path):
                raise CheckpointError(
                    f"{path} holds optimizer state but no leto metadata: with shard = true, "
                    "a checkpoint leto did not write starts the model only (save the model "
                    "alone)"
                )
            load_shard_state(path, s.model, s.layout, s.full.plan, s.rank, src, optimizer=False)
            s.ropt.set_version(0)
            return 0
        check_same_plan(meta, s.W, s.layout.chunk_numel, src)
        load_shard_state(path, s.model, s.layout, s.full.plan, s.rank, src)
        step = int(meta["step"])
        self._seal(step, meta, src)
        return step

    def _seal(self, step: int, meta: dict[str, Any], src: str) -> None:
        """After loading a leto checkpoint of ``step``: the version, this rank's process
        state (rank 0's at another world size) and, at the same plan, the checksums."""
        s = self.s
        assert s.ropt is not None
        s.ropt.set_version(step)
        same = meta.get("world_size") == s.W
        s.ps.load(meta["process_states"][str(s.rank) if same else "0"])
        if same and meta.get("chunk_numel") == s.layout.chunk_numel:
            rx.seal_checked(s.layout, step, meta["checksums"][str(s.rank)], src, f"rank {s.rank}")

    def restore(self, step: int) -> None:
        """A recovery's fallback to the latest durable checkpoint (``step``): the model's
        and optimizer's state from the DCP files (sharded: this rank's shard), this
        rank's process state beside them, checked bitwise."""
        s = self.s
        store = CheckpointStore(str(s.cfg.checkpoint_dir))
        lay = s.layout
        where = f"the checkpoint of step {step} in {store.describe()}"
        if s.full is not None:
            path, meta = store.durable(step)  # checks the tree is private before loading
            rx.free_undo(lay)
            load_shard_state(path, s.model, lay, s.full.plan, s.rank, where)
        else:
            state, meta = store.read(step)
            rx.free_undo(lay)
            load_model_state(s.model, state, where)
            load_retained_optimizer_state(lay, state, where)
        r = str(s.rank)
        rx.seal_checked(lay, step, meta["checksums"][r], "disk checkpoint", f"rank {r}")
        lay.clear_prepared()
        s.ps.load(meta["process_states"][r])
