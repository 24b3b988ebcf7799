"""The step in flight, replayed in parallel: who computes which micro-batch of a lost share.

A death before the vote loses the dead rank's compute of the step in flight (its
forward and backward); the survivors keep theirs (:func:`leto.core.reconcile.keeps_compute`)
and wait at the all-reduce for the replacement to compute the lost share again. When
the step is ``k`` micro-batches whose gradients are accumulated (``g = ((g1 + g2) + g3)
...``, each ``gi`` computed from the same parameters), the micro-batches of the lost
share are independent computations: every rank of the new generation computes some of
them, from the same retained parameters (those of the step the recovery resumed at),
and the owner of the share adds them **in the micro-batch order**, as its own backward
passes would have accumulated them. Floating-point addition is commutative but not
associative, so the order is the whole guarantee: the sum is bitwise the lost rank's
(spec/PROTOCOL.md, "The step in flight, replayed in parallel"; spec/Replay.tla).

What a micro-batch reads besides the parameters is the RNG: the lost rank's stream at
that micro-batch's start, which is lost with it. A replay therefore needs a compute
that draws no random numbers (the backend refuses a step that draws one, with the
setting to turn the replay off named); where the ranks' parameters differ (not
data-parallel replicas) or more than one rank must compute its share afresh, there is
no plan and each rank computes its own share, as before.

Pure: which ranks compute which micro-batch is decided here, for every backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = ["ReplayPlan", "replay_plan"]


def _v_computers(
    inst: ReplayPlan, _a: attrs.Attribute[tuple[int, ...]], v: tuple[int, ...]
) -> None:
    if len(v) != inst.micro_batches:
        raise ValueError(f"{len(v)} computers for {inst.micro_batches} micro-batches")
    if any(not 0 <= r < inst.world for r in v):
        raise ValueError(f"computers {v} outside ranks 0..{inst.world - 1}")


@attrs.frozen
class ReplayPlan:
    """The lost share of ``owner`` (its ``micro_batches`` micro-batches of the step in
    flight): ``computers[i]`` computes micro-batch ``i``; ``owner`` adds them in the
    order ``0, 1, ..., micro_batches - 1``."""

    owner: int = attrs.field()
    world: int = attrs.field()
    micro_batches: int = attrs.field()
    computers: tuple[int, ...] = attrs.field(validator=_v_computers)

    @owner.validator
    def _v_owner(self, _a: attrs.Attribute[int], v: int) -> None:
        if not 0 <= v < self.world:
            raise ValueError(f"owner {v} outside ranks 0..{self.world - 1}")

    def of(self, rank: int) -> tuple[int, ...]:
        """The micro-batches ``rank`` computes, in order."""
        return tuple(i for i, c in enumerate(self.computers) if c == rank)

    @property
    def order(self) -> tuple[int, ...]:
        """The order in which the owner adds the micro-batches' gradients: its own."""
        return tuple(range(self.micro_batches))


def replay_plan(fresh: Sequence[bool], same_params: bool, micro_batches: int) -> ReplayPlan | None:
    """The replay of the step in flight after a recovery, from each rank's word:
    ``fresh[r]``, rank ``r`` computes its share from its start (a promoted rank, or a
    survivor whose compute the recovery did not keep); ``same_params``, every rank holds
    the same parameters. A plan only for exactly one fresh rank, ``micro_batches >= 2``
    and the same parameters everywhere; micro-batch ``i`` goes to rank ``(owner + i) mod
    W``: the owner first (it has nothing else to compute), then the others in turn."""
    W = len(fresh)
    owners = [r for r, f in enumerate(fresh) if f]
    if micro_batches < 2 or W < 2 or len(owners) != 1 or not same_params:
        return None
    owner = owners[0]
    computers = tuple((owner + i) % W for i in range(micro_batches))
    return ReplayPlan(owner=owner, world=W, micro_batches=micro_batches, computers=computers)
