"""The engine: leto's protocol core driven over real tensors on a backend.

Two halves:

* the **executor** (:meth:`Engine.execute`) carries out the effects of one core
  event on real tensors, one function per effect (:mod:`.executors`): forward/backward
  on a rank's model, the gradient all-reduce into retained memory, PREPARE, APPLY chunk
  by chunk, FINISH, faults, fencing, promotion; the ``Reconcile`` event's plan as a
  whole (:mod:`.recovery`), followed by a check of every chunk's checksum before
  anything resumes;
* the **driver** (:meth:`Engine.run_step`, :meth:`Engine.recover`,
  :meth:`Engine.train`) feeds the core's :class:`~leto.core.cluster.ClusterModel`
  the events of each step in a fixed order, consults the backend's fault
  injector at every point of the step (:mod:`.faults`), and on a failure runs the
  recovery events the core schedules (:mod:`.recovery`).

The rest lives next to it, one concept per module: binding ranks to their retained
state (:mod:`.layouts`), tier-1 parity (:mod:`.tier1`), tier-2 snapshots
(:mod:`.snapshots`), disk checkpoints (:mod:`.checkpoints`), checksum failures
(:mod:`.integrity`) and the read-only checks tests use (:mod:`.inspect`). They are
functions (or, for checkpoints and fault points, a collaborator) rather than methods,
so that each reads on its own; the engine holds the shared state and passes itself,
each part typing the narrow view of it that it uses as a Protocol of its own
(:class:`.host.RanksHost`, the ranks, and the roles built on it: ``ExecutorHost``,
``RecoveryHost``, ``CheckpointHost``, ...), so that no part imports the engine.

The core's state and COMMIT records live in the backend's
:class:`~leto.backends.base.ProtocolRecord`, never in a trainer. The Hypothesis
machine in ``tests/fake`` drives the executor alone, with events it picks.

Per rank ("process", :class:`~.rank.RankProc`): a model, its torch optimizer and LR
scheduler (one deep copy of the user's per simulated rank), a retained layout with a
chunked optimizer over it, and the rank's RNG state. Process state (optimizer scalars,
scheduler, sampler position, RNG) is JSON in the node agent's memory (tier 1 of the
small state: it survives a rank's memory loss) and in the tier-2 snapshot.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from leto.backends.base import Backend, NodeStore, ProtocolRecord
from leto.core import events as ev
from leto.core.cluster import ClusterConfig, ClusterModel, ClusterState, Effect
from leto.core.recovery import Phase
from leto.core.shadow import ShadowState
from leto.core.trainer import TrainerState
from leto.retained.checkpoint import Checkpointer
from leto.retained.layout import ChecksumError
from leto.retained.optim import check_supported
from leto.retained.process_state import BatchCursor, capture_rng
from leto.retained.recovery import IntegrityError

from . import inspect, integrity, layouts, recovery, snapshots, tier1
from .backend import Fault, FaultInjector
from .checkpoints import Checkpoints
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
        self.injector: FaultInjector | None = getattr(backend, "faults", None)
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
        self.checkpoints = Checkpoints(
            self, checkpointer, options.checkpoint_interval, started=self._t0
        )
        self.points = FaultPoints(self)
        self.open_faults: list[Fault] = []  # faults fired since the last resume
        self.recovery_record: RecoveryRecord | None = None
        self.current_step = 0
        self.stale: dict[int, RankProc] = {}
        self.integrity_notes: list[str] = []

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
            self.backend.spawn_shadow(p.rank, self.new_shadow)
        if resume is not None:
            self.checkpoints.resume(*resume)
        for p in self.procs:
            self.store(p.rank).process_states[p.rank] = {start: p.ps_json(start)}
        recovery.rebuild_redundancy(self, start)
        self.current_step = start
        if checkpointer is not None:  # the start is durable in the model from the start
            self.checkpoints.write(start)
            self.checkpoints.publish(start)
        self.log("start", step=start, detail=inspect.describe(self, checkpointer))

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

    def store(self, rank: int) -> NodeStore:
        return self.backend.node_store(self.backend.node_of(rank))

    def member(self, rank: int) -> int:
        return self.backend.ranks_of(self.backend.node_of(rank)).index(rank)

    def log(self, event: str, **kw: Any) -> None:
        self.timeline.append(
            {"t_ms": round((time.perf_counter() - self._t0) * 1e3, 3), "event": event, **kw}
        )

    def new_shadow(self) -> Replica:
        """A shadow's replica: the user's objects, deep-copied, with no optimizer state."""
        return copy_replica(self.template, clear_state=True)

    _shadow_factory = new_shadow  # its earlier name (tests/fake spawns shadows with it)

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
            recovery.reconcile(self, before, after, effects)
            return
        for effect in effects:
            EXECUTORS[type(effect)](self, effect, before, after)

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

    def try_feed(self, e: ev.Event) -> bool:
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
        self.current_step = V
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
                self.points.between(r, V, "tail")
                self.feed(ev.Close(r))
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
        if self.checkpoints.due(V):
            self.checkpoints.take()
        self.warm_shadows()
        return loss

    def warm_shadows(self) -> None:
        for r in range(self.W):
            if self.state.shadow[r] is not ShadowState.WARM:
                self.try_feed(ev.ShadowWarm(r))

    def recover(self) -> None:
        """Feed the recovery the core schedules until every rank runs again (or raise):
        :func:`leto.backends.fake.recovery.run`."""
        recovery.run(self)

    def train(self, steps: int, step_fn: StepFn | None = None) -> None:
        """Train until the committed step reaches ``steps``, recovering in place."""
        if step_fn is not None:
            self.step_fn = step_fn
        while self.state.committed < steps or self.state.phase is not Phase.RUNNING:
            self.run_step()

    # --- checks (tests and the demo use them): :mod:`.inspect`, :mod:`.tier1` ------

    def mismatches(self, s: ClusterState | None = None) -> list[str]:
        """Where the real state disagrees with the core's ``s`` (default: the current
        state); empty: it refines it."""
        return inspect.mismatches(self, self.state if s is None else s)

    def parity_exact(self) -> list[str]:
        """Recompute every node's tier-1 parity from the members' bytes and compare."""
        return tier1.exact(self, self.n_chunks)

    def retained_state(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's params and optimizer state buffers (copies), for bitwise checks."""
        return inspect.retained_state(self.procs)

    def process_states(self) -> list[dict[str, Any]]:
        """Every rank's optimizer and scheduler process state (JSON-able)."""
        return inspect.process_states(self.procs)
