"""Whether data-parallel replicas agree: the rule the coordinator applies to the
digests its ranks send with a step's FINISH (docs/loop.md, "Replicas agree").

Ranks that must hold the same bytes (every rank of an unsharded data-parallel job)
each send one digest of their retained state after a step; the digests either all
agree, or the ranks split into groups of equal digests. A split is an integrity
failure that no chunk checksum sees (every replica's bytes are sealed and intact, they
are only different): the job must not go on, and never ends as if it had succeeded.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

__all__ = ["Disagreement", "disagreement"]


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

    def line(self) -> str:
        """One line naming the ranks and the step."""
        parts = " / ".join("ranks " + ", ".join(map(str, g)) for g in self.groups)
        if self.majority is not None:
            odd = sorted(r for g in self.groups[1:] for r in g)
            who = f"rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} differ from the others"
        else:
            who = "no majority"
        return (
            f"the data-parallel replicas disagree after step {self.step} ({who}: {parts} "
            "hold different retained state): a rank's state diverged without failing a "
            "checksum (a nondeterministic or rank-dependent change to the model, the "
            "optimizer or the scheduler)"
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
