"""A world change carried out in place (``spec/Elastic.tla``'s Shrink, InPlace): the
protocol model of the new world, taken over from the old one's, with no step lost.

Theory of operation: when :func:`leto.core.world.decide` shrinks the world, the
surviving ranks keep their processes and their retained state; each rolls to the
committed step (forward with its sealed gradients where the commit was recorded, back
with its undo copies where it was not: the settle of any recovery), the old ranks are
renumbered densely in their order (:func:`survivors`), and the new world starts at the
committed step, in the generation the recovery fenced the keepers at, with tier 2
re-encoded over the surviving nodes there. The disk checkpoint the model falls back to
is the old world's: nothing was written to disk for the change.

Sharded state (``shard = true``) is one flat element space cut into equal shards, one
a rank (:mod:`leto.retained.shard`); in a world of another size each new rank's shard
is a run of slices of the old ranks' shards (:func:`shard_slices`), the same for the
parameters, the gradients and every optimizer state.

Pure: no IO, no clock.
"""

from __future__ import annotations

import attrs

from leto.core.cluster import ClusterModel
from leto.core.state import ClusterState

__all__ = ["Slice", "in_place", "renumbered", "renumbered_rank", "shard_slices", "survivors"]


@attrs.frozen
class Slice:
    """Elements ``[start, stop)`` of old rank ``old``'s shard go to offset ``at`` of the
    new rank's shard."""

    old: int
    start: int
    stop: int
    at: int


def survivors(nodes: int, per_node: int, lost: frozenset[int]) -> tuple[int, ...]:
    """The old ranks kept, in the new world's rank order: the nodes not in ``lost`` keep
    their order and their ranks are renumbered densely (new rank ``i`` is old rank
    ``survivors(...)[i]``)."""
    if nodes < 1 or per_node < 1:
        raise ValueError(f"a world of {nodes} node(s) x {per_node} rank(s) has no ranks")
    if not lost <= set(range(nodes)):
        raise ValueError(f"lost nodes {sorted(lost)} are not all among nodes 0..{nodes - 1}")
    if len(lost) == nodes:
        raise ValueError("every node is lost: no world is left to go on with")
    return tuple(n * per_node + r for n in range(nodes) if n not in lost for r in range(per_node))


def renumbered(node: int, lost: frozenset[int]) -> int:
    """The index in the new world of the old world's surviving node ``node``: the nodes
    after a lost one move down by one for each lost node below them (node ``n`` becomes
    ``n - |{l in lost: l < n}|``), as :func:`survivors` orders their ranks."""
    if node < 0 or node in lost:
        raise ValueError(f"node {node} is not a surviving node (lost: {sorted(lost)})")
    return node - sum(1 for n in lost if n < node)


def renumbered_rank(rank: int, per_node: int, lost: frozenset[int]) -> int:
    """The new world's number of the old world's surviving ``rank`` (``per_node`` ranks a
    node): its node renumbered (:func:`renumbered`), its local rank kept; the inverse of
    :func:`survivors`."""
    if rank < 0 or per_node < 1:
        raise ValueError(f"rank {rank} of {per_node} rank(s) a node is not a rank")
    return renumbered(rank // per_node, lost) * per_node + rank % per_node


def shard_slices(
    used: int, old: tuple[int, int], new: tuple[int, int], rank: int
) -> tuple[Slice, ...]:
    """Where new rank ``rank``'s shard comes from when sharded state of ``used`` real
    elements (the rest of the flat space is padding, zeros) moves from ``old`` = (world,
    elements a shard) to ``new`` = (world, elements a shard): the old ranks' slices, in
    order, that cover the new shard's part of ``[0, used)`` (its padding comes from no
    one). Rank ``r`` of a world of shards of ``S`` elements holds ``[r*S, (r+1)*S)``."""
    (ow, os_), (nw, ns) = old, new
    if min(ow, os_, nw, ns) < 1:
        raise ValueError(f"a shard layout needs positive worlds and shards: old {old}, new {new}")
    if not 0 <= used <= min(ow * os_, nw * ns):
        raise ValueError(
            f"{used} elements do not fit both the old layout ({ow} x {os_}) and the new ({nw} x {ns})"
        )
    if not 0 <= rank < nw:
        raise ValueError(f"rank {rank} is not a rank of the new world of {nw}")
    lo, hi = rank * ns, min((rank + 1) * ns, used)
    out = []
    for q in range(lo // os_, -(-hi // os_) if hi > lo else 0):
        a, b = max(lo, q * os_), min(hi, (q + 1) * os_)
        out.append(Slice(q, a - q * os_, b - q * os_, a - lo))
    return tuple(out)


def in_place(model: ClusterModel, step: int, gen: int, ckpt: int) -> ClusterState:
    """The new world's state (``model``: its topology) after an in-place change of the
    world at the committed ``step``: every member idle there, in generation ``gen`` (the
    one the keepers were fenced at for the change), its tier-2 snapshot re-encoded there,
    and the old world's disk checkpoint of step ``ckpt`` the fallback (the change makes
    no step durable on disk)."""
    if not 0 <= ckpt <= step:
        raise ValueError(f"the checkpoint of step {ckpt} is not in 0..{step}")
    s = model.initial(step)
    return attrs.evolve(s, gen=gen, tgen=(gen,) * model.config.ranks, ckpt=ckpt)
