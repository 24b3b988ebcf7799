"""Sharded state (``shard = true``) moved to a world of another size: a new rank's
shard of one flat buffer (the parameters, or one optimizer state) from the old ranks'
shards, by the core's rule (:func:`leto.core.reshape.shard_slices`).

Groundwork for shrinking a sharded job in place (docs/gloo.md, "Sharded state"): the
caller supplies every old rank's shard, verified against its chunks' checksums (the
survivors' own, the lost ranks' decoded from tier 2), all at one step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from leto.core.reshape import shard_slices
from leto.retained.layout import LayoutError
from leto.retained.shard import ShardPlan

__all__ = ["reshard"]


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
