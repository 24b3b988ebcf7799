"""The fake engine's executors: one function per effect of the core.

``EXECUTORS`` maps every effect class (:mod:`leto.core.effects`) to the function that
carries it out on the simulated ranks' real tensors; ``tests/fake`` checks that every
effect has exactly one. The reconcile plan's ``RunRepair`` and ``Reconciled`` are
carried out together by :func:`.recovery.reconcile` (the ``Reconcile`` event), through
the one recovery executor (:mod:`leto.retained.recovery`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from leto.backends.base import FencedError, ProtocolRecord
from leto.core import effects as fx
from leto.core.chunk import NONE
from leto.core.cluster import ClusterState
from leto.core.recovery import Kind
from leto.core.trainer import TrainerState
from leto.core.txn import TxnState
from leto.retained.checkpoint import Checkpointer
from leto.retained.layout import ChecksumError
from leto.retained.parity import add_delta_, as_bytes
from leto.retained.process_state import (
    BatchCursor,
    capture_buffers,
    capture_rng,
    restore_rng,
    shard,
    step_scheduler,
)
from leto.retained.recovery import IntegrityError

from . import inspect, recovery, snapshots, tier1
from .backend import Fault
from .checkpoints import Checkpoints
from .faults import FaultPoints
from .host import RanksHost
from .rank import RankProc, RecoveryRecord, Replica, StepFn, UnrecoverableError

__all__ = ["EXECUTORS", "RECONCILE_EFFECTS", "ExecutorHost"]


class ExecutorHost(RanksHost, Protocol):
    """What the executors act on besides the ranks: the engine's executor half (the
    step function and batches, the core's record, fault points, shadows, fenced
    processes, checkpoints, the recovery under way and the timeline)."""

    @property
    def step_fn(self) -> StepFn | None: ...

    @property
    def cursor(self) -> BatchCursor: ...

    @property
    def record(self) -> ProtocolRecord: ...

    @property
    def n_chunks(self) -> int: ...

    @property
    def points(self) -> FaultPoints: ...

    @property
    def stale(self) -> dict[int, RankProc]: ...

    @property
    def checkpointer(self) -> Checkpointer | None: ...

    @property
    def checkpoints(self) -> Checkpoints: ...

    @property
    def current_step(self) -> int: ...

    #: the recovery under way (opened at Detected, closed at Resume)
    recovery_record: RecoveryRecord | None

    @property
    def integrity_notes(self) -> list[str]: ...

    @property
    def open_faults(self) -> list[Fault]: ...

    @property
    def recoveries(self) -> list[dict[str, Any]]: ...

    def new_shadow(self) -> Replica: ...

    def log(self, event: str, **kw: Any) -> None: ...


def forward_backward(
    host: ExecutorHost, a: fx.ForwardBackward, before: ClusterState, after: ClusterState
) -> None:
    r, step = a.rank, a.step
    p = host.procs[r]
    if host.step_fn is None:
        raise RuntimeError("no step function: pass one to train() / run_step()")
    batch = shard(host.cursor.batch(step), r, host.W)
    model = p.replica.model
    assert p.rng is not None
    restore_rng(p.rng)
    for prm in model.parameters():
        prm.grad = None
    loss = host.step_fn(model, batch)
    host.points.inside(r, step, "forward", adopt=False)
    loss.backward()  # type: ignore[no-untyped-call]
    host.points.inside(r, step, "backward", adopt=False)
    p.rng = capture_rng()
    lay = p.layout
    flat = torch.zeros(lay.numel, dtype=lay.dtype)
    present = torch.zeros(len(lay.params), dtype=torch.int64)
    for i, prm in enumerate(lay.params):
        g = prm.grad
        if g is not None:
            s = lay.slots[i]
            flat[s.offset : s.offset + s.numel].copy_(g.reshape(-1))
            present[i] = 1
        prm.grad = None
    p.work = host.backend.all_reduce(r, flat, tag=("grad", p.gen, step))
    p.pwork = host.backend.all_reduce(r, present, tag=("present", p.gen, step))
    p.loss = float(loss.detach())


def all_reduce_gradients(
    host: ExecutorHost, a: fx.AllReduceGradients, before: ClusterState, after: ClusterState
) -> None:
    r = a.rank
    p = host.procs[r]
    host.backend.check_writer(r, p.gen)
    assert p.work is not None and p.pwork is not None
    total = p.work.wait()
    counts = p.pwork.wait()
    total.div_(host.W)
    lay = p.layout
    store = host.store(r)
    keep = host.options.tier1 and store.gparity is not None
    old = None
    if keep:
        comp = store.gparity_versions[host.member(r)]
        gb = as_bytes(lay.grad_buffer)
        old = gb.clone() if comp != NONE else torch.zeros_like(gb)
    lay.clear_prepared()  # the old gradients are being overwritten
    with torch.no_grad():
        lay.grad_buffer.copy_(total)
    if old is not None:
        p.gdelta = as_bytes(lay.grad_buffer).clone().sub_(old)
    p.present = [bool(c > 0) for c in counts.tolist()]
    p.work = p.pwork = None


def write_gradient_parity(
    host: ExecutorHost, a: fx.WriteGradientParity, before: ClusterState, after: ClusterState
) -> None:
    r, step = a.rank, a.step
    p = host.procs[r]
    host.backend.check_writer(r, p.gen)
    lay = p.layout
    assert p.ropt is not None and p.present is not None
    if step != p.ropt.version + 1:
        raise IntegrityError(f"rank {r}: prepare({step}) but the optimizer is at {p.ropt.version}")
    if host.options.verify:
        # The step's gradients were computed from these bytes: a chunk that fails its
        # checksum now must not get a vote (the step is rolled back and recomputed).
        bad = lay.verify()
        if bad:
            raise ChecksumError(f"chunks {bad} fail their checksums at PREPARE of step {step}")
    lay.seal_grads(step, p.present)
    host.points.inside(r, step, "prepare", adopt=False)
    store = host.store(r)
    if host.options.tier1 and store.gparity is not None and p.gdelta is not None:
        store.gparity.add_(p.gdelta)
        store.gparity_versions[host.member(r)] = step
    store.pending[r] = json.dumps(
        {
            "step": step,
            "rng": p.rng,
            "sampler": host.cursor.state_after(step),
            "buffers": capture_buffers(p.replica.model),  # after this step's forward
            "present": p.present,
            "grad_checksums": lay.grads.checksums(),
        }
    )
    p.gdelta = None


def vote(host: ExecutorHost, a: fx.Vote, before: ClusterState, after: ClusterState) -> None:
    pass  # the vote is the coordinator's record (the core's ``prepared`` set)


def record_commit(
    host: ExecutorHost, a: fx.RecordCommit, before: ClusterState, after: ClusterState
) -> None:
    host.record.record_commit(a.step)


def save_undo(
    host: ExecutorHost, a: fx.SaveUndo, before: ClusterState, after: ClusterState
) -> None:
    r, c = a.rank, a.chunk
    p = host.procs[r]
    host.backend.check_writer(r, p.gen)
    assert p.ropt is not None
    step = before.step[r] + 1
    if before.pc[r] is TxnState.PREPARED:
        p.ropt.begin(step)
    p.ropt.save_undo(c)  # with verify: the chunk's checksum is checked first
    host.points.inside(r, step, "apply", chunk=c, where="undo_saved", adopt=True)


def apply_chunk(
    host: ExecutorHost, a: fx.ApplyChunk, before: ClusterState, after: ClusterState
) -> None:
    r, c, step = a.rank, a.chunk, a.step
    p = host.procs[r]
    assert p.ropt is not None
    ropt = p.ropt

    def tear() -> None:  # the trainer dies half way through writing the chunk
        ropt.apply_chunk(c, seal=False)
        lay = ropt.layout
        with torch.no_grad():
            for dst, src in zip(lay.chunk_data(c), lay.undo_data(c), strict=True):
                h = dst.numel() // 2
                dst[h:].copy_(src[h:])

    host.points.inside(r, step, "apply", chunk=c, where="mid_write", adopt=True, tear=tear)
    ropt.apply_chunk(c, seal=False)


def chunk_written(
    host: ExecutorHost, a: fx.ChunkWritten, before: ClusterState, after: ClusterState
) -> None:
    r, c, step = a.rank, a.chunk, a.step
    p = host.procs[r]
    host.backend.check_writer(r, p.gen)
    p.layout.seal_chunk(c, step)


def update_parity(
    host: ExecutorHost, a: fx.UpdateParity, before: ClusterState, after: ClusterState
) -> None:
    r, c, step = a.rank, a.chunk, a.step
    p = host.procs[r]
    host.backend.check_writer(r, p.gen)
    lay = p.layout
    store = host.store(r)
    if host.options.tier1 and store.parity is not None:
        m = host.member(r)
        if store.parity_versions[c][m] != step - 1:
            raise IntegrityError(
                f"rank {r} chunk {c}: the parity encodes version {store.parity_versions[c][m]}, "
                f"the undo copy is {step - 1}"
            )
        add_delta_(store.parity[c], lay.undo_data(c), lay.chunk_data(c))
        store.parity_versions[c][m] = step
        store.parity_checksums[c][m] = lay.stored_checksum(c)
    host.points.inside(r, step, "parity", chunk=c, adopt=True)


def release_undo(
    host: ExecutorHost, a: fx.ReleaseUndo, before: ClusterState, after: ClusterState
) -> None:
    p = host.procs[a.rank]
    assert p.ropt is not None
    p.ropt.finish_chunk(a.chunk)


def step_done(
    host: ExecutorHost, a: fx.StepDone, before: ClusterState, after: ClusterState
) -> None:
    r, step = a.rank, a.step
    p = host.procs[r]
    assert p.ropt is not None
    p.ropt.end()
    store = host.store(r)
    pend = json.loads(store.pending[r])  # kept: a tier-1 gradient rebuild may read it
    if pend["step"] != step:
        raise IntegrityError(f"rank {r}: the prepare record is of step {pend['step']}, not {step}")
    p.sampler_state = pend["sampler"]


def keep_process_state(
    host: ExecutorHost, a: fx.KeepProcessState, before: ClusterState, after: ClusterState
) -> None:
    """The step's loop tail (here the scheduler's step, which the engine takes for the
    user), then its closed process state kept by the rank's node: what a recovery to
    ``step`` restores (a rank that died before it replays the tail from ``step - 1``)."""
    r, step = a.rank, a.step
    p = host.procs[r]
    step_scheduler(p.replica.scheduler)
    hist = host.store(r).process_states.setdefault(r, {})
    hist[step] = p.ps_json(step)
    for old in [s for s in hist if s < step - 2]:
        del hist[old]


def tier2_snapshot(
    host: ExecutorHost, a: fx.TakeSnapshot, before: ClusterState, after: ClusterState
) -> None:
    snapshots.take(host, a.step)


def warm_shadow(
    host: ExecutorHost, a: fx.WarmShadow, before: ClusterState, after: ClusterState
) -> None:
    host.backend.spawn_shadow(a.rank, host.new_shadow)


def reclaim_shadow(
    host: ExecutorHost, a: fx.ReclaimShadow, before: ClusterState, after: ClusterState
) -> None:
    host.backend.reclaim_shadow(a.rank)


def crash(host: ExecutorHost, a: fx.Crash, before: ClusterState, after: ClusterState) -> None:
    host.backend.crash(a.rank)  # type: ignore[attr-defined]


def hang(host: ExecutorHost, a: fx.Hang, before: ClusterState, after: ClusterState) -> None:
    host.backend.hang(a.rank)  # type: ignore[attr-defined]


def lose_memory(
    host: ExecutorHost, a: fx.LoseMemory, before: ClusterState, after: ClusterState
) -> None:
    host.backend.lose_memory(a.rank)  # type: ignore[attr-defined]


def lose_node(
    host: ExecutorHost, a: fx.LoseNode, before: ClusterState, after: ClusterState
) -> None:
    host.backend.lose_node(a.node)  # type: ignore[attr-defined]
    for r in host.backend.ranks_of(a.node):
        host.stale.pop(r, None)  # its processes are gone with it


def detected(host: ExecutorHost, a: fx.Detected, before: ClusterState, after: ClusterState) -> None:
    if host.recovery_record is None:
        host.recovery_record = RecoveryRecord(
            from_step=host.current_step, started=time.perf_counter()
        )
        host.recovery_record.integrity.extend(host.integrity_notes)
        host.integrity_notes.clear()
    else:
        host.recovery_record.restarts += 1
        host.stats["recovery_restarts"] += 1
    host.recovery_record.failed = [f"rank {r} {after.trainer[r].name.lower()}" for r in a.ranks]


def fence(host: ExecutorHost, a: fx.Fence, before: ClusterState, after: ClusterState) -> None:
    gen = a.generation
    host.backend.fence(gen)
    for r, t in enumerate(before.trainer):
        if t is TrainerState.HUNG:  # a stale process lives on, fenced out
            host.stale[r] = host.procs[r]
            host.backend.crash(r)  # type: ignore[attr-defined]
    if host.recovery_record is not None:
        host.recovery_record.generation = gen


def abort_collectives(
    host: ExecutorHost, a: fx.AbortCollectives, before: ClusterState, after: ClusterState
) -> None:
    host.backend.abort(a.generation)
    for p in host.procs:
        p.work = p.pwork = None


def refuse_stale_write(
    host: ExecutorHost, a: fx.RefuseStaleWrite, before: ClusterState, after: ClusterState
) -> None:
    r = a.rank
    stale = host.stale.get(r)
    gen = stale.gen if stale is not None else -1
    try:
        host.backend.check_writer(r, gen)
    except FencedError:
        host.stats["stale_writes_refused"] += 1
        if host.recovery_record is not None:
            host.recovery_record.stale_refused += 1
    else:
        raise IntegrityError(f"rank {r}: the keeper accepted a write from generation {gen}")


def kill_stale(
    host: ExecutorHost, a: fx.KillStale, before: ClusterState, after: ClusterState
) -> None:
    host.stale.pop(a.rank, None)
    host.backend.kill(a.rank)


def stale_write_accepted(
    host: ExecutorHost, a: fx.StaleWriteAccepted, before: ClusterState, after: ClusterState
) -> None:
    raise IntegrityError("the no_fencing mutant cannot run on real tensors")


def promote(host: ExecutorHost, a: fx.Promote, before: ClusterState, after: ClusterState) -> None:
    r, gen = a.rank, a.generation
    replica = host.backend.promote_shadow(r, gen)
    host.procs[r] = RankProc(r, gen, replica)
    if host.recovery_record is not None:
        host.recovery_record.promoted.append(r)


def spawn_shadow(
    host: ExecutorHost, a: fx.SpawnShadow, before: ClusterState, after: ClusterState
) -> None:
    pass  # a replacement starts spawning; it is warm at ShadowWarm


def fallback(host: ExecutorHost, a: fx.Fallback, before: ClusterState, after: ClusterState) -> None:
    if host.checkpointer is None:
        raise UnrecoverableError(recovery.lost_message(host.backend.topology, before, a.reason))


def job_failed(
    host: ExecutorHost, a: fx.JobFailed, before: ClusterState, after: ClusterState
) -> None:
    raise UnrecoverableError(
        f"the recovery deadline passed while {a.phase} (generation {a.generation}): the job stopped"
    )


def save_checkpoint(
    host: ExecutorHost, a: fx.SaveCheckpoint, before: ClusterState, after: ClusterState
) -> None:
    host.checkpoints.write(a.step)


def publish_checkpoint(
    host: ExecutorHost, a: fx.PublishCheckpoint, before: ClusterState, after: ClusterState
) -> None:
    host.checkpoints.publish(a.step)


def abort_checkpoint(
    host: ExecutorHost, a: fx.AbortCheckpoint, before: ClusterState, after: ClusterState
) -> None:
    host.checkpoints.abort(a.step)


def load_checkpoint(
    host: ExecutorHost, a: fx.LoadCheckpoint, before: ClusterState, after: ClusterState
) -> None:
    host.checkpoints.restore(before, a.step)
    recovery.note_recovered(
        host.recovery_record, Kind.CKPT.value, a.step, before.committed - a.step
    )
    host.stats["checkpoint_restores"] += 1


def rebuild_communicator(
    host: ExecutorHost, a: fx.RebuildCommunicator, before: ClusterState, after: ClusterState
) -> None:
    gen = a.generation
    host.backend.rebuild(gen)
    for p in host.procs:
        p.gen = gen


def resume(host: ExecutorHost, a: fx.Resume, before: ClusterState, after: ClusterState) -> None:
    for p in host.procs:
        p.work = p.pwork = None
        p.gdelta = None
        p.present = None
    sampler = host.procs[0].sampler_state
    assert sampler is not None
    host.cursor.restore(sampler)
    if host.options.check:
        wrong = inspect.mismatches(host, after) + tier1.exact(host, host.n_chunks)
        if wrong:
            raise IntegrityError(f"after recovery the real state differs from the core's: {wrong}")
    for f in host.open_faults:
        f.recovered += 1
    host.open_faults.clear()
    rec = host.recovery_record
    host.recovery_record = None
    host.stats["recoveries"] += 1
    if rec is not None:
        ms = round((time.perf_counter() - rec.started) * 1e3, 3)
        entry = {
            "from_step": rec.from_step,
            "generation": a.generation,
            "failed": rec.failed,
            "promoted": rec.promoted,
            "kind": rec.kind,
            "resumed_at": a.step,
            "steps_lost": rec.loss,
            "chunks_repaired_from_parity": rec.tier1_chunks,
            "grad_blocks_repaired_from_parity": rec.tier1_grads,
            "chunks_rolled_forward": rec.forward_chunks,
            "rolled_back": rec.dropped,
            "integrity_failures": rec.integrity,
            "stale_writes_refused": rec.stale_refused,
            "restarts": rec.restarts,
            "ms": ms,
        }
        host.recoveries.append(entry)
        host.log("recovered", step=a.step, **entry)


Executor = Callable[[ExecutorHost, Any, ClusterState, ClusterState], None]

#: One executor per effect of the core (``tests/fake`` checks every effect has one).
#: The reconcile plan's ``Repair`` and ``Reconciled`` are carried out together by
#: :func:`.recovery.reconcile`, which ``execute`` calls for the ``Reconcile`` event.
EXECUTORS: dict[type[fx.Effect], Executor] = {
    fx.ForwardBackward: forward_backward,
    fx.AllReduceGradients: all_reduce_gradients,
    fx.WriteGradientParity: write_gradient_parity,
    fx.Vote: vote,
    fx.RecordCommit: record_commit,
    fx.SaveUndo: save_undo,
    fx.ApplyChunk: apply_chunk,
    fx.ChunkWritten: chunk_written,
    fx.UpdateParity: update_parity,
    fx.ReleaseUndo: release_undo,
    fx.StepDone: step_done,
    fx.KeepProcessState: keep_process_state,
    fx.TakeSnapshot: tier2_snapshot,
    fx.WarmShadow: warm_shadow,
    fx.ReclaimShadow: reclaim_shadow,
    fx.SpawnShadow: spawn_shadow,
    fx.Crash: crash,
    fx.Hang: hang,
    fx.LoseMemory: lose_memory,
    fx.LoseNode: lose_node,
    fx.StaleWriteAccepted: stale_write_accepted,
    fx.RefuseStaleWrite: refuse_stale_write,
    fx.KillStale: kill_stale,
    fx.Detected: detected,
    fx.Fence: fence,
    fx.AbortCollectives: abort_collectives,
    fx.Promote: promote,
    fx.Fallback: fallback,
    fx.JobFailed: job_failed,
    fx.SaveCheckpoint: save_checkpoint,
    fx.PublishCheckpoint: publish_checkpoint,
    fx.AbortCheckpoint: abort_checkpoint,
    fx.LoadCheckpoint: load_checkpoint,
    fx.RebuildCommunicator: rebuild_communicator,
    fx.Resume: resume,
}
#: carried out by recovery.reconcile as a whole
RECONCILE_EFFECTS = (fx.RunRepair, fx.Reconciled)
