"""Disk checkpoints on the simulated ranks: the fallback below both tiers.

The core decides when a checkpoint is written (BeginCheckpoint, each writer's
WriteShard, CheckpointDurable) and when a recovery falls back to one (GoFallback,
RestoreCheckpoint); :class:`Checkpoints` writes, publishes and loads them, and keeps
what a checkpoint in flight needs between its events. A run can also start from a DCP
checkpoint (:meth:`Checkpoints.resume`).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from leto.core import events as ev
from leto.core.chunk import LOST, NONE
from leto.core.cluster import ClusterState
from leto.retained import recovery as rx
from leto.retained.checkpoint import Checkpointer
from leto.retained.dcp_state import (
    load_model_state,
    load_retained_optimizer_state,
    load_training_state,
    training_state,
    young_daly_interval,
)
from leto.retained.process_state import BatchCursor

from .host import RanksHost
from .layouts import ensure
from .recovery import rebuild_redundancy

__all__ = ["CheckpointHost", "Checkpoints"]


class CheckpointHost(RanksHost, Protocol):
    """What checkpoints read and feed besides the ranks: the core (its state, and the
    checkpoint's events), the batch cursor a resume restores, the timeline."""

    @property
    def state(self) -> ClusterState: ...

    @property
    def cursor(self) -> BatchCursor: ...

    def feed(self, e: ev.Event) -> None: ...

    def log(self, event: str, **kw: Any) -> None: ...


class Checkpoints:
    """The engine's checkpoints through its ``checkpointer`` (none: no fallback).

    ``started``: when the run started (``time.perf_counter``), for Young/Daly's step
    time."""

    def __init__(
        self,
        host: CheckpointHost,
        checkpointer: Checkpointer | None,
        interval: int,
        *,
        started: float,
    ) -> None:
        self.host = host
        self.checkpointer = checkpointer
        self._started = started
        #: steps between checkpoints (0: only step 0's, unless Young/Daly sets it)
        self.interval = interval
        self._meta: dict[int, dict[str, Any]] = {}  # written, not yet published
        self._save_s = 0.0  # the last checkpoint's save cost (Young/Daly)

    def write(self, step: int) -> None:
        """``SaveCheckpoint``: the model's and optimizer's own state dicts at ``step``,
        written once for the replica group (every simulated rank holds the same
        replica: rank 0 writes it), the process states and checksums kept for
        :meth:`publish`."""
        host, checkpointer = self.host, self.checkpointer
        assert checkpointer is not None
        t0 = time.perf_counter()
        p0 = host.procs[0]
        assert p0.ropt is not None
        checkpointer.write(step, training_state(p0.replica.model, p0.ropt, copy=True))
        self._save_s = time.perf_counter() - t0
        self._meta[step] = {
            "step": step,
            "world_size": host.W,
            "checksums": {
                str(p.rank): [p.layout.stored_checksum(c) for c in range(p.layout.n_chunks)]
                for p in host.procs
            },
            "process_states": {
                str(p.rank): host.store(p.rank).process_states[p.rank][step] for p in host.procs
            },
            "n_chunks": p0.layout.n_chunks,
            "chunk_numel": p0.layout.chunk_numel,
        }

    def publish(self, step: int) -> None:
        """``PublishCheckpoint``: every writer finished; the checkpoint is the fallback."""
        host, checkpointer = self.host, self.checkpointer
        assert checkpointer is not None
        checkpointer.publish(step, self._meta.pop(step))
        host.stats["checkpoints_durable"] += 1
        host.log(
            "checkpoint", step=step, detail=f"step {step} durable in {checkpointer.describe()}"
        )

    def abort(self, step: int) -> None:
        """``AbortCheckpoint``: a failure interrupted it; nothing of it is kept."""
        if self.checkpointer is not None:
            self.checkpointer.abort(step)
        self._meta.pop(step, None)

    def due(self, step: int) -> bool:
        """Is a checkpoint due after ``step`` (none in flight, the interval passed)?"""
        host = self.host
        s = host.state
        if self.checkpointer is None or s.cpend != NONE:
            return False
        if self.interval <= 0 and host.options.checkpoint_mtbf > 0 and self._save_s > 0:
            step_s = (time.perf_counter() - self._started) / max(1, host.stats["steps_run"])
            self.interval = young_daly_interval(self._save_s, host.options.checkpoint_mtbf, step_s)
        return self.interval > 0 and step - s.ckpt >= self.interval

    def take(self) -> None:
        """The protocol's checkpoint: BeginCheckpoint (the writers save), each writer's
        WriteShard, CheckpointDurable (published). The fake backend writes at once."""
        host = self.host
        host.feed(ev.BeginCheckpoint())
        for r in range(host.W):
            host.feed(ev.WriteShard(r))
        host.feed(ev.CheckpointDurable())

    def restore(self, before: ClusterState, step: int) -> None:
        """``LoadCheckpoint``: every rank loads the checkpoint of ``step``, checked
        bitwise against its checksums, and the redundancy is rebuilt at ``step``."""
        host, checkpointer = self.host, self.checkpointer
        assert checkpointer is not None
        lost = {r for r in range(host.W) if all(d == LOST for d in before.data[r])}
        for r in range(host.W):
            ensure(host, r, r in lost)
            rx.free_undo(host.procs[r].layout)
        state, meta = checkpointer.read(step)
        where = f"the checkpoint of step {step} in {checkpointer.describe()}"
        for p in host.procs:
            load_model_state(p.replica.model, state, where)
            load_retained_optimizer_state(p.layout, state, where)
            rx.seal_checked(
                p.layout, step, meta["checksums"][str(p.rank)], "disk checkpoint", f"rank {p.rank}"
            )
            p.layout.clear_prepared()
            p.load_ps(meta["process_states"][str(p.rank)])
        rebuild_redundancy(host, step)

    def resume(self, state: dict[str, Any], meta: dict[str, Any] | None, where: str) -> None:
        """Start from a DCP checkpoint: every rank loads it (the same state: the ranks
        are replicas); a leto checkpoint of this world size also restores each rank's
        process state and is checked bitwise against its checksums."""
        host = self.host
        step = int(meta["step"]) if meta is not None else 0
        same_world = meta is not None and meta.get("world_size") == host.W
        for p in host.procs:
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
        sampler = host.procs[0].sampler_state
        assert sampler is not None
        host.cursor.restore(sampler)
