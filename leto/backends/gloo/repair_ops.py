"""A rank's side of the reconcile plan on gloo: :class:`~leto.retained.recovery.RepairOps`
over ``torch.distributed`` and the node's shared records.

:func:`leto.retained.recovery.carry_out` owns the plan's order; this module supplies
what is gloo's own. Every member of a node runs the plan (SPMD), so the tier-1
operations are the node's collectives, in the order ``carry_out`` calls them: tier 1 as
parity (:class:`ParityOps`, a member's chunk decoded from the others and the node's
parity) or as replicas (:class:`ReplicaOps`, a lost chunk copied from a settled member).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from leto.core.chunk import NONE
from leto.core.reconcile import Plan, Repair, RepairKind, expand_repairs
from leto.retained import recovery as rx
from leto.retained import replicas as rpl
from leto.retained import rs
from leto.retained.checkpoint import CheckpointError
from leto.retained.layout import RetainedLayout
from leto.retained.parity import decode_rotated, encode_rotated_alike
from leto.retained.recovery import IntegrityError, Settled

from . import messages as M
from .channel import AgentChannel
from .checkpoints import Checkpoints
from .parity_block import ParityBlock
from .process_groups import ProcessGroups
from .rank_state import RankState
from .snapshots import Tier2Snapshots

__all__ = ["ParityOps", "RepairFollower", "RepairHost", "ReplicaOps", "ops_for"]


class RepairFollower(Protocol):
    """What the operations ask of the recovery that runs them (:class:`~.follow.Follower`)."""

    def _check_deferred(self, gen: int, chunks: set[int] | None = None) -> None: ...
    def _check_deferred_grads(self, gen: int, repairs: tuple[Repair, ...]) -> None: ...
    def _forget_grad_parity(self, *, gather: bool = False) -> None: ...
    def _settle(self, target: int) -> tuple[int, int]: ...
    def _who(self, member: int) -> str: ...


class RepairHost(Protocol):
    """What the operations read of their rank's session."""

    @property
    def rank(self) -> int: ...
    @property
    def W(self) -> int: ...
    @property
    def node(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def nproc(self) -> int: ...
    @property
    def nnodes(self) -> int: ...
    @property
    def replica(self) -> bool: ...
    @property
    def ch(self) -> AgentChannel: ...
    @property
    def layout(self) -> RetainedLayout: ...
    @property
    def parity(self) -> list[ParityBlock]: ...
    @property
    def gparity(self) -> ParityBlock | None: ...
    @property
    def stats(self) -> dict[str, int]: ...
    @property
    def groups(self) -> ProcessGroups: ...
    @property
    def ps(self) -> RankState: ...
    @property
    def snapshots(self) -> Tier2Snapshots: ...
    @property
    def checkpoints(self) -> Checkpoints: ...


def ops_for(
    follower: RepairFollower, session: RepairHost, msg: M.Reconcile, *, early: bool
) -> ParityOps:
    """The operations of ``session``'s rank for ``msg``'s plan, run by ``follower``.
    ``early``: the plan writes no chunk, so forgetting the gradient parity gathers the
    node's checksums."""
    return (ReplicaOps if session.replica else ParityOps)(follower, session, msg, early)


class ParityOps:
    """Tier 1 as parity: a lost chunk (or gradient block) decoded from the node's parity
    and the other members' bytes (:func:`leto.retained.recovery.decode_chunk`)."""

    copies_from_settled = False

    def __init__(
        self, follower: RepairFollower, session: RepairHost, msg: M.Reconcile, early: bool
    ) -> None:
        self.follower, self.session, self.msg, self.early = follower, session, msg, early

    def ranks(self) -> Sequence[int]:
        return (self.session.rank,)

    def repairs(self, plan: Plan) -> Sequence[Repair]:
        """The repairs of this node's ranks, chunk by chunk (each run expanded by the
        core: :meth:`leto.core.reconcile.Repair.expand`), in the plan's order."""
        session = self.session
        return expand_repairs(x for x in plan.repairs if x.rank // session.nproc == session.node)

    def check_sources(self, repairs: Sequence[Repair]) -> None:
        gen = self.msg.gen
        self.follower._check_deferred(gen, {x.chunk for x in repairs if x.what is RepairKind.TIER1})
        self.follower._check_deferred_grads(gen, tuple(repairs))

    def restore_snapshot(self, target: int) -> int:
        assert self.msg.snapshot is not None
        restore_snapshot(self.session, target, self.msg.snapshot)
        self.session.stats["snapshot_restores"] += 1
        return self.session.layout.n_chunks

    def restore_checkpoint(self, target: int) -> int:
        """The latest durable checkpoint (``target``), checked bitwise (:mod:`.checkpoints`)."""
        try:
            self.session.checkpoints.restore(target)
        except CheckpointError as e:
            raise IntegrityError(str(e)) from None
        self.session.stats["checkpoint_restores"] += 1
        return self.session.layout.n_chunks

    def rebuild_chunks(self, repairs: Sequence[Repair], target: int) -> int:
        """Each chunk at its repair's version from the node's parity (every member runs
        :func:`leto.retained.recovery.decode_chunk`)."""
        session = self.session
        for x in repairs:
            block = session.parity[x.chunk]
            mi = x.rank - session.node * session.nproc
            rx.decode_chunk(
                session.groups.parity(session.groups.node_group),
                session.layout,
                x.chunk,
                lost=mi,
                version=x.version,
                versions=block.versions(),
                checksum=block.checksums()[mi],
                parity=block.parity() if session.local_rank == 0 else None,
                who=f"rank {x.rank}",
            )
        return sum(x.rank == session.rank for x in repairs)

    def rebuild_grads(self, repairs: Sequence[Repair]) -> int:
        """Each rank's gradients of its repair's step from the node's gradient parity."""
        session = self.session
        for x in repairs:
            assert session.gparity is not None
            rx.decode_grads(
                session.groups.parity(session.groups.node_group),
                session.layout,
                lost=x.rank - session.node * session.nproc,
                step=x.version,
                versions=session.gparity.versions(),
                parity=session.gparity.parity() if session.local_rank == 0 else None,
                pending=session.ps.node_state()[1] if x.rank == session.rank else None,
                who=f"rank {x.rank}",
            )
        return sum(x.rank == session.rank for x in repairs)

    def forget_grad_parity(self) -> None:
        self.follower._forget_grad_parity(gather=self.early)

    def settle(self, rank: int, target: int) -> Settled:
        assert rank == self.session.rank
        fwd, back = self.follower._settle(target)
        return Settled(fwd, back, False)

    def finish(self) -> None:
        pass


class ReplicaOps(ParityOps):
    """Tier 1 as replicas: a lost chunk copied from a member of the node settled at the
    target (:mod:`leto.retained.replicas`), checked against the node's tier-1 record."""

    copies_from_settled = True

    def check_sources(self, repairs: Sequence[Repair]) -> None:
        gen = self.msg.gen
        self.follower._check_deferred_grads(gen, tuple(repairs))
        self.follower._check_deferred(gen, {x.chunk for x in repairs if x.what is RepairKind.TIER1})

    def rebuild_grads(self, repairs: Sequence[Repair]) -> int:
        if not repairs:
            return 0
        session = self.session
        ex = session.groups.parity(session.groups.node_group)
        base = session.node * session.nproc
        n = 0
        for x in repairs:
            copied = rpl.copy_grads(
                ex,
                session.layout,
                x.rank - base,
                x.version,
                pending=grad_record(self.session, set(self.msg.diverged)),
                who=self.follower._who,
            )
            n += int(copied and x.rank == session.rank)
        return n

    def rebuild_chunks(self, repairs: Sequence[Repair], target: int) -> int:
        """Every lost chunk copied from a member that lost none, if there is one, then the
        gradients a member whose chunks are still behind lacks."""
        session = self.session
        ex = session.groups.parity(session.groups.node_group)
        base = session.node * session.nproc
        chunks = [(x.rank - base, x.chunk, x.version) for x in repairs]
        lost = {x.rank for x in repairs}
        diverged = session.rank in self.msg.diverged
        n = rpl.copy_chunks(
            ex,
            session.layout,
            chunks,
            target=target,
            # a diverged rank's record is of the bytes discarded: no check
            record=lambda c: (
                (NONE, 0)
                if diverged
                else (
                    session.parity[c].versions()[session.local_rank],
                    session.parity[c].checksums()[session.local_rank],
                )
            ),
            who=self.follower._who,
        )
        rpl.copy_grads_behind(
            ex,
            session.layout,
            target,
            lost_any=session.rank in lost,
            pending=grad_record(self.session, set(self.msg.diverged)),
            who=self.follower._who,
        )
        return n

    def finish(self) -> None:
        if self.msg.diverged:
            adopt_replicated(self.session, set(self.msg.diverged))


def grad_record(session: RepairHost, diverged: set[int]) -> Callable[[int], dict[str, Any] | None]:
    """The prepare record a copy of gradients from node member ``m`` is checked against:
    this rank's own, or, where it diverged (its record is of the discarded gradients),
    the source'session."""
    if session.rank not in diverged:
        return lambda _m: session.ps.node_state()[1]
    base = session.node * session.nproc
    return lambda m: session.ps.node_state(of=base + m)[1]


def adopt_replicated(session: RepairHost, diverged: set[int]) -> None:
    """Ranks of this node discarded because they diverged (``diverged``; settled at
    the target with their own process state) take what replicas hold alike besides
    the chunks they were copied (:meth:`.RankState.replicated`: the optimizer's
    scalars and hyper-parameters, the scheduler) from the node's lowest rank that was
    not discarded, a member of the majority, settled at the target too. Every
    member of the node calls it (one broadcast per such rank)."""
    base = session.node * session.nproc
    node = range(base, base + session.nproc)
    if not diverged & set(node):
        return
    src = next(r for r in node if r not in diverged)
    box = [session.ps.replicated() if session.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=session.groups.node_group)
    if session.rank in diverged:
        state = box[0]
        assert state is not None  # the source's, broadcast
        session.ps.adopt(state)


def restore_snapshot(session: RepairHost, step: int, snap: dict[str, Any]) -> None:
    """This rank's chunks and process state from the tier-2 snapshot of ``step``: its own
    block where its node kept it, else decoded across the nodes."""
    meta = snap["meta"][str(session.rank)]
    if int(snap["step"]) != step or meta is None or int(meta["step"]) != step:
        raise IntegrityError(f"rank {session.rank}: no tier-2 snapshot record of step {step}")
    reply, _ = session.ch.request(M.SnapshotSlot(step=-1))
    have = reply.get("active") is not None and reply.get("active_step") == step
    flags = torch.zeros(session.W, dtype=torch.int64)
    flags[session.rank] = 1 if have else 0
    dist.all_reduce(flags)
    missing_nodes = sorted({q // session.nproc for q in range(session.W) if not flags[q]})
    m = session.snapshots.t2_parity
    if len(missing_nodes) > m:
        raise IntegrityError(
            f"tier-2 snapshots of nodes {missing_nodes} are gone: beyond tier 2 "
            f"({m} parit{'y' if m == 1 else 'ies'})"
        )
    nb, share = session.snapshots.layout()
    lay = session.layout
    if have:
        seg = session.snapshots.segment(int(reply["active"]))
        data = seg[session.local_rank * nb : (session.local_rank + 1) * nb].clone()
        base = session.nproc * nb
        sh = seg[base + session.local_rank * share : base + (session.local_rank + 1) * share]
    else:
        data = torch.zeros(nb, dtype=torch.uint8)
        sh = None
    if missing_nodes:
        coll = session.groups.parity(session.groups.cross_group)
        if session.snapshots.alike and sh is not None:  # not stored: every rank's bytes alike
            sh = encode_rotated_alike(data, session.nnodes, session.node)
        if m == 1:
            decode_rotated(coll, data, missing_nodes[0], sh)
        else:  # a lost node's own shares are not kept: the snapshot is retaken
            shares = sh if sh is not None else torch.zeros(share, dtype=torch.uint8)
            rs.decode_striped(coll, data, m, missing_nodes, shares)
    rx.free_undo(session.layout)
    rx.unpack_into(lay, data)
    rx.seal_checked(lay, step, meta["checksums"], "tier-2 snapshot", f"rank {session.rank}")
    lay.clear_prepared()
    session.ps.load(meta["ps"])


def take_process_state(session: RepairHost, step: int, *, load: bool = True) -> dict[str, Any]:
    """An in-place change of the world: every rank takes rank 0's process state at
    ``step`` (its RNG, data position, optimizer scalars, scheduler), over the new world's
    group, as a job resumed in a world of another size takes rank 0's from the checkpoint
    (:meth:`.Checkpoints.resume`), so that the run goes on as that one does; rank 0's
    head (``step``, its chunks' checksums, its process state), for a copy of its chunks
    (``load`` false: a rank whose chunks the copy brings takes the state after them)."""
    lay = session.layout
    head: list[Any] = [None]
    if session.rank == 0:
        sums = [lay.stored_checksum(c) for c in range(lay.n_chunks)]
        head = [{"step": step, "checksums": sums, "ps": session.ps.to_json(step)}]
    dist.broadcast_object_list(head, src=0)
    meta: dict[str, Any] = head[0]
    if int(meta["step"]) != step:
        raise IntegrityError(
            f"rank {session.rank}: rank 0's state is at {meta['step']}, not {step}"
        )
    if load and session.rank != 0:
        session.ps.load(meta["ps"])
    return meta


def copy_replica(session: RepairHost, step: int, joins: bool) -> None:
    """A grow in place: rank 0's retained state at ``step`` (its bytes, checksums and
    process state: a live data-parallel replica) copied into the ranks that ``joins``
    (a new node's, their memory fresh), over the new world's group; every rank takes
    part (two broadcasts) and takes rank 0's process state (:func:`take_process_state`),
    the others keep their own chunks."""
    lay = session.layout
    meta = take_process_state(session, step, load=not joins)
    if session.rank == 0:
        data = rx.packed(lay)
    else:
        nbytes = sum(b.numel() * b.element_size() for b in lay.data_buffers())
        data = torch.empty(nbytes, dtype=torch.uint8)
    dist.broadcast(data, src=0)
    if not joins:
        return
    rx.free_undo(lay)
    rx.unpack_into(lay, data)
    rx.seal_checked(lay, step, meta["checksums"], "replica of rank 0", f"rank {session.rank}")
    lay.clear_prepared()
    session.ps.load(meta["ps"])
