"""What a rank of a shrunk (or grown back) data-parallel world computes of a global batch.

Theory of operation: a job's global batch is cut into ``full`` parts, one per rank of the
world the job started with (part ``p`` is ``batch[p::full]``, leto's ``shard``). The
sampler's position never depends on the world, so after a grow-back every part is the
one the failure-free job would see. When the world has ``world < full`` ranks, the
user's ``keep_global_batch`` setting chooses:

* ``False`` (the default, *keep the per-rank batch*): rank ``r`` computes part ``r``
  alone; parts ``world..full-1`` of each global batch are skipped, so a step of a
  shrunk world trains on ``world/full`` of the global batch, at the same cost per rank;
* ``True`` (*keep the global batch*): rank ``r`` computes parts ``r, r + world, ...``
  (below ``full``), one after the other, accumulating their gradients: every part of
  every global batch is trained on, and a rank's step costs up to ``ceil(full/world)``
  micro-batches.

Either way the gradients are summed over the world and divided by :attr:`Plan.divisor`
(the number of parts the step trained on), so a step's update is the mean over the
parts it saw. A world larger than ``full`` (grown past the start, up to MAX) cuts the
global batch into ``world`` parts instead. Bitwise reproducibility: the parts, their
order and the divisor depend only on ``(rank, world, full, keep_global_batch)``, so a
failure-free job told the same world-size schedule (``leto.core.world.schedule_at``)
computes the same bytes. Pure: no torch, no IO.
"""

from __future__ import annotations

import attrs

__all__ = ["Plan", "plan"]


@attrs.frozen
class Plan:
    """Rank ``rank``'s parts of a global batch cut into ``parts`` parts (accumulated in
    this order), and the divisor of the world's summed gradients."""

    parts: tuple[int, ...]
    cut: int  # the global batch is cut into this many parts: part p is batch[p::cut]
    divisor: int


def plan(rank: int, world: int, full: int, keep_global_batch: bool) -> Plan:
    """What rank ``rank`` of a world of ``world`` ranks computes, for a job whose global
    batch is cut into ``full`` parts (the config's ``batch_parts``; 0: as many as the
    world has ranks, whatever it is)."""
    if not (type(rank) is int and type(world) is int and type(full) is int):
        raise TypeError(f"rank, world and full are ints, got {rank!r}, {world!r}, {full!r}")
    if not 0 <= rank < world or full < 0:
        raise ValueError(
            f"rank {rank} of a world of {world} with {full} parts: need 0 <= rank < world, full >= 0"
        )
    full = full or world
    cut = max(world, full)
    if not keep_global_batch or world >= full:
        return Plan(parts=(rank,), cut=cut, divisor=world)
    return Plan(parts=tuple(range(rank, full, world)), cut=cut, divisor=full)
