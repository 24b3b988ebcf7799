"""Sharded state (``shard = true``) resharded in place when the world shrinks
(docs/gloo.md, "Sharded state"): a new rank's shard of one flat buffer (the parameters,
or one optimizer state) from the old ranks' shards by the core's rule
(:func:`leto.core.reshape.shard_slices`, :func:`reshard`); the old shards read from the
tier-2 snapshot in the old world (:func:`old_shards`: this rank's own bytes and, with
two nodes, its lost partner's, which its share of the code is), gathered, checked
against their chunks' checksums and cut into the new shard in the new world
(:func:`reshard_in_place`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from leto.core.reshape import shard_slices
from leto.retained import recovery as rx
from leto.retained.layout import LayoutError, RetainedLayout
from leto.retained.optim import RetainedOptimizer, bind_layout
from leto.retained.recovery import IntegrityError
from leto.retained.shard import FullParams, ShardPlan

from . import messages as M
from .channel import AgentChannel
from .rank_memory import RankMemory
from .rank_state import RankState
from .snapshots import Tier2Snapshots

__all__ = ["ReshardHost", "old_shards", "reshard", "reshard_in_place"]


def reshard(
    shards: Sequence[torch.Tensor], old: ShardPlan, new: ShardPlan, rank: int
) -> torch.Tensor:
    """New rank ``rank``'s shard under plan ``new`` of the flat buffer whose old ranks'
    shards under plan ``old`` are ``shards`` (one a rank, in rank order): its part of the
    parameters' elements copied from them, its padding zeros."""
    same = (old.names, old.offsets, old.numels, old.dtype)
    if same != (new.names, new.offsets, new.numels, new.dtype):
        raise LayoutError("reshard: the two shard plans are not of the same flat space")
    if len(shards) != old.world:
        raise LayoutError(f"reshard: {len(shards)} shard(s) given for a world of {old.world}")
    bad = [q for q, t in enumerate(shards) if t.dim() != 1 or t.numel() != old.shard_numel]
    if bad:
        raise LayoutError(f"reshard: the shards of ranks {bad} are not {old.shard_numel} elements")
    out = torch.zeros(new.shard_numel, dtype=shards[0].dtype, device=shards[0].device)
    for s in shard_slices(
        old.used, (old.world, old.shard_numel), (new.world, new.shard_numel), rank
    ):
        out[s.at : s.at + s.stop - s.start].copy_(shards[s.old][s.start : s.stop])
    return out


class ReshardHost(Protocol):
    """What :func:`old_shards` and :func:`reshard_in_place` read of their rank's session."""

    @property
    def rank(self) -> int: ...
    @property
    def W(self) -> int: ...
    @property
    def full(self) -> FullParams | None: ...
    @property
    def ropt(self) -> RetainedOptimizer | None: ...

    @property
    def local_rank(self) -> int: ...
    @property
    def nproc(self) -> int: ...
    @property
    def nnodes(self) -> int: ...
    @property
    def node(self) -> int: ...
    @property
    def cfg(self) -> Any: ...
    @property
    def ch(self) -> AgentChannel: ...
    @property
    def layout(self) -> RetainedLayout: ...
    @property
    def model(self) -> nn.Module: ...
    @property
    def user_optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def snapshots(self) -> Tier2Snapshots: ...
    @property
    def memory(self) -> RankMemory: ...
    @property
    def ps(self) -> RankState: ...


def old_shards(session: ReshardHost, snap: dict[str, Any]) -> dict[int, torch.Tensor]:
    """In the old world (before the rank takes its new number): the packed bytes (the
    parameters, then each optimizer state) at the tier-2 snapshot ``snap`` of this rank
    and of its partner on the lost node, by old rank. Two nodes only: each one's share of
    the rotated code is the other's bytes (:func:`~leto.retained.parity.encode_rotated`)."""
    step = int(snap["step"])
    if session.nnodes != 2 or session.snapshots.t2_parity != 1:
        raise IntegrityError(
            f"rank {session.rank}: sharded state reshards in place only from 2 nodes "
            f"(tier2_parity 1), not {session.nnodes}"
        )
    reply, _ = session.ch.request(M.SnapshotSlot(step=-1))
    if reply.get("active") is None or reply.get("active_step") != step:
        raise IntegrityError(
            f"rank {session.rank}: its node holds no tier-2 snapshot of step {step} to reshard from"
        )
    nb, share = session.snapshots.layout()
    seg = session.snapshots.segment(int(reply["active"]))
    me, base = session.local_rank, session.nproc * nb
    partner = (1 - session.node) * session.nproc + me
    return {
        session.rank: seg[me * nb : (me + 1) * nb].clone(),
        partner: seg[base + me * share : base + me * share + nb].clone(),
    }


def _layout_of(plan: ShardPlan, q: int, session: ReshardHost) -> RetainedLayout:
    """Old rank ``q``'s layout of its pieces, in this process's memory (to read and
    check bytes of it)."""
    named = list(session.model.named_parameters())
    lay = session.layout
    return bind_layout(
        plan.piece_params(q, named, values=False),
        tuple(lay.states),
        attach=False,
        alloc=None,
        prefix="old",
        chunk_numel=plan.chunk_numel,
        offsets=plan.local_offsets(q),
        numel=plan.shard_numel,
        checksum_algorithm=getattr(session.cfg, "checksum_algorithm", None),
    )


def reshard_in_place(
    session: ReshardHost, snap: dict[str, Any], mine: dict[int, torch.Tensor]
) -> None:
    """In the new world (its number taken, its groups formed): every old rank's shard at
    the snapshot's step gathered (``mine``: what :func:`old_shards` read here), each
    checked against its chunks' checksums of the snapshot, and this rank's new shard
    (:func:`reshard`) retained afresh (segments ``leto.wW``), sealed at that step; the
    process state old rank 0's of that step, the optimizer's per-piece scalars mapped
    onto the new pieces."""
    step, meta = int(snap["step"]), snap["meta"]
    assert session.full is not None
    old = session.full.plan
    held = sorted(mine)  # two old ranks a new rank: its own and its lost partner
    n = mine[held[0]].numel()
    got = [torch.empty(len(held) * n, dtype=torch.uint8) for _ in range(session.W)]
    dist.all_gather(got, torch.cat([mine[q] for q in held]))
    owners: list[Any] = [None] * session.W  # each new rank's old ranks, in its order
    dist.all_gather_object(owners, held)
    shards: dict[int, RetainedLayout] = {}
    for qs, flat in zip(owners, got, strict=True):
        for k, q in enumerate(qs):
            lay = _layout_of(old, q, session)
            rx.unpack_into(lay, flat[k * n : (k + 1) * n])
            rx.seal_checked(
                lay, step, meta[str(q)]["checksums"], "tier-2 snapshot", f"old rank {q}"
            )
            shards[q] = lay
    if sorted(shards) != list(range(old.world)):
        raise IntegrityError(
            f"resharding: old ranks {sorted(set(range(old.world)) - set(shards))} are missing"
        )
    ps = [json.loads(meta[str(q)]["ps"]) for q in range(old.world)]
    session.memory.prefix = f"leto.w{session.W}"
    session.memory.rebind_shard(attach=False, values=False, groups=True)
    lay, new = session.layout, session.full.plan
    with torch.no_grad():
        for i, buf in enumerate(lay.data_buffers()):
            buf.copy_(
                reshard(
                    [shards[q].data_buffers()[i] for q in range(old.world)], old, new, session.rank
                )
            )
    lay.seal_all(step)
    session.ps.load(json.dumps(_process_state(ps, old, new, session)))


def _process_state(
    ps: list[dict[str, Any]], old: ShardPlan, new: ShardPlan, session: ReshardHost
) -> dict[str, Any]:
    """Old rank 0's process state (every rank takes it, as a job resumed in a world of
    another size does), its optimizer's groups and per-piece state for this rank's new
    pieces: a parameter's scalars (Adam's step) are those of any old piece of it."""
    by_param: dict[int, Any] = {}
    for q, p in enumerate(ps):
        for idx, entry in p["optimizer"]["state"].items():
            pieces = old.pieces[q]
            if int(idx) < len(pieces):
                by_param.setdefault(pieces[int(idx)].param, entry)
    assert session.ropt is not None
    fresh = session.ropt.process_state()
    out = dict(ps[0])
    opt = dict(out["optimizer"])
    opt["param_groups"] = [
        {**g, "params": f["params"]}
        for g, f in zip(opt["param_groups"], fresh["param_groups"], strict=True)
    ]
    opt["state"] = {
        str(j): by_param[pc.param]
        for j, pc in enumerate(new.pieces[session.rank])
        if pc.param in by_param
    }
    out["optimizer"] = opt
    return out
