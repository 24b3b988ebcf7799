"""The trainer side of the gloo backend: one rank's step transaction and its recovery.

:func:`wrap_gloo` is what ``leto.wrap`` becomes in a process started by ``leto
launch`` with ``backend = "gloo"``. It returns a :class:`GlooSession` with the
same surface as the fake backend's session (``run_step``, ``train``, ``step``,
``model``, ``optimizer``, ``timeline``, ``stats``, ``retained_state``).

Each rank is one process. Its parameters, gradients and optimizer state are
views into memfd segments owned by its keeper (:mod:`.keeper`); its node's
tier-1 blocks (a parity, or with replicas only the records) and tier-2 snapshot
slots are segments owned by the node agent.
One step ``V`` (the same transaction as the fake backend's engine, the protocol's
events in brackets):

1. forward and backward on the rank's shard of the global batch [Compute];
2. the gradients' sum all-reduce over gloo, divided by the world size, copied into
   the retained gradient buffer [Reduce];
3. checksums verified, gradients sealed, this rank's delta added to the node's
   gradient parity (with replicas: only the record of their step), the prepare
   record (RNG, sampler position, present mask, gradient checksums) sent to the
   node agent, the vote sent [Prepare];
4. wait for ``commit(V)`` from the coordinator [Decide];
5. per chunk: undo copy [BeginChunk], new bytes written and sealed [EndChunk],
   the node's chunk parity (with replicas: its record) updated [ParityChunk],
   undo released;
6. the process state of ``V`` to the node agent, ``finished`` [Finish]; every K
   steps the tier-2 snapshot (own bytes into the node's slot, rotated parity
   across nodes) and a wait for its confirmation [Tier2Snapshot].

A recovery (``abort`` from the coordinator, or a collective that fails because
a peer died) stops the step at the next safe point; the process keeps running,
tears its process group down and follows the coordinator's commands: ``report``
(join the communicator of the new generation, attach, report the retained
truth), ``reconcile`` (tier-1 repairs, roll forward/back, tier-2 restore or the
checkpoint; verify everything; re-encode parity; new snapshot), ``rebuild``,
``resume``. A promoted shadow enters the same loop from ``wrap``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from leto.core.chunk import NONE
from leto.errors import ConfigError
from leto.retained import recovery as rx
from leto.retained import rs
from leto.retained.checkpoint import CheckpointError, CheckpointStore
from leto.retained.dcp_state import (
    load_model_state,
    load_retained_optimizer_state,
    load_training_state,
    read_checkpoint,
    training_state,
    young_daly_interval,
)
from leto.retained.layout import (
    RetainedLayout,
    ShapeMismatchError,
)
from leto.retained.optim import RetainedOptimizer, check_supported, retain
from leto.retained.parity import (
    TorchDistCollective,
    as_bytes,
    encode_rotated,
    rotated_share_nbytes,
)
from leto.retained.process_state import (
    BatchCursor,
    capture_rng,
    is_per_rank,
    restore_rng,
    scheduler_state,
    shard,
    step_scheduler,
)
from leto.retained.recovery import IntegrityError

from . import bootstrap
from . import messages as M
from .channel import Aborted, AgentChannel
from .collective import CollectiveFailed as _CollectiveFailed
from .collective import Interrupted as _Interrupted
from .collective import coll as _coll
from .faults import label as fault_label
from .follow import Follower
from .keeper_client import FencedError, KeeperClient
from .parity_block import ParityBlock, block_bytes
from .step import UserLoop
from .stops import StopPoints

__all__ = ["GlooSession", "IntegrityError", "finish", "wrap_gloo"]

StepFn = Any
_STATUS = "gloo.status"  # keeper segment: int64 [lost flag]


def _to_meta(model: nn.Module) -> None:
    """Release the parameters' memory: the shadow keeps a skeleton of the same objects.

    A parameter is swapped for a meta-device one in place (``swap_tensors``: the
    optimizer and the module keep the same object). ``swap_tensors`` refuses a tensor
    that has weak references (RNN modules keep them in ``_flat_weight_refs``): such a
    parameter keeps its object and its device, and its ``.data`` becomes one element
    broadcast to its shape, so its storage is released all the same and attaching the
    retained state later rebinds ``.data`` (the module sees the same object).
    """
    for p in model.parameters():
        if p.device.type == "meta" or _is_placeholder(p):
            continue
        if weakref.getweakrefcount(p):
            p.data = torch.empty((), dtype=p.dtype, device=p.device).expand(p.shape)
        else:
            torch.utils.swap_tensors(  # type: ignore[no-untyped-call]
                p, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            )


def _is_placeholder(p: torch.Tensor) -> bool:
    """A skeleton parameter of :func:`_to_meta` that kept its device (no storage of its own)."""
    return p.numel() > 1 and p.untyped_storage().nbytes() < p.numel() * p.element_size()


def _materialize(model: nn.Module) -> None:
    """Give skeleton parameters (uninitialised) CPU memory; buffers are left alone."""
    for p in model.parameters():
        if p.device.type == "meta":
            torch.utils.swap_tensors(  # type: ignore[no-untyped-call]
                p, nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
            )
        elif _is_placeholder(p):
            p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device)


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
        self.lr: int = spec["local_rank"]
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
        self.keeper: KeeperClient | None = None
        self.status: torch.Tensor | None = None
        self.rng: dict[str, Any] | None = None
        self.sampler_state: dict[str, Any] | None = None
        self.t2 = 0
        self._t2_pending: int | None = None  # a snapshot sent, its "t2" not yet seen
        self._save_s = 0.0  # the last checkpoint's save cost here
        self._step_t0 = 0.0  # when the start's checkpoint was done
        self._yd: int | None = None  # Young/Daly's checkpoint interval, once agreed
        self.K = config.tier2_interval if config.tier2 else 10**12
        # m: lost nodes the snapshot survives (m >= 2: leto.retained.rs, striped)
        self.t2_parity = int(getattr(config, "tier2_parity", 1))
        self.faults = list(spec.get("faults", []))
        self.store: Any = None
        self.pg_gen: int | None = None
        self.node_group: Any = None
        self.cross_group: Any = None
        self.parity: list[ParityBlock] = []
        self.gparity: ParityBlock | None = None
        # tier 1 as replicas (tier1_code "replica", or gloo's default "auto" with 2+
        # ranks per node): the node's other ranks hold the same state; the blocks
        # keep only each member's versions and checksums
        self.replica = config.tier1_kind == "replica"
        self._red: torch.Tensor | None = None  # the all-reduce buffer, reused
        self._gdelta: torch.Tensor | None = None  # the gradient parity's delta, reused
        self._reencoded = False  # did the last recovery re-encode the node's tier-1 parity
        self._parity_checked = False  # did it check a kept parity (LETO_CHECK_KEPT_PARITY)
        self.completed = False
        self.t0 = time.perf_counter()
        self.timeline: list[dict[str, Any]] = []
        self.losses: dict[int, float] = {}
        self.stats: dict[str, int] = {
            "steps_run": 0,
            "recoveries": 0,
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
        self._step_in_progress = 0
        self.follower = Follower(self)  # carries out recoveries (follow.py)
        self.stops = StopPoints(model, lambda: ch.aborted_since(self.gen), _Interrupted)
        self.loop: Any = None  # the user's own loop (step.py), once wrap installs it

    # ================================================================ properties

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

    def _log(self, event: str, **kw: Any) -> None:
        self.timeline.append(
            {"t_ms": round((time.perf_counter() - self.t0) * 1e3, 3), "event": event, **kw}
        )

    # ================================================================ start

    def start(self) -> None:
        self.store = dist.TCPStore(  # type: ignore[attr-defined]
            self.spec["store_host"],
            int(self.spec["store_port"]),
            None,
            False,
            timedelta(seconds=max(60.0, float(self.spec["collective_timeout"]))),
        )
        if self.role == "shadow":
            self._as_shadow()
            return
        self.keeper = KeeperClient(self.spec["keeper_socket"], generation=self.gen)
        self._init_pg(self.gen)
        self._create_layout()
        self.rng = capture_rng()
        self.sampler_state = self.cursor.initial
        resumed = bool(getattr(self.cfg, "resume", None))
        start = self._resume() if resumed else 0
        self._node_memory()
        self._send_ps(start)
        meta = self.follower._after_recovery_state(start)
        self._checkpoint(start, first=True, resumed=resumed)
        if self.rank == 0:  # the first step's time is Young/Daly's (shadows read it here)
            self.store.set(f"leto/{self.spec['job']}/first_step", str(start + 1))
        self._step_t0 = time.perf_counter()
        self.status_lost(False)
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
                tier2_parity=self.t2_parity,
                checkpoint=self.cfg.checkpoint_dir is not None,
                snapshot=meta,
                start=start,
            )
        )
        self.ch.mark("idle", 0)

    def _as_shadow(self) -> None:
        """Wait, warm, until promoted; then recover into the job.

        A shadow releases its parameters' memory (a skeleton); a cold start (a process
        started to be promoted at once, or where no skeleton could be built) keeps them:
        attaching the retained state rebinds them all the same.
        """
        if self.spec.get("skeleton", True):
            _to_meta(self.model)
        self.keeper = KeeperClient(self.spec["keeper_socket"], generation=self.gen, role="shadow")
        self.ch.mark("shadow", 0)
        self.ch.send(M.Warm())
        while True:
            msg = self.ch.next_command()
            if isinstance(msg, M.Promote):
                break
        self.gen = msg.gen
        self.keeper_pid = msg.keeper_pid
        self.role = "trainer"
        # the keeper may have been replaced (its memory lost) since this shadow connected
        self.keeper.close()
        self.keeper = KeeperClient(msg.keeper_socket, generation=self.gen)
        self.ch.send(M.Promoted(rank=self.rank, gen=self.gen))
        self._log("promoted", generation=self.gen)
        self.follower._follow()

    # ================================================================ memory

    def _status_seg(self) -> torch.Tensor:
        if self.status is None:
            assert self.keeper is not None
            self.status = self.keeper.alloc(_STATUS, 8).view(torch.int64)
        return self.status

    def status_lost(self, lost: bool) -> None:
        self._status_seg()[0] = 1 if lost else 0

    def _bind(self, *, attach: bool) -> None:
        assert self.keeper is not None
        if not attach:
            _materialize(self.model)  # a skeleton has no values: garbage until repaired
        self.ropt = retain(
            self.model,
            self.user_optimizer,
            chunk_numel=int(self.cfg.chunk_size),
            alloc=self.keeper.alloc,
            attach=attach,
            # verify_chunks is done once per step, for every chunk, before the vote
            # (during the gradient all-reduce, so a corrupt chunk stops the step
            # before its commit); checking each chunk again at its undo copy would
            # read the whole state a second time for nothing
            verify=False,
        )

    def _create_layout(self) -> None:
        self._bind(attach=False)

    def _ensure_layout(self) -> bool:
        """Attach to the retained state, or create it fresh if the keeper lost it.

        Returns True if the memory was lost (the rank must be rebuilt).
        """
        assert self.keeper is not None
        if self.ropt is not None:
            return bool(self._status_seg()[0])
        have = self.keeper.listing()
        if "leto.super" in have:
            try:
                self._bind(attach=True)
            except ShapeMismatchError as e:
                self._fatal(
                    f"the script's model does not match the retained state: {e}. "
                    "Every process of a rank must build the same model (shapes, names, dtype)."
                )
            return bool(self._status_seg()[0])
        self.status_lost(True)  # until the rebuild completes, a restart sees LOST
        self._bind(attach=False)
        return True

    def _fatal(self, message: str) -> None:
        try:
            self.ch.send(M.Fatal(rank=self.rank, error=message))
        finally:
            sys.stderr.write(f"leto: rank {self.rank}: {message}\n")
            sys.stderr.flush()
            os._exit(3)

    def _node_memory(self) -> None:
        """Map this node's parity blocks (tier 1); created empty by the agent."""
        lay = self.layout
        if not self.cfg.tier1:
            return
        item = 0 if self.replica else lay.dtype.itemsize  # replicas: the records only
        cbytes = (1 + len(lay.states)) * lay.chunk_numel * item
        self.parity = [self._block(f"parity.{c}", cbytes) for c in range(lay.n_chunks)]
        self.gparity = self._block("gparity", lay.numel * item)

    def _block(self, name: str, nbytes: int) -> ParityBlock:
        fd = self._segment(name, block_bytes(self.members, nbytes))
        return ParityBlock(fd, self.members, nbytes)

    def _segment(self, name: str, nbytes: int) -> int:
        _, fds = self.ch.request(M.NodeSegment(name=name, nbytes=nbytes))
        if len(fds) != 1:
            raise IntegrityError(f"the agent sent no segment for {name}")
        return fds[0]

    # ================================================================ process groups

    def _init_pg(self, gen: int) -> None:
        if self.pg_gen == gen and dist.is_initialized():
            return
        self._destroy_pg()
        t = time.perf_counter()
        base = f"leto/{self.spec['job']}/pg/{gen}"
        # An abortable barrier first: gloo's own rendezvous blocks (up to the collective
        # timeout) on a peer that never comes; here every rank polls, and a recovery that
        # restarts meanwhile (a peer died or hangs) interrupts the wait at once.
        self.store.set(f"{base}/here/{self.rank}", "1")
        keys = [f"{base}/here/{q}" for q in range(self.W)]
        deadline = time.monotonic() + float(self.spec["collective_timeout"])
        while not self.store.check(keys):
            if self.ch.aborted_since(gen):
                raise Aborted(f"generation {gen} was aborted while its communicator formed")
            if time.monotonic() > deadline:
                raise _CollectiveFailed(f"not every rank joined generation {gen} in time")
            time.sleep(0.005)
        t_barrier = time.perf_counter()
        prefix = dist.PrefixStore(base, self.store)  # type: ignore[attr-defined]
        dist.init_process_group(
            "gloo",
            store=prefix,
            rank=self.rank,
            world_size=self.W,
            timeout=timedelta(seconds=float(self.spec["collective_timeout"])),
        )
        # every rank creates every group, in the same order (gloo: tier-1 groups of each
        # node, then tier-2 groups of each local rank across nodes)
        for n in range(self.nnodes):
            g = dist.new_group(list(range(n * self.nproc, (n + 1) * self.nproc)))
            if n == self.node:
                self.node_group = g
        self.cross_group = None
        if self.nnodes >= 2:
            for lr in range(self.nproc):
                g = dist.new_group([n * self.nproc + lr for n in range(self.nnodes)])
                if lr == self.lr:
                    self.cross_group = g
        self.pg_gen = gen
        self._log(
            "process_group",
            generation=gen,
            ms=round((time.perf_counter() - t) * 1e3, 3),
            barrier_ms=round((t_barrier - t) * 1e3, 3),
        )

    def _destroy_pg(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group is torn down regardless
                pass
        self.pg_gen = None
        self.node_group = None
        self.cross_group = None

    # ================================================================ faults

    def _point(
        self, phase: str, chunk: int | None = None, where: str | None = None, *, tear: Any = None
    ) -> None:
        """A safe point (abort check) and a fault point of the plan."""
        step = self._step_in_progress
        for f in self.faults:
            if f.get("_fired"):
                continue
            at_chunk = f["chunk"] if phase in ("apply", "parity") else None  # corrupt: its target
            if f["phase"] != phase or (at_chunk is not None and at_chunk != chunk):
                continue
            if f["where"] is not None and f["where"] != where:
                continue
            if phase == "recovery":
                if step < f["step"]:
                    continue
            elif f["step"] != step:
                continue
            f["_fired"] = True
            if int(self.store.add(f"leto/{self.spec['job']}/fault/{f['id']}", 1)) != 1:
                continue  # fired by an earlier incarnation
            self._fire(f, tear)
        if phase != "recovery" and self.ch.aborted_since(self.gen):
            raise _Interrupted

    def _fire(self, f: dict[str, Any], tear: Any) -> None:
        what = fault_label(f)
        print(f"leto: injecting fault: {what}", flush=True)
        sys.stdout.flush()
        kind = f["kind"]
        if kind == "crash":
            if tear is not None:
                tear()
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "exception":
            raise RuntimeError(f"injected exception: {what}")
        elif kind == "lose_memory":
            os.kill(self.keeper_pid, signal.SIGKILL)
            time.sleep(120)  # the agent kills this process (the last holder of the memory)
        elif kind == "lose_node":
            os.kill(int(self.spec["agent_pid"]), signal.SIGKILL)
            time.sleep(120)  # dies with its agent
        elif kind == "corrupt":
            if not self.cfg.verify_chunks:
                self._fatal(f"fault {what}: needs verify_chunks (PREPARE's checksum pass)")
            c = int(f["chunk"] or 0)
            if not 0 <= c < self.layout.n_chunks:
                self._fatal(f"fault {what}: this rank has chunks 0..{self.layout.n_chunks - 1}")
            first = as_bytes(self.layout.chunk_data(c)[0])
            first[0] ^= 0x10  # and train on: nothing reported a memory error
            return
        time.sleep(120)

    # ================================================================ the step

    def run_step(self, step_fn: StepFn | None = None) -> float | None:
        """One step (every rank runs it); its loss on this rank, or None if interrupted."""
        if step_fn is not None:
            self.step_fn = step_fn
        if self.step_fn is None:
            raise RuntimeError("no step function: pass one to train() / run_step()")
        try:
            return self._step()
        except (_Interrupted, Aborted, FencedError):
            self._stopped("")
        except _CollectiveFailed as e:
            self._stopped(f"collective failed: {e}")
        self.follower._follow()
        return None

    def _stopped(self, reason: str) -> None:
        self._destroy_pg()
        self.ch.mark("stopped")
        self.ch.send(M.Stopped(rank=self.rank, gen=self.gen, reason=reason[: M.MAX_TEXT]))

    def _step(self) -> float:
        assert self.ropt is not None and self.keeper is not None
        ropt, lay = self.ropt, self.layout
        # a recovery may have kept a snapshot that is now K steps back: take it first
        self._tier2(ropt.version)
        V = ropt.version + 1
        self._step_in_progress = V
        r, W = self.rank, self.W

        # 1. compute
        self.ch.mark("forward", ropt.version)
        self._point("forward_start")
        batch = shard(self.cursor.batch(V), r, W)
        assert self.rng is not None
        restore_rng(self.rng)
        for prm in self.model.parameters():
            prm.grad = None
        assert self.step_fn is not None
        with self.stops.armed():  # a recovery stops the compute at the next layer
            loss = self.step_fn(self.model, batch)
            self._point("forward")
            self.ch.mark("backward")
            loss.backward()
        self._point("backward")
        rng_after = capture_rng()
        # one buffer: the gradients, then a presence flag per parameter (small integers,
        # exact in floating point), so one collective is in flight, never two (a gloo
        # group torn down with a second operation pending waits for its timeout)
        n = lay.numel
        if self._red is None or self._red.numel() != n + len(lay.params) + 1:
            self._red = torch.zeros(n + len(lay.params) + 1, dtype=lay.dtype)
        buf = self._red  # reused every step: no fresh pages to fault in
        flat = buf[:n]
        buf[n:].zero_()
        buf[-1] = float(loss.detach())  # summed with the gradients: the mean loss
        for i, prm in enumerate(lay.params):
            g = prm.grad
            s = lay.slots[i]
            if g is not None:
                flat[s.offset : s.offset + s.numel].copy_(g.reshape(-1))
                buf[n + i] = 1
            else:
                flat[s.offset : s.offset + s.numel].zero_()
            prm.grad = None
        # 2. reduce
        self.ch.mark("allreduce")
        work = _coll(dist.all_reduce, buf, op=dist.ReduceOp.SUM, async_op=True)
        self._point("allreduce")
        # PREPARE's checksum pass over the chunks runs while the all-reduce is in
        # flight: it reads only the chunks, which nothing writes before APPLY, and a
        # rank mostly waits for the slowest one here (its CPU counts as "allreduce")
        bad = lay.verify() if self.cfg.verify_chunks else []
        _coll(work.wait)
        present = buf[n:-1]
        mean_loss = (
            float(buf[-1]) / W
        )  # a metric scheduler's (ReduceLROnPlateau), alike on every rank
        flat.div_(W)
        self._point("reduced")
        self.keeper.check_writer()
        m = self.lr
        gdelta = None
        if self.gparity is not None and not self.replica:
            # this member's change of the gradient parity: new bytes - old bytes
            # (old: zeros if the parity never held this member's gradients)
            comp = self.gparity.versions()[m]
            if self._gdelta is None or self._gdelta.numel() != flat.numel() * flat.element_size():
                self._gdelta = torch.empty(flat.numel() * flat.element_size(), dtype=torch.uint8)
            gdelta = self._gdelta
            if comp != NONE:
                torch.sub(as_bytes(flat), as_bytes(lay.grad_buffer), out=gdelta)
            else:
                gdelta.copy_(as_bytes(flat))
        lay.clear_prepared()
        with torch.no_grad():
            lay.grad_buffer.copy_(flat)
        present_mask = [bool(c > 0) for c in present.tolist()]
        return self._commit(
            V, bad, present_mask, gdelta, rng_after, float(loss.detach()), metric=mean_loss
        )

    def _commit(
        self,
        V: int,
        bad: list[int],
        present_mask: list[bool],
        gdelta: torch.Tensor | None,
        rng_after: dict[str, Any],
        lval: float | None,
        *,
        scheduler: bool = True,
        metric: float | None = None,
    ) -> float:
        """Steps 3-6 of step ``V``, its gradients in retained memory: prepare (seal, the
        gradient parity's ``gdelta``, the vote), decide, apply chunk by chunk, finish
        (``scheduler``: step the LR scheduler, as the step-function form does, with
        ``metric``, the mean loss, for one that takes a metric; the user's loop steps
        its own)."""
        assert self.ropt is not None and self.keeper is not None
        ropt, lay, r = self.ropt, self.layout, self.rank
        m = self.lr
        # 3. prepare
        self.ch.mark("prepare")
        if bad:
            raise IntegrityError(f"chunks {bad} fail their checksums at PREPARE of step {V}")
        lay.seal_grads(V, present_mask)
        self._point("prepare")
        if self.gparity is not None:
            if self.replica:  # the record that this member's gradients are of step V
                self.gparity.record(m, V)
            else:
                assert gdelta is not None
                self.gparity.add_delta(m, gdelta, V)
        n = lay.n_chunks
        pending = {
            "step": V,
            "rng": rng_after,
            "sampler": self.cursor.state_after(V),
            "present": present_mask,
            "grad_checksums": lay.grad_checksums(),
            "metric": metric,  # a metric scheduler's, for a roll-forward
        }
        # the agent keeps the pending state (a recovery may need it) before it passes
        # the vote on: one message, one wakeup of the agent
        self.ch.send(M.Vote(rank=r, step=V, gen=self.gen, pending=json.dumps(pending)))
        # 4. decide
        self.ch.mark("decide")
        self._point("decide", where="before")
        self.ch.wait_for("commit", (self.gen, V), self.gen)
        self._point("decide", where="after")
        # 5. apply, chunk by chunk, each member of the node's parity group starting at
        # another chunk: the parity updates under each block's lock seldom collide
        self.ch.mark("apply")
        ropt.begin(V)
        for c in [(m + i) % n for i in range(n)]:
            self.keeper.check_writer()
            ropt.save_undo(c)
            self._point("apply", c, "undo_saved")

            def tear(c: int = c) -> None:  # the trainer dies half way through the chunk
                ropt.apply_chunk(c, seal=False)
                with torch.no_grad():
                    for dst, src in zip(lay.chunk_data(c), lay.undo_data(c), strict=True):
                        h = dst.numel() // 2
                        dst[h:].copy_(src[h:])

            self._point("apply", c, "mid_write", tear=tear)
            ropt.apply_chunk(c, seal=False)
            lay.seal_chunk(c, V)
            self._point("apply", c, "written")
            self._tier1_chunk(c, V)
            self._point("parity", c)
            ropt.finish_chunk(c)
        # 6. finish
        self._point("finish")
        ropt.end()
        if scheduler:
            step_scheduler(self.scheduler, metric)
        self.rng = rng_after
        self.sampler_state = self.cursor.state_after(V)
        if lval is not None:
            self.losses[V] = lval
        self.stats["steps_run"] += 1
        # with the process state after the step, which the agent keeps
        loss = lval if lval is not None else 0.0
        self.ch.send(M.Finished(rank=r, step=V, gen=self.gen, loss=loss, ps=self._ps_json(V)))
        self.ch.mark("idle", V)
        self._tier2(V)
        interval = self._checkpoint_interval(V)
        if interval and V % interval == 0:
            self._checkpoint(V)
        return lval if lval is not None else 0.0

    def _checkpoint_interval(self, V: int) -> int:
        """The user's ``checkpoint_interval``; or, with ``checkpoint_mtbf`` only, Young/
        Daly's for the slowest rank's measured save cost (the start's checkpoint) and
        step time (the job's first step), agreed at that step by one collective of every
        rank (a promoted shadow, which measured neither, adds zeros), and kept in the
        job's store for the shadows promoted later."""
        n = int(getattr(self.cfg, "checkpoint_interval", 0) or 0)
        mtbf = int(getattr(self.cfg, "checkpoint_mtbf", 0) or 0)
        if n or not mtbf or self.cfg.checkpoint_dir is None:
            return n
        if self._yd is None:
            key = f"leto/{self.spec['job']}/checkpoint_interval"
            first = int(self.store.get(f"leto/{self.spec['job']}/first_step"))
            if V == first:
                step_s = time.perf_counter() - self._step_t0 if self._step_t0 else 0.0
                t = torch.tensor([self._save_s, step_s], dtype=torch.float64)
                _coll(dist.all_reduce, t, op=dist.ReduceOp.MAX)
                self._yd = young_daly_interval(max(float(t[0]), 1e-6), mtbf, max(float(t[1]), 1e-6))
                if self.rank == 0:
                    self.store.set(key, str(self._yd))
            elif self.store.check([key]):
                self._yd = int(self.store.get(key))
            else:
                return 0
        return self._yd

    def _tier2(self, V: int) -> None:
        """The tier-2 snapshot of step ``V`` if the last one is K steps back."""
        if not self.cfg.tier2 or V - self.t2 < self.K:
            return
        if self._t2_pending is not None:  # the previous snapshot is complete (long since)
            self.ch.wait_for("t2", self._t2_pending, self.gen)
        bad = self.layout.verify() if self.cfg.verify_chunks else []
        if bad:  # PROTOCOL.md, Tier2Snapshot: a snapshot captures verified bytes only
            raise IntegrityError(
                f"chunks {bad} fail their checksums at the tier-2 snapshot of step {V}"
            )
        meta = _coll(self._snapshot, V)
        self.ch.send(M.SnapshotDone(rank=self.rank, step=V, gen=self.gen, meta=meta))
        # No wait for the coordinator's "t2" here (it was a barrier of every rank each
        # K steps): step V+1 cannot commit before it anyway, since the coordinator
        # receives this rank's snapshot_done before its vote for V+1 (one FIFO path)
        # and feeds the model's Tier2Snapshot before that step's Compute events.
        self._t2_pending = V
        self.t2 = V

    def batches(self, steps: int | None = None) -> Any:
        """The user's own loop: this rank's batch of each step (leto's step boundary),
        until the committed step is ``steps`` and the whole job is done (docs/loop.md)."""
        return self.loop.batches(steps)

    def no_sync(self) -> Any:
        """Gradient accumulation: backwards inside reduce nothing (DDP's ``no_sync``)."""
        return self.loop.no_sync()

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
        digest = self.digest()
        if os.environ.get("LETO_DUMP_FINAL"):  # debugging: the final process state as JSON
            d = os.path.join(os.environ.get("LETO_RUN_DIR", "."), "final")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"rank{self.rank}.process_state.json"), "w") as f:
                f.write(self._ps_json(self.step))
        self.ch.send(M.Done(rank=self.rank, step=self.step, gen=self.gen, digest=digest))
        self.ch.mark("done")
        while True:
            msg = self.ch.next_command()
            if isinstance(msg, M.Complete):
                self.completed = True
                return True
            if isinstance(msg, M.Abort):
                break
        self._stopped("")
        self.follower._follow()
        return False

    def digest(self) -> dict[str, str]:
        """SHA-256 of every retained buffer (params, optimizer states) and of the process
        state (optimizer scalars, LR scheduler, sampler position, RNG)."""
        out = {
            name: hashlib.sha256(as_bytes(buf).numpy().tobytes()).hexdigest()
            for name, buf in rx.named_buffers(self.layout)
        }
        out["process_state"] = hashlib.sha256(self._ps_json(self.step).encode()).hexdigest()
        return out

    def retained_state(self) -> list[dict[str, torch.Tensor]]:
        """This rank's params and optimizer state (copies), as a one-element list."""
        return [{name: buf.clone() for name, buf in rx.named_buffers(self.layout)}]

    # ================================================================ process state

    def _ps_json(self, step: int) -> str:

        assert self.ropt is not None
        return json.dumps(
            {
                "step": step,
                "optimizer": self.ropt.process_state(),
                "scheduler": scheduler_state(self.scheduler),
                "sampler": self.sampler_state,
                "rng": self.rng,
                "extra": self.loop.state() if self.loop is not None else None,
            }
        )

    def replay_scheduler(self, pending: dict[str, Any] | None) -> None:
        """A roll-forward's stand-in for what followed step ``V``'s apply on a rank that
        did not finish it: the scheduler's step (the user's loop: :mod:`.step`)."""
        if self.loop is not None and self.step_fn is None:
            self.loop.replay(pending)
        else:
            step_scheduler(self.scheduler, (pending or {}).get("metric"))

    def _send_ps(self, step: int) -> None:
        self.ch.send(M.ProcessState(rank=self.rank, step=step, json=self._ps_json(step)))

    def _load_ps(self, text: str) -> None:
        ps = json.loads(text)
        assert self.ropt is not None
        self.ropt.load_process_state(ps["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(ps["scheduler"])
        self.rng = ps["rng"]
        self.sampler_state = ps["sampler"]
        if self.loop is not None:
            self.loop.load_state(ps.get("extra"))

    def _node_state(self) -> tuple[dict[int, str], dict[str, Any] | None]:
        reply, _ = self.ch.request(M.GetState(rank=self.rank))
        hist = {int(k): v for k, v in reply.get("ps", {}).items()}
        pend = reply.get("pending")
        return hist, (json.loads(pend) if pend else None)

    # ================================================================ recovery

    # --- repairs ---------------------------------------------------------------

    # --- tier 1 as replicas: a member's lost state copied from another member ------

    def _tier1_chunk(self, c: int, step: int) -> None:
        """Chunk ``c``'s new bytes (its undo copy holds the old) into the node's tier 1:
        the parity's change, or for replicas only the record of its version."""
        if not self.parity:
            return
        lay = self.layout
        if self.replica:
            self.parity[c].record(self.lr, step, lay.stored_checksum(c))
        else:
            self.parity[c].update(
                self.lr, lay.undo_data(c), lay.chunk_data(c), step, lay.stored_checksum(c)
            )

    def _snapshot_layout(self) -> tuple[int, int]:
        """(snapshot bytes of this rank, parity bytes it stores for tier 2)."""
        nb = sum(as_bytes(b).numel() for b in self.layout.data_buffers())
        m = self.t2_parity
        if self.nnodes < 2:
            return nb, 0
        if m == 1:
            return nb, rotated_share_nbytes(nb, self.nnodes)
        return nb, m * rs.striped_share_nbytes(nb, self.nnodes, m)

    def _snap_seg(self, slot: int) -> torch.Tensor:
        from . import segments

        nb, share = self._snapshot_layout()
        total = self.nproc * (nb + share)
        fd = self._segment(f"snap.{slot}", total)
        try:
            return segments.as_tensor(fd, total)
        finally:
            os.close(fd)

    def _snapshot(self, step: int) -> dict[str, Any]:
        """Tier 2: this rank's bytes at ``step`` into its node's slot + the cross-node code."""
        self.ch.mark("snapshot")
        reply, _ = self.ch.request(M.SnapshotSlot(step=step))
        seg = self._snap_seg(int(reply["write"]))
        nb, share = self._snapshot_layout()
        own = seg[self.lr * nb : (self.lr + 1) * nb]
        off = 0
        for b in self.layout.data_buffers():  # straight into the slot: no packed copy
            bb = as_bytes(b)
            own[off : off + bb.numel()].copy_(bb)
            off += bb.numel()
        if self.nnodes >= 2:
            base = self.nproc * nb
            out = seg[base + self.lr * share : base + (self.lr + 1) * share]
            coll = TorchDistCollective(self.cross_group)
            if self.t2_parity == 1:
                encode_rotated(coll, own, out=out)
            else:
                rs.encode_striped(coll, own, self.t2_parity, out)
        lay = self.layout
        return {
            "step": step,
            "checksums": [lay.stored_checksum(c) for c in range(lay.n_chunks)],
            "ps": self._ps_json(step),
        }

    def _checkpoint(self, V: int, *, first: bool = False, resumed: bool = False) -> None:
        """``SaveCheckpoint`` of step ``V``: this rank's part of one collective DCP save of
        the model's and optimizer's own state dicts (DCP's planner writes each replicated
        tensor once: once per data-parallel replica group, not W copies), then its
        process state and checksums beside it; its report feeds ``WriteShard``, and the
        coordinator feeds ``CheckpointDurable`` once every rank reported. ``first``: the
        job's start (durable in the model from the start): a job resumed from this
        directory's checkpoint of ``V`` keeps it; a fresh one drops what a former run left
        in the directory."""
        if self.cfg.checkpoint_dir is None:
            return
        store = CheckpointStore(self.cfg.checkpoint_dir)
        latest = store.latest()
        if not first and latest is not None and latest >= V:
            return  # a recovery went back before the durable checkpoint: it still holds
        if first and resumed and latest == V:
            self.ch.send(M.CheckpointWritten(rank=self.rank, step=V, gen=self.gen))
            return
        if self.rank == 0:
            store.prune(V if first else latest, newer=first)
        assert self.ropt is not None
        t0 = time.perf_counter()
        _coll(store.write, V, training_state(self.model, self.ropt), no_dist=False)
        self._save_s = time.perf_counter() - t0
        lay = self.layout
        store.write_rank_meta(
            V,
            self.rank,
            {
                "step": V,
                "world_size": self.W,
                "chunk_numel": lay.chunk_numel,
                "checksums": [lay.stored_checksum(c) for c in range(lay.n_chunks)],
                "ps": self._ps_json(V),
            },
        )
        self.ch.send(M.CheckpointWritten(rank=self.rank, step=V, gen=self.gen))

    def _resume(self) -> int:
        """Start from the DCP checkpoint ``resume`` names (leto's, or any of this model):
        the model's and optimizer's state and, from a leto checkpoint of this world
        size, this rank's process state, checked bitwise; its step."""
        src = str(self.cfg.resume)
        try:
            state, meta = read_checkpoint(src)
            assert self.ropt is not None
            if meta is None:
                load_training_state(self.model, self.ropt, state, src)
                self.ropt.set_version(0)
                return 0
            step = int(meta["step"])
            load_model_state(self.model, state, src)
            load_retained_optimizer_state(self.layout, state, src)
            self.ropt.set_version(step)
            ranks = meta["process_states"]
            same = meta.get("world_size") == self.W
            self._load_ps(ranks[str(self.rank) if same else "0"])
            if same and meta.get("chunk_numel") == self.layout.chunk_numel:
                rx.seal_checked(
                    self.layout, step, meta["checksums"][str(self.rank)], src, f"rank {self.rank}"
                )
        except CheckpointError as e:
            raise ConfigError("resume", str(e)) from None
        self.cursor.restore(self.sampler_state)
        return step
