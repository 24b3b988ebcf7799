"""The trainer side of the gloo backend: one rank's session, from ``wrap`` to the job's end.

:func:`wrap_gloo` is what ``leto.wrap`` becomes in a process started by ``leto
launch`` with ``backend = "gloo"``. It returns a :class:`GlooSession` with the
same surface as the fake backend's session (``run_step``, ``train``, ``step``,
``model``, ``optimizer``, ``timeline``, ``stats``, ``retained_state``).

Each rank is one process. Its parameters, gradients and optimizer state are
views into memfd segments owned by its keeper (:mod:`.keeper`); its node's
tier-1 blocks (a parity, or with replicas only the records) and tier-2 snapshot
slots are segments owned by the node agent. The session holds one rank's state
and its life (start, or wait warm as a shadow until promoted; the job-wide
completion barrier); small collaborators do the rest, each seeing the session
through a protocol of its own module that names what it uses (``GroupsHost``,
``MemoryHost``, ``StepHost``, ...), so that none imports this module back:

* :mod:`.rank_memory`: the retained state bound from the keeper, the node's segments;
* :mod:`.process_groups`: the gloo communicators of each generation;
* :mod:`.fault_points`: safe points, and the faults of the plan fired there;
* :mod:`.transaction`: one step as a transaction (compute, reduce, prepare,
  decide, apply chunk by chunk, finish);
* :mod:`.snapshots` and :mod:`.checkpoints`: the tiers beyond one step;
* :mod:`.rank_state`: the process state (RNG, scheduler, sampler) kept by the agent;
* :mod:`.step`: the user's own loop; :mod:`.follow`: a recovery, carried out.

A recovery (``abort`` from the coordinator, or a collective that fails because
a peer died) stops the step at the next safe point, or, arriving inside the step
function's forward and backward, runs on a thread beside them while they go on
(:mod:`.transaction`, "a recovery in the compute"); the process keeps running,
tears its process group down and follows the coordinator's commands: ``report``
(join the communicator of the new generation, attach, report the retained
truth), ``reconcile`` (tier-1 repairs, roll forward/back, tier-2 restore or the
checkpoint; verify everything; re-encode parity; new snapshot), ``rebuild``,
``resume``. A promoted shadow enters the same loop from ``wrap``.
"""

from __future__ import annotations

import hashlib
import os
import queue
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from leto.errors import ConfigError
from leto.retained import recovery as rx
from leto.retained.layout import RetainedLayout
from leto.retained.optim import RetainedOptimizer, check_supported
from leto.retained.parity import as_bytes
from leto.retained.process_state import (
    BatchCursor,
    capture_rng,
    flush_denormal_on,
    is_per_rank,
)
from leto.retained.recovery import IntegrityError
from leto.retained.shard import FullParams

from . import bootstrap
from . import messages as M
from .channel import AgentChannel
from .checkpoints import Checkpoints
from .collective import Interrupted
from .fault_points import FaultPoints
from .follow import Follower
from .keeper_client import KeeperClient
from .parity_block import ParityBlock
from .process_groups import ProcessGroups
from .rank_memory import RankMemory, to_meta
from .rank_state import RankState
from .snapshots import Tier2Snapshots
from .step import UserLoop, install_unscale_grads
from .stops import StopPoints
from .title import set_title
from .transaction import StepFn, StepTransaction

PREMAP_EVERY_S = 2.0  # a warm shadow looks for node blocks made since, this often

__all__ = ["GlooSession", "IntegrityError", "finish", "wrap_gloo"]


def wrap_gloo(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    sampler: Any = None,
    *,
    config: Any,
    step_fn: StepFn | None = None,
    checkpointer: Any = None,
    backend: Any = None,
    check: bool = False,
    scaler: Any = None,
    per_rank: bool | None = None,
) -> GlooSession:
    """``leto.wrap`` on the gloo backend (only inside a process started by ``leto launch``).

    ``check`` (the fake engine's model-vs-state check after each recovery) has no
    separate switch here: every recovery verifies every chunk's checksum and version
    before training resumes.
    """
    del check
    ch = bootstrap.CHANNEL
    if ch is None:
        raise ConfigError(
            "backend",
            "'gloo' runs one process per rank: start this script with `leto launch "
            "--nproc-per-node N [--nnodes M ...] script.py` (or use backend='fake')",
        )
    if bootstrap.WATCH is not None:  # the script calls leto.wrap: torch as it was
        bootstrap.WATCH.wrapped()
    if backend is not None:
        raise ConfigError("backend", "the gloo backend takes no backend object")
    if checkpointer is not None:
        raise ConfigError("checkpointer", "on gloo, set checkpoint_dir in the config instead")
    spec = bootstrap.SPEC
    if config.nodes != spec["nnodes"] or config.ranks_per_node != spec["nproc"]:
        raise ConfigError(
            "topology",
            f"{config.nodes}x{config.ranks_per_node} in the config, but `leto launch` started "
            f"{spec['nnodes']} node(s) x {spec['nproc']} rank(s)",
        )
    if scheduler is not None and getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("scheduler: it is bound to another optimizer than the one wrapped")
    check_supported(optimizer)
    session = GlooSession(ch, spec, model, optimizer, scheduler, sampler, config, step_fn)
    loop = UserLoop(
        session,
        stateful={} if scaler is None else {"scaler": scaler},
        per_rank=is_per_rank(sampler) if per_rank is None else per_rank,
    )
    if scaler is not None and scaler.is_enabled() and (config.shard or config.master_weights):
        # its gradients are in retained memory, not in .grad (float32 masters: of another
        # dtype; sharded: this rank's shard, whose inf/NaN finding every rank must share)
        install_unscale_grads(scaler, loop.unscale_grads)
    session.start()
    loop.started()
    global _SESSION
    _SESSION = session
    if finish not in bootstrap.AT_EXIT:
        bootstrap.AT_EXIT.append(finish)
    return session


_SESSION: GlooSession | None = None


def finish(ch: AgentChannel) -> None:
    """At the script's end: the job-wide completion barrier, if not done already."""
    s = _SESSION
    if s is not None and not s.completed and not s.complete():
        s._fatal(
            "the script ended (it does not call session.train), but a recovery then rolled "
            f"this rank back to step {s.step}: use session.train(step_fn, steps)"
        )


class GlooSession:
    """One rank of a gloo job (see the module docstring)."""

    def __init__(
        self,
        ch: AgentChannel,
        spec: dict[str, Any],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        sampler: Any,
        config: Any,
        step_fn: StepFn | None,
    ) -> None:

        self.ch = ch
        self.spec = spec
        self.cfg = config
        self.rank: int = spec["rank"]
        self.W: int = spec["world"]
        self.node: int = spec["node"]
        self.local_rank: int = spec["local_rank"]
        self.nproc: int = spec["nproc"]
        self.nnodes: int = spec["nnodes"]
        self.role: str = spec["role"]
        self.model = model
        self.user_optimizer = optimizer
        self.scheduler = scheduler
        self.step_fn = step_fn
        self.cursor = BatchCursor(sampler)
        self.gen: int = int(spec.get("generation", 0))
        self.ropt: RetainedOptimizer | None = None
        # sharded state (shard = true): the model's parameters, not retained
        self.full: FullParams | None = None
        self.keeper: KeeperClient | None = None
        self.rng: dict[str, Any] | None = None
        self.sampler_state: dict[str, Any] | None = None
        # the main thread's subnormal mode at leto.wrap (set in start): every step's and
        # every recovery's math runs in it (check_float_mode, the recovery's thread)
        self.flush_denormal = False
        self._store: Any = None
        self._store_at: tuple[str, int] | None = None
        self.parity: list[ParityBlock] = []
        self.gparity: ParityBlock | None = None
        # tier 1 as replicas (tier1_code "replica", or gloo's default "auto" with 2+
        # ranks per node): the node's other ranks hold the same state; the blocks
        # keep only each member's versions and checksums
        self.replica = config.tier1_kind == "replica"
        self.completed = False
        self.t0 = time.perf_counter()
        self.timeline: list[dict[str, Any]] = []
        self.losses: dict[int, float] = {}
        # this process's counters: a replacement process counts from its own start
        # (the job's recoveries are in the event log and `leto report`)
        self.stats: dict[str, int] = {
            "steps_run": 0,
            "recoveries": 0,
            "computes_kept": 0,  # a compute paused by a recovery and not run again
            "micro_batches_replayed": 0,  # of another rank's lost share, or its own
            "chunks_repaired_from_parity": 0,
            "grad_blocks_repaired_from_parity": 0,
            "chunks_copied_from_replicas": 0,
            "grad_blocks_copied_from_replicas": 0,
            "chunks_rolled_forward": 0,
            "snapshot_restores": 0,
            "checkpoint_restores": 0,
            "parity_reencodes_skipped": 0,
        }
        self.keeper_pid: int = spec.get("keeper_pid", 0)
        self._premap_failed = False  # a warm shadow's early mapping of its node's blocks
        # the collaborators, each holding this session (see the module docstring)
        self.memory = RankMemory(self)
        self.groups = ProcessGroups(self)
        self.fault_points = FaultPoints(self, list(spec.get("faults", [])))
        self.ps = RankState(self)
        self.txn = StepTransaction(self)
        self.snapshots = Tier2Snapshots(self, config)
        self.checkpoints = Checkpoints(self)
        self.follower = Follower(self)  # carries out recoveries (follow.py)
        self.stops = StopPoints(
            model, lambda: ch.aborted_since(self.gen) or self.txn.beside(), Interrupted
        )
        self.stops.pause = self.txn.paused  # a recovery noticed inside the compute
        self.stops.tick = ch.tick  # each layer is progress for the agent's hang check
        ch.on_abort = self.txn._abort_seen  # inside the compute: the recovery starts beside it
        self.loop: UserLoop | None = None  # the user's own loop (step.py), once wrap installs it

    # ================================================================ properties

    @property
    def store(self) -> Any:
        """The job's TCPStore: where the agent last said it is (a coordinator that took
        over serves a new one, :class:`~.messages.StoreAt`), connected on first use."""
        at = self.ch.store_at or (str(self.spec["store_host"]), int(self.spec["store_port"]))
        if self._store is None or at != self._store_at:
            moved = self._store is not None
            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                at[0],
                at[1],
                None,
                False,
                timedelta(seconds=max(60.0, float(self.spec["collective_timeout"]))),
            )
            self._store_at = at
            if moved:
                self.checkpoints.reseed(self._store)
        return self._store

    @property
    def device_name(self) -> str:
        """Where the retained state lives (the config's ``device``), as the keeper names it."""
        return str(getattr(self.cfg, "torch_device", "cpu"))

    @property
    def layout(self) -> RetainedLayout:
        return rx.layout_of(self.ropt, f"rank {self.rank}")

    @property
    def optimizer(self) -> RetainedOptimizer:
        assert self.ropt is not None
        return self.ropt

    @property
    def step(self) -> int:
        """The last step this rank completed (the committed step between steps)."""
        return self.ropt.version if self.ropt is not None else 0

    @property
    def members(self) -> int:
        return self.nproc

    def phase_cpu_s(self) -> dict[str, float]:
        """CPU seconds this process has spent in each phase of the protocol so far.

        Phases as the agent sees them (``forward``, ``backward``, ``allreduce``,
        ``prepare``, ``decide``, ``apply``, ``snapshot``, ``idle``, recovery phases);
        the phase under way when this is read is counted up to its last change.
        All threads of the process count (the heartbeat and agent reader too).
        """
        return dict(self.ch.phase_cpu)

    def phase_wall_s(self) -> dict[str, float]:
        """Wall seconds this process has spent in each phase so far (as :meth:`phase_cpu_s`)."""
        return dict(self.ch.phase_wall)

    def check_float_mode(self) -> None:
        """At a step's start, on the thread that computes it: the subnormal mode is still
        the one at ``leto.wrap``. A shadow promoted in this rank's place takes the mode
        its script had when it reached ``leto.wrap``, and leto's own threads that of the
        process then, so a mode changed afterwards would make a recovery's math differ
        from the steps' (not bitwise the run that never failed): refused in one line."""
        if flush_denormal_on() != self.flush_denormal:
            now = "on" if not self.flush_denormal else "off"
            raise RuntimeError(
                f"torch.set_flush_denormal() turned subnormal flushing {now} after leto.wrap: "
                "call it before leto.wrap, so that a recovery computes in the same mode as "
                "the steps"
            )

    def _log(self, event: str, **kw: Any) -> None:
        self.timeline.append(
            {"t_ms": round((time.perf_counter() - self.t0) * 1e3, 3), "event": event, **kw}
        )

    # ================================================================ start

    def start(self) -> None:
        self.flush_denormal = flush_denormal_on()  # as a promoted shadow's will be
        self.store  # noqa: B018 - connected at the start, as a trainer of torchrun is
        if self.role == "shadow":
            self._as_shadow()
            return
        self.keeper = KeeperClient(
            self.spec["keeper_socket"], generation=self.gen, device=self.device_name
        )
        self.groups.init(self.gen)
        self.memory.bind(attach=False)
        self.rng = capture_rng()
        self.sampler_state = self.cursor.initial
        resumed = bool(getattr(self.cfg, "resume", None))
        start = self.checkpoints.resume() if resumed else 0
        self.memory.node_memory()
        self.ps.send(start)
        meta = self.follower._after_recovery_state(start)
        self.follower._renew_grad_parity()  # no rank holds gradients yet
        self.snapshots.t2 = start  # its snapshot is the start's (a resumed job's too)
        self.checkpoints.write(start, first=True, resumed=resumed)
        self.checkpoints.first = start + 1
        if self.rank == 0:  # the first step's time is Young/Daly's (shadows read it here)
            self.store.set(f"leto/{self.spec['job']}/first_step", str(start + 1))
        self.checkpoints.step_t0 = time.perf_counter()
        self.memory.status_lost(False)
        self.ready(start, meta)

    def take_place(self, node: int, nodes: int) -> None:
        """The world changed in place to ``nodes`` nodes, this rank's node now numbered
        ``node`` (a node before it was lost: :func:`leto.core.reshape.renumbered`). The
        one place a rank's identity changes: everything after (its groups, its part of
        the global batch, its messages, its node's tier-2 share) reads it from here, and
        the script's torchrun variables say it too."""
        self.node, self.nnodes = node, nodes
        self.rank, self.W = node * self.nproc + self.local_rank, nodes * self.nproc
        for k, v in (("RANK", self.rank), ("ROLE_RANK", self.rank), ("WORLD_SIZE", self.W)):
            os.environ[k] = str(v)
        os.environ["GROUP_RANK"] = os.environ["NODE_RANK"] = str(node)

    def ready(self, start: int, meta: dict[str, Any] | None) -> None:
        """Say this rank is ready to train from ``start`` (its tier-2 snapshot ``meta``):
        at the job's start, and after an in-place change of the world (``reshape``)."""
        self.ch.send(
            M.Ready(
                rank=self.rank,
                gen=self.gen,
                n_chunks=self.layout.n_chunks,
                chunk_numel=self.layout.chunk_numel,
                tier1=bool(self.cfg.tier1),
                tier1_kind=str(self.cfg.tier1_kind),
                tier2=bool(self.cfg.tier2),
                tier2_interval=int(self.cfg.tier2_interval),
                tier2_parity=self.snapshots.t2_parity,
                checkpoint=self.cfg.checkpoint_dir is not None,
                snapshot=meta,
                start=start,
                shard=bool(self.cfg.shard),
            )
        )
        self.ch.mark("idle", 0)

    def _premap(self) -> None:
        """A warm shadow's early mapping of its node's blocks (a pure saving: if it fails,
        a promotion maps them as before)."""
        if self._premap_failed:
            return
        try:
            self.memory.premap_node()
        except Exception as e:  # noqa: BLE001 - then they are mapped at the promotion
            self._premap_failed = True
            sys.stderr.write(f"leto: shadow of rank {self.rank}: blocks not mapped early: {e}\n")

    def _as_shadow(self) -> None:
        """Wait, warm, until promoted; then recover into the job.

        A shadow releases its parameters' memory (a skeleton); a cold start (a process
        started to be promoted at once, or where no skeleton could be built) keeps them:
        attaching the retained state rebinds them all the same.
        """
        if self.spec.get("skeleton", True):
            to_meta(self.model)
        self.keeper = KeeperClient(
            self.spec["keeper_socket"], generation=self.gen, role="shadow", device=self.device_name
        )
        self.ch.mark("shadow", 0)
        self.ch.send(M.Warm())
        while True:
            # the node's tier-1 blocks mapped while waiting, not while a recovery waits
            # for this rank's report: those made so far, and every few seconds those
            # made since (a job's shadows start before its trainers make them)
            self._premap()
            try:
                msg = self.ch.next_command(timeout=PREMAP_EVERY_S)
            except queue.Empty:
                continue
            if isinstance(msg, M.Promote):
                break
        self.gen = msg.gen
        self.keeper_pid = msg.keeper_pid
        self.role = "trainer"
        if msg.nodes:  # the world now (changed in place since this shadow started)
            self.take_place(self.node if msg.node is None else msg.node, msg.nodes)
        set_title(f"trainer rank {self.rank}", str(self.spec.get("job", "")))
        # the keeper may have been replaced (its memory lost) since this shadow connected
        self.keeper.close()
        self.keeper = KeeperClient(msg.keeper_socket, generation=self.gen, device=self.device_name)
        self.ch.send(M.Promoted(rank=self.rank, gen=self.gen))
        self._log("promoted", generation=self.gen)
        self.follower._follow()

    def _fatal(self, message: str) -> None:
        try:
            self.ch.send(M.Fatal(rank=self.rank, error=message))
        finally:
            sys.stderr.write(f"leto: rank {self.rank}: {message}\n")
            sys.stderr.flush()
            os._exit(3)

    # ================================================================ the step

    def run_step(self, step_fn: StepFn | None = None) -> float | None:
        """One step (every rank runs it); its loss on this rank, or None if interrupted."""
        return self.txn.run(step_fn)

    def batches(self, steps: int | None = None) -> Any:
        """The user's own loop: this rank's batch of each step (leto's step boundary),
        until the committed step is ``steps`` and the whole job is done (docs/loop.md)."""
        assert self.loop is not None  # leto.wrap installs it
        return self.loop.batches(steps)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The user's loop: clip this step's reduced gradients by their global norm
        (with ``shard = true``, what to call instead of ``torch.nn.utils.clip_grad_norm_``:
        one all-reduce of the shards' norms); the total norm."""
        assert self.loop is not None
        return self.loop.clip_grad_norm_(max_norm, norm_type)

    def no_sync(self) -> Any:
        """Gradient accumulation: backwards inside reduce nothing (DDP's ``no_sync``)."""
        assert self.loop is not None
        return self.loop.no_sync()

    @property
    def committed(self) -> bool:
        """The user's loop: this iteration's ``optimizer.step()`` committed its step (the
        model holds the weights of ``session.step``). False before it, and for the rest
        of an iteration a recovery made void: what the loop computes then is discarded,
        so code that saves or reports state after ``optimizer.step()`` (a checkpoint of
        its own, a metric) runs only ``if session.committed`` (docs/loop.md)."""
        return self.loop is not None and bool(self.loop.committed)

    def train(self, step_fn: StepFn, steps: int) -> dict[str, int]:
        """Run steps until every rank has completed ``steps``; the counters."""
        self.step_fn = step_fn
        while True:
            while self.step < steps:
                self.run_step(step_fn)
            if self.complete():
                return dict(self.stats)

    def complete(self) -> bool:
        """Report this rank's final state and wait until the whole job is done.

        False if a recovery intervened (it may have rolled this rank back: train on).
        """
        if self.completed or self.ropt is None:
            self.completed = True
            return True
        self.checkpoints.drain()  # the job's end waits for an asynchronous save in flight
        digest = self.digest()
        if os.environ.get("LETO_DUMP_FINAL"):  # debugging: the final process state as JSON
            d = os.path.join(os.environ.get("LETO_RUN_DIR", "."), "final")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"rank{self.rank}.process_state.json"), "w") as f:
                f.write(self.ps.to_json(self.step))
        lay = self.layout
        memory = {
            "device": str(lay.device),
            "checksum": lay.checksum_algorithm,
            "staged": self.groups.stage,
        }
        self.ch.send(
            M.Done(rank=self.rank, step=self.step, gen=self.gen, digest=digest, memory=memory)
        )
        self.ch.mark("done")
        while True:
            msg = self.ch.next_command()
            if isinstance(msg, M.Complete):
                self.completed = True
                return True
            if isinstance(msg, M.Abort):
                break
        self.txn.stopped("")
        self.follower._follow()
        return False

    def digest(self) -> dict[str, str]:
        """SHA-256 of every retained buffer (params, optimizer states) and of the process
        state (optimizer scalars, LR scheduler, sampler position, RNG)."""
        out = {
            name: hashlib.sha256(as_bytes(buf).cpu().numpy().tobytes()).hexdigest()
            for name, buf in rx.named_buffers(self.layout)
        }
        out["process_state"] = hashlib.sha256(self.ps.to_json(self.step).encode()).hexdigest()
        return out

    def retained_state(self) -> list[dict[str, torch.Tensor]]:
        """This rank's params and optimizer state (copies), as a one-element list."""
        return [{name: buf.clone() for name, buf in rx.named_buffers(self.layout)}]
