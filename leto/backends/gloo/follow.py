"""A trainer's side of a recovery: the coordinator's commands, carried out on this rank.

:class:`Follower` is the seam between the training step (:mod:`.runtime`'s
session, seen as a :class:`FollowerHost`) and a recovery: once a step is interrupted, the session
hands over to :meth:`Follower._follow`, which reports this rank's retained memory,
carries out the core's reconcile plan through the one plan interpreter
(:func:`leto.retained.recovery.carry_out`, over :mod:`.repair_ops`: tier 1 as parity
or as replicas, snapshot and checkpoint restores), rebuilds the redundancy and
resumes. Everything lives in the session (``self.session``) but what its report checked:
the chunks whose checksums held, which the check before resuming does not read again
(one pass over the retained bytes per recovery, not two).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from leto.core import reshape
from leto.core.chunk import LOST, NONE
from leto.core.reconcile import Plan, Repair, writes_no_chunk
from leto.core.recovery import Kind
from leto.core.runs import records_runs_json, runs_json
from leto.retained import recovery as rx
from leto.retained.alloc import settle
from leto.retained.optim import RetainedOptimizer
from leto.retained.parity import (
    Collective,
    encode,
)
from leto.retained.process_state import BatchCursor, restore_buffers
from leto.retained.recovery import IntegrityError
from leto.retained.shard import FullParams

from . import messages as M
from .collective import CHECK_KEPT_PARITY, comm_error
from .fault_points import FaultPoints
from .faults import COMMAND_POINT
from .keeper_client import FencedError, KeeperClient
from .rank_memory import RankMemory
from .repair_ops import RepairHost, copy_replica, ops_for, take_process_state
from .reshard import old_shards, reshard_in_place

__all__ = ["Follower", "FollowerHost", "StepStopper"]


class StepStopper(Protocol):
    """What a recovery tells the step transaction (:class:`~.transaction.StepTransaction`)."""

    def stopped(self, reason: str) -> None: ...
    def tier1_chunk(self, c: int, step: int) -> None: ...


class FollowerHost(RepairHost, Protocol):
    """What :class:`Follower` reads of its rank's session, and the state a recovery
    sets there (besides what the repair operations read: :class:`~.repair_ops.RepairHost`)."""

    gen: int
    rng: dict[str, Any] | None
    sampler_state: dict[str, Any] | None
    completed: bool

    @property
    def cfg(self) -> Any: ...
    @property
    def step(self) -> int: ...
    @property
    def model(self) -> nn.Module: ...
    @property
    def ropt(self) -> RetainedOptimizer | None: ...
    @property
    def full(self) -> FullParams | None: ...
    @property
    def user_optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def keeper(self) -> KeeperClient | None: ...
    @property
    def cursor(self) -> BatchCursor: ...
    @property
    def memory(self) -> RankMemory: ...
    @property
    def fault_points(self) -> FaultPoints: ...
    @property
    def txn(self) -> StepStopper: ...
    def _fatal(self, message: str) -> None: ...
    def _log(self, event: str, **kw: Any) -> None: ...
    def ready(self, start: int, meta: dict[str, Any] | None) -> None: ...
    def take_place(self, node: int, nodes: int) -> None: ...


class Follower:
    """Carries out recoveries for one rank's session (see the module docstring)."""

    def __init__(self, session: FollowerHost) -> None:
        self.session = session
        self.reencoded = 0  # chunks whose tier-1 parity the last recovery re-encoded
        self.parity_checked = False  # did it check a kept parity (LETO_CHECK_KEPT_PARITY)
        # (generation, {chunk: version}): the chunks this rank's report found CLEAN
        # with their checksums holding or left to the next PREPARE (intact_at)
        self.intact: tuple[int, dict[int, int]] | None = None
        # (generation, chunks): those whose checksums the report left to the next
        # PREPARE (leto.retained.recovery.deferrable), until this recovery reads them
        self.deferred: tuple[int, set[int]] | None = None
        # (generation, step): the sealed gradients the report left unread likewise
        # (leto.retained.recovery.grads_deferrable), until a repair of the node reads them
        self.deferred_grads: tuple[int, int] | None = None
        # the core's plans this rank carried out (each Reconcile), since ``_follow`` began,
        # which a compute paused across the recovery is judged by (transaction.paused)
        self.plans: list[Plan] = []
        # the node's checksums gathered at the start of a reconcile whose plan writes
        # no chunk ([chunk][member]), until its end uses them
        self._sums_at_start: list[list[int]] | None = None
        self._before_writes: Callable[[], None] | None = None
        # the generation whose reconcile this rank carried out to its end: its Rebuild
        # (every rank of the job has reported that end) renews the gradient parity
        self._reconciled: int | None = None
        self._beside = False  # following on a thread beside the compute (_follow)
        self.world_changed = False  # the recovery changed the world in place (reshape)
        # the generation of the last recovery this rank resumed from (the parallel
        # replay's exchange follows each: transaction, replay.py)
        self.resumed_gen: int | None = None

    def _follow(
        self, before_writes: Callable[[], None] | None = None, *, beside: bool = False
    ) -> None:
        """Carry out the coordinator's recovery commands until ``resume``.
        ``before_writes``: called before each plan is carried out (its plan in
        :attr:`plans`), by a recovery beside the compute (transaction); ``beside``: on
        that recovery's thread, the sampler is left for the compute's thread to put
        back (after it, with the rest of what the compute reads)."""
        self.plans = []
        self.world_changed = False  # a reshape: no compute of the old world is kept
        self._before_writes = before_writes
        self._beside = beside
        self.session.checkpoints.cancel()  # an asynchronous save in flight never reports
        self.session.groups.destroy()
        while True:
            msg = self.session.ch.next_command()
            if isinstance(msg, M.Abort):
                self.session.groups.destroy()
                continue
            if isinstance(msg, M.Complete):
                self.session.completed = True
                continue
            if isinstance(msg, M.Reshape) and not self.session.ch.aborted_since(msg.gen):
                self._reshape(msg)
                return
            if not isinstance(msg, tuple(COMMAND_POINT)):
                continue  # nothing else is a recovery command
            t = msg.TAG
            gen = int(getattr(msg, "gen", self.session.gen))
            if gen < self.session.gen or self.session.ch.aborted_since(gen):
                continue  # a command of a generation that has been aborted since
            self.session.ch.mark(t)
            self.session.fault_points.point("recovery", where=COMMAND_POINT[type(msg)])
            try:
                match msg:
                    case M.CallReports():
                        self._report(gen)
                    case M.Reconcile():
                        try:
                            self._reconcile(msg)
                        finally:
                            self.session.ps.drop_prefetch()
                    case M.Rebuild():
                        self._rebuild(gen)
                    case M.Resume():
                        self._resume(msg)
                        return
            except FencedError as e:
                # fenced: either a newer generation overtook this command (its abort is on
                # the way: wait for the next command), or this process is stale: it must go
                deadline = time.monotonic() + 3.0
                while time.monotonic() < deadline and not self.session.ch.aborted_since(gen):
                    time.sleep(0.01)
                if self.session.ch.aborted_since(gen):
                    self.session.txn.stopped(f"generation {gen} was overtaken")
                    continue
                sys.stderr.write(f"leto: rank {self.session.rank}: fenced off ({e}); exiting\n")
                os._exit(4)
            except Exception as e:  # noqa: BLE001
                if not comm_error(e):
                    self.session._fatal(
                        f"recovery ({t}, generation {gen}) failed: {type(e).__name__}: {e}\n"
                        + traceback.format_exc()
                    )
                # a collective of the recovery failed (another failure): wait for the restart
                self.session.txn.stopped(
                    f"recovery step {t} failed: {str(e).splitlines()[0] if str(e) else e}"
                )

    def _report(self, gen: int) -> None:
        self.session.ch.mark("report")
        self.session.gen = gen
        assert self.session.keeper is not None
        self.session.keeper.readmit(gen)
        # This rank's own memory first: nothing but this process writes it now (the fence
        # killed any stale writer before the promotion), so its checksum pass runs while
        # the other ranks are still stopping their step, not after they all joined.
        lost = self.session.memory.ensure_layout()
        if not self.session.parity and self.session.cfg.tier1:
            self.session.memory.node_memory()
        lay = self.session.layout
        C = lay.n_chunks
        self.intact = self.deferred = self.deferred_grads = None
        if lost:
            data, undo, grad = [LOST] * C, [NONE] * C, LOST
        else:
            # what this recovery writes from is read now; the other CLEAN chunks are
            # checked by the next PREPARE's pass, as between failures (or here, by
            # _check_deferred, if the recovery reads them after all)
            deferred = rx.deferrable(lay) if self.session.cfg.verify_chunks else []
            bad = set(lay.verify(deferred))
            if bad:
                lay.mark_suspect()  # until a recovery ends, every report reads every chunk
            data, undo = rx.observe(lay, bad)
            self.intact = (gen, rx.intact_at(lay, data))
            self.deferred = (gen, set(deferred))
            ps = lay.prepared_step
            if rx.grads_deferrable(lay, deferred):  # read before a repair of the node
                grad, self.deferred_grads = ps, (gen, ps)
            else:
                ok = ps >= 0 and not lay.grads.verify(ps)
                grad = ps if ok else (NONE if ps < 0 else LOST)
            if ps < 0 and lay.grads.reduced_step == self.session.step + 1:
                # the next step's gradients, reduced and not sealed (the spec's REDUCED:
                # the node's gradient parity still records the step before)
                grad = lay.grads.reduced_step
            elif grad == NONE and self._gparity_names_mine():
                # released as a step's reduction began writing the buffer: the gradients
                # the node's record still names are gone (LOST), not "none held"
                grad = LOST
        t0 = time.perf_counter()
        self.session.groups.init(
            gen
        )  # every rank has stopped: the node's shared records hold still
        pg_ms = round((time.perf_counter() - t0) * 1e3, 3)
        node_par = node_gpar = None
        if self.session.local_rank == 0:  # the node's first rank: its parity records, if valid
            if (
                self.session.cfg.tier1
                and self.session.parity
                and all(b.valid for b in self.session.parity)
            ):
                node_par = records_runs_json([b.versions() for b in self.session.parity])
                assert self.session.gparity is not None
                node_gpar = self.session.gparity.versions() if self.session.gparity.valid else None
        self.session.ch.send(
            M.Report(
                rank=self.session.rank,
                gen=gen,
                data=runs_json(data),
                undo=runs_json(undo),
                grad=grad,
                lost=lost,
                pg_ms=pg_ms,
                node_par=node_par,
                node_gpar=node_gpar,
            )
        )

    def _reconcile(self, msg: M.Reconcile) -> None:
        self.session.ch.mark("reconcile")
        self.session.ps.prefetch()  # the settle's node state, asked for beside what comes first
        gen, target = msg.gen, msg.target
        plan = Plan(target, Kind(msg.kind), tuple(self._runs(msg)), "")
        self.plans.append(plan)
        # a plan that writes no chunk: the node's checksums are gathered as the gradient
        # parity is forgotten (that collective orders the release), not again at the end
        early = writes_no_chunk(plan)
        self._sums_at_start = None
        self._reconciled = None
        if self._before_writes is not None:
            self._before_writes()
        self.session.groups.init(gen)
        t0 = time.perf_counter()
        if plan.kind is Kind.TIER2 and msg.snapshot is None:
            raise IntegrityError("a tier-2 reconcile without the snapshot's record")
        done = rx.carry_out(plan, ops_for(self, self.session, msg, early=early))
        summary: dict[str, Any] = done.counts()
        how = "copied_from_replicas" if self.session.replica else "repaired_from_parity"
        self.session.stats[f"chunks_{how}"] += summary["chunks_repaired_tier1"]
        self.session.stats[f"grad_blocks_{how}"] += summary["grads_repaired_tier1"]
        self.session.stats["chunks_rolled_forward"] += summary["chunks_rolled_forward"]
        t1 = time.perf_counter()
        meta = self._after_recovery_state(
            target, snapshot=msg.retake_t2, intact=self._untouched(msg)
        )
        summary["repair_ms"] = round((t1 - t0) * 1e3, 3)
        summary["redundancy_ms"] = round((time.perf_counter() - t1) * 1e3, 3)
        summary["parity_reencoded"] = int(self.reencoded > 0)
        summary["parity_chunks_reencoded"] = self.reencoded
        summary["parity_checked"] = int(self.parity_checked)
        settle(self.session.layout.device)  # the repaired bytes on a GPU are written
        self.session.memory.status_lost(False)
        self._reconciled = gen
        self.session.ch.send(
            M.Reconciled(rank=self.session.rank, gen=gen, summary=summary, snapshot=meta)
        )

    def _rebuild(self, gen: int) -> None:
        """The communicator of this generation was formed before Reconcile and carried its
        collectives: the rank only says it is on it (no barrier: the coordinator's wait for
        every Rebuilt is one). Every rank has reported its reconcile done, so every
        gradient is released: the node's gradient parity is written afresh now."""
        self.session.ch.mark("rebuild")
        if self._reconciled == gen:
            self._renew_grad_parity()
        settle(self.session.layout.device)  # the rebuilt bytes on a GPU are written
        self.session.ch.send(M.Rebuilt(rank=self.session.rank, gen=gen))

    def _runs(self, msg: M.Reconcile) -> list[Repair]:
        """The plan's repairs as the coordinator sent them: runs of chunks (``count``)."""
        return [Repair.from_wire(x) for x in msg.repairs]

    def _check_deferred(self, gen: int, chunks: set[int] | None = None) -> None:
        """Read now the deferred chunks (``chunks`` of them; None: all) that this
        recovery is about to read: a source of a tier-1 rebuild, a re-encoding, a
        snapshot. One failing marks the layout suspect and fails the recovery loudly
        (the next report reads every chunk and finds it)."""
        if self.deferred is None or self.deferred[0] != gen:
            return
        left = self.deferred[1]
        todo = sorted(left if chunks is None else left & chunks)
        if not todo:
            return
        lay = self.session.layout
        bad = [c for c in todo if not lay.records.verify_chunk(c)]
        self.deferred = (gen, left - set(todo))
        if bad:
            lay.mark_suspect()
            raise IntegrityError(
                f"rank {self.session.rank}: chunks {bad} fail their checksums (read by the "
                f"recovery of generation {gen})"
            )

    def _check_deferred_grads(self, gen: int, repairs: tuple[Repair, ...]) -> None:
        """Read now the gradients the report left unread, if a repair of this node may
        read them (a member's gradients copied or decoded from the others', or a lost
        member's chunks rolled forward with gradients copied from them). One failing
        marks the layout suspect and fails the recovery loudly, as a chunk does."""
        if self.deferred_grads is None or self.deferred_grads[0] != gen or not repairs:
            return
        step = self.deferred_grads[1]
        self.deferred_grads = None
        lay = self.session.layout
        if lay.grads.verify(step):
            lay.mark_suspect()
            raise IntegrityError(
                f"rank {self.session.rank}: the gradients of step {step} fail their checksums "
                f"(read by the recovery of generation {gen})"
            )

    def _gparity_names_mine(self) -> bool:
        """The node's gradient parity records gradients of some step for this rank."""
        g = self.session.gparity
        return bool(
            self.session.cfg.tier1
            and g is not None
            and g.valid
            and g.versions()[self.session.local_rank] != NONE
        )

    def _forget_grad_parity(self, *, gather: bool = False) -> None:
        """The node's gradient parity is LOST from here until :meth:`_renew_grad_parity`
        writes it again (PROTOCOL.md, "Gradient parity during a reconcile").

        The spec's Reconcile releases every gradient and resets the gradient parity in
        one step; here each rank releases its own (``settle``) while the node's record
        would still name the released step. Invalidated first, behind a barrier of the
        node, a recovery that interrupts this one reads no record of gradients that are
        gone (found by ``leto spec trace --tlc`` on the demo's faulted run).

        ``gather``: the plan writes no chunk (``leto.core.reconcile.writes_no_chunk``), so
        the collective is the gather of the node's checksums, which the end of the
        reconcile then uses (an all-gather orders what follows it as a barrier does).
        """
        if not self.session.cfg.tier1 or self.session.gparity is None:
            return
        if self.session.local_rank == 0:
            self.session.gparity.invalidate()
        if gather:
            self._sums_at_start = self._node_checksums()
        else:
            dist.barrier(group=self.session.groups.node_group)

    def _renew_grad_parity(self) -> None:
        """The node's gradient parity written afresh (every member NONE) by its first rank,
        once every member has released its gradients: at the coordinator's Rebuild, which
        comes after every rank reported its reconcile done (or at the start, where no rank
        holds any). At the end of this rank's own reconcile a member may still hold its
        gradients (a plan that writes no chunk has no collective of the node after the
        settles): killed there, its next report would hold gradients the record names
        NONE for, which breaks ParityOK's gradient clause (the adoption is refused)."""
        if self.session.cfg.tier1 and self.session.local_rank == 0:
            assert self.session.gparity is not None
            self.session.gparity.write_full(
                None, [NONE] * self.session.nproc, [0] * self.session.nproc
            )

    def _own_checksums(self) -> list[int]:
        return self.session.layout.records.stored_checksum_list()

    def _node_checksums(self) -> list[list[int]]:
        """Every chunk's stored checksum on every rank of the node: ``[chunk][member]``
        (one all-gather of the node)."""
        sums = self.session.layout.records.stored_checksums()
        allsums = [torch.zeros_like(sums) for _ in range(self.session.nproc)]
        dist.all_gather(allsums, sums, group=self.session.groups.node_group)
        return [[int(x) for x in row] for row in torch.stack(allsums, dim=1).tolist()]

    def _untouched(self, msg: M.Reconcile) -> list[int]:
        """The chunks this rank's report of ``msg``'s generation found intact at the
        target that the reconcile wrote nothing to: no restore, no repair of this rank."""
        if (
            self.intact is None
            or self.intact[0] != msg.gen
            or Kind(msg.kind) in (Kind.TIER2, Kind.CKPT)
        ):
            return []
        mine = {c for x in self._runs(msg) if x.rank == self.session.rank for c in x.chunks}
        return [c for c, v in self.intact[1].items() if v == msg.target and c not in mine]

    def _resume(self, msg: M.Resume) -> None:
        self.session.ch.mark("resume")
        step = msg.step
        assert self.session.ropt is not None
        if self.session.ropt.version != step:
            self.session._fatal(
                f"resume at step {step}, but this rank's state is at {self.session.ropt.version}"
            )
        self.session.snapshots.t2 = step if msg.t2 is None else msg.t2
        self.session.snapshots.pending = None
        assert self.session.sampler_state is not None
        if not self._beside:
            self.session.cursor.restore(self.session.sampler_state)
        self.session.stats["recoveries"] += 1
        self.session.layout.mark_suspect(False)  # every chunk was read or is left to PREPARE
        self.deferred = self.deferred_grads = None
        self.resumed_gen = msg.gen
        self.session._log("resumed", step=step, generation=self.session.gen)
        self.session.ch.mark("idle", step)

    def _reshape(self, msg: M.Reshape) -> None:
        """The world changed in place (:mod:`leto.core.reshape`): this rank keeps its
        process and its retained state, rolls to the committed step, takes its number
        in the new world (renumbered when a node before its own was lost), forms the new
        world's groups, rebuilds its redundancy there (tier 1 in its node, as before;
        tier 2 re-encoded over the surviving nodes) and says ``ready`` again. Sharded
        state (``msg.snapshot``) goes to the tier-2 snapshot's step instead, resharded
        from it for the new world (:mod:`.reshard`)."""
        session = self.session
        session.ch.mark("reshape")
        self.world_changed = True
        if self._before_writes is not None:  # a compute beside: it stops first
            self._before_writes()
        session.gen = msg.gen
        assert session.keeper is not None
        session.keeper.readmit(msg.gen)
        joins = session.memory.ensure_layout()  # lost: a rank of a node joining (grow)
        if joins and not msg.grow:
            session._fatal("its retained state was lost; the world cannot change in place")
        was, rank = session.W, session.rank
        sharded = msg.snapshot is not None  # resharded from the tier-2 snapshot of msg.step
        mine = old_shards(session, msg.snapshot) if msg.snapshot is not None else {}
        # its new number first: its agent keeps its process states by it since the change
        session.take_place(reshape.renumbered(session.node, frozenset(msg.lost_nodes)), msg.nodes)
        forward, back = (0, 0) if joins or sharded else self._settle(msg.step)
        session.groups.init(msg.gen)
        if msg.grow:
            copy_replica(session, msg.step, joins)
        elif msg.snapshot is not None:
            reshard_in_place(session, msg.snapshot, mine)
        else:
            take_process_state(session, msg.step)
        meta = self._after_recovery_state(msg.step)
        self._renew_grad_parity()
        self._resume(M.Resume(gen=msg.gen, step=msg.step, t2=msg.step))
        session._log(
            "reshaped", step=msg.step, generation=msg.gen, world=session.W, was=was,
            rolled_forward=forward, rolled_back=back, rank=session.rank, was_rank=rank,
        )  # fmt: skip
        session.ready(msg.step, meta)

    def _seal_rebuilt_grads(self, step: int, how: str) -> None:
        """This rank's gradients of ``step``, rebuilt: sealed with the present mask of
        its prepare record and checked against that record's checksums."""
        rx.seal_rebuilt_grads(
            self.session.layout,
            step,
            self.session.ps.node_state()[1],
            how,
            f"rank {self.session.rank}",
        )

    def _who(self, member: int) -> str:
        """How an error names local member ``member`` of this node."""
        return f"rank {self.session.node * self.session.nproc + member}"

    def _settle(self, target: int) -> tuple[int, int]:
        """Roll this rank to ``target`` (:func:`leto.retained.recovery.settle`);
        (chunks rolled forward, chunks rolled back)."""
        assert self.session.ropt is not None
        hist, pend = self.session.ps.node_state()
        # Checksums gathered before the settle (a plan that writes no chunk): no
        # collective follows it before each rank reads the node's shared records to pick
        # the stale chunks, so no settle may write them. A chunk it restores and rolls
        # forward (one that failed its checksum since the report) ends with the same
        # bytes, and its parity, one step behind for this member, is re-encoded there.
        early = self._sums_at_start is not None
        done = rx.settle(
            self.session.layout,
            self.session.ropt,
            target,
            history=hist,
            pending=pend,
            load_ps=self.session.ps.load,
            step_scheduler=lambda: self.session.ps.replay_scheduler(pend),
            who=f"rank {self.session.rank}",
            on_applied=None if early else (lambda c: self._parity_follows(c, target)),
        )
        if done.rng is not None:
            self.session.rng = done.rng
            self.session.sampler_state = done.sampler
        if done.buffers is not None:
            restore_buffers(self.session.model, done.buffers)
        return done.forward, done.back

    def _check_kept_parity(self, coll: Collective, target: int, kept: list[int]) -> None:
        """Test aid (``LETO_CHECK_KEPT_PARITY=1``): the node's kept parity of chunks
        ``kept``, byte for byte, against a fresh encoding of every member's chunks at
        ``target``."""
        par = self._encode_chunks(coll, kept)
        self.parity_checked = True
        if par is not None:
            bad = [
                c
                for c, p in zip(kept, par, strict=True)
                if not torch.equal(p.cpu(), self.session.parity[c].parity())
            ]
            if bad:
                raise IntegrityError(
                    f"node {self.session.node}: the kept parity of chunks {bad} is not the encoding "
                    f"of its members at step {target}"
                )

    def _encode_chunks(self, coll: Collective, chunks: list[int]) -> list[torch.Tensor] | None:
        """Tier-1 parity of ``chunks`` (every member calls it): one reduce of their bytes,
        in order; on the node's first rank each chunk's parity, else None."""
        lay = self.session.layout
        par = encode(coll, [t for c in chunks for t in lay.chunk_data(c)], 0)
        if par is None:
            return None
        out, at = [], 0
        for c in chunks:
            n = sum(t.numel() * t.element_size() for t in lay.chunk_data(c))
            out.append(par[at : at + n])
            at += n
        return out

    def _parity_follows(self, c: int, step: int) -> None:
        """A rolled-forward chunk's change into the node's parity, as a step's APPLY does.

        Only where the parity holds this member's chunk one step back (a death between
        seal and parity update leaves it there; after the update it is already at
        ``step``); otherwise the recovery re-encodes this chunk's parity.
        """
        if not self.session.parity:
            return
        block = self.session.parity[c]
        if block.valid and block.versions()[self.session.local_rank] == step - 1:
            self.session.txn.tier1_chunk(c, step)

    def _after_recovery_state(
        self, target: int, *, snapshot: bool = True, intact: list[int] | None = None
    ) -> dict[str, Any] | None:
        """Verify, then rebuild the redundancy at ``target``: parity, gradient parity, and
        (``snapshot``: the coordinator says the tier-2 snapshot lost blocks) the snapshot.
        ``intact``: chunks whose checksums this recovery checked already."""
        lay = self.session.layout
        self.reencoded = 0
        self.parity_checked = False
        rx.check_resumable(
            lay, self.session.ropt, target, f"rank {self.session.rank}", intact or ()
        )
        # the target's process state kept before the prepare record it may have come
        # from is dropped: a death between the two left neither (no state of the target,
        # no record to roll it forward from), and the next recovery could not settle
        self.session.ps.send(target)
        self.session.ch.send(M.Pending(rank=self.session.rank, json=""))
        if self.session.cfg.tier1:
            if not self.session.parity:
                self.session.memory.node_memory()
            coll = self.session.groups.parity(self.session.groups.node_group)
            want, self._sums_at_start = self._sums_at_start, None
            if want is None:
                want = self._node_checksums()
            else:  # gathered before the settle: the plan wrote no chunk, so they hold
                moved = [
                    c
                    for c, v in enumerate(self._own_checksums())
                    if v != want[c][self.session.local_rank]
                ]
                if moved:
                    raise IntegrityError(
                        f"rank {self.session.rank}: chunks {moved} changed in a reconcile whose "
                        "plan writes no chunk"
                    )
            # A chunk whose parity already encodes every member at ``target`` (no byte of
            # it changed in this recovery, or a roll forward updated it as APPLY does) is,
            # byte for byte, what re-encoding would write: only the others are encoded.
            # Every rank of the node reads the same shared blocks and the same gathered
            # checksums, so all choose the same chunks.
            stale = [
                c
                for c, b in enumerate(self.session.parity)
                if not (
                    b.valid
                    and b.versions() == [target] * self.session.nproc
                    and b.checksums() == want[c]
                )
            ]
            self.session.stats["parity_reencodes_skipped"] += int(not stale)
            self.reencoded = len(stale)
            if self.session.replica:
                # no bytes to encode: the replicas must agree, then the records say so
                split = [c for c in range(lay.n_chunks) if len(set(want[c])) != 1]
                if split:
                    raise IntegrityError(
                        f"node {self.session.node}: its ranks' chunks {split} differ at step {target}; "
                        f"tier1_code {self.session.cfg.tier1_code!r} keeps tier 1 as replicas, which "
                        "needs every rank of a node to hold the same state (data-parallel "
                        "training): set tier1_code = 'parity'"
                    )
                if self.session.local_rank == 0:
                    for c in stale:
                        self.session.parity[c].write_full(
                            None, [target] * self.session.nproc, want[c]
                        )
            else:
                kept = sorted(set(range(lay.n_chunks)) - set(stale))
                if kept and CHECK_KEPT_PARITY:
                    self._check_kept_parity(coll, target, kept)
                if stale:
                    self._check_deferred(self.session.gen, set(stale))  # the chunks encoded
                    par = self._encode_chunks(coll, stale)
                    if par is not None:  # the node's first rank writes the blocks
                        for c, p in zip(stale, par, strict=True):
                            self.session.parity[c].write_full(
                                p, [target] * self.session.nproc, want[c]
                            )
        # No barrier after the writes: a rank reports its end (``reconciled``, or ``ready``
        # at the start) only after them, and nothing goes on until every rank has (the
        # coordinator's rebuild and resume, or its start, wait for all of them). The
        # gradient parity is not among them: :meth:`_renew_grad_parity` writes it later.
        if self.session.cfg.tier2 and snapshot:
            self._check_deferred(self.session.gen)  # every chunk is copied into the snapshot
        meta = self.session.snapshots.take(target) if self.session.cfg.tier2 and snapshot else None
        lay.derive_params()  # master weights: bf16/fp16 parameters cast from the target's
        self.session.memory.gather_params()  # sharded: the model's parameters at the target
        return meta
