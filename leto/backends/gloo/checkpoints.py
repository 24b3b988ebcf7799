"""Periodic checkpoints on a gloo rank: DCP saves beyond the retained tiers, and resuming.

A checkpoint is the last resort (every tier lost) and the way a job starts again from
disk. Its interval is the user's, or Young/Daly's for the measured save cost and step
time, agreed once by every rank. Sharded state (``shard = true``) is written and read
by each rank for its own shard (:mod:`leto.retained.dcp_shard`).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

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
from leto.retained.layout import RetainedLayout
from leto.retained.optim import RetainedOptimizer
from leto.retained.process_state import BatchCursor
from leto.retained.shard import FullParams
from leto.retained.staged_save import BackgroundSave, HostStage

from . import messages as M
from .channel import AgentChannel
from .collective import coll as _coll
from .process_groups import ProcessGroups
from .rank_memory import RankMemory
from .rank_state import RankState

__all__ = ["CheckpointHost", "Checkpoints"]


class CheckpointHost(Protocol):
    """What :class:`Checkpoints` reads of its rank's session."""

    @property
    def cfg(self) -> Any: ...
    @property
    def spec(self) -> dict[str, Any]: ...
    @property
    def store(self) -> Any: ...
    @property
    def ch(self) -> AgentChannel: ...
    @property
    def rank(self) -> int: ...
    @property
    def W(self) -> int: ...
    @property
    def gen(self) -> int: ...
    @property
    def model(self) -> nn.Module: ...
    @property
    def ropt(self) -> RetainedOptimizer | None: ...
    @property
    def full(self) -> FullParams | None: ...
    @property
    def layout(self) -> RetainedLayout: ...
    @property
    def cursor(self) -> BatchCursor: ...
    @property
    def sampler_state(self) -> dict[str, Any] | None: ...
    @property
    def memory(self) -> RankMemory: ...
    @property
    def ps(self) -> RankState: ...
    @property
    def groups(self) -> ProcessGroups: ...
    def _log(self, event: str, **kw: Any) -> None: ...


class Checkpoints:
    """One rank's part of the job's checkpoints (see the module docstring)."""

    def __init__(self, session: CheckpointHost) -> None:
        self.session = session
        self.save_s = 0.0  # the last checkpoint's save cost here
        self.step_t0 = 0.0  # when the start's checkpoint was done
        self.yd: int | None = None  # Young/Daly's checkpoint interval, once agreed
        self.first: int | None = None  # the job's first step (its time is Young/Daly's)
        self.stage = HostStage()  # checkpoint_async: the host buffers of the staged state
        self.inflight: BackgroundSave | None = None  # checkpoint_async: the save being written
        self.abandoned: list[BackgroundSave] = []  # cancelled saves whose thread may still run

    def interval(self, V: int) -> int:
        """The user's ``checkpoint_interval``; or, with ``checkpoint_mtbf`` only, Young/
        Daly's for the slowest rank's measured save cost (the start's checkpoint) and
        step time (the job's first step), agreed at that step by one collective of every
        rank (a promoted shadow, which measured neither, adds zeros), and kept in the
        job's store for the shadows promoted later."""
        session = self.session
        n = int(getattr(session.cfg, "checkpoint_interval", 0) or 0)
        mtbf = int(getattr(session.cfg, "checkpoint_mtbf", 0) or 0)
        if n or not mtbf or session.cfg.checkpoint_dir is None:
            return n
        if self.yd is None:
            key = f"leto/{session.spec['job']}/checkpoint_interval"
            if self.first is None:
                self.first = int(session.store.get(f"leto/{session.spec['job']}/first_step"))
            first = self.first
            if V == first:
                step_s = time.perf_counter() - self.step_t0 if self.step_t0 else 0.0
                t = torch.tensor([self.save_s, step_s], dtype=torch.float64)
                _coll(dist.all_reduce, t, op=dist.ReduceOp.MAX)
                self.yd = young_daly_interval(max(float(t[0]), 1e-6), mtbf, max(float(t[1]), 1e-6))
                if session.rank == 0:
                    session.store.set(key, str(self.yd))
            elif session.store.check([key]):
                self.yd = int(session.store.get(key))
            else:
                return 0
        return self.yd

    def reseed(self, store: Any) -> None:
        """The job's TCPStore moved (its coordinator failed over, and the store with it):
        what this rank knows of the keys a promoted shadow reads there, put back."""
        job = self.session.spec["job"]
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
        session = self.session
        if session.cfg.checkpoint_dir is None:
            return
        store = CheckpointStore(session.cfg.checkpoint_dir)
        latest = store.latest()
        if not first and latest is not None and latest >= V:
            return  # a recovery went back before the durable checkpoint: it still holds
        if first and resumed and latest == V:
            session.ch.send(M.CheckpointWritten(rank=session.rank, step=V, gen=session.gen))
            return
        if session.rank == 0:
            store.prune(V if first else latest, newer=first)
        assert session.ropt is not None
        if not first and getattr(session.cfg, "checkpoint_async", False):
            self._write_async(V, store)
            return
        t0 = time.perf_counter()
        if session.full is not None:  # sharded: each rank its own shard
            state = shard_training_state(
                session.model,
                session.ropt,
                session.full.plan,
                session.rank,
                session.memory.shard_groups,
            )
        else:
            state = training_state(session.model, session.ropt)
        _coll(store.write, V, state, no_dist=False)
        self.save_s = time.perf_counter() - t0
        if not first:
            session._log("checkpoint_stall", step=V, ms=round(self.save_s * 1e3, 3), mode="sync")
        store.write_rank_meta(V, session.rank, self._rank_meta(V))
        session.ch.send(M.CheckpointWritten(rank=session.rank, step=V, gen=session.gen))

    def _rank_meta(self, V: int) -> dict[str, Any]:
        """This rank's process state and checksums at ``V``, written beside the DCP files."""
        session = self.session
        lay = session.layout
        return {
            "step": V,
            "world_size": session.W,
            "chunk_numel": lay.chunk_numel,
            "checksums": [lay.stored_checksum(c) for c in range(lay.n_chunks)],
            "ps": session.ps.to_json(V),
        }

    def _write_async(self, V: int, store: CheckpointStore) -> None:
        """``SaveCheckpoint`` of step ``V`` with ``checkpoint_async`` (the module
        docstring): wait for the save in flight, stage, report ``CheckpointStaged``, and
        write the copy on a thread; its ``CheckpointWritten`` once the write completed."""
        session = self.session
        t0 = time.perf_counter()
        self.drain()
        if any(s.running and s.step == V for s in self.abandoned):
            # a cancelled save of this step still runs (its abort would remove this one's
            # files): this checkpoint is left out, the next due one is written
            session._log("checkpoint_skipped", step=V, why="a cancelled save of it still runs")
            return
        assert session.ropt is not None
        staged = self.stage.stage(training_state(session.model, session.ropt))
        meta = self._rank_meta(V)
        rank, gen, group = session.rank, session.gen, session.groups.ckpt_group
        session.ch.send(M.CheckpointStaged(rank=rank, step=V, gen=gen))
        stall = time.perf_counter() - t0
        session._log("checkpoint_stall", step=V, ms=round(stall * 1e3, 3), mode="async")

        def finish() -> None:
            store.write_rank_meta(V, rank, meta)
            session.ch.send(M.CheckpointWritten(rank=rank, step=V, gen=gen))

        self.inflight = BackgroundSave(
            V,
            write=lambda: store.write(V, staged, process_group=group, no_dist=False),
            finish=finish,
            abort=lambda: store.abort(V),
        )

    def drain(self) -> None:
        """Wait for the asynchronous save in flight (a checkpoint due meanwhile, the job's
        end), and for cancelled ones' threads (briefly: a recovery tore their group down).
        A save that failed outside a recovery raises its error here, on the training
        thread, as the synchronous save would have raised it."""
        for old in self.abandoned:
            old.wait(timeout=5.0)
        self.abandoned = [old for old in self.abandoned if old.running]
        s = self.inflight
        if s is None:
            return
        self.inflight = None
        if not s.wait() and s.error is not None and not s.cancelled:
            raise s.error

    def cancel(self) -> None:
        """A recovery began: the save in flight must not finish (its generation is over;
        the protocol's ``AbortCheckpoint``). Its thread ends when its group is torn down;
        its host buffers are dropped, since it may still read them."""
        s = self.inflight
        if s is None:
            return
        self.inflight = None
        s.cancel()
        if s.running:
            self.abandoned.append(s)
            self.stage.drop()

    def resume(self) -> int:
        """Start from the DCP checkpoint ``resume`` names (leto's, or any of this model):
        the model's and optimizer's state and, from a leto checkpoint of this world
        size, this rank's process state, checked bitwise; its step."""
        session = self.session
        src = str(session.cfg.resume)
        try:
            if session.full is not None:
                step = self._resume_shard(src)
            else:
                state, meta = read_checkpoint(src)
                assert session.ropt is not None
                if meta is None:
                    load_training_state(session.model, session.ropt, state, src)
                    session.ropt.set_version(0)
                    return 0
                step = int(meta["step"])
                load_model_state(session.model, state, src)
                load_retained_optimizer_state(session.layout, state, src)
                self._seal(step, meta, src)
        except CheckpointError as e:
            raise ConfigError("resume", str(e)) from None
        assert session.sampler_state is not None
        session.cursor.restore(session.sampler_state)
        return step

    def _resume_shard(self, src: str) -> int:
        """``resume`` with sharded state: this rank's shard of a leto checkpoint of this
        world size and chunk size; from a DCP checkpoint leto did not write, the model
        only (its optimizer state, by parameter, has none of leto's per-piece scalars)."""
        session = self.session
        assert session.full is not None and session.ropt is not None
        path = checkpoint_path(src)
        meta = read_meta(path)
        if meta is None:
            if has_optimizer_state(path):
                raise CheckpointError(
                    f"{path} holds optimizer state but no leto metadata: with shard = true, "
                    "a checkpoint leto did not write starts the model only (save the model "
                    "alone)"
                )
            load_shard_state(
                path,
                session.model,
                session.layout,
                session.full.plan,
                session.rank,
                src,
                optimizer=False,
            )
            session.ropt.set_version(0)
            return 0
        check_same_plan(meta, session.W, session.layout.chunk_numel, src)
        load_shard_state(path, session.model, session.layout, session.full.plan, session.rank, src)
        step = int(meta["step"])
        self._seal(step, meta, src)
        return step

    def _seal(self, step: int, meta: dict[str, Any], src: str) -> None:
        """After loading a leto checkpoint of ``step``: the version, this rank's process
        state (rank 0's at another world size) and, at the same plan, the checksums."""
        session = self.session
        assert session.ropt is not None
        session.ropt.set_version(step)
        same = meta.get("world_size") == session.W
        session.ps.load(meta["process_states"][str(session.rank) if same else "0"])
        if same and meta.get("chunk_numel") == session.layout.chunk_numel:
            rx.seal_checked(
                session.layout,
                step,
                meta["checksums"][str(session.rank)],
                src,
                f"rank {session.rank}",
            )

    def restore(self, step: int) -> None:
        """A recovery's fallback to the latest durable checkpoint (``step``): the model's
        and optimizer's state from the DCP files (sharded: this rank's shard), this
        rank's process state beside them, checked bitwise."""
        session = self.session
        store = CheckpointStore(str(session.cfg.checkpoint_dir))
        lay = session.layout
        where = f"the checkpoint of step {step} in {store.describe()}"
        if session.full is not None:
            path, meta = store.durable(step)  # checks the tree is private before loading
            rx.free_undo(lay)
            load_shard_state(path, session.model, lay, session.full.plan, session.rank, where)
        else:
            state, meta = store.read(step)
            rx.free_undo(lay)
            load_model_state(session.model, state, where)
            load_retained_optimizer_state(lay, state, where)
        r = str(session.rank)
        rx.seal_checked(lay, step, meta["checksums"][r], "disk checkpoint", f"rank {r}")
        lay.clear_prepared()
        session.ps.load(meta["process_states"][r])
