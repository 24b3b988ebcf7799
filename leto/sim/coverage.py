"""Which tier recovers a set of overlapping failures: the core's coverage analysis,
queried at the scale of the simulated cluster.

:func:`leto.core.erasure.coverage` enumerates every pattern of up to two failure
elements (a rank's memory, a node) on a topology, and says which tier recovers it
(0 nothing lost, 1 tier-1 parity, 2 tier-2 rollback, 3 disk checkpoint). Enumerating
131,072 ranks is out of the question, and unnecessary: a pattern's tier depends on
which of its elements share a node, and on the placement's rules, not on node
numbers. So the simulator builds the core's placement on a *small* topology with the
job's ranks per node and just enough nodes (more than ``tier2_parity`` and at least
one per distinct node in a pattern), relabels a pattern's nodes onto it in order of
appearance, and looks it up. Patterns of more than two elements (three overlapping
memory losses: vanishingly rare) are decoded directly by :func:`leto.core.erasure.decode`.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

from leto.core import erasure

# A failure element as the simulator records it: (kind, node, local rank).
RANK, NODE = 0, 1
Element = tuple[int, int, int]


class CoreTiers:
    """Tier lookups for one cluster shape and one leto configuration."""

    def __init__(
        self, nodes: int, ranks_per_node: int, *, tier1: bool, tier2: bool, tier2_parity: int
    ) -> None:
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.tier1 = tier1
        self.tier2 = tier2
        # A job on fewer nodes than the parity asks for keeps its snapshots (they still
        # cover two memory losses inside a node) without cross-node parity.
        self.parity = min(tier2_parity, nodes - 1) if tier2 else 0
        self.small = min(nodes, self.parity + 2)
        self._table = {
            p.failures: p.tier
            for p in erasure.coverage(self._placement(self.small), max_failures=2).patterns
        }

    def _placement(self, nodes: int) -> erasure.Placement:
        topo = erasure.Topology.uniform(nodes, self.ranks_per_node)
        return erasure.place(topo, tier1=self.tier1, tier2=self.tier2, tier2_parity=self.parity)

    def tier(self, elements: Iterable[Element]) -> int:
        """The tier that recovers all of ``elements`` lost together."""
        relabel: dict[int, int] = {}
        failures: set[erasure.Failure] = set()
        for kind, node, local in elements:
            n = relabel.setdefault(node, len(relabel))
            if kind == NODE:
                failures.add(erasure.NodeLoss(n))
            else:
                failures.add(erasure.RankMemory(n * self.ranks_per_node + local))
        lost_nodes = {f.node for f in failures if isinstance(f, erasure.NodeLoss)}
        failures = {
            f
            for f in failures
            if not (
                isinstance(f, erasure.RankMemory) and f.rank // self.ranks_per_node in lost_nodes
            )
        }
        if not failures:
            return 0
        key = frozenset(failures)
        if len(relabel) <= self.small and key in self._table:
            return self._table[key]
        placement = self._placement(max(len(relabel), self.small))
        return erasure.decode(placement, erasure.lost_blocks(placement, key)).tier


@cache
def core_tiers(
    nodes: int, ranks_per_node: int, tier1: bool, tier2: bool, tier2_parity: int
) -> CoreTiers:
    """A cached :class:`CoreTiers` (sweeps ask for the same shape many times)."""
    return CoreTiers(nodes, ranks_per_node, tier1=tier1, tier2=tier2, tier2_parity=tier2_parity)
