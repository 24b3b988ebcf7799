"""Whether data-parallel replicas agree: the rule the coordinator applies to the
digests its ranks send with a step's FINISH (docs/loop.md, "Replicas agree").

Ranks that must hold the same bytes (every rank of an unsharded data-parallel job)
each send one digest of their retained state after a step; the digests either all
agree, or the ranks split into groups of equal digests. A split is an integrity
failure that no chunk checksum sees (every replica's bytes are sealed and intact, they
are only different): the job must not go on as it is, and never ends as if it had
succeeded.

Where the agreeing ranks are a majority, :func:`repair_plan` says how the minority is
repaired in place: each of its ranks' retained memory is discarded (the protocol's
``LoseMemory``, so the core's recovery rebuilds it like any lost memory) and copied from
a member of the majority on its own node (tier 1 as replicas), whose optimizer and
scheduler state it adopts too. Where that cannot be (no majority, tier 1 as parity, a
minority rank alone with other minority ranks on its node, a rank that diverges a
second time), the plan is the reason, and the job stops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

__all__ = ["Disagreement", "ReplicaRepair", "disagreement", "repair_plan"]


@attrs.frozen
class Disagreement:
    """Replicas that hold different state after ``step``: ``groups`` of ranks with equal
    digests, largest first (ties by lowest rank); ``majority`` is the first group when
    it holds more than half of the ranks, else None."""

    step: int
    groups: tuple[tuple[int, ...], ...]

    @property
    def majority(self) -> tuple[int, ...] | None:
        n = sum(len(g) for g in self.groups)
        return self.groups[0] if 2 * len(self.groups[0]) > n else None

    @property
    def minority(self) -> tuple[int, ...]:
        """The ranks outside the majority (every rank, where there is none)."""
        first = 1 if self.majority is not None else 0
        return tuple(sorted(r for g in self.groups[first:] for r in g))

    def line(self, why_not_repaired: str | None = None) -> str:
        """One line naming the ranks and the step (and, given, why no repair)."""
        parts = " / ".join("ranks " + ", ".join(map(str, g)) for g in self.groups)
        if self.majority is not None:
            odd = sorted(r for g in self.groups[1:] for r in g)
            many = len(odd) > 1
            who = (
                f"rank{'s' if many else ''} {', '.join(map(str, odd))} "
                f"differ{'' if many else 's'} from the others"
            )
        else:
            who = "no majority"
        return (
            f"the data-parallel replicas disagree after step {self.step} ({who}: {parts} "
            "hold different retained state): a rank's state diverged without failing a "
            "checksum (a nondeterministic or rank-dependent change to the model, the "
            "optimizer or the scheduler)"
            + (f"; not repaired in place: {why_not_repaired}" if why_not_repaired else "")
        )


def disagreement(step: int, digests: Mapping[int, str]) -> Disagreement | None:
    """None if every rank's digest is the same, else the groups of equal digests."""
    by: dict[str, list[int]] = {}
    for r in sorted(digests):
        by.setdefault(digests[r], []).append(r)
    if len(by) <= 1:
        return None
    groups = sorted((tuple(g) for g in by.values()), key=lambda g: (-len(g), g[0]))
    return Disagreement(step, tuple(groups))


@attrs.frozen
class ReplicaRepair:
    """The in-place repair of a split with a majority: every ``(rank, source)`` of
    ``sources``: ``rank``'s retained memory is discarded (``LoseMemory``) and copied from
    ``source``, a member of the majority on ``rank``'s node."""

    step: int
    sources: tuple[tuple[int, int], ...]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for r, _ in self.sources)


def repair_plan(
    split: Disagreement,
    node_of: Sequence[int],
    *,
    tier1_replicas: bool,
    repaired: Mapping[int, int],
) -> ReplicaRepair | str:
    """How ``split`` is repaired in place, or why it cannot be (one clause).

    ``node_of[r]``: the node of rank ``r``; ``tier1_replicas``: tier 1 keeps the node's
    ranks as replicas of each other (a lost rank is copied from one of them; with parity
    the parity encodes the diverged bytes, so a rebuild gives them back); ``repaired``:
    rank -> the step of its repair, for the ranks repaired before in this job (a rank
    that diverges again is its program's or its hardware's doing: a repair would only
    repeat).
    """
    majority = split.majority
    if majority is None:
        return "no majority agrees"
    if not tier1_replicas:
        return (
            "tier 1 keeps parity, which encodes the diverged bytes (a copy from the "
            "majority needs tier 1 as replicas)"
        )
    again = sorted(r for r in split.minority if r in repaired)
    if again:
        r = again[0]
        return (
            f"rank {r} diverged again after its repair at step {repaired[r]} (a rank "
            "that keeps diverging is its program's or its hardware's doing)"
        )
    sources = []
    for r in split.minority:
        peers = [m for m in majority if node_of[m] == node_of[r]]
        if not peers:
            return f"rank {r}'s node {node_of[r]} holds no rank of the majority to copy from"
        sources.append((r, peers[0]))
    return ReplicaRepair(split.step, tuple(sources))
