"""Disk checkpoints on the simulated ranks: the fallback below both tiers.

The core decides when a checkpoint is written (BeginCheckpoint, each writer's
WriteShard, CheckpointDurable) and when a recovery falls back to one (GoFallback,
RestoreCheckpoint); :class:`Checkpoints` writes, publishes and loads them, and keeps
what a checkpoint in flight needs between its events. A run can also start from a DCP
checkpoint (:meth:`Checkpoints.resume`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from leto.core import events as ev
from leto.core.chunk import LOST, NONE
from leto.core.cluster import ClusterState
from leto.retained import recovery as rx
from leto.retained.dcp_state import (
    load_model_state,
    load_retained_optimizer_state,
    load_training_state,
    training_state,
    young_daly_interval,
)

from .layouts import ensure
from .recovery import rebuild_redundancy

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Checkpoints"]


class Checkpoints:
    """The engine's checkpoints through its ``checkpointer`` (none: no fallback)."""

    def __init__(self, eng: Engine, interval: int) -> None:
        self.eng = eng
        #: steps between checkpoints (0: only step 0's, unless Young/Daly sets it)
        self.interval = interval
        self._meta: dict[int, dict[str, Any]] = {}  # written, not yet published
        self._save_s = 0.0  # the last checkpoint's save cost (Young/Daly)

    def write(self, step: int) -> None:
        """``SaveCheckpoint``: the model's and optimizer's own state dicts at ``step``,
        written once for the replica group (every simulated rank holds the same
        replica: rank 0 writes it), the process states and checksums kept for
        :meth:`publish`."""
        eng = self.eng
        assert eng.checkpointer is not None
        t0 = time.perf_counter()
        p0 = eng.procs[0]
        assert p0.ropt is not None
        eng.checkpointer.write(step, training_state(p0.replica.model, p0.ropt, copy=True))
        self._save_s = time.perf_counter() - t0
        self._meta[step] = {
            "step": step,
            "world_size": eng.W,
            "checksums": {
                str(p.rank): [p.layout.stored_checksum(c) for c in range(p.layout.n_chunks)]
                for p in eng.procs
            },
            "process_states": {
                str(p.rank): eng._store(p.rank).process_states[p.rank][step] for p in eng.procs
            },
            "n_chunks": p0.layout.n_chunks,
            "chunk_numel": p0.layout.chunk_numel,
        }

    def publish(self, step: int) -> None:
        """``PublishCheckpoint``: every writer finished; the checkpoint is the fallback."""
        eng = self.eng
        assert eng.checkpointer is not None
        eng.checkpointer.publish(step, self._meta.pop(step))
        eng.stats["checkpoints_durable"] += 1
        eng._log(
            "checkpoint", step=step, detail=f"step {step} durable in {eng.checkpointer.describe()}"
        )

    def abort(self, step: int) -> None:
        """``AbortCheckpoint``: a failure interrupted it; nothing of it is kept."""
        if self.eng.checkpointer is not None:
            self.eng.checkpointer.abort(step)
        self._meta.pop(step, None)

    def due(self, step: int) -> bool:
        """Is a checkpoint due after ``step`` (none in flight, the interval passed)?"""
        eng = self.eng
        s = eng.state
        if eng.checkpointer is None or s.cpend != NONE:
            return False
        if self.interval <= 0 and eng.options.checkpoint_mtbf > 0 and self._save_s > 0:
            step_s = (time.perf_counter() - eng._t0) / max(1, eng.stats["steps_run"])
            self.interval = young_daly_interval(self._save_s, eng.options.checkpoint_mtbf, step_s)
        return self.interval > 0 and step - s.ckpt >= self.interval

    def take(self) -> None:
        """The protocol's checkpoint: BeginCheckpoint (the writers save), each writer's
        WriteShard, CheckpointDurable (published). The fake backend writes at once."""
        eng = self.eng
        eng.feed(ev.BeginCheckpoint())
        for r in range(eng.W):
            eng.feed(ev.WriteShard(r))
        eng.feed(ev.CheckpointDurable())

    def restore(self, before: ClusterState, step: int) -> None:
        """``LoadCheckpoint``: every rank loads the checkpoint of ``step``, checked
        bitwise against its checksums, and the redundancy is rebuilt at ``step``."""
        eng = self.eng
        assert eng.checkpointer is not None
        lost = {r for r in range(eng.W) if all(d == LOST for d in before.data[r])}
        for r in range(eng.W):
            ensure(eng, r, r in lost)
            rx.free_undo(eng.procs[r].layout)
        state, meta = eng.checkpointer.read(step)
        where = f"the checkpoint of step {step} in {eng.checkpointer.describe()}"
        for p in eng.procs:
            load_model_state(p.replica.model, state, where)
            load_retained_optimizer_state(p.layout, state, where)
            rx.seal_checked(
                p.layout, step, meta["checksums"][str(p.rank)], "disk checkpoint", f"rank {p.rank}"
            )
            p.layout.clear_prepared()
            p.load_ps(meta["process_states"][str(p.rank)])
        rebuild_redundancy(eng, step)

    def resume(self, state: dict[str, Any], meta: dict[str, Any] | None, where: str) -> None:
        """Start from a DCP checkpoint: every rank loads it (the same state: the ranks
        are replicas); a leto checkpoint of this world size also restores each rank's
        process state and is checked bitwise against its checksums."""
        eng = self.eng
        step = int(meta["step"]) if meta is not None else 0
        same_world = meta is not None and meta.get("world_size") == eng.W
        for p in eng.procs:
            assert p.ropt is not None
            if meta is None:
                load_training_state(p.replica.model, p.ropt, state, where)
            else:
                load_model_state(p.replica.model, state, where)
                load_retained_optimizer_state(p.layout, state, where)
            p.ropt.set_version(step)
            if meta is None:
                continue
            p.load_ps(meta["process_states"][str(p.rank) if same_world else "0"])
            if same_world and meta.get("chunk_numel") == p.layout.chunk_numel:
                rx.seal_checked(
                    p.layout, step, meta["checksums"][str(p.rank)], where, f"rank {p.rank}"
                )
        sampler = eng.procs[0].sampler_state
        assert sampler is not None
        eng.cursor.restore(sampler)
