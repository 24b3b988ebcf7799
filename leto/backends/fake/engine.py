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

import time
from typing import Any

import torch

from leto.backends.base import (
    Backend,
    NodeStore,
    ProtocolRecord,
)
from leto.core import effects as fx
from leto.core import events as ev
from leto.core import schedule
from leto.core.chunk import LOST, NONE
from leto.core.cluster import ClusterConfig, ClusterModel, ClusterState, Effect
from leto.core.recovery import Kind, Phase
from leto.core.shadow import ShadowState
from leto.core.trainer import TrainerState
from leto.retained import recovery as rx
from leto.retained.checkpoint import Checkpointer
from leto.retained.dcp_state import (
    load_model_state,
    load_retained_optimizer_state,
    load_training_state,
    training_state,
    young_daly_interval,
)
from leto.retained.layout import (
    ChecksumError,
)
from leto.retained.optim import check_supported
from leto.retained.process_state import (
    BatchCursor,
    capture_rng,
    step_scheduler,
)
from leto.retained.recovery import IntegrityError

from . import inspect, integrity, layouts, snapshots, tier1
from .backend import RECOVERY_WHERE
from .executors import EXECUTORS
from .faults import FaultPoints
from .rank import (
    EngineOptions,
    InjectedFault,
    RankProc,
    RecoveryRecord,
    Replica,
    StepFn,
    UnrecoverableError,
    _Interrupted,
    copy_replica,
)

__all__ = [
    "Engine",
    "EngineOptions",
    "InjectedFault",
    "IntegrityError",
    "RankProc",
    "Replica",
    "UnrecoverableError",
]


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
        resume: tuple[dict[str, Any], dict[str, Any] | None, str] | None = None,
    ) -> None:
        """``resume``: (state, leto.json or None, where) of a DCP checkpoint
        (:func:`leto.retained.dcp_state.read_checkpoint`) to start from instead of the
        model's own state: the step and process state of a leto checkpoint, or, for any
        other DCP checkpoint of the same model, its weights (and optimizer) at step 0."""
        check_supported(replica.optimizer)
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
            "checkpoints_durable": 0,
        }
        self._ckpt_meta: dict[int, dict[str, Any]] = {}  # written, not yet published
        self._ckpt_interval = options.checkpoint_interval
        self._save_s = 0.0  # the last checkpoint's save cost (Young/Daly)
        self.points = FaultPoints(self)
        self._open: list[Any] = []  # faults fired since the last resume
        self._rec: RecoveryRecord | None = None
        self._current_step = 0
        self.stale: dict[int, RankProc] = {}
        self._integrity_notes: list[str] = []

        # The skeleton for shadows, and one replica per simulated rank (rank 0: the user's).
        self.template = copy_replica(replica, clear_state=True)
        replicas = [replica] + [copy_replica(replica) for _ in range(1, self.W)]
        self.procs = [RankProc(r, backend.generation, replicas[r]) for r in range(self.W)]
        if attach:
            layouts.attach_all(self)
            return
        for p in self.procs:
            layouts.create(self, p)
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
            tier2_parity=options.tier2_parity,
        )
        if cfg.tier1 != options.tier1:
            raise ValueError(f"core config has tier1={cfg.tier1}, the engine tier1={options.tier1}")
        if options.tier2_parity > 1 and options.tier2_parity >= backend.nodes:
            raise ValueError(
                f"tier2_parity={options.tier2_parity} needs more than that many nodes, "
                f"not {backend.nodes}"
            )
        if cfg.chunks != n_chunks or cfg.topology != backend.topology:
            raise ValueError(
                f"core config has {cfg.chunks} chunks on {cfg.topology}, the retained state "
                f"{n_chunks} chunks on {backend.topology}"
            )
        model = ClusterModel(cfg)
        start = 0
        if resume is not None and resume[1] is not None:
            start = int(resume[1]["step"])
        backend.record = ProtocolRecord(model, model.initial(start))
        rng0 = capture_rng()
        for p in self.procs:
            p.rng = rng0
            p.sampler_state = self.cursor.initial
            self.backend.spawn_shadow(p.rank, self._shadow_factory)
        if resume is not None:
            self._resume(*resume)
        for p in self.procs:
            self._store(p.rank).process_states[p.rank] = {start: p.ps_json(start)}
        self._after_recovery_state(start)
        self._current_step = start
        if checkpointer is not None:  # the start is durable in the model from the start
            self.write_checkpoint(start)
            self.publish_checkpoint(start)
        self._log("start", step=start, detail=inspect.describe(self))

    def _resume(self, state: dict[str, Any], meta: dict[str, Any] | None, where: str) -> None:
        """Every rank loads the checkpoint (the same state: the ranks are replicas); a
        leto checkpoint of this world size also restores each rank's process state and
        is checked bitwise against its checksums."""
        step = int(meta["step"]) if meta is not None else 0
        same_world = meta is not None and meta.get("world_size") == self.W
        for p in self.procs:
            assert p.ropt is not None
            if meta is None:
                load_training_state(p.replica.model, p.ropt, state, where)
            else:
                load_model_state(p.replica.model, state, where)
                load_retained_optimizer_state(p.layout, state, where)
            p.ropt.set_version(step)
            if meta is None:
                continue
            ps = meta["process_states"][str(p.rank) if same_world else "0"]
            p.load_ps(ps)
            if same_world and meta.get("chunk_numel") == p.layout.chunk_numel:
                rx.seal_checked(
                    p.layout, step, meta["checksums"][str(p.rank)], where, f"rank {p.rank}"
                )
        sampler = self.procs[0].sampler_state
        assert sampler is not None
        self.cursor.restore(sampler)

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

    def _log(self, event: str, **kw: Any) -> None:
        self.timeline.append(
            {"t_ms": round((time.perf_counter() - self._t0) * 1e3, 3), "event": event, **kw}
        )

    def _shadow_factory(self) -> Replica:
        return copy_replica(self.template, clear_state=True)

    # ------------------------------------------------------------ fault points

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

    # --- shadows, faults, fencing ------------------------------------------------

    # --- recovery plans on real tensors --------------------------------------------

    def _reconcile(
        self, before: ClusterState, after: ClusterState, effects: tuple[Effect, ...]
    ) -> None:
        target, kind = after.target, after.kind
        lost = {r for r in range(self.W) if all(d == LOST for d in before.data[r])}
        for r in range(self.W):
            layouts.ensure(self, r, r in lost)
        reason = next((a.reason for a in effects if isinstance(a, fx.Reconciled)), "")
        rec = self._rec
        if kind is Kind.TIER2:
            snapshots.restore(self, target)
            self.stats["snapshot_restores"] += 1
        else:
            for a in effects:
                if not isinstance(a, fx.RunRepair):
                    continue
                if a.what == "tier1":
                    tier1.decode_chunk(self, a.rank, a.chunk, a.step)
                    self.stats["chunks_repaired_from_parity"] += 1
                    if rec:
                        rec.tier1_chunks += 1
                elif a.what == "grad-tier1":
                    tier1.decode_grads(self, a.rank, a.step)
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
            load_ps=p.load_ps,
            step_scheduler=lambda: step_scheduler(p.replica.scheduler),
            who=f"rank {r}",
        )
        if done.rng is not None:
            p.rng = done.rng
            p.sampler_state = done.sampler
        return done.forward, done.dropped

    def write_checkpoint(self, step: int) -> None:
        """``SaveCheckpoint``: the model's and optimizer's own state dicts at ``step``,
        written once for the replica group (every simulated rank holds the same
        replica: rank 0 writes it), the process states and checksums kept for
        :meth:`publish_checkpoint`."""
        assert self.checkpointer is not None
        t0 = time.perf_counter()
        p0 = self.procs[0]
        assert p0.ropt is not None
        self.checkpointer.write(step, training_state(p0.replica.model, p0.ropt, copy=True))
        self._save_s = time.perf_counter() - t0
        self._ckpt_meta[step] = {
            "step": step,
            "world_size": self.W,
            "checksums": {
                str(p.rank): [p.layout.stored_checksum(c) for c in range(p.layout.n_chunks)]
                for p in self.procs
            },
            "process_states": {
                str(p.rank): self._store(p.rank).process_states[p.rank][step] for p in self.procs
            },
            "n_chunks": p0.layout.n_chunks,
            "chunk_numel": p0.layout.chunk_numel,
        }

    def publish_checkpoint(self, step: int) -> None:
        """``PublishCheckpoint``: every writer finished; the checkpoint is the fallback."""
        assert self.checkpointer is not None
        self.checkpointer.publish(step, self._ckpt_meta.pop(step))
        self.stats["checkpoints_durable"] += 1
        self._log(
            "checkpoint", step=step, detail=f"step {step} durable in {self.checkpointer.describe()}"
        )

    def abort_checkpoint(self, step: int) -> None:
        if self.checkpointer is not None:
            self.checkpointer.abort(step)
        self._ckpt_meta.pop(step, None)

    def _checkpoint_due(self, step: int) -> bool:
        s = self.state
        if self.checkpointer is None or s.cpend != NONE:
            return False
        if self._ckpt_interval <= 0 and self.options.checkpoint_mtbf > 0 and self._save_s > 0:
            step_s = (time.perf_counter() - self._t0) / max(1, self.stats["steps_run"])
            self._ckpt_interval = young_daly_interval(
                self._save_s, self.options.checkpoint_mtbf, step_s
            )
        return self._ckpt_interval > 0 and step - s.ckpt >= self._ckpt_interval

    def _take_checkpoint(self) -> None:
        """The protocol's checkpoint: BeginCheckpoint (the writers save), each writer's
        WriteShard, CheckpointDurable (published). The fake backend writes at once."""
        self.feed(ev.BeginCheckpoint())
        for r in range(self.W):
            self.feed(ev.WriteShard(r))
        self.feed(ev.CheckpointDurable())

    def _restore_checkpoint(self, before: ClusterState, step: int) -> None:
        assert self.checkpointer is not None
        lost = {r for r in range(self.W) if all(d == LOST for d in before.data[r])}
        for r in range(self.W):
            layouts.ensure(self, r, r in lost)
            rx.free_undo(self.procs[r].layout)
        state, meta = self.checkpointer.read(step)
        where = f"the checkpoint of step {step} in {self.checkpointer.describe()}"
        for p in self.procs:
            load_model_state(p.replica.model, state, where)
            load_retained_optimizer_state(p.layout, state, where)
            rx.seal_checked(
                p.layout, step, meta["checksums"][str(p.rank)], "disk checkpoint", f"rank {p.rank}"
            )
            p.layout.clear_prepared()
            p.load_ps(meta["process_states"][str(p.rank)])
        self._after_recovery_state(step)

    def _after_recovery_state(self, target: int, *, snapshot: bool = True) -> None:
        """Verify every chunk, then rebuild the redundancy at ``target``: process states,
        tier-1 parity, empty gradient parity, and (``snapshot``) the tier-2 snapshot."""
        for p in self.procs:
            rx.check_resumable(p.layout, p.ropt, target, f"rank {p.rank}")
        for n in range(self.backend.nodes):
            self.backend.node_store(n).pending.clear()
        for p in self.procs:
            self._store(p.rank).process_states[p.rank] = {target: p.ps_json(target)}
        tier1.encode_all(self, target)
        if snapshot:
            snapshots.take(self, target)

    # --- checks (tests and the demo use them) --------------------------------------

    def mismatches(self, s: ClusterState | None = None) -> list[str]:
        """Where the real state disagrees with the core's ``s`` (default: the current
        state); empty: it refines it."""
        return inspect.mismatches(self, self.state if s is None else s)

    def parity_exact(self) -> list[str]:
        """Recompute every node's tier-1 parity from the members' bytes and compare."""
        return tier1.exact(self)

    def retained_state(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's params and optimizer state buffers (copies), for bitwise checks."""
        return inspect.retained_state(self)

    def process_states(self) -> list[dict[str, Any]]:
        """Every rank's optimizer and scheduler process state (JSON-able)."""
        return inspect.process_states(self)

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
            self.points.fire(f.faults)
            raise _Interrupted from None
        except ChecksumError as err:
            if not isinstance(e, (ev.BeginChunk, ev.Prepare)):
                raise
            coord.adopt(before)  # no vote cast / no undo copy taken
            integrity.failure(self, e.rank, str(err))
            raise _Interrupted from None
        coord.adopt(after)

    def _try(self, e: ev.Event) -> bool:
        if self.model.why_not(self.state, e) is not None:
            return False
        self.feed(e)
        return True

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
            if not snapshots.capture_clean(self):
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
                self.points.between(r, V, "allreduce")
                self.feed(ev.Reduce(r))
            for r in R:
                self.feed(ev.Prepare(r))
            for r in R:
                self.points.between(r, V, "decide", where="before")
            self.feed(ev.Decide())
            for r in R:
                self.points.between(r, V, "decide", where="after")
            for c in range(self.n_chunks):
                for r in R:
                    self.feed(ev.BeginChunk(r, c))
                    self.feed(ev.EndChunk(r, c))
                    self.points.between(r, V, "apply", c, "written")
                    self.feed(ev.ParityChunk(r, c))
            for r in R:
                self.points.between(r, V, "finish")
                self.feed(ev.Finish(r))
        except _Interrupted:
            self.recover()
            return None
        loss = sum(p.loss or 0.0 for p in self.procs) / self.W
        self.losses[V] = loss
        self.stats["steps_run"] += 1
        s = self.state
        if self.options.tier2 and V - s.t2 >= self.options.tier2_interval:
            if not snapshots.capture_clean(self):
                self.recover()
                return loss
            self.feed(ev.Tier2Snapshot())
        if self._checkpoint_due(V):
            self._take_checkpoint()
        self._warm_shadows()
        return loss

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
                bad = integrity.scan(self, s)
                if bad:
                    for r, why in bad.items():
                        integrity.failure(self, r, why)
                    continue
            e = schedule.next_event(self.model, s)
            if e is None:
                break
            if isinstance(e, ev.GoFallback) and self.checkpointer is None:
                reason = self.model.plan(s).reason
                self._log("unrecoverable", step=V, detail=reason)
                raise UnrecoverableError(self.lost_message(s, reason))
            name = type(e).__name__
            if self.injector is not None and name in RECOVERY_WHERE:
                hits = [
                    f
                    for r in range(self.W)
                    for f in self.injector.take(r, V, "recovery", None, name)
                ]
                if hits:
                    self.points.fire(hits)
                    continue
            self.feed(e)
            if isinstance(e, ev.Fence):
                for r in sorted(self.stale):  # the fenced process wakes up and tries to write
                    self._try(ev.StaleWrite(r, 0))
        else:  # pragma: no cover
            raise RuntimeError("recovery did not end")
        self._warm_shadows()

    def train(self, steps: int, step_fn: StepFn | None = None) -> None:
        """Train until the committed step reaches ``steps``, recovering in place."""
        if step_fn is not None:
            self.step_fn = step_fn
        while self.state.committed < steps or self.state.phase is not Phase.RUNNING:
            self.run_step()

    # --- attach to retained state left by an earlier engine ------------------------
