"""The user's own training loop on a gloo rank: leto's step behind ``optimizer.step()``.

Theory of operation. The script keeps its loop (forward, ``loss.backward()``,
clipping, ``GradScaler``, ``optimizer.step()``, ``scheduler.step()``); leto sees it
at four places and runs the same transaction as the step-function form there:

* **the batch** (:meth:`UserLoop.next_batch`, what ``session.batches()`` yields) is
  the step boundary: the iteration before is closed (its process state after the
  user's ``scheduler.step()`` and ``scaler.update()`` sent to the node agent, which
  keeps none of the step before: a rank lost in the loop's *tail*, after
  ``optimizer.step()`` and before this, rolls the step forward from the step before's
  and replays the tail's scheduler step and scaler update; an
  iteration whose ``optimizer.step()`` was skipped, as ``GradScaler`` does on an
  inf/NaN, commits an empty step, every gradient absent), and the batch of the next
  step is drawn;
* **the end of a backward** (a hook queued on the autograd engine, as DDP does):
  outside :meth:`UserLoop.no_sync` the gradients are summed over the ranks, divided
  by the world size and written into retained memory, and every ``.grad`` becomes a
  view of it, so ``clip_grad_norm_`` and ``scaler.unscale_`` act on the retained
  gradients; inside ``no_sync`` they accumulate in ordinary tensors;
* **``optimizer.step()``**: PREPARE (checksums, seal, vote), DECIDE, APPLY chunk by
  chunk, FINISH (:meth:`.transaction.StepTransaction.commit`); afterwards ``.grad``
  is ``None`` (nothing outside the transaction writes retained gradients);
* **a forward**: a fault point, and where a recovery under way is noticed.

A recovery (a peer died, this rank was told to abort) is carried out where it is
noticed: the rank follows the coordinator to the committed step, in place. The
iteration under way is then void: ``optimizer.step()`` does nothing, ``.grad`` are
zeros outside retained memory (clipping and unscaling run harmlessly), and the next
batch restores the process state of the committed step (RNG, scheduler, scaler,
sampler) and is the batch after it. A promoted shadow starts the script anew: its
``leto.wrap`` returns at the committed step and its loop draws the same batch.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from leto.core import accumulation
from leto.core.chunk import NONE
from leto.errors import ConfigError
from leto.retained.layout import RetainedLayout
from leto.retained.parity import as_bytes
from leto.retained.process_state import (
    BatchCursor,
    capture_rng,
    from_json,
    restore_rng,
    shard,
    step_scheduler,
    takes_metric,
    to_json,
)
from leto.retained.shard import FullParams

from .channel import Aborted, AgentChannel
from .checkpoints import Checkpoints
from .collective import REDUCE_SCATTER, CollectiveFailed, Interrupted, wait_or_abort
from .collective import coll as _coll
from .fault_points import FaultPoints
from .follow import Follower
from .keeper_client import FencedError, KeeperClient
from .parity_block import ParityBlock
from .rank_memory import RankMemory
from .rank_state import RankState
from .snapshots import Tier2Snapshots
from .transaction import StepTransaction, first_chunk, prepare_pass

__all__ = ["LoopHost", "UserLoop", "install_unscale_grads", "scaler_update"]


class LoopHost(Protocol):
    """What :class:`UserLoop` reads of its rank's session, and the state its steps set
    there (it installs itself as the session's ``loop``)."""

    loop: UserLoop | None
    rng: dict[str, Any] | None
    sampler_state: dict[str, Any] | None

    @property
    def role(self) -> str: ...
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
    def step(self) -> int: ...
    @property
    def model(self) -> nn.Module: ...
    @property
    def user_optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def scheduler(self) -> Any: ...
    @property
    def cursor(self) -> BatchCursor: ...
    @property
    def full(self) -> FullParams | None: ...
    @property
    def layout(self) -> RetainedLayout: ...
    @property
    def keeper(self) -> KeeperClient | None: ...
    @property
    def gparity(self) -> ParityBlock | None: ...
    @property
    def stats(self) -> dict[str, int]: ...
    @property
    def memory(self) -> RankMemory: ...
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
    def txn(self) -> StepTransaction: ...
    def check_float_mode(self) -> None: ...
    def complete(self) -> bool: ...
    def _fatal(self, message: str) -> None: ...


class UserLoop:
    """One rank's side of the user's loop (see the module docstring)."""

    def __init__(self, session: LoopHost, *, stateful: dict[str, Any], per_rank: bool) -> None:
        self.session = session
        self.stateful = stateful  # name -> an object with state_dict()/load_state_dict()
        self.per_rank = per_rank  # the loader yields this rank's batches (no split)
        self.sync = True
        self.open = False  # a batch was drawn and its step is under way
        self.reduced = False  # this iteration's gradients are in retained memory
        self.stepped = False  # this iteration's optimizer.step() committed
        self.void = False  # a recovery interrupted this iteration
        self.broken: str | None = None  # sharded: the gather after a committed step failed
        self.present: list[bool] = []
        self.old: torch.Tensor | None = None  # gradient bytes before the reduce (parity delta)
        self.buf: torch.Tensor | None = None
        self.out = torch.zeros(0)  # sharded: the reduce-scatter's output
        self.queued = False
        self.hooked: dict[int, Any] = {}
        self.V = session.step
        session.model.register_forward_pre_hook(self._on_forward)
        opt = session.user_optimizer

        # the user's optimizer object is stepped by the loop: its step is leto's
        def step(closure: Any = None) -> None:
            self.step(closure)

        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # a scheduler's check
        opt.step = step  # type: ignore[method-assign,assignment]
        opt.zero_grad = self.zero_grad  # type: ignore[method-assign]
        session.loop = (
            self  # before the session starts: a promoted shadow's recovery loads its state
        )
        _guard_user_collectives(self)
        self.resumed: str | None = None
        # the step this process just committed, whose periodic checkpoint is written at
        # the step boundary (never after a recovery: every rank or none writes it)
        self.ckpt_due: int | None = None

    def started(self) -> None:
        """The session started (a promoted shadow: recovered): the loop begins there."""
        session = self.session
        if session.stats["recoveries"] == 0 and session.role == "trainer":
            session.ps.send(
                session.step
            )  # the state the loop starts from, with the stateful objects
        self.resumed = session.ps.to_json(session.step)  # restored at the first batch

    @property
    def committed(self) -> bool:
        """This iteration's ``optimizer.step()`` committed, and no recovery voided it."""
        return self.open and self.stepped and not self.void and self.broken is None

    # ------------------------------------------------------------ process state

    def state(self) -> dict[str, Any]:
        return {k: to_json(o.state_dict(), f"the state of {k}") for k, o in self.stateful.items()}

    def load_state(self, state: dict[str, Any] | None) -> None:
        for k, v in (state or {}).items():
            if k in self.stateful:
                self.stateful[k].load_state_dict(from_json(v))

    def replay(self, pending: dict[str, Any] | None) -> None:
        """A roll-forward of a step this rank did not finish: the scheduler's step the
        loop would have taken (a metric scheduler's needs the user's metric: kept as
        it was; docs/loop.md)."""
        sch = self.session.scheduler
        if sch is not None and not takes_metric(sch):
            step_scheduler(sch)
        skipped = bool((pending or {}).get("skipped"))  # the scaler found an inf/NaN
        for obj in self.stateful.values():
            if isinstance(obj, torch.amp.GradScaler) and obj.is_enabled():
                obj.load_state_dict(scaler_update(obj.state_dict(), skipped))

    # ------------------------------------------------------------ recovery

    def _guard(self, fn: Any) -> bool:
        """Run ``fn``; on a recovery under way, follow it here. True if ``fn`` completed."""
        try:
            fn()
            return True
        except (Interrupted, Aborted, FencedError):
            self._recover("")
        except CollectiveFailed as e:
            self._recover(f"collective failed: {e}")
        return False

    def user_collective(self, fn: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        """The script's own collective (``dist.all_reduce`` of a metric, ...) during a
        step: a peer's death there is this recovery's, followed here, and the iteration
        becomes void; in a void iteration nothing is sent (its values are discarded, and
        the peers, recovered or promoted, are not in this iteration). What it returns
        then: None (``async_op``: a finished work)."""
        if not self.void:
            out: list[Any] = []

            def run() -> None:
                session = self.session
                if session.ch.aborted_since(session.gen) and session.txn.claims_recovery():
                    raise Interrupted
                out.append(_coll(fn, *args, **kwargs))
                if kwargs.get("async_op") and out[0] is not None:
                    _coll(out[0].wait)  # its failure surfaces here, not in the script

            if self._guard(run):
                return out[0]
        return _Finished() if kwargs.get("async_op") else None

    def _recover(self, reason: str) -> None:
        self.session.txn.stopped(reason)
        self.session.follower._follow()
        self._resumed()

    def _resumed(self) -> None:
        self.resumed = self.session.ps.to_json(self.session.step)
        self.void = True
        self.ckpt_due = None
        self.queued = False
        self._scratch_grads()

    def _params(self) -> list[torch.nn.Parameter]:
        """The model's parameters (sharded: not the retained pieces)."""
        session = self.session
        return session.full.params if session.full is not None else session.layout.params

    def _scratch_grads(self) -> None:
        for p in self._params():
            p.grad = torch.zeros_like(p) if p.requires_grad else None

    # ------------------------------------------------------------ the batch

    def batches(self, steps: int | None = None) -> Iterator[Any]:
        """This rank's batch of each step until the committed step is ``steps``; then
        the job-wide completion (a recovery there may roll back: the loop goes on)."""
        session = self.session
        while True:
            self._close()
            if steps is not None and session.step >= steps:
                if not self._guard(self._checkpoint):
                    continue
                if session.complete():
                    self.open = False
                    return
                self._resumed()
                continue
            yield self.next_batch()

    def _close(self) -> None:
        """The step boundary: close the iteration under way, or restore after a recovery."""
        session = self.session
        if self.open and not self.void:
            self._guard(self._post if self.stepped else self._empty_step)
        if self.broken is not None:  # the step committed; its recovery starts here
            reason, self.broken = self.broken, None
            if not self.void:  # unless the boundary's safe point already followed it
                self._recover(reason)
        if self.resumed is not None:
            text, self.resumed = self.resumed, None
            session.ps.load(text)
            assert session.rng is not None and session.sampler_state is not None
            restore_rng(session.rng)
            session.cursor.restore(session.sampler_state)
            for p in self._params():
                p.grad = None
        self.open = self.void = False

    def next_batch(self) -> Any:
        session = self.session
        self._close()
        # the tiers beyond one step, at the step boundary: the process state after the
        # user's code that followed optimizer.step() (the scheduler's step)
        while not (
            self._guard(lambda: session.snapshots.maybe_take(session.step))
            and self._guard(self._checkpoint)
        ):
            self._close()
        self.V = session.step + 1
        session.txn.in_progress = self.V
        session.check_float_mode()
        batch = session.cursor.batch(self.V)
        self.open, self.stepped, self.reduced = True, False, False
        session.ch.mark("forward", session.step)
        if self.per_rank:
            return batch
        cut = _cut(self.session)
        if len(cut.parts) > 1:
            raise ConfigError(
                "keep_global_batch",
                f"rank {session.rank} of a world of {session.W} would accumulate parts "
                f"{list(cut.parts)} of each global batch, which only session.train does; "
                "in your own loop keep the per-rank batch (keep_global_batch = false)",
            )
        return shard(batch, cut.parts[0], cut.cut)

    def _checkpoint(self) -> None:
        """The periodic checkpoint of the step just committed, if one is due."""
        V, self.ckpt_due = self.ckpt_due, None
        if V is not None and V == self.session.step:
            self.session.checkpoints.maybe_write(V)

    def _post(self) -> None:
        """The process state after the user's code that followed ``optimizer.step()``:
        the step is closed (the agent keeps its final process state)."""
        session = self.session
        session.fault_points.point("tail")
        session.rng = capture_rng()
        session.sampler_state = session.cursor.state_after(session.step)
        session.ps.send(session.step)

    def _empty_step(self) -> None:
        """A step whose optimizer step was skipped: committed with no gradient present."""
        session = self.session
        lay = session.layout
        if not self.reduced:  # the retained gradients stay as they are: a zero parity delta
            comp = (
                session.gparity.versions()[session.local_rank]
                if session.gparity is not None
                else NONE
            )
            self.old = as_bytes(lay.grad_buffer).clone() if comp != NONE else None
            lay.clear_prepared()
        self.present = [False] * len(lay.params)
        self._transact(skipped=True)
        self.stepped = True

    # ------------------------------------------------------------ hooks

    def _hook_params(self) -> None:
        for p in self._params():
            hooks = getattr(p, "_post_accumulate_grad_hooks", None)
            h = self.hooked.get(id(p))
            if p.requires_grad and (h is None or not hooks or h.id not in hooks):
                self.hooked[id(p)] = p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]

    def _on_forward(self, module: Any, args: Any) -> None:
        if not self.open or not torch.is_grad_enabled():
            return  # outside leto's batches (an evaluation)
        self._hook_params()
        self._guard(lambda: self.session.fault_points.point("forward"))

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.queued and self.open:
            self.queued = True
            self.session.ch.mark("backward")  # the first gradient: the backward is running
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        self.queued = False
        if self.void:
            self._scratch_grads()
            return
        if not self.sync:  # a micro-batch: the gradients accumulate, nothing is reduced
            self._guard(lambda: self.session.fault_points.point("backward"))
            return
        self._guard(self._reduce)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate their gradients and reduce nothing (DDP's
        ``no_sync``); the first backward outside reduces the sum."""
        before, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = before

    def _reduce(self) -> None:
        session = self.session
        lay = session.layout
        assert session.keeper is not None
        session.fault_points.point("backward")
        session.ch.mark("allreduce")
        plan = session.full.plan if session.full is not None else None
        if plan is None:
            n, k = lay.numel, len(lay.params)
            if self.buf is None or self.buf.numel() != n + k:
                self.buf = torch.zeros(n + k, dtype=lay.dtype, device=lay.device)
            buf = self.buf
            flat = buf[:n]
            buf[n:].zero_()
            for i, prm in enumerate(lay.params):
                sl = lay.slots[i]
                if prm.grad is not None:
                    flat[sl.offset : sl.offset + sl.numel].copy_(prm.grad.reshape(-1))
                    buf[n + i] = 1
                else:
                    flat[sl.offset : sl.offset + sl.numel].zero_()
                prm.grad = None
            work = _coll(dist.all_reduce, buf, op=dist.ReduceOp.SUM, async_op=True)
        else:  # sharded: this rank receives its shard's sum and every presence flag
            n = plan.shard_numel
            width = n + len(plan.names)
            if self.buf is None or self.buf.numel() != plan.world * width:
                self.buf = torch.zeros(plan.world * width, dtype=lay.dtype)
                self.out = torch.zeros(width, dtype=lay.dtype)
            plan.pack_grads(self._params(), self.buf)
            buf = self.out
            flat = buf[:n]
            work = _coll(REDUCE_SCATTER, buf, self.buf, op=dist.ReduceOp.SUM, async_op=True)
        session.fault_points.point("allreduce")
        try:
            wait_or_abort(
                work, lambda: session.ch.aborted_since(session.gen), "the gradients were reduced"
            )
        except Aborted:
            self.buf = None  # the abandoned collective's: the next step takes fresh ones
            raise
        session.keeper.check_writer()
        self.old = None
        if (
            session.gparity is not None
            and not session.replica
            and session.gparity.versions()[session.local_rank] != NONE
        ):
            self.old = as_bytes(lay.grad_buffer).clone()
        lay.clear_prepared()
        with torch.no_grad():  # the mean written straight into retained memory: one pass
            torch.div(flat, _cut(self.session).divisor, out=lay.grad_buffer)
        lay.grads.mark_reduced(self.V)
        flags = buf[n:].tolist()
        if plan is None:
            self.present = [bool(c > 0) for c in flags]
            derived = set(lay.derived)
            for i, prm in enumerate(lay.params):
                if not self.present[i]:
                    prm.grad = None
                elif i in derived:  # bf16/fp16: its float32 gradients are in retained memory
                    prm.grad = self._refusing(prm, _MasterGrad)
                else:
                    prm.grad = lay.grad_view(i)
        else:
            self.present = plan.present_pieces(session.rank, flags)
            for prm, c in zip(self._params(), flags, strict=True):
                prm.grad = self._refusing(prm, _ShardedGrad) if c > 0 else None
        self.reduced = True

    def _refusing(self, p: torch.Tensor, cls: type[_RefusedGrad]) -> torch.Tensor:
        """A parameter's ``.grad`` after the reduce that holds no gradient: sharded (this
        rank holds only its shard of the reduced gradients, in retained memory) or derived
        from a float32 master (its gradients are float32, in retained memory). Any use of
        it stops the job with one line naming what to call instead (:class:`_RefusedGrad`)."""
        _RefusedGrad.fatal = self.session._fatal
        # on the parameter's device: torch refuses a .grad on another device ("attempting
        # to assign a gradient with device type 'cpu' to a tensor with device type 'cuda'")
        zero = torch.zeros((), dtype=p.dtype, device=p.device)
        return torch.Tensor._make_subclass(cls, zero.expand(p.shape))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the reduced gradients of this step by their global norm (torch's
        ``clip_grad_norm_``; its total norm returned). Sharded: each rank's norm of its
        shard, combined by one all-reduce, every shard scaled alike; otherwise torch's
        own over the parameters' ``.grad`` (the same on every rank)."""
        session = self.session
        if self.void or not self.open:
            return torch.zeros(())
        if not self.reduced:
            raise RuntimeError(
                "session.clip_grad_norm_(): no gradients were reduced since the batch was "
                "drawn (call it after the last loss.backward())"
            )
        if session.full is None and not session.layout.derived:
            return torch.nn.utils.clip_grad_norm_(self._params(), max_norm, norm_type)
        out = torch.zeros((), device=session.layout.device)  # the norm where torch's is
        sharded = session.full is not None

        def clip() -> None:
            g = session.layout.grad_buffer
            p = float(norm_type)
            inf = p == float("inf")
            local = g.abs().max() if inf else torch.linalg.vector_norm(g, p) ** p
            t = local.reshape(1).clone()
            if sharded:  # every rank's shard; unsharded, the buffer is the whole gradient
                _coll(dist.all_reduce, t, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
            total = t[0] if inf else t[0] ** (1.0 / p)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            assert session.keeper is not None
            session.keeper.check_writer()
            with torch.no_grad():
                g.mul_(coef)
            out.copy_(total)

        self._guard(clip)
        return out

    def unscale_grads(
        self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """``GradScaler._unscale_grads_`` with sharded state or float32 master weights
        (wrap installs it on the scaler): the reduced gradients in retained memory (this
        rank's shard; float32 with masters) unscaled in place and checked for inf/NaN, as
        torch does for ``.grad``; sharded, the finding is all-reduced (as torch's
        ``ShardedGradScaler`` does), so that every rank steps or skips alike."""
        del optimizer
        session = self.session
        if self.void or not self.open or not self.reduced:
            return {found_inf.device: found_inf}  # a void iteration: nothing is stepped
        g = session.layout.grad_buffer
        if g.dtype == torch.float16 and not allow_fp16:
            raise ValueError("Attempting to unscale FP16 gradients.")  # torch's own refusal

        def unscale() -> None:
            assert session.keeper is not None
            session.keeper.check_writer()
            torch._amp_foreach_non_finite_check_and_unscale_([g], found_inf, inv_scale)
            if session.full is not None:  # each rank checked its shard: every rank's finding
                _coll(dist.all_reduce, found_inf, op=dist.ReduceOp.MAX)

        if not self._guard(unscale):
            found_inf.zero_()
        return {found_inf.device: found_inf}

    # ------------------------------------------------------------ the optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every ``.grad`` to None (leto's gradients are never zeroed in place)."""
        for p in self._params():
            p.grad = None

    def step(self, closure: Any = None) -> None:
        """leto's transactional step on the reduced gradients (``optimizer.step()``)."""
        if closure is not None:
            raise TypeError("optimizer.step(closure): a closure is not supported by leto's step")
        self.session.user_optimizer._opt_called = True  # type: ignore[attr-defined]
        if self.void or not self.open:
            return
        if self.stepped:
            raise RuntimeError(f"optimizer.step() called twice for the batch of step {self.V}")
        if not self.reduced:
            raise RuntimeError(
                "optimizer.step(): no gradients were reduced since the batch was drawn "
                "(call loss.backward() outside no_sync() on the last micro-batch)"
            )
        if self._guard(self._transact):
            self.stepped = True
            self.zero_grad()
            try:  # sharded: the new parameters; a failure here leaves the step committed,
                # so the user's code after it runs, as after any step (its recovery: _close)
                self.session.memory.gather_params()
            except CollectiveFailed as e:
                self.broken = f"collective failed: {e}"

    def _transact(self, skipped: bool = False) -> None:
        session = self.session
        lay = session.layout
        V = session.step + 1
        if V != self.V:
            raise RuntimeError(f"the batch is of step {self.V}, the optimizer is at step {V - 1}")
        bad = prepare_pass(session, first_chunk(session.local_rank, lay))
        gdelta = None
        if session.gparity is not None and not session.replica:
            gdelta = as_bytes(lay.grad_buffer).clone()
            if self.old is not None:
                gdelta.sub_(self.old)
        session.txn.commit(
            V,
            bad,
            self.present,
            gdelta,
            capture_rng(),
            None,
            scheduler=False,
            gather=False,
            checkpoint=False,
            skipped=skipped,
            tail=not skipped,  # an empty step is committed at the boundary, after the tail
        )
        self.ckpt_due = V


class _RefusedGrad(torch.Tensor):
    """What a parameter's ``.grad`` is after a reduce that keeps its gradients elsewhere:
    any use stops the job with its class's ``why``."""

    fatal: Any = None
    why = ""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        _RefusedGrad.fatal(cls.why)


class _ShardedGrad(_RefusedGrad):
    why = (
        "shard = true: a parameter's .grad holds no gradient after the reduce (each rank "
        "keeps only its shard): clip with session.clip_grad_norm_(max_norm), not "
        "torch.nn.utils.clip_grad_norm_"
    )


class _MasterGrad(_RefusedGrad):
    why = (
        "master_weights = true: a bf16/fp16 parameter's .grad holds no gradient after the "
        "reduce (its float32 gradients are in retained memory): clip with "
        "session.clip_grad_norm_(max_norm), not torch.nn.utils.clip_grad_norm_"
    )


class _Finished:
    """What a void iteration's ``async_op`` collective returns: a work already done."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


# torch.distributed's collectives a script calls; leto's own calls (and torch's calls
# inside torch.distributed, such as all_gather_object's all_gather) pass straight on
USER_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)
_OWN_CALLERS = ("leto.", "torch.distributed")
_active: list[UserLoop] = []  # the process's loop (one per trainer)
_originals: dict[str, Any] = {}


def _guard_user_collectives(loop: UserLoop) -> None:
    """``dist.<collective>`` called by the script's main thread during a step goes
    through :meth:`UserLoop.user_collective` (a script that imported the function
    itself before ``leto.wrap`` keeps the bare one: call them as ``dist.all_reduce``)."""
    _active[:] = [loop]
    for name in USER_COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None or name in _originals:
            continue
        _originals[name] = fn
        setattr(dist, name, _guarded(fn))


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        loop = _active[0] if _active else None
        caller = str(sys._getframe(1).f_globals.get("__name__", ""))
        if (
            loop is None
            or not loop.open
            or caller.startswith(_OWN_CALLERS)
            or threading.current_thread() is not threading.main_thread()
        ):
            return fn(*args, **kwargs)
        return loop.user_collective(fn, args, kwargs)

    return call


def install_unscale_grads(
    scaler: Any, unscale: Callable[..., dict[torch.device, torch.Tensor]]
) -> None:
    """Make ``unscale`` (:meth:`UserLoop.unscale_grads`) the ``GradScaler``'s
    ``_unscale_grads_``, on that one scaler object.

    A private method of torch's, overwritten: ``GradScaler.unscale_`` and ``step`` find
    the gradients' inf/NaN through it, and torch has no public hook for gradients kept
    elsewhere than ``.grad`` (retained memory: this rank's shard, or float32 beside
    fp16 parameters). Kept here alone, so that a torch that renames it breaks one line."""
    scaler._unscale_grads_ = unscale


def scaler_update(st: dict[str, Any], skipped: bool) -> dict[str, Any]:
    """A ``GradScaler`` state after ``update()`` of a committed step, as torch's
    ``_amp_update_scale_`` computes it: ``skipped`` (its ``optimizer.step()`` was
    skipped on an inf/NaN: an empty step) backs the scale off; a finite step grows it
    every ``growth_interval`` steps."""
    out = dict(st)
    if skipped:
        out["scale"] = float(torch.tensor(st["scale"], dtype=torch.float32) * st["backoff_factor"])
        out["_growth_tracker"] = 0
        return out
    tracker = int(st["_growth_tracker"]) + 1
    if tracker == int(st["growth_interval"]):
        out["scale"] = float(torch.tensor(st["scale"], dtype=torch.float32) * st["growth_factor"])
        tracker = 0
    out["_growth_tracker"] = tracker
    return out


def _cut(session: Any) -> accumulation.Plan:
    """``session``'s rank's part of the global batch (leto.core.accumulation)."""
    return accumulation.plan(
        session.rank, session.W, session.cfg.batch_parts, session.cfg.keep_global_batch
    )
