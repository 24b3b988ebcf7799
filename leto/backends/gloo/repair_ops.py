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
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from leto.core.chunk import NONE
from leto.core.reconcile import Plan, Repair, RepairKind, expand_repairs
from leto.retained import recovery as rx
from leto.retained import replicas as rpl
from leto.retained import rs
from leto.retained.checkpoint import CheckpointError
from leto.retained.parity import TorchDistCollective, decode_rotated, encode_rotated_alike
from leto.retained.recovery import IntegrityError, Settled

from . import messages as M

if TYPE_CHECKING:
    from .follow import Follower

__all__ = ["ParityOps", "ReplicaOps", "ops_for"]


def ops_for(f: Follower, msg: M.Reconcile, *, early: bool) -> ParityOps:
    """The operations of ``f``'s rank for ``msg``'s plan. ``early``: the plan writes no
    chunk, so forgetting the gradient parity gathers the node's checksums."""
    return (ReplicaOps if f.s.replica else ParityOps)(f, msg, early)


class ParityOps:
    """Tier 1 as parity: a lost chunk (or gradient block) decoded from the node's parity
    and the other members' bytes (:func:`leto.retained.recovery.decode_chunk`)."""

    copies_from_settled = False

    def __init__(self, f: Follower, msg: M.Reconcile, early: bool) -> None:
        self.f, self.s, self.msg, self.early = f, f.s, msg, early

    def ranks(self) -> Sequence[int]:
        return (self.s.rank,)

    def repairs(self, plan: Plan) -> Sequence[Repair]:
        """The repairs of this node's ranks, chunk by chunk (each run expanded by the
        core: :meth:`leto.core.reconcile.Repair.expand`), in the plan's order."""
        s = self.s
        return expand_repairs(x for x in plan.repairs if x.rank // s.nproc == s.node)

    def check_sources(self, repairs: Sequence[Repair]) -> None:
        gen = self.msg.gen
        self.f._check_deferred(gen, {x.chunk for x in repairs if x.what is RepairKind.TIER1})
        self.f._check_deferred_grads(gen, tuple(repairs))

    def restore_snapshot(self, target: int) -> int:
        assert self.msg.snapshot is not None
        restore_snapshot(self.f, target, self.msg.snapshot)
        self.s.stats["snapshot_restores"] += 1
        return self.s.layout.n_chunks

    def restore_checkpoint(self, target: int) -> int:
        """The latest durable checkpoint (``target``), checked bitwise (:mod:`.checkpoints`)."""
        try:
            self.s.checkpoints.restore(target)
        except CheckpointError as e:
            raise IntegrityError(str(e)) from None
        self.s.stats["checkpoint_restores"] += 1
        return self.s.layout.n_chunks

    def rebuild_chunks(self, repairs: Sequence[Repair], target: int) -> int:
        """Each chunk at its repair's version from the node's parity (every member runs
        :func:`leto.retained.recovery.decode_chunk`)."""
        s = self.s
        for x in repairs:
            block = s.parity[x.chunk]
            mi = x.rank - s.node * s.nproc
            rx.decode_chunk(
                TorchDistCollective(s.groups.node_group),
                s.layout,
                x.chunk,
                lost=mi,
                version=x.version,
                versions=block.versions(),
                checksum=block.checksums()[mi],
                parity=block.parity() if s.lr == 0 else None,
                who=f"rank {x.rank}",
            )
        return sum(x.rank == s.rank for x in repairs)

    def rebuild_grads(self, repairs: Sequence[Repair]) -> int:
        """Each rank's gradients of its repair's step from the node's gradient parity."""
        s = self.s
        for x in repairs:
            assert s.gparity is not None
            rx.decode_grads(
                TorchDistCollective(s.groups.node_group),
                s.layout,
                lost=x.rank - s.node * s.nproc,
                step=x.version,
                versions=s.gparity.versions(),
                parity=s.gparity.parity() if s.lr == 0 else None,
                pending=s.ps.node_state()[1] if x.rank == s.rank else None,
                who=f"rank {x.rank}",
            )
        return sum(x.rank == s.rank for x in repairs)

    def forget_grad_parity(self) -> None:
        self.f._forget_grad_parity(gather=self.early)

    def settle(self, rank: int, target: int) -> Settled:
        assert rank == self.s.rank
        fwd, back = self.f._settle(target)
        return Settled(fwd, back, False)

    def finish(self) -> None:
        pass


class ReplicaOps(ParityOps):
    """Tier 1 as replicas: a lost chunk copied from a member of the node settled at the
    target (:mod:`leto.retained.replicas`), checked against the node's tier-1 record."""

    copies_from_settled = True

    def check_sources(self, repairs: Sequence[Repair]) -> None:
        gen = self.msg.gen
        self.f._check_deferred_grads(gen, tuple(repairs))
        self.f._check_deferred(gen, {x.chunk for x in repairs if x.what is RepairKind.TIER1})

    def rebuild_grads(self, repairs: Sequence[Repair]) -> int:
        if not repairs:
            return 0
        s = self.s
        ex = TorchDistCollective(s.groups.node_group)
        base = s.node * s.nproc
        n = 0
        for x in repairs:
            copied = rpl.copy_grads(
                ex,
                s.layout,
                x.rank - base,
                x.version,
                pending=grad_record(self.f, set(self.msg.diverged)),
                who=self.f._who,
            )
            n += int(copied and x.rank == s.rank)
        return n

    def rebuild_chunks(self, repairs: Sequence[Repair], target: int) -> int:
        """Every lost chunk copied from a member that lost none, if there is one, then the
        gradients a member whose chunks are still behind lacks."""
        s = self.s
        ex = TorchDistCollective(s.groups.node_group)
        base = s.node * s.nproc
        chunks = [(x.rank - base, x.chunk, x.version) for x in repairs]
        lost = {x.rank for x in repairs}
        diverged = s.rank in self.msg.diverged
        n = rpl.copy_chunks(
            ex,
            s.layout,
            chunks,
            target=target,
            # a diverged rank's record is of the bytes discarded: no check
            record=lambda c: (
                (NONE, 0)
                if diverged
                else (s.parity[c].versions()[s.lr], s.parity[c].checksums()[s.lr])
            ),
            who=self.f._who,
        )
        rpl.copy_grads_behind(
            ex,
            s.layout,
            target,
            lost_any=s.rank in lost,
            pending=grad_record(self.f, set(self.msg.diverged)),
            who=self.f._who,
        )
        return n

    def finish(self) -> None:
        if self.msg.diverged:
            adopt_replicated(self.f, set(self.msg.diverged))


def grad_record(f: Follower, diverged: set[int]) -> Callable[[int], dict[str, Any] | None]:
    """The prepare record a copy of gradients from node member ``m`` is checked against:
    this rank's own, or, where it diverged (its record is of the discarded gradients),
    the source's."""
    s = f.s
    if s.rank not in diverged:
        return lambda _m: s.ps.node_state()[1]
    base = s.node * s.nproc
    return lambda m: s.ps.node_state(of=base + m)[1]


def adopt_replicated(f: Follower, diverged: set[int]) -> None:
    """Ranks of this node discarded because they diverged (``diverged``; settled at
    the target with their own process state) take what replicas hold alike besides
    the chunks they were copied (:meth:`.RankState.replicated`: the optimizer's
    scalars and hyper-parameters, the scheduler) from the node's lowest rank that was
    not discarded, a member of the majority, settled at the target too. Every
    member of the node calls it (one broadcast per such rank)."""
    s = f.s
    base = s.node * s.nproc
    node = range(base, base + s.nproc)
    if not diverged & set(node):
        return
    src = next(r for r in node if r not in diverged)
    box = [s.ps.replicated() if s.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=s.groups.node_group)
    if s.rank in diverged:
        s.ps.adopt(box[0])


def restore_snapshot(f: Follower, step: int, snap: dict[str, Any]) -> None:
    """This rank's chunks and process state from the tier-2 snapshot of ``step``: its own
    block where its node kept it, else decoded across the nodes."""
    s = f.s
    meta = snap["meta"][str(s.rank)]
    if int(snap["step"]) != step or meta is None or int(meta["step"]) != step:
        raise IntegrityError(f"rank {s.rank}: no tier-2 snapshot record of step {step}")
    reply, _ = s.ch.request(M.SnapshotSlot(step=-1))
    have = reply.get("active") is not None and reply.get("active_step") == step
    flags = torch.zeros(s.W, dtype=torch.int64)
    flags[s.rank] = 1 if have else 0
    dist.all_reduce(flags)
    missing_nodes = sorted({q // s.nproc for q in range(s.W) if not flags[q]})
    m = s.snapshots.t2_parity
    if len(missing_nodes) > m:
        raise IntegrityError(
            f"tier-2 snapshots of nodes {missing_nodes} are gone: beyond tier 2 "
            f"({m} parit{'y' if m == 1 else 'ies'})"
        )
    nb, share = s.snapshots.layout()
    lay = s.layout
    if have:
        seg = s.snapshots.segment(int(reply["active"]))
        data = seg[s.lr * nb : (s.lr + 1) * nb].clone()
        base = s.nproc * nb
        sh = seg[base + s.lr * share : base + (s.lr + 1) * share]
    else:
        data = torch.zeros(nb, dtype=torch.uint8)
        sh = None
    if missing_nodes:
        coll = TorchDistCollective(s.groups.cross_group)
        if s.snapshots.alike and sh is not None:  # not stored: every rank's bytes alike
            sh = encode_rotated_alike(data, s.nnodes, s.node)
        if m == 1:
            decode_rotated(coll, data, missing_nodes[0], sh)
        else:  # a lost node's own shares are not kept: the snapshot is retaken
            shares = sh if sh is not None else torch.zeros(share, dtype=torch.uint8)
            rs.decode_striped(coll, data, m, missing_nodes, shares)
    rx.free_undo(s.layout)
    rx.unpack_into(lay, data)
    rx.seal_checked(lay, step, meta["checksums"], "tier-2 snapshot", f"rank {s.rank}")
    lay.clear_prepared()
    s.ps.load(meta["ps"])
