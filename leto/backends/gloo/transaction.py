"""One step of one gloo rank as a transaction (the fake backend's engine, for real).

One step ``V`` (the protocol's events in brackets):

1. forward and backward on the rank's shard of the global batch [Compute];
2. the gradients' sum all-reduce over gloo, divided by the world size, copied into
   the retained gradient buffer [Reduce];
3. checksums verified, gradients sealed, this rank's delta added to the node's
   gradient parity (with replicas: only the record of their step), the prepare
   record (RNG, sampler position, present mask, gradient checksums) sent to the
   node agent, the vote sent [Prepare];
4. wait for ``commit(V)`` from the coordinator [Decide]. The first chunk to apply is
   already copied into a free undo slot by step 3's checksum pass, one pass over its
   bytes for both (with ``verify_chunks`` off, or Fletcher checksums: copied here,
   during the wait); the slot stays free: BeginChunk is still step 5's, which then
   writes only its header;
5. per chunk: undo copy [BeginChunk], new bytes written and sealed [EndChunk],
   the node's chunk parity (with replicas: its record) updated [ParityChunk],
   undo released;
6. the process state of ``V`` to the node agent, ``finished`` [Finish]; every K
   steps the tier-2 snapshot (own bytes into the node's slot, rotated parity
   across nodes) and a wait for its confirmation [Tier2Snapshot].

The step-function form runs all six here (:meth:`StepTransaction.run`); the user's own
loop (:mod:`.step`) runs 1-2 itself and steps 3-6 through :meth:`StepTransaction.commit`.
A step stopped by a recovery (:meth:`StepTransaction.stopped`) hands over to
:mod:`.follow`. An abort that arrives inside step 1 starts the recovery at once on a
thread of its own, beside the compute, which goes on; it stops at a layer (:mod:`.stops`)
only where the recovery must write what it reads, and at the end it goes on if the core
keeps it (:meth:`StepTransaction.paused`, "a recovery in the compute" below): a
survivor does not compute its share of the step again when its retained state came
through the recovery untouched, and the recovery does not wait for its layer in flight.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from leto.core import accumulation
from leto.core.chunk import NONE
from leto.core.reconcile import keeps_compute
from leto.core.replay import ReplayPlan
from leto.retained.alloc import settle
from leto.retained.layout import RetainedLayout
from leto.retained.optim import RetainedOptimizer
from leto.retained.parity import as_bytes
from leto.retained.process_state import (
    BatchCursor,
    capture_buffers,
    capture_rng,
    restore_rng,
    shard,
    step_scheduler,
)
from leto.retained.recovery import IntegrityError
from leto.retained.shard import FullParams

from . import messages as M
from .channel import Aborted, AgentChannel
from .checkpoints import Checkpoints
from .collective import REDUCE_SCATTER, CollectiveFailed, Interrupted, wait_or_abort
from .collective import coll as _coll
from .fault_points import FaultPoints
from .follow import Follower
from .keeper_client import FencedError, KeeperClient
from .parity_block import ParityBlock
from .process_groups import ProcessGroups
from .procs import Backseat
from .rank_memory import RankMemory
from .rank_state import RankState
from .replay import Replayer, accumulate, micro, params_digest
from .snapshots import Tier2Snapshots
from .stops import StopPoints

__all__ = [
    "PrepareHost",
    "Recovered",
    "StepFn",
    "StepHost",
    "StepTransaction",
    "first_chunk",
    "prepare_pass",
]

StepFn = Any  # the user's step function (model, batch) -> loss


class PrepareHost(Protocol):
    """What :func:`prepare_pass` reads of a rank's session."""

    @property
    def cfg(self) -> Any: ...
    @property
    def layout(self) -> RetainedLayout: ...


class StepHost(Protocol):
    """What :class:`StepTransaction` reads of its rank's session, and the state a
    step sets there."""

    step_fn: StepFn | None
    rng: dict[str, Any] | None
    sampler_state: dict[str, Any] | None

    @property
    def cfg(self) -> Any: ...
    @property
    def ch(self) -> AgentChannel: ...
    @property
    def gen(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def W(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def replica(self) -> bool: ...
    @property
    def flush_denormal(self) -> bool: ...
    @property
    def model(self) -> nn.Module: ...
    @property
    def scheduler(self) -> Any: ...
    @property
    def cursor(self) -> BatchCursor: ...
    @property
    def ropt(self) -> RetainedOptimizer | None: ...
    @property
    def full(self) -> FullParams | None: ...
    @property
    def layout(self) -> RetainedLayout: ...
    @property
    def keeper(self) -> KeeperClient | None: ...
    @property
    def parity(self) -> list[ParityBlock]: ...
    @property
    def gparity(self) -> ParityBlock | None: ...
    @property
    def stats(self) -> dict[str, int]: ...
    @property
    def losses(self) -> dict[int, float]: ...
    @property
    def memory(self) -> RankMemory: ...
    @property
    def groups(self) -> ProcessGroups: ...
    @property
    def ps(self) -> RankState: ...
    @property
    def fault_points(self) -> FaultPoints: ...
    @property
    def snapshots(self) -> Tier2Snapshots: ...
    @property
    def checkpoints(self) -> Checkpoints: ...
    @property
    def follower(self) -> Follower: ...
    @property
    def stops(self) -> StopPoints: ...
    def check_float_mode(self) -> None: ...
    def _log(self, event: str, **kw: Any) -> None: ...


def first_chunk(local_rank: int, layout: RetainedLayout) -> int:
    """The chunk a rank applies first (the members of a node's parity group start at
    different chunks): PREPARE's pass stages its undo copy, DECIDE keeps it."""
    return local_rank % layout.n_chunks


def prepare_pass(session: PrepareHost, first: int | None = None) -> list[int]:
    """PREPARE's checksum pass over the rank's chunks: those failing. One failing marks
    the layout suspect at once, before anything else may stop this step (a peer's
    death, an abort): the recovery that follows, whichever ends the step, then reads
    every chunk of this rank in its report and rebuilds the chunk, instead of leaving
    it to the next PREPARE (PROTOCOL.md, "Which bytes a report reads").

    ``first``: the chunk the step applies first. Its undo copy is staged here, into a
    free slot, and checked as it is made (``UndoSlots.stage_checked``): one pass over
    its bytes serves the check and the copy, which the step then keeps (or drops, if
    the step ends before its apply). None: every chunk read by the check alone, and the
    copy left to the step (the passes apart, as before they were fused), as with a
    Fletcher layout (a device's)."""
    if not session.cfg.verify_chunks:
        return []
    lay = session.layout
    if lay.checksum_algorithm != "xxh3":  # Fletcher: torch ops share no pass; batched
        first = None  # over every chunk, with one read of the result, not one a chunk
    staged = None if first is None else lay.undo.stage_checked(first)
    if first is None or staged is None:
        bad = lay.verify()
    else:
        bad = sorted(lay.verify(intact=[first]) + ([] if staged else [first]))
    if bad:
        lay.mark_suspect()
    return bad


class _Beside:
    """A recovery carried out on its own thread while the compute goes on."""

    def __init__(self) -> None:
        self.done = threading.Event()  # it ended (resumed, or failed: ``error``)
        self.park = threading.Event()  # it must write what the compute may read: stop
        self.parked = threading.Event()  # the compute stopped (or ended) until it is done
        self.error: BaseException | None = None


class Recovered(Exception):
    """A recovery was carried out inside the step's compute, which is void: the step is
    run again from the recovery's state."""


class StepTransaction:
    """One rank's steps (see the module docstring); ``in_progress``: the step under way."""

    def __init__(self, session: StepHost) -> None:
        self.session = session
        self.in_progress = 0
        self._red: torch.Tensor | None = None  # the all-reduce buffer, reused
        self._gdelta: torch.Tensor | None = None  # the gradient parity's delta, reused
        self._out = torch.zeros(0)  # sharded: the reduce-scatter's output, reused
        self._phase = "forward"  # the part of step 1 under way (the status board's mark)
        # the model holds persistent buffers, which a recovery writes back (process
        # state), so its compute is never kept across one: a write into a tensor saved
        # for the backward would fail it
        self._buffers = bool(capture_buffers(session.model))
        # a recovery beside the compute (see "a recovery in the compute" below)
        self._lock = threading.Lock()
        self._computing = False  # inside step 1: an abort starts the recovery beside it
        self._rec: _Beside | None = None
        # while a recovery runs beside it, the compute's thread yields the CPU to it
        self._backseat = Backseat()
        self._compute_tid = 0
        self.replayer = Replayer()  # the step in flight replayed in parallel (replay.py)

    def run(self, step_fn: StepFn | None = None) -> float | None:
        """One step (every rank runs it); its loss on this rank, or None if interrupted."""
        session = self.session
        if step_fn is not None:
            session.step_fn = step_fn
        if session.step_fn is None:
            raise RuntimeError("no step function: pass one to train() / run_step()")
        try:
            return self._step()
        except Recovered:
            return None  # followed already, inside the compute
        except (Interrupted, Aborted, FencedError):
            self.stopped("")
        except CollectiveFailed as e:
            self.stopped(f"collective failed: {e}")
        session.follower._follow()
        return None

    def stopped(self, reason: str) -> None:
        """This rank stopped its step (a recovery): tell the coordinator."""
        session = self.session
        session.groups.destroy()
        session.ch.mark("stopped")
        session.ch.send(M.Stopped(rank=session.rank, gen=session.gen, reason=reason[: M.MAX_TEXT]))

    # --------------------------------------------------------- a recovery in the compute

    def beside(self) -> bool:
        """A recovery runs beside the compute (the stop points then ask :meth:`paused`
        at each layer whether the compute must stop; a safe point does not interrupt)."""
        return self._rec is not None

    def _abort_seen(self) -> None:
        """The channel's reader thread, on an ``abort``: inside the compute (step 1), the
        recovery starts at once on a thread of its own, beside the compute, which goes
        on (it writes nothing the recovery reads: its forward and backward write only
        private tensors). Elsewhere the step's next safe point takes it, as before."""
        with self._lock:
            if not self._computing or self._rec is not None:
                return
            rec = self._rec = _Beside()
        # the recovery first: every rank waits for it (the next collective needs the
        # replaced rank, which computes only after it), not for this rank's compute
        self._backseat.lower(self._compute_tid)
        try:
            threading.Thread(
                target=self._recover_beside, args=(rec,), name="leto-recovery", daemon=True
            ).start()
        except RuntimeError:  # no thread to be had: the compute's next safe point takes it
            self._backseat.restore(self._compute_tid)
            with self._lock:
                self._rec = None

    def _recover_beside(self, rec: _Beside) -> None:
        try:
            # this thread's math (a roll forward, the masters' casts) in the steps' mode:
            # it was started by the channel's reader, which may predate the script's call
            torch.set_flush_denormal(self.session.flush_denormal)
            self.stopped("")
            self.session.follower._follow(
                before_writes=lambda: self._before_writes(rec), beside=True
            )
        except BaseException as e:  # noqa: BLE001 - handed to the compute's thread
            rec.error = e
        finally:
            self._backseat.restore(self._compute_tid)
            rec.done.set()

    def _before_writes(self, rec: _Beside) -> None:
        """The follower is about to carry out a plan (the recovery thread): one under which
        the compute is not kept may write what the compute reads, so the compute stops
        at its next stop point first."""
        if self._keeps():
            return
        # the recovery now waits for the compute to reach its stop point: its thread
        # gets its priority back first (at SCHED_IDLE it would run only on a spare CPU)
        self._backseat.restore(self._compute_tid)
        rec.park.set()
        rec.parked.wait()

    def _keeps(self) -> bool:
        """The core keeps the compute (:func:`leto.core.reconcile.keeps_compute`: every
        plan since it paused resumed at the step it began from and wrote none of this
        rank's chunks), and the backend does too: a sharded model's parameters are
        gathered again, and a model's persistent buffers written back, by every recovery,
        which the protocol does not see, so their compute is void."""
        session = self.session
        return (
            keeps_compute(session.follower.plans, session.rank, self.in_progress - 1)
            and not session.follower.world_changed
            and session.full is None
            and not self._buffers
        )

    def claims_recovery(self) -> bool:
        """A safe point found an abort: True if this thread is to follow it (no recovery
        runs beside the compute, and from now on none starts: the reader thread may set
        the abort a moment before it offers the recovery, :meth:`_abort_seen`)."""
        with self._lock:
            if self._rec is not None:
                return False
            self._computing = False
            return True

    def paused(self) -> None:
        """A stop point of the compute of step ``in_progress`` found a recovery
        (:mod:`.stops`). With one beside the compute: go on, unless it asks the compute
        to stop or has ended (then :meth:`_wait` for it). Without (the abort came before
        the compute began): carried out here. Either way the compute then goes on if
        kept, else :class:`Recovered` (the step is run again)."""
        if self.claims_recovery():  # none beside: carried out here
            self.stopped("")
            self.session.follower._follow()
        else:
            rec = self._rec  # cleared only by this thread (_wait)
            assert rec is not None
            if not (rec.park.is_set() or rec.done.is_set()):
                return
            self._wait(rec)
        self._decide()
        with self._lock:
            self._computing = True

    def _wait(self, rec: _Beside) -> None:
        """Stop the compute until the recovery beside it ends (no other starts beside it
        meanwhile: this thread decides, and may run collectives, before the compute goes
        on); its error, if it failed, raised here."""
        session = self.session
        session.ch.mark("stopped")  # a phase the agent's hang check does not time: it waits
        rec.parked.set()
        rec.done.wait()
        with self._lock:
            self._rec = None
            self._computing = False
        if rec.error is not None:
            raise rec.error
        # the sampler back where the recovery resumed (not on the recovery's thread: a
        # plain iterable is replayed under fork_rng, which would rewind the compute's RNG)
        assert session.sampler_state is not None
        session.cursor.restore(session.sampler_state)

    def _decide(self) -> None:
        session = self.session
        assert session.ropt is not None
        if not self._keeps():
            raise Recovered(f"step {self.in_progress} is computed again after the recovery")
        # as the step's start: a snapshot now K steps back first (every rank takes it
        # before its compute; collective), the sampler after this step's batch again
        session.snapshots.maybe_take(session.ropt.version)
        session.cursor.batch(self.in_progress)
        session.stats["computes_kept"] += 1
        session.ch.send(M.Kept(rank=session.rank, step=self.in_progress, gen=session.gen))
        session._log("compute kept", step=self.in_progress, generation=session.gen)
        session.ch.mark(self._phase)

    @contextlib.contextmanager
    def _compute(self) -> Iterator[None]:
        """Step 1, where a recovery runs beside the compute (:meth:`_abort_seen`) and the
        stop points are armed; at its end, a recovery still beside it is waited for.
        Under an exception the compute is not kept: a recovery beside it is waited for
        (one recovery, not two), then a recovery's exception becomes :class:`Recovered`
        (followed already) and any other goes on as it was."""
        with self._lock:
            self._computing = True
            self._compute_tid = threading.get_native_id()
        try:
            with self.session.stops.armed():
                yield
        except BaseException as e:
            rec = self._end_compute()
            if rec is None:
                raise
            self._wait(rec)
            if isinstance(e, (Interrupted, Aborted, FencedError, CollectiveFailed)):
                raise Recovered(f"step {self.in_progress}: {e}") from e
            raise
        rec = self._end_compute()
        if rec is not None:
            self._wait(rec)
            self._decide()

    # ------------------------------------------------ the step in flight, replayed

    def _forward_done(self) -> None:
        self.session.fault_points.point("forward")
        self.session.ch.mark("backward")
        self._phase = "backward"

    def _replays(self) -> bool:
        """The parallel replay applies to this job's steps (replay.py): micro-batches of
        the step function, the setting on, the model's parameters whole on every rank
        and no persistent buffers (a replayed forward would write a survivor's)."""
        cfg = self.session.cfg
        return (
            cfg.micro_batches > 1
            and cfg.parallel_replay
            and self.session.full is None
            and not self._buffers
        )

    def _exchange(self, *, fresh: bool) -> ReplayPlan | None:
        session = self.session
        resumed = session.follower.resumed_gen
        assert resumed is not None
        session.ch.mark("allreduce")  # a collective: the rank waits for the slowest
        digest = params_digest(session.layout.records.stored_checksum_list())
        return self.replayer.exchange(
            resumed,
            fresh,
            digest,
            session.W,
            session.cfg.micro_batches,
            lambda: session.ch.aborted_since(session.gen),
        )

    def _replay(self, plan: ReplayPlan, V: int, share: Any) -> torch.Tensor | None:
        """This rank's micro-batches of ``plan.owner``'s share of step ``V``, computed
        and gathered at the owner; the owner's ``.grad`` then their sum in order, and its
        loss returned (None on the other ranks)."""
        session = self.session
        lay = session.layout
        r = session.rank
        assert session.step_fn is not None
        offsets = [(sl.offset, sl.numel) for sl in lay.slots]
        width = lay.numel + len(lay.params) + 1
        mine = plan.of(r)
        session.ch.mark("backward")
        rows = self.replayer.compute(
            plan,
            r,
            session.model,
            lay.params,
            session.step_fn,
            micro(share, plan.micro_batches),
            width,
            lay.dtype,
            offsets,
        )
        session.ch.mark("allreduce")
        aborted = lambda: session.ch.aborted_since(session.gen)  # noqa: E731
        gathered = self.replayer.gather(plan, r, rows, aborted)
        session.stats["micro_batches_replayed"] += len(mine)
        session.ch.send(
            M.Replayed(rank=r, step=V, gen=session.gen, owner=plan.owner, micro_batches=list(mine))
        )
        session._log("replayed", step=V, owner=plan.owner, micro_batches=list(mine))
        if gathered is None:
            return None
        return self.replayer.add_in_order(plan, gathered, lay.params, offsets)

    def _end_compute(self) -> _Beside | None:
        """Step 1 is over: no recovery starts beside it now; the one that runs, if any."""
        with self._lock:
            self._computing = False
            return self._rec

    def _step(self) -> float:
        session = self.session
        assert session.ropt is not None and session.keeper is not None
        ropt, lay = session.ropt, session.layout
        # a recovery may have kept a snapshot that is now K steps back: take it first
        session.snapshots.maybe_take(ropt.version)
        V = ropt.version + 1
        self.in_progress = V
        r, W = session.rank, session.W
        point = session.fault_points.point

        # 1. compute
        session.check_float_mode()
        session.ch.mark("forward", ropt.version)
        point("forward_start")
        # this rank's parts of the global batch (one, but where a shrunk world keeps the
        # global batch by accumulation: leto.core.accumulation), and the gradients' divisor
        cut = accumulation.plan(r, W, session.cfg.batch_parts, session.cfg.keep_global_batch)
        whole = session.cursor.batch(V)
        batch = shard(whole, cut.parts[0], cut.cut)  # this rank's share (its first part)
        assert session.rng is not None
        restore_rng(session.rng)
        for prm in session.model.parameters():
            prm.grad = None
        assert session.step_fn is not None
        self._phase = "forward"
        k = session.cfg.micro_batches
        # the parallel replay of a lost share: one part per rank (batch_parts 0)
        replay = self._replays() and len(cut.parts) == 1 and cut.cut == W
        rplan = None
        if replay and self.replayer.due(session.follower.resumed_gen):
            rplan = self._exchange(fresh=True)  # this rank computes its share afresh
        if rplan is not None:  # its share's micro-batches, computed by every rank
            summed = self._replay(rplan, V, batch)
            assert summed is not None  # (the owner's)
            loss = summed
        else:
            with self._compute():  # a recovery runs beside it; it stops at a layer if it must
                if k == 1 and len(cut.parts) == 1:
                    loss = session.step_fn(session.model, batch)
                    self._forward_done()
                    loss.backward()
                else:  # micro-batches, of each part (several: a shrunk world accumulates)
                    loss = accumulate(
                        session.model,
                        session.step_fn,
                        [mb for p in cut.parts for mb in micro(shard(whole, p, cut.cut), k)],
                        check_rng=replay,
                        after_forward=lambda i: self._forward_done() if i == 0 else None,
                    )
            point("backward")
            if replay and self.replayer.due(session.follower.resumed_gen):
                rplan = self._exchange(fresh=False)  # a recovery kept this compute
                if rplan is not None:  # another rank's share: this rank computes some of it
                    self._replay(rplan, V, shard(session.cursor.batch(V), rplan.owner, W))
        div = cut.divisor  # the mean over the parts the world trained on
        rng_after = capture_rng()
        # one buffer: the gradients, then a presence flag per parameter (small integers,
        # exact in floating point), so one collective is in flight, never two (a gloo
        # group torn down with a second operation pending waits for its timeout)
        plan = session.full.plan if session.full is not None else None
        if plan is None:
            n = lay.numel
            if self._red is None or self._red.numel() != n + len(lay.params) + 1:
                # on the layout's device: gloo reduces CUDA tensors through its own host
                # copies, NCCL where they are
                self._red = torch.zeros(n + len(lay.params) + 1, dtype=lay.dtype, device=lay.device)
            buf = self._red  # reused every step: no fresh pages to fault in
            flat = buf[:n]
            buf[n:].zero_()
            buf[-1] = float(loss.detach())  # summed with the gradients: the mean loss
            for i, prm in enumerate(lay.params):
                g = prm.grad
                sl = lay.slots[i]
                if g is not None:
                    flat[sl.offset : sl.offset + sl.numel].copy_(g.reshape(-1))
                    buf[n + i] = 1
                else:
                    flat[sl.offset : sl.offset + sl.numel].zero_()
                prm.grad = None
        else:  # sharded: each rank receives its shard's sum (and every flag, the loss)
            n = plan.shard_numel
            width = n + len(plan.names) + 1
            if self._red is None or self._red.numel() != W * width:
                self._red = torch.zeros(W * width, dtype=lay.dtype)
                self._out = torch.zeros(width, dtype=lay.dtype)
            plan.pack_grads(list(session.model.parameters()), self._red, [float(loss.detach())])
            buf = self._out
            flat = buf[:n]
        # 2. reduce
        session.ch.mark("allreduce")
        if plan is None:
            work = _coll(dist.all_reduce, buf, op=dist.ReduceOp.SUM, async_op=True)
        else:
            work = _coll(REDUCE_SCATTER, buf, self._red, op=dist.ReduceOp.SUM, async_op=True)
        point("allreduce")
        # PREPARE's checksum pass over the chunks runs while the all-reduce is in
        # flight: it reads only the chunks, which nothing writes before APPLY, and a
        # rank mostly waits for the slowest one here (its CPU counts as "allreduce")
        bad = prepare_pass(session, first_chunk(session.local_rank, lay))
        try:
            wait_or_abort(
                work, lambda: session.ch.aborted_since(session.gen), "the gradients were reduced"
            )
        except Aborted:
            self._red = None  # the abandoned collective's: the next step takes fresh ones
            raise
        present = buf[n:-1]
        mean_loss = (
            float(buf[-1]) / div
        )  # a metric scheduler's (ReduceLROnPlateau), alike on every rank
        point("reduced")
        session.keeper.check_writer()
        m = session.local_rank
        gdelta = None
        if session.gparity is not None and not session.replica:
            flat.div_(div)
            # this member's change of the gradient parity: new bytes - old bytes
            # (old: zeros if the parity never held this member's gradients)
            comp = session.gparity.versions()[m]
            if self._gdelta is None or self._gdelta.numel() != flat.numel() * flat.element_size():
                self._gdelta = torch.empty(
                    flat.numel() * flat.element_size(), dtype=torch.uint8, device=flat.device
                )
            gdelta = self._gdelta
            if comp != NONE:
                torch.sub(as_bytes(flat), as_bytes(lay.grad_buffer), out=gdelta)
            else:
                gdelta.copy_(as_bytes(flat))
        lay.clear_prepared()
        sums = None  # the seal's checksums, computed as the mean is written
        with torch.no_grad():
            if gdelta is None:  # the mean written straight into retained memory: one pass
                sums = lay.grads.write_mean(flat, div, V)
            else:
                lay.grad_buffer.copy_(flat)
        lay.grads.mark_reduced(V)
        if plan is None:
            present_mask = [bool(c > 0) for c in present.tolist()]
        else:
            present_mask = plan.present_pieces(session.rank, present.tolist())
        return self.commit(
            V,
            bad,
            present_mask,
            gdelta,
            rng_after,
            float(loss.detach()),
            metric=mean_loss,
            grad_sums=sums,
        )

    def commit(
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
        gather: bool = True,
        checkpoint: bool = True,
        skipped: bool = False,
        tail: bool = False,
        grad_sums: torch.Tensor | None = None,
    ) -> float:
        """Steps 3-6 of step ``V``, its gradients in retained memory: prepare (seal, the
        gradient parity's ``gdelta``, the vote), decide, apply chunk by chunk, finish
        (``scheduler``: step the LR scheduler, as the step-function form does, with
        ``metric``, the mean loss, for one that takes a metric; the user's loop steps
        its own; ``gather``: all-gather a sharded model's parameters here, else the caller
        does; ``checkpoint``: the periodic checkpoint here, else the caller writes it at
        the step boundary, after its own scheduler's step; ``skipped``: the user's loop
        skipped ``optimizer.step()``, as a ``GradScaler`` does on an inf/NaN: recorded
        for a roll-forward's replay of its ``update()``; ``tail``: the user's loop runs
        its own code after the step, so the process state is not closed here: the
        agent keeps it only at the step boundary, :meth:`.step.UserLoop.next_batch`;
        ``grad_sums``: the gradients' checksums as ``GradBuffer.write_mean`` computed
        them while it wrote them, else the seal reads the gradients again)."""
        session = self.session
        assert session.ropt is not None and session.keeper is not None
        ropt, lay, r = session.ropt, session.layout, session.rank
        m = session.local_rank
        point = session.fault_points.point
        # 3. prepare
        session.ch.mark("prepare")
        if bad:  # (the layout is marked suspect already: prepare_pass)
            raise IntegrityError(f"chunks {bad} fail their checksums at PREPARE of step {V}")
        lay.seal_grads(V, present_mask, grad_sums)
        point("prepare")
        if session.gparity is not None:
            if session.replica:  # the record that this member's gradients are of step V
                session.gparity.record(m, V)
            else:
                assert gdelta is not None
                session.gparity.add_delta(m, gdelta, V)
        n = lay.n_chunks
        pending = {
            "step": V,
            "rng": rng_after,
            "sampler": session.cursor.state_after(V),
            "present": present_mask,
            "grad_checksums": lay.grads.checksums(),
            "metric": metric,  # a metric scheduler's, for a roll-forward
            "skipped": skipped,  # a GradScaler's skipped step, for a roll-forward
            "buffers": capture_buffers(session.model),  # after this step's forward
        }
        # the agent keeps the pending state (a recovery may need it) before it passes
        # the vote on: one message, one wakeup of the agent
        settle(lay.device)  # the checksums and gradients on a GPU are written
        session.ch.send(M.Vote(rank=r, step=V, gen=session.gen, pending=json.dumps(pending)))
        # 4. decide
        session.ch.mark("decide")
        point("decide", where="before")
        # the undo copy of the first chunk to apply, in a slot that stays free (a recovery
        # ignores its bytes) until BeginChunk: staged by PREPARE's pass, else made here
        # while the COMMIT is on its way
        first = first_chunk(m, lay)
        session.keeper.check_writer()
        staged = lay.undo.holds_staged(first) or lay.undo.stage(first)
        session.ch.wait_for("commit", (session.gen, V), session.gen)
        point("decide", where="after")
        # 5. apply, chunk by chunk, each member of the node's parity group starting at
        # another chunk: the parity updates under each block's lock seldom collide
        session.ch.mark("apply")
        ropt.begin(V)
        for c in [(m + i) % n for i in range(n)]:
            session.keeper.check_writer()
            ropt.save_undo(c, staged=staged and c == first)
            point("apply", c, "undo_saved")

            def tear(c: int = c) -> None:  # the trainer dies half way through the chunk
                ropt.apply_chunk(c, seal=False)
                with torch.no_grad():
                    for dst, src in zip(lay.chunk_data(c), lay.undo_data(c), strict=True):
                        h = dst.numel() // 2
                        dst[h:].copy_(src[h:])

            point("apply", c, "mid_write", tear=tear)
            ropt.apply_chunk(c, seal=False)
            lay.seal_chunk(c, V)
            point("apply", c, "written")
            self.tier1_chunk(c, V)
            point("parity", c)
            ropt.finish_chunk(c)
        # 6. finish
        point("finish")
        ropt.end()
        if scheduler:
            step_scheduler(session.scheduler, metric)
        session.rng = rng_after
        session.sampler_state = session.cursor.state_after(V)
        if lval is not None:
            session.losses[V] = lval
        session.stats["steps_run"] += 1
        # with the process state after the step, which the agent keeps; in the user's
        # loop that state is not final until the loop's tail (its scheduler's step) ran:
        # a rank lost there rolls step V forward from the state of V - 1 (PROTOCOL.md)
        ps = None if tail else session.ps.to_json(V)
        replica = session.ps.replica_digest(V)
        settle(session.layout.device)  # the step's chunks and seals on a GPU are written
        session.ch.send(
            M.Finished(rank=r, step=V, gen=session.gen, loss=lval, ps=ps, replica=replica)
        )
        if gather:
            session.memory.gather_params()  # sharded: every rank's new shard into the model
        session.ch.mark("idle", V)
        if not tail:  # the user's loop takes it at the step boundary, after its tail ran
            session.snapshots.maybe_take(V)
        if checkpoint:
            session.checkpoints.maybe_write(V)
        return lval if lval is not None else 0.0

    def tier1_chunk(self, c: int, step: int) -> None:
        """Chunk ``c``'s new bytes (its undo copy holds the old) into the node's tier 1:
        the parity's change, or for replicas only the record of its version."""
        session = self.session
        if not session.parity:
            return
        lay = session.layout
        if session.replica:
            session.parity[c].record(session.local_rank, step, lay.stored_checksum(c))
        else:
            session.parity[c].update(
                session.local_rank,
                lay.undo_data(c),
                lay.chunk_data(c),
                step,
                lay.stored_checksum(c),
            )
