"""The engine: leto's protocol core driven over real tensors on a backend.

Two halves:

* the **executor** (:meth:`Engine.execute`) carries out the effects of one core
  event on real tensors: forward/backward on a rank's model, the gradient
  all-reduce into retained memory, PREPARE (seal the gradients, gradient parity,
  the prepare record), APPLY chunk by chunk (undo copy, write, seal, tier-1
  parity, release), FINISH (process state), tier-2 snapshots, faults, fencing,
  promotion, and the recovery plan (roll forward from undo copies and retained
  gradients, roll back, rebuild chunks and gradients from tier-1 parity, restore
  the tier-2 snapshot, load the disk checkpoint), followed by a check of every
  chunk's checksum before anything resumes;
* the **driver** (:meth:`Engine.run_step`, :meth:`Engine.recover`,
  :meth:`Engine.train`) feeds the core's :class:`~leto.core.cluster.ClusterModel`
  the events of each step in a fixed order, consults the backend's fault
  injector at every point of the step, and on a failure runs the recovery
  events (Detect, Fence, Promote, EndPromote, Reconcile or GoFallback +
  RestoreCheckpoint, Rebuild, Resume) through the core.

The core's state and COMMIT records live in the backend's
:class:`~leto.backends.base.ProtocolRecord`, never in a trainer. The Hypothesis
machine in ``tests/fake`` drives the executor alone, with events it picks.

Per rank ("process"): a model, its torch optimizer and LR scheduler (one deep copy
of the user's per simulated rank), a retained layout with a chunked optimizer
over it, and the rank's RNG state. Process state (optimizer scalars, scheduler,
sampler position, RNG) is JSON in the node agent's memory (tier 1 of the small
state: it survives a rank's memory loss) and in the tier-2 snapshot.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from leto.backends.base import (
    Backend,
    FencedError,
    NodeStore,
    ProtocolRecord,
    Snapshot,
    Work,
)
from leto.core import effects as fx
from leto.core import events as ev
from leto.core import schedule
from leto.core.chunk import LOST, NONE
from leto.core.cluster import ClusterConfig, ClusterModel, ClusterState, Effect
from leto.core.recovery import Kind, Phase
from leto.core.shadow import ShadowState
from leto.core.trainer import TrainerState
from leto.core.txn import TxnState
from leto.errors import ConfigError
from leto.retained import recovery as rx
from leto.retained.checkpoint import Checkpointer
from leto.retained.layout import (
    ChecksumError,
    ChunkStatus,
    LayoutError,
    RetainedLayout,
    ShapeMismatchError,
)
from leto.retained.optim import RetainedOptimizer, is_chunkable, retain
from leto.retained.parity import (
    add_delta_,
    as_bytes,
    decode_rotated,
    encode,
    encode_rotated,
)
from leto.retained.process_state import (
    BatchCursor,
    capture_rng,
    restore_rng,
    scheduler_state,
    shard,
    step_scheduler,
)
from leto.retained.recovery import IntegrityError

__all__ = [
    "Engine",
    "EngineOptions",
    "InjectedFault",
    "IntegrityError",
    "RankProc",
    "Replica",
    "UnrecoverableError",
]

StepFn = Callable[[nn.Module, Any], torch.Tensor]
RECOVERY_EVENTS = ("Fence", "Promote", "EndPromote", "Reconcile", "Rebuild", "Resume")


class UnrecoverableError(RuntimeError):
    """The loss is beyond both tiers and no checkpoint is configured: training stops."""


class InjectedFault(Exception):
    """A planned fault struck inside an event's effects (carried out by the driver)."""

    def __init__(self, faults: list[Any], adopt: bool) -> None:
        super().__init__(", ".join(f.label for f in faults))
        self.faults = faults
        self.adopt = adopt  # does the event's transition count as done?


class _Interrupted(Exception):
    """A step was interrupted by a failure: recover."""


@dataclass
class Replica:
    """One trainer's torch objects: model, its optimizer, its scheduler."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None


@dataclass
class RankProc:
    """One rank's trainer process (simulated): its objects and per-step scratch."""

    rank: int
    gen: int
    replica: Replica
    ropt: RetainedOptimizer | None = None
    rng: dict[str, Any] | None = None
    sampler_state: dict[str, Any] | None = None
    work: Work | None = None
    pwork: Work | None = None
    present: list[bool] | None = None
    gdelta: torch.Tensor | None = None
    loss: float | None = None

    @property
    def layout(self) -> RetainedLayout:
        return rx.layout_of(self.ropt, f"rank {self.rank}")


@dataclass
class EngineOptions:
    chunk_numel: int
    tier1: bool = True
    tier2: bool = True
    tier2_interval: int = 10
    verify: bool = True
    align_bytes: int = 256
    max_steps: int = 10**9
    check: bool = False  # after each recovery: real state vs the core's, parity bytes exact


def copy_replica(rep: Replica, *, clear_state: bool = False) -> Replica:
    """A deep copy of model, optimizer and scheduler that keeps their links."""
    model, opt, sched = copy.deepcopy((rep.model, rep.optimizer, rep.scheduler))
    if clear_state:
        opt.state.clear()
    return Replica(model, opt, sched)


def _named_buffers(lay: RetainedLayout) -> list[tuple[str, torch.Tensor]]:
    return [("param", lay.param_buffer)] + [("state." + s, lay.state_buffer(s)) for s in lay.states]


@dataclass
class _Recovery:
    """What one recovery did (for the timeline and the counters)."""

    from_step: int
    started: float
    generation: int = 0
    restarts: int = 0
    failed: list[str] = field(default_factory=list)
    promoted: list[int] = field(default_factory=list)
    kind: str = ""
    target: int = -1
    loss: int = 0
    tier1_chunks: int = 0
    tier1_grads: int = 0
    forward_chunks: int = 0
    dropped: bool = False
    integrity: list[str] = field(default_factory=list)
    stale_refused: int = 0
    reason: str = ""


class Engine:
    """Drives the core over real tensors on ``backend`` (see the module docstring)."""

    def __init__(
        self,
        backend: Backend,
        replica: Replica,
        *,
        step_fn: StepFn | None,
        sampler: Any,
        options: EngineOptions,
        checkpointer: Checkpointer | None = None,
        core_config: ClusterConfig | None = None,
        attach: bool = False,
    ) -> None:
        if not is_chunkable(replica.optimizer):
            raise TypeError(
                f"optimizer: {type(replica.optimizer).__name__} has no chunked version in leto "
                "(supported: torch.optim.SGD, Adam, AdamW)"
            )
        self.backend = backend
        self.options = options
        self.step_fn = step_fn
        self.checkpointer = checkpointer
        self.injector = getattr(backend, "faults", None)
        self.W = backend.world_size
        self.cursor = BatchCursor(sampler)
        self._t0 = time.perf_counter()
        self.timeline: list[dict[str, Any]] = []
        self.recoveries: list[dict[str, Any]] = []
        self.losses: dict[int, float] = {}
        self.stats: dict[str, int] = {
            "steps_run": 0,
            "failures_injected": 0,
            "recoveries": 0,
            "rolled_forward": 0,
            "rolled_back": 0,
            "chunks_rolled_forward": 0,
            "chunks_repaired_from_parity": 0,
            "grad_blocks_repaired_from_parity": 0,
            "snapshot_restores": 0,
            "checkpoint_restores": 0,
            "integrity_failures": 0,
            "stale_writes_refused": 0,
            "recovery_restarts": 0,
            "snapshots_taken": 0,
        }
        self._open: list[Any] = []  # faults fired since the last resume
        self._rec: _Recovery | None = None
        self._current_step = 0
        self.stale: dict[int, RankProc] = {}
        self._integrity_notes: list[str] = []

        # The skeleton for shadows, and one replica per simulated rank (rank 0: the user's).
        self.template = copy_replica(replica, clear_state=True)
        replicas = [replica] + [copy_replica(replica) for _ in range(1, self.W)]
        self.procs = [RankProc(r, backend.generation, replicas[r]) for r in range(self.W)]
        if attach:
            self._attach_all()
            return
        for p in self.procs:
            self._create_layout(p)
        n_chunks = self.procs[0].layout.n_chunks
        if self.injector is not None:
            self.injector.n_chunks = n_chunks
        cfg = core_config or ClusterConfig(
            topology=backend.topology,
            chunks=n_chunks,
            max_step=options.max_steps,
            max_faults=10**9,
            k=options.tier2_interval if options.tier2 else options.max_steps + 1,
            tier1=options.tier1,
        )
        if cfg.tier1 != options.tier1:
            raise ValueError(f"core config has tier1={cfg.tier1}, the engine tier1={options.tier1}")
        if cfg.chunks != n_chunks or cfg.topology != backend.topology:
            raise ValueError(
                f"core config has {cfg.chunks} chunks on {cfg.topology}, the retained state "
                f"{n_chunks} chunks on {backend.topology}"
            )
        model = ClusterModel(cfg)
        backend.record = ProtocolRecord(model, model.initial())
        rng0 = capture_rng()
        for p in self.procs:
            p.rng = rng0
            p.sampler_state = self.cursor.initial
            self.backend.spawn_shadow(p.rank, self._shadow_factory)
        for p in self.procs:
            self._store(p.rank).process_states[p.rank] = {0: self._ps_json(p, 0)}
        self._after_recovery_state(0)
        if checkpointer is not None:
            self._save_checkpoint()
        self._log("start", step=0, detail=self._describe())

    # ------------------------------------------------------------------ basics

    @property
    def record(self) -> ProtocolRecord:
        c = self.backend.record
        assert c is not None
        return c

    @property
    def state(self) -> ClusterState:
        return self.record.state

    @property
    def model(self) -> ClusterModel:
        return self.record.model

    @property
    def n_chunks(self) -> int:
        return self.model.config.chunks

    def _store(self, rank: int) -> NodeStore:
        return self.backend.node_store(self.backend.node_of(rank))

    def _member(self, rank: int) -> int:
        return self.backend.ranks_of(self.backend.node_of(rank)).index(rank)

    def _describe(self) -> str:
        t = self.backend.topology
        lay = self.procs[0].layout
        return (
            f"{self.backend.name} backend, {t.nodes} node(s) x {t.node_sizes[0]} rank(s), "
            f"{lay.n_chunks} chunks of {lay.chunk_numel} elements, states {list(lay.states)}, "
            f"tier1={'on' if self.options.tier1 else 'off'}, "
            f"tier2={'every ' + str(self.options.tier2_interval) + ' steps' if self.options.tier2 else 'off'}, "
            f"checkpoint={self.checkpointer.describe() if self.checkpointer else 'none'}"
        )

    def _log(self, event: str, **kw: Any) -> None:
        self.timeline.append(
            {"t_ms": round((time.perf_counter() - self._t0) * 1e3, 3), "event": event, **kw}
        )

    def _shadow_factory(self) -> Replica:
        return copy_replica(self.template, clear_state=True)

    def _create_layout(self, p: RankProc) -> None:
        """Fresh retained state for ``p`` in its keeper (at version 0; repairs follow)."""
        self.backend.reset_memory(p.rank)
        self._bind_layout(p, attach=False)

    def _attach_layout(self, p: RankProc) -> None:
        """Bind ``p`` to the retained state in its keeper (validates shapes first)."""
        self._bind_layout(p, attach=True)

    def _bind_layout(self, p: RankProc, *, attach: bool) -> None:
        rep = p.replica
        p.ropt = retain(
            rep.model,
            rep.optimizer,
            chunk_numel=self.options.chunk_numel,
            alloc=self.backend.allocator(p.rank),
            attach=attach,
            align_bytes=self.options.align_bytes,
            # chunks are verified at PREPARE (all of them, before the step's vote) and
            # at every recovery; not again before each chunk's undo copy
            verify=False,
        )

    def _ps_json(self, p: RankProc, step: int) -> str:
        assert p.ropt is not None
        return json.dumps(
            {
                "step": step,
                "optimizer": p.ropt.process_state(),
                "scheduler": scheduler_state(p.replica.scheduler),
                "sampler": p.sampler_state,
                "rng": p.rng,
            }
        )

    def _load_ps(self, p: RankProc, text: str) -> None:
        ps = json.loads(text)
        assert p.ropt is not None
        p.ropt.load_process_state(ps["optimizer"])
        if p.replica.scheduler is not None:
            p.replica.scheduler.load_state_dict(ps["scheduler"])
        p.rng = ps["rng"]
        p.sampler_state = ps["sampler"]

    # ------------------------------------------------------------ fault points

    def _inside(
        self,
        rank: int,
        step: int,
        phase: str,
        chunk: int | None = None,
        where: str | None = None,
        *,
        adopt: bool,
        tear: Callable[[], None] | None = None,
    ) -> None:
        """A fault point inside an event's effects."""
        if self.injector is None or not self.injector.pending_at(rank, step, phase, chunk, where):
            return
        faults = self.injector.take(rank, step, phase, chunk, where)
        if tear is not None:
            tear()
        raise InjectedFault(faults, adopt)

    # ================================================================= executor

    def execute(
        self,
        event: ev.Event,
        effects: tuple[Effect, ...],
        before: ClusterState,
        after: ClusterState,
    ) -> None:
        """Carry out ``effects`` of ``event`` (``before`` -> ``after``) on real tensors."""
        if isinstance(event, ev.Reconcile):
            self._reconcile(before, after, effects)
            return
        for effect in effects:
            EXECUTORS[type(effect)](self, effect, before, after)

    # --- a step ---------------------------------------------------------------

    def _fx_forward_backward(
        self, a: fx.ForwardBackward, before: ClusterState, after: ClusterState
    ) -> None:
        r, step = a.rank, a.step
        p = self.procs[r]
        if self.step_fn is None:
            raise RuntimeError("no step function: pass one to train() / run_step()")
        batch = shard(self.cursor.batch(step), r, self.W)
        model = p.replica.model
        assert p.rng is not None
        restore_rng(p.rng)
        for prm in model.parameters():
            prm.grad = None
        loss = self.step_fn(model, batch)
        self._inside(r, step, "forward", adopt=False)
        loss.backward()  # type: ignore[no-untyped-call]
        self._inside(r, step, "backward", adopt=False)
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
        p.work = self.backend.all_reduce(r, flat, tag=("grad", p.gen, step))
        p.pwork = self.backend.all_reduce(r, present, tag=("present", p.gen, step))
        p.loss = float(loss.detach())

    def _fx_all_reduce_gradients(
        self, a: fx.AllReduceGradients, before: ClusterState, after: ClusterState
    ) -> None:
        r = a.rank
        p = self.procs[r]
        self.backend.check_writer(r, p.gen)
        assert p.work is not None and p.pwork is not None
        total = p.work.wait()
        counts = p.pwork.wait()
        total.div_(self.W)
        lay = p.layout
        store = self._store(r)
        keep = self.options.tier1 and store.gparity is not None
        old = None
        if keep:
            comp = store.gparity_versions[self._member(r)]
            gb = as_bytes(lay.grad_buffer)
            old = gb.clone() if comp != NONE else torch.zeros_like(gb)
        lay.clear_prepared()  # the old gradients are being overwritten
        with torch.no_grad():
            lay.grad_buffer.copy_(total)
        if old is not None:
            p.gdelta = as_bytes(lay.grad_buffer).clone().sub_(old)
        p.present = [bool(c > 0) for c in counts.tolist()]
        p.work = p.pwork = None

    def _fx_write_gradient_parity(
        self, a: fx.WriteGradientParity, before: ClusterState, after: ClusterState
    ) -> None:
        r, step = a.rank, a.step
        p = self.procs[r]
        self.backend.check_writer(r, p.gen)
        lay = p.layout
        assert p.ropt is not None and p.present is not None
        if step != p.ropt.version + 1:
            raise IntegrityError(
                f"rank {r}: prepare({step}) but the optimizer is at {p.ropt.version}"
            )
        if self.options.verify:
            # The step's gradients were computed from these bytes: a chunk that fails its
            # checksum now must not get a vote (the step is rolled back and recomputed).
            bad = lay.verify()
            if bad:
                raise ChecksumError(f"chunks {bad} fail their checksums at PREPARE of step {step}")
        lay.seal_grads(step, p.present)
        self._inside(r, step, "prepare", adopt=False)
        store = self._store(r)
        if self.options.tier1 and store.gparity is not None and p.gdelta is not None:
            store.gparity.add_(p.gdelta)
            store.gparity_versions[self._member(r)] = step
        store.pending[r] = json.dumps(
            {
                "step": step,
                "rng": p.rng,
                "sampler": self.cursor.state_after(step),
                "present": p.present,
                "grad_checksums": lay.grad_checksums(),
            }
        )
        p.gdelta = None

    def _fx_vote(self, a: fx.Vote, before: ClusterState, after: ClusterState) -> None:
        pass  # the vote is the coordinator's record (the core's ``prepared`` set)

    def _fx_record_commit(
        self, a: fx.RecordCommit, before: ClusterState, after: ClusterState
    ) -> None:
        self.record.record_commit(a.step)

    def _fx_save_undo(self, a: fx.SaveUndo, before: ClusterState, after: ClusterState) -> None:
        r, c = a.rank, a.chunk
        p = self.procs[r]
        self.backend.check_writer(r, p.gen)
        assert p.ropt is not None
        step = before.step[r] + 1
        if before.pc[r] is TxnState.PREPARED:
            p.ropt.begin(step)
        p.ropt.save_undo(c)  # with verify: the chunk's checksum is checked first
        self._inside(r, step, "apply", c, "undo_saved", adopt=True)

    def _fx_apply_chunk(self, a: fx.ApplyChunk, before: ClusterState, after: ClusterState) -> None:
        r, c, step = a.rank, a.chunk, a.step
        p = self.procs[r]
        assert p.ropt is not None
        ropt = p.ropt

        def tear() -> None:  # the trainer dies half way through writing the chunk
            ropt.apply_chunk(c, seal=False)
            lay = ropt.layout
            with torch.no_grad():
                for dst, src in zip(lay.chunk_data(c), lay.undo_data(c), strict=True):
                    h = dst.numel() // 2
                    dst[h:].copy_(src[h:])

        self._inside(r, step, "apply", c, "mid_write", adopt=True, tear=tear)
        ropt.apply_chunk(c, seal=False)

    def _fx_chunk_written(
        self, a: fx.ChunkWritten, before: ClusterState, after: ClusterState
    ) -> None:
        r, c, step = a.rank, a.chunk, a.step
        p = self.procs[r]
        self.backend.check_writer(r, p.gen)
        p.layout.seal_chunk(c, step)

    def _fx_update_parity(
        self, a: fx.UpdateParity, before: ClusterState, after: ClusterState
    ) -> None:
        r, c, step = a.rank, a.chunk, a.step
        p = self.procs[r]
        self.backend.check_writer(r, p.gen)
        lay = p.layout
        store = self._store(r)
        if self.options.tier1 and store.parity is not None:
            m = self._member(r)
            if store.parity_versions[c][m] != step - 1:
                raise IntegrityError(
                    f"rank {r} chunk {c}: the parity encodes version {store.parity_versions[c][m]}, "
                    f"the undo copy is {step - 1}"
                )
            add_delta_(store.parity[c], lay.undo_data(c), lay.chunk_data(c))
            store.parity_versions[c][m] = step
            store.parity_checksums[c][m] = lay.stored_checksum(c)
        self._inside(r, step, "parity", c, adopt=True)

    def _fx_release_undo(
        self, a: fx.ReleaseUndo, before: ClusterState, after: ClusterState
    ) -> None:
        p = self.procs[a.rank]
        assert p.ropt is not None
        p.ropt.finish_chunk(a.chunk)

    def _fx_step_done(self, a: fx.StepDone, before: ClusterState, after: ClusterState) -> None:
        r, step = a.rank, a.step
        p = self.procs[r]
        assert p.ropt is not None
        p.ropt.end()
        step_scheduler(p.replica.scheduler)
        store = self._store(r)
        pend = json.loads(store.pending[r])  # kept: a tier-1 gradient rebuild may read it
        if pend["step"] != step:
            raise IntegrityError(
                f"rank {r}: the prepare record is of step {pend['step']}, not {step}"
            )
        p.sampler_state = pend["sampler"]
        hist = store.process_states.setdefault(r, {})
        hist[step] = self._ps_json(p, step)
        for old in [s for s in hist if s < step - 2]:
            del hist[old]

    def _fx_tier2_snapshot(
        self, a: fx.TakeSnapshot, before: ClusterState, after: ClusterState
    ) -> None:
        self._take_snapshot(a.step)

    # --- shadows, faults, fencing ------------------------------------------------

    def _fx_warm_shadow(self, a: fx.WarmShadow, before: ClusterState, after: ClusterState) -> None:
        self.backend.spawn_shadow(a.rank, self._shadow_factory)

    def _fx_reclaim_shadow(
        self, a: fx.ReclaimShadow, before: ClusterState, after: ClusterState
    ) -> None:
        self.backend.reclaim_shadow(a.rank)

    def _fx_crash(self, a: fx.Crash, before: ClusterState, after: ClusterState) -> None:
        self.backend.crash(a.rank)  # type: ignore[attr-defined]

    def _fx_hang(self, a: fx.Hang, before: ClusterState, after: ClusterState) -> None:
        self.backend.hang(a.rank)  # type: ignore[attr-defined]

    def _fx_lose_memory(self, a: fx.LoseMemory, before: ClusterState, after: ClusterState) -> None:
        self.backend.lose_memory(a.rank)  # type: ignore[attr-defined]

    def _fx_lose_node(self, a: fx.LoseNode, before: ClusterState, after: ClusterState) -> None:
        self.backend.lose_node(a.node)  # type: ignore[attr-defined]
        for r in self.backend.ranks_of(a.node):
            self.stale.pop(r, None)  # its processes are gone with it

    def _fx_detected(self, a: fx.Detected, before: ClusterState, after: ClusterState) -> None:
        if self._rec is None:
            self._rec = _Recovery(from_step=self._current_step, started=time.perf_counter())
            self._rec.integrity.extend(self._integrity_notes)
            self._integrity_notes.clear()
        else:
            self._rec.restarts += 1
            self.stats["recovery_restarts"] += 1
        self._rec.failed = [f"rank {r} {after.trainer[r].name.lower()}" for r in a.ranks]

    def _fx_fence(self, a: fx.Fence, before: ClusterState, after: ClusterState) -> None:
        gen = a.generation
        self.backend.fence(gen)
        for r, t in enumerate(before.trainer):
            if t is TrainerState.HUNG:  # a stale process lives on, fenced out
                self.stale[r] = self.procs[r]
                self.backend.crash(r)  # type: ignore[attr-defined]
        if self._rec is not None:
            self._rec.generation = gen

    def _fx_abort_collectives(
        self, a: fx.AbortCollectives, before: ClusterState, after: ClusterState
    ) -> None:
        self.backend.abort(a.generation)
        for p in self.procs:
            p.work = p.pwork = None

    def _fx_refuse_stale_write(
        self, a: fx.RefuseStaleWrite, before: ClusterState, after: ClusterState
    ) -> None:
        r = a.rank
        stale = self.stale.get(r)
        gen = stale.gen if stale is not None else -1
        try:
            self.backend.check_writer(r, gen)
        except FencedError:
            self.stats["stale_writes_refused"] += 1
            if self._rec is not None:
                self._rec.stale_refused += 1
        else:
            raise IntegrityError(f"rank {r}: the keeper accepted a write from generation {gen}")

    def _fx_kill_stale(self, a: fx.KillStale, before: ClusterState, after: ClusterState) -> None:
        self.stale.pop(a.rank, None)
        self.backend.kill(a.rank)

    def _fx_stale_write_accepted(
        self, a: fx.StaleWriteAccepted, before: ClusterState, after: ClusterState
    ) -> None:
        raise IntegrityError("the no_fencing mutant cannot run on real tensors")

    def _fx_promote(self, a: fx.Promote, before: ClusterState, after: ClusterState) -> None:
        r, gen = a.rank, a.generation
        replica = self.backend.promote_shadow(r, gen)
        self.procs[r] = RankProc(r, gen, replica)
        if self._rec is not None:
            self._rec.promoted.append(r)

    def _fx_spawn_shadow(
        self, a: fx.SpawnShadow, before: ClusterState, after: ClusterState
    ) -> None:
        pass  # a replacement starts spawning; it is warm at ShadowWarm

    def _fx_fallback(self, a: fx.Fallback, before: ClusterState, after: ClusterState) -> None:
        if self.checkpointer is None:
            raise UnrecoverableError(self.lost_message(before, a.reason))

    def _fx_load_checkpoint(
        self, a: fx.LoadCheckpoint, before: ClusterState, after: ClusterState
    ) -> None:
        self._restore_checkpoint(before, a.step)
        self._note_recovered(after, Kind.CKPT.value, a.step, before.committed - a.step)
        self.stats["checkpoint_restores"] += 1

    def _fx_rebuild_communicator(
        self, a: fx.RebuildCommunicator, before: ClusterState, after: ClusterState
    ) -> None:
        gen = a.generation
        self.backend.rebuild(gen)
        for p in self.procs:
            p.gen = gen

    def _fx_resume(self, a: fx.Resume, before: ClusterState, after: ClusterState) -> None:
        for p in self.procs:
            p.work = p.pwork = None
            p.gdelta = None
            p.present = None
        sampler = self.procs[0].sampler_state
        assert sampler is not None
        self.cursor.restore(sampler)
        if self.options.check:
            wrong = self.mismatches(after) + self.parity_exact()
            if wrong:
                raise IntegrityError(
                    f"after recovery the real state differs from the core's: {wrong}"
                )
        for f in self._open:
            f.recovered += 1
        self._open.clear()
        rec = self._rec
        self._rec = None
        self.stats["recoveries"] += 1
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
            self.recoveries.append(entry)
            self._log("recovered", step=a.step, **entry)

    # --- recovery plans on real tensors --------------------------------------------

    def _ensure_layout(self, r: int, lost: bool) -> None:
        p = self.procs[r]
        if lost or self.backend.memory_lost(r):
            self._create_layout(p)
        elif p.ropt is None:
            self._attach_layout(p)

    def _reconcile(
        self, before: ClusterState, after: ClusterState, effects: tuple[Effect, ...]
    ) -> None:
        target, kind = after.target, after.kind
        lost = {r for r in range(self.W) if all(d == LOST for d in before.data[r])}
        for r in range(self.W):
            self._ensure_layout(r, r in lost)
        reason = next((a.reason for a in effects if isinstance(a, fx.Reconciled)), "")
        rec = self._rec
        if kind is Kind.TIER2:
            self._restore_snapshot(target)
            self.stats["snapshot_restores"] += 1
        else:
            for a in effects:
                if not isinstance(a, fx.RunRepair):
                    continue
                if a.what == "tier1":
                    self._decode_chunk(a.rank, a.chunk, a.step)
                    self.stats["chunks_repaired_from_parity"] += 1
                    if rec:
                        rec.tier1_chunks += 1
                elif a.what == "grad-tier1":
                    self._decode_grads(a.rank, a.step)
                    self.stats["grad_blocks_repaired_from_parity"] += 1
                    if rec:
                        rec.tier1_grads += 1
            rolled, dropped = 0, False
            for r in range(self.W):
                n, d = self._settle(r, target)
                rolled += n
                dropped = dropped or d
            self.stats["chunks_rolled_forward"] += rolled
            if rolled:
                self.stats["rolled_forward"] += 1
            if dropped or kind is Kind.BACK:
                self.stats["rolled_back"] += 1
            if rec:
                rec.forward_chunks += rolled
                rec.dropped = rec.dropped or dropped or kind is Kind.BACK
        # the tier-2 snapshot is retaken only if it lost blocks (the model's rule)
        self._after_recovery_state(target, snapshot=bool(before.t2lost))
        self._note_recovered(after, kind.value, target, after.loss, reason)

    def _note_recovered(
        self, after: ClusterState, kind: str, target: int, loss: int, reason: str = ""
    ) -> None:
        if self._rec is not None:
            self._rec.kind = kind
            self._rec.target = target
            self._rec.loss = loss
            self._rec.reason = reason

    def _decode_chunk(self, r: int, c: int, version: int) -> None:
        """Tier 1: rank ``r``'s chunk ``c`` at ``version`` from its node's parity
        (:func:`leto.retained.recovery.decode_chunk` on every member of the node)."""
        members = self.backend.ranks_of(self.backend.node_of(r))
        store = self._store(r)
        if store.parity is None:
            raise IntegrityError(f"rank {r} chunk {c}: its node's tier-1 parity is gone")
        mi = members.index(r)
        versions = list(store.parity_versions[c])
        checksum = store.parity_checksums[c][mi]
        parity = store.parity[c]

        def program(coll: Any) -> None:
            rx.decode_chunk(
                coll,
                self.procs[members[coll.rank]].layout,
                c,
                lost=mi,
                version=version,
                versions=versions,
                checksum=checksum,
                parity=parity,
                who=f"rank {r}",
            )

        self.backend.spmd(members, program)

    def _decode_grads(self, r: int, step: int) -> None:
        """Tier 1: rank ``r``'s gradients of ``step`` from its node's gradient parity
        (:func:`leto.retained.recovery.decode_grads` on every member of the node)."""
        members = self.backend.ranks_of(self.backend.node_of(r))
        store = self._store(r)
        if store.gparity is None:
            raise IntegrityError(f"rank {r}: its node's gradient parity is gone")
        mi = members.index(r)
        versions = list(store.gparity_versions)
        pending = rx.load_pending(store.pending.get(r))
        gparity = store.gparity

        def program(coll: Any) -> None:
            rx.decode_grads(
                coll,
                self.procs[members[coll.rank]].layout,
                lost=mi,
                step=step,
                versions=versions,
                parity=gparity,
                pending=pending,
                who=f"rank {r}",
            )

        self.backend.spmd(members, program)

    def _settle(self, r: int, target: int) -> tuple[int, bool]:
        """Bring rank ``r`` to ``target`` (:func:`leto.retained.recovery.settle`).
        Returns (chunks rolled forward, uncommitted gradients dropped)."""
        p = self.procs[r]
        assert p.ropt is not None
        store = self._store(r)
        done = rx.settle(
            p.layout,
            p.ropt,
            target,
            history=store.process_states.get(r, {}),
            pending=rx.load_pending(store.pending.get(r)),
            load_ps=lambda text: self._load_ps(p, text),
            step_scheduler=lambda: step_scheduler(p.replica.scheduler),
            who=f"rank {r}",
        )
        if done.rng is not None:
            p.rng = done.rng
            p.sampler_state = done.sampler
        return done.forward, done.dropped

    def _restore_snapshot(self, step: int) -> None:
        """Tier 2: every rank restores its node's snapshot (a lost node's is decoded)."""
        N = self.backend.nodes
        stores = [self.backend.node_store(n) for n in range(N)]
        snaps = [st.snapshot for st in stores]
        missing = [n for n, sn in enumerate(snaps) if sn is None or sn.step != step]
        if len(missing) > 1:
            raise IntegrityError(f"tier-2 snapshots of nodes {missing} are gone: beyond tier 2")
        if missing:
            lost = missing[0]
            ref = next(
                s.snapshot for s in stores if s.snapshot is not None and s.snapshot.step == step
            )
            assert ref is not None
            datas = [
                torch.zeros_like(ref.data) if n == lost else stores[n].snapshot.data  # type: ignore[union-attr]
                for n in range(N)
            ]
            shares = [None if n == lost else stores[n].snapshot.share for n in range(N)]  # type: ignore[union-attr]

            def program(coll: Any) -> Any:
                return decode_rotated(coll, datas[coll.rank], lost, shares[coll.rank])

            out = self.backend.spmd(list(range(N)), program)
            stores[lost].snapshot = Snapshot(
                step, datas[lost], dict(ref.checksums), dict(ref.process_states), out[lost]
            )
        for n in range(N):
            snap = stores[n].snapshot
            assert snap is not None
            for j, r in enumerate(self.backend.ranks_of(n)):
                p = self.procs[r]
                lay = p.layout
                rx.free_undo(lay)
                nb = rx.packed(lay).numel()
                rx.unpack_into(lay, snap.data[j * nb : (j + 1) * nb])
                rx.seal_checked(lay, step, snap.checksums[r], "tier-2 snapshot", f"rank {r}")
                lay.clear_prepared()
                self._load_ps(p, snap.process_states[r])

    def _checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return {
            f"rank{p.rank}.{name}": buf
            for p in self.procs
            for name, buf in _named_buffers(p.layout)
        }

    def _save_checkpoint(self) -> None:
        assert self.checkpointer is not None
        meta = {
            "step": 0,
            "checksums": {
                str(p.rank): [p.layout.stored_checksum(c) for c in range(p.layout.n_chunks)]
                for p in self.procs
            },
            "process_states": {
                str(p.rank): self._store(p.rank).process_states[p.rank][0] for p in self.procs
            },
            "n_chunks": self.procs[0].layout.n_chunks,
            "chunk_numel": self.procs[0].layout.chunk_numel,
        }
        self.checkpointer.save(0, self._checkpoint_tensors(), meta)
        self._log("checkpoint", step=0, detail=f"step 0 written to {self.checkpointer.describe()}")

    def _restore_checkpoint(self, before: ClusterState, step: int) -> None:
        assert self.checkpointer is not None
        lost = {r for r in range(self.W) if all(d == LOST for d in before.data[r])}
        for r in range(self.W):
            self._ensure_layout(r, r in lost)
            rx.free_undo(self.procs[r].layout)
        with torch.no_grad():
            meta = self.checkpointer.load(step, self._checkpoint_tensors())
        for p in self.procs:
            rx.seal_checked(
                p.layout, step, meta["checksums"][str(p.rank)], "disk checkpoint", f"rank {p.rank}"
            )
            p.layout.clear_prepared()
            self._load_ps(p, meta["process_states"][str(p.rank)])
        self._after_recovery_state(step)

    def _after_recovery_state(self, target: int, *, snapshot: bool = True) -> None:
        """Verify every chunk, then rebuild the redundancy at ``target``: process states,
        tier-1 parity, empty gradient parity, and (``snapshot``) the tier-2 snapshot."""
        for p in self.procs:
            rx.check_resumable(p.layout, p.ropt, target, f"rank {p.rank}")
        for n in range(self.backend.nodes):
            self.backend.node_store(n).pending.clear()
        for p in self.procs:
            self._store(p.rank).process_states[p.rank] = {target: self._ps_json(p, target)}
        self._encode_parity(target)
        if snapshot:
            self._take_snapshot(target)

    def _encode_parity(self, step: int) -> None:
        C = self.procs[0].layout.n_chunks
        for n in range(self.backend.nodes):
            store = self.backend.node_store(n)
            members = self.backend.ranks_of(n)
            if not self.options.tier1:
                store.parity = None
                store.gparity = None
                continue
            lays = [self.procs[q].layout for q in members]

            def program(coll: Any, lays: list[RetainedLayout] = lays) -> Any:
                return [encode(coll, lays[coll.rank].chunk_data(c), 0) for c in range(C)]

            out = self.backend.spmd(members, program)
            store.parity = out[0]
            store.parity_versions = [[step] * len(members) for _ in range(C)]
            store.parity_checksums = [[lay.stored_checksum(c) for lay in lays] for c in range(C)]
            store.gparity = torch.zeros(as_bytes(lays[0].grad_buffer).numel(), dtype=torch.uint8)
            store.gparity_versions = [NONE] * len(members)

    def _take_snapshot(self, step: int) -> None:
        self.stats["snapshots_taken"] += 1
        N = self.backend.nodes
        rank_bytes = [rx.packed(p.layout) for p in self.procs]
        nb = rank_bytes[0].numel()
        width = max(self.backend.topology.node_sizes)
        checks = {
            p.rank: [p.layout.stored_checksum(c) for c in range(p.layout.n_chunks)]
            for p in self.procs
        }
        states = {p.rank: self._store(p.rank).process_states[p.rank][step] for p in self.procs}
        datas = []
        for n in range(N):
            d = torch.zeros(width * nb, dtype=torch.uint8)
            for j, r in enumerate(self.backend.ranks_of(n)):
                d[j * nb : (j + 1) * nb] = rank_bytes[r]
            datas.append(d)
        shares: list[Any] = [None] * N
        if N >= 2:

            def program(coll: Any) -> Any:
                return encode_rotated(coll, datas[coll.rank])

            shares = self.backend.spmd(list(range(N)), program)
        for n in range(N):
            self.backend.node_store(n).snapshot = Snapshot(
                step, datas[n], checks, states, shares[n]
            )

    # --- checks (tests and the demo use them) --------------------------------------

    def mismatches(self, s: ClusterState | None = None) -> list[str]:
        """Where the real state disagrees with the core's ``s`` (empty: it refines it)."""
        s = self.state if s is None else s
        out: list[str] = []
        for r in range(self.W):
            p = self.procs[r]
            if all(d == LOST for d in s.data[r]) or p.ropt is None or self.backend.memory_lost(r):
                continue
            lay = p.layout
            for c in range(lay.n_chunks):
                d, u = s.data[r][c], s.undo[r][c]
                st, v = lay.chunk_status(c), lay.chunk_version(c)
                if u == NONE:
                    ok = st is ChunkStatus.CLEAN and v == d
                elif d == -1:  # TORN
                    ok = st is ChunkStatus.TORN and lay.undo_version(c) == u
                else:
                    ok = st is ChunkStatus.APPLIED and v == d and lay.undo_version(c) == u
                if not ok:
                    out.append(f"rank {r} chunk {c}: model data={d} undo={u}, real {st.value} v{v}")
        for n in range(self.backend.nodes):
            store = self.backend.node_store(n)
            par, gpar = s.par[n], s.gpar[n]
            if par is not None and self.options.tier1:
                real = [list(x) for x in store.parity_versions]
                if real != [list(x) for x in par]:
                    out.append(f"node {n}: parity versions {real}, model {par}")
            if gpar is not None and self.options.tier1 and list(gpar) != store.gparity_versions:
                out.append(
                    f"node {n}: gradient parity versions {store.gparity_versions}, model {gpar}"
                )
        return out

    def parity_exact(self) -> list[str]:
        """Recompute every node's tier-1 parity from the members' bytes and compare."""
        from leto.retained.parity import encode_local

        out: list[str] = []
        if not self.options.tier1:
            return out
        for n in range(self.backend.nodes):
            store = self.backend.node_store(n)
            if store.parity is None:
                continue
            members = self.backend.ranks_of(n)
            for c in range(self.n_chunks):
                datas = []
                for j, q in enumerate(members):
                    if self.backend.memory_lost(q) or self.procs[q].ropt is None:
                        break
                    datas.append(rx.bytes_at(self.procs[q].layout, c, store.parity_versions[c][j]))
                else:
                    if not torch.equal(encode_local(datas), store.parity[c]):
                        out.append(
                            f"node {n} chunk {c}: parity bytes differ from the members' code"
                        )
        return out

    def retained_state(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's params and optimizer state buffers (copies), for bitwise checks."""
        return [{name: buf.clone() for name, buf in _named_buffers(p.layout)} for p in self.procs]

    def process_states(self) -> list[dict[str, Any]]:
        """Every rank's optimizer and scheduler process state (JSON-able)."""
        out = []
        for p in self.procs:
            assert p.ropt is not None
            out.append(
                {
                    "optimizer": p.ropt.process_state(),
                    "scheduler": scheduler_state(p.replica.scheduler),
                    "rng": p.rng,
                }
            )
        return out

    def lost_message(self, s: ClusterState, reason: str) -> str:
        topo = self.backend.topology
        parts = []
        if s.nlost:
            parts.append(
                f"node(s) {sorted(s.nlost)} (their ranks' retained memory, their tier-1 parity "
                "and their tier-2 snapshot blocks)"
            )
        lost_nodes_ranks = {r for n in s.nlost for r in topo.ranks_of(n)}
        mem = sorted(set(s.mlost) - lost_nodes_ranks)
        if mem:
            parts.append(f"the retained memory of rank(s) {mem}")
        what = "; ".join(parts) or "retained state"
        return (
            f"leto: cannot recover in place from step {s.committed}: lost {what}. "
            f"Why: {reason}; tier 2's single cross-node parity rebuilds at most one node "
            f"(snapshot blocks lost on nodes {sorted(s.t2lost)}). No checkpoint is configured "
            "(set checkpoint_dir), so training stops here instead of resuming on wrong "
            "state; the retained state was left as it was."
        )

    # ==================================================================== driver

    def feed(self, e: ev.Event) -> None:
        """Step the core with ``e``, carry out its effects, adopt the new state."""
        coord = self.record
        before = coord.state
        after, effects = coord.step(e)
        try:
            self.execute(e, effects, before, after)
        except InjectedFault as f:
            coord.adopt(after if f.adopt else before)
            self._fire(f.faults)
            raise _Interrupted from None
        except ChecksumError as err:
            if not isinstance(e, (ev.BeginChunk, ev.Prepare)):
                raise
            coord.adopt(before)  # no vote cast / no undo copy taken
            self._integrity_failure(e.rank, str(err))
            raise _Interrupted from None
        coord.adopt(after)

    def _try(self, e: ev.Event) -> bool:
        if self.model.why_not(self.state, e) is not None:
            return False
        self.feed(e)
        return True

    def _fire(self, faults: list[Any]) -> None:
        for f in faults:
            self.stats["failures_injected"] += 1
            self._open.append(f)
            self._log("fault", step=f.step, detail=f.label)
            if f.kind == "crash":
                self._try(ev.Crash(f.rank))
            elif f.kind == "hang":
                self._try(ev.Hang(f.rank))
            elif f.kind == "lose_memory":
                self._try(ev.LoseMemory(f.rank))
            elif f.kind == "lose_node":
                self._try(ev.LoseNode(f.node))
            elif f.kind == "corrupt":
                self._flip(f)
            else:  # pragma: no cover - the injector validates kinds
                raise ValueError(f.kind)

    def _flip(self, f: Any) -> None:
        lay = self.procs[f.rank].layout
        b = as_bytes(lay.chunk_data(f.target_chunk)[0])
        with torch.no_grad():
            b[0] = int(b[0]) ^ (1 << f.bit)

    def _integrity_failure(self, r: int, why: str) -> None:
        """A checksum caught bad bytes on rank ``r``: its keeper discards the memory."""
        self.stats["integrity_failures"] += 1
        if self.injector is not None:
            for f in self.injector.faults:
                if f.kind == "corrupt" and f.rank == r and f.fired and not f.detected:
                    f.detected += 1
        if self._rec is not None:
            self._rec.integrity.append(f"rank {r}: {why}")
        else:
            self._integrity_notes.append(f"rank {r}: {why}")
        self._log(
            "integrity", rank=r, detail=f"checksum mismatch ({why}); memory of rank {r} discarded"
        )
        self._try(ev.LoseMemory(r))

    def _pt(
        self, rank: int, step: int, phase: str, chunk: int | None = None, where: str | None = None
    ) -> None:
        """A fault point between events."""
        if self.injector is None or not self.injector.pending_at(rank, step, phase, chunk, where):
            return
        faults = self.injector.take(rank, step, phase, chunk, where)
        self._fire(faults)
        if any(f.kind != "corrupt" for f in faults):
            raise _Interrupted

    def run_step(self, step_fn: StepFn | None = None) -> float | None:
        """One training step on every rank; on a failure, recover in place.

        Returns the step's mean loss over the ranks, or None if the step was
        interrupted (training then continues from where recovery resumed).
        """
        if step_fn is not None:
            self.step_fn = step_fn
        s = self.state
        if s.phase is not Phase.RUNNING or any(t is not TrainerState.ALIVE for t in s.trainer):
            self.recover()
            s = self.state
        if self.options.tier2 and s.step[0] - s.t2 >= self.options.tier2_interval:
            # a recovery kept a snapshot that is now K steps back: take the next one first
            if not self._snapshot_capture_clean():
                self.recover()
            self.feed(ev.Tier2Snapshot())
            s = self.state
        V = s.step[0] + 1
        self._current_step = V
        R = range(self.W)
        try:
            for r in R:
                self.feed(ev.Compute(r))
            for r in R:
                self._pt(r, V, "allreduce")
                self.feed(ev.Reduce(r))
            for r in R:
                self.feed(ev.Prepare(r))
            for r in R:
                self._pt(r, V, "decide", where="before")
            self.feed(ev.Decide())
            for r in R:
                self._pt(r, V, "decide", where="after")
            for c in range(self.n_chunks):
                for r in R:
                    self.feed(ev.BeginChunk(r, c))
                    self.feed(ev.EndChunk(r, c))
                    self._pt(r, V, "apply", c, "written")
                    self.feed(ev.ParityChunk(r, c))
            for r in R:
                self._pt(r, V, "finish")
                self.feed(ev.Finish(r))
        except _Interrupted:
            self.recover()
            return None
        loss = sum(p.loss or 0.0 for p in self.procs) / self.W
        self.losses[V] = loss
        self.stats["steps_run"] += 1
        s = self.state
        if self.options.tier2 and V - s.t2 >= self.options.tier2_interval:
            if not self._snapshot_capture_clean():
                self.recover()
                return loss
            self.feed(ev.Tier2Snapshot())
        self._warm_shadows()
        return loss

    def _snapshot_capture_clean(self) -> bool:
        """PROTOCOL.md, Tier2Snapshot: a snapshot captures verified bytes only.

        Bytes damaged after PREPARE's pass (a silent flip between the vote and the
        snapshot) would enter the snapshot under the chunk's good checksum and be found
        only when the snapshot is restored, with no tier left to repair them. A rank whose
        chunks fail here is an integrity failure (its memory is discarded and rebuilt
        from tier 1) and the snapshot is taken after that recovery.
        """
        if not self.options.verify:
            return True
        bad = {p.rank: p.layout.verify() for p in self.procs}
        bad = {r: cs for r, cs in bad.items() if cs}
        for r, cs in bad.items():
            self._integrity_failure(r, f"chunks {cs} fail their checksums at the tier-2 snapshot")
        return not bad

    def _warm_shadows(self) -> None:
        for r in range(self.W):
            if self.state.shadow[r] is not ShadowState.WARM:
                self._try(ev.ShadowWarm(r))

    def recover(self) -> None:
        """Feed the recovery the core schedules until every rank runs again (or raise).

        The order is the core's (:func:`leto.core.schedule.next_event`); the engine
        only gathers what an event needs first: before ``Reconcile`` it checks every
        rank's retained memory (a checksum failure is a lost memory), and a shadow
        still spawning warms at once (simulated ranks start instantly).
        """
        V = self._current_step
        for _ in range(10_000):
            s = self.state
            if s.phase is Phase.RECONCILING:
                bad = self.integrity_scan(s)
                if bad:
                    for r, why in bad.items():
                        self._integrity_failure(r, why)
                    continue
            e = schedule.next_event(self.model, s)
            if e is None:
                break
            if isinstance(e, ev.GoFallback) and self.checkpointer is None:
                reason = self.model.plan(s).reason
                self._log("unrecoverable", step=V, detail=reason)
                raise UnrecoverableError(self.lost_message(s, reason))
            name = type(e).__name__
            if self.injector is not None and name in RECOVERY_EVENTS:
                hits = [
                    f
                    for r in range(self.W)
                    for f in self.injector.take(r, V, "recovery", None, name)
                ]
                if hits:
                    self._fire(hits)
                    continue
            self.feed(e)
            if isinstance(e, ev.Fence):
                for r in sorted(self.stale):  # the fenced process wakes up and tries to write
                    self._try(ev.StaleWrite(r, 0))
        else:  # pragma: no cover
            raise RuntimeError("recovery did not end")
        self._warm_shadows()

    def integrity_scan(self, s: ClusterState) -> dict[int, str]:
        """Ranks whose retained memory fails a check (chunks, undo copies, sealed grads)."""
        bad: dict[int, str] = {}
        for r in range(self.W):
            if all(d == LOST for d in s.data[r]):
                continue
            p = self.procs[r]
            if p.ropt is None:
                try:
                    self._attach_layout(p)
                except ShapeMismatchError:
                    raise  # the shadow's model does not fit: a program error, not lost memory
                except (LayoutError, ChecksumError) as e:
                    bad[r] = f"cannot attach its retained state: {e}"
                    continue
            lay = p.layout
            chunks = lay.verify()
            undo = [
                c
                for c in range(lay.n_chunks)
                if lay.chunk_status(c) is not ChunkStatus.CLEAN and not lay.verify_undo(c)
            ]
            grads = lay.verify_grads(lay.prepared_step) if lay.prepared_step >= 0 else []
            if chunks or undo or grads:
                bad[r] = (
                    f"chunks {chunks} / undo copies {undo} / gradient chunks {grads} fail their checksums"
                )
        return bad

    def train(self, steps: int, step_fn: StepFn | None = None) -> None:
        """Train until the committed step reaches ``steps``, recovering in place."""
        if step_fn is not None:
            self.step_fn = step_fn
        while self.state.committed < steps or self.state.phase is not Phase.RUNNING:
            self.run_step()

    # --- attach to retained state left by an earlier engine ------------------------

    def _attach_all(self) -> None:
        coord = self.backend.record
        if coord is None:
            raise LayoutError("the backend holds no retained job to attach to")
        s = coord.state
        if (
            s.phase is not Phase.RUNNING
            or len(set(s.step)) != 1
            or any(pc is not TxnState.IDLE for pc in s.pc)
        ):
            raise LayoutError(
                f"the retained job is not idle between steps (phase {s.phase.name}): "
                "it must recover first"
            )
        meta = RetainedLayout.read_meta(self.backend.allocator(0))
        if meta["chunk_numel"] != self.options.chunk_numel:
            raise ConfigError(
                "chunk_size",
                f"{self.options.chunk_numel} elements, but the retained state is chunked by "
                f"{meta['chunk_numel']}",
            )
        for p in self.procs:  # validates shapes before binding anything; copies nothing
            self._attach_layout(p)
        step = s.step[0]
        for p in self.procs:
            self._load_ps(p, self._store(p.rank).process_states[p.rank][step])
            p.gen = s.gen
            self.backend.spawn_shadow(p.rank, self._shadow_factory)
        sampler = self.procs[0].sampler_state
        assert sampler is not None
        self.cursor.restore(sampler)
        if self.injector is not None:
            self.injector.n_chunks = self.procs[0].layout.n_chunks
        self._log("attach", step=step, detail=self._describe())


Executor = Callable[[Engine, Any, ClusterState, ClusterState], None]

#: One executor per effect of the core (``tests/fake`` checks every effect has one).
#: The reconcile plan's ``Repair`` and ``Reconciled`` are carried out together by
#: :meth:`Engine._reconcile`, which ``execute`` calls for the ``Reconcile`` event.
EXECUTORS: dict[type[fx.Effect], Executor] = {
    fx.ForwardBackward: Engine._fx_forward_backward,
    fx.AllReduceGradients: Engine._fx_all_reduce_gradients,
    fx.WriteGradientParity: Engine._fx_write_gradient_parity,
    fx.Vote: Engine._fx_vote,
    fx.RecordCommit: Engine._fx_record_commit,
    fx.SaveUndo: Engine._fx_save_undo,
    fx.ApplyChunk: Engine._fx_apply_chunk,
    fx.ChunkWritten: Engine._fx_chunk_written,
    fx.UpdateParity: Engine._fx_update_parity,
    fx.ReleaseUndo: Engine._fx_release_undo,
    fx.StepDone: Engine._fx_step_done,
    fx.TakeSnapshot: Engine._fx_tier2_snapshot,
    fx.WarmShadow: Engine._fx_warm_shadow,
    fx.ReclaimShadow: Engine._fx_reclaim_shadow,
    fx.SpawnShadow: Engine._fx_spawn_shadow,
    fx.Crash: Engine._fx_crash,
    fx.Hang: Engine._fx_hang,
    fx.LoseMemory: Engine._fx_lose_memory,
    fx.LoseNode: Engine._fx_lose_node,
    fx.StaleWriteAccepted: Engine._fx_stale_write_accepted,
    fx.RefuseStaleWrite: Engine._fx_refuse_stale_write,
    fx.KillStale: Engine._fx_kill_stale,
    fx.Detected: Engine._fx_detected,
    fx.Fence: Engine._fx_fence,
    fx.AbortCollectives: Engine._fx_abort_collectives,
    fx.Promote: Engine._fx_promote,
    fx.Fallback: Engine._fx_fallback,
    fx.LoadCheckpoint: Engine._fx_load_checkpoint,
    fx.RebuildCommunicator: Engine._fx_rebuild_communicator,
    fx.Resume: Engine._fx_resume,
}
#: carried out by Engine._reconcile as a whole
RECONCILE_EFFECTS = (fx.RunRepair, fx.Reconciled)
