"""leto's tiers come from the core's coverage analysis, queried at any scale."""

from __future__ import annotations

import numpy as np
import pytest

from leto.core import erasure
from leto.sim import trace
from leto.sim.coverage import NODE, RANK, CoreTiers
from leto.sim.params import SimParams


@pytest.mark.parametrize("parity", [1, 2])
def test_small_lookup_agrees_with_the_core_on_the_full_topology(parity: int) -> None:
    # On a 6-node topology the core can enumerate everything: every pattern of up to two
    # failures, relabelled and looked up on the reduced topology, gets the core's tier.
    nodes, rpn = 6, 2
    tiers = CoreTiers(nodes, rpn, tier1=True, tier2=True, tier2_parity=parity)
    assert tiers.small < nodes
    full = erasure.coverage(
        erasure.place(erasure.Topology.uniform(nodes, rpn), tier2_parity=parity), max_failures=2
    )
    for pattern in full.patterns:
        elements = [
            (NODE, f.node, 0)
            if isinstance(f, erasure.NodeLoss)
            else (RANK, f.rank // rpn, f.rank % rpn)
            for f in sorted(pattern.failures)
        ]
        assert tiers.tier(elements) == pattern.tier, pattern.label()


def test_tiers_at_131072_gpus() -> None:
    tiers = CoreTiers(16_384, 8, tier1=True, tier2=True, tier2_parity=1)
    assert tiers.tier([]) == 0
    assert tiers.tier([(RANK, 9000, 3)]) == 1
    assert tiers.tier([(NODE, 9000, 0)]) == 2
    assert tiers.tier([(RANK, 9000, 3), (RANK, 9000, 4)]) == 2  # two ranks of one node
    assert tiers.tier([(RANK, 9000, 3), (RANK, 12, 4)]) == 1
    assert tiers.tier([(NODE, 9000, 0), (NODE, 12, 0)]) == 3  # single parity, two nodes
    assert tiers.tier([(RANK, 9000, 3), (NODE, 9000, 0)]) == 2  # subsumed by the node
    assert tiers.tier([(RANK, 1, 0), (RANK, 1, 1), (RANK, 1, 2)]) == 2  # three: decoded
    no_t2 = CoreTiers(16_384, 8, tier1=True, tier2=False, tier2_parity=1)
    assert no_t2.tier([(NODE, 5, 0)]) == 3
    one_node = CoreTiers(1, 6, tier1=True, tier2=True, tier2_parity=1)
    assert one_node.tier([(NODE, 0, 0)]) == 3
    assert one_node.tier([(RANK, 0, 1), (RANK, 0, 2)]) == 2  # snapshots, no cross-node parity


def test_traces_are_coupled_across_a_sweep() -> None:
    base = SimParams(gpus=4096, days=10.0)
    lo = trace.generate(SimParams(gpus=4096, days=10.0, hof_fraction=0.2), 3)
    hi = trace.generate(SimParams(gpus=4096, days=10.0, hof_fraction=0.6), 3)
    np.testing.assert_array_equal(lo.times, hi.times)
    # a failure in place at 20% stays in place at 60%
    assert np.all(hi.cls[lo.cls == 0] == 0) and (hi.cls == 0).sum() > (lo.cls == 0).sum()
    fast = trace.generate(SimParams(gpus=4096, days=10.0, mtbf_hours=1.0), 3)
    slow = trace.generate(SimParams(gpus=4096, days=10.0, mtbf_hours=2.0), 3)
    np.testing.assert_allclose(slow.times, 2.0 * fast.times[: len(slow)])
    t = trace.generate(base, 3)
    assert np.all(np.diff(t.times) > 0) and t.times[-1] < t.horizon_s
    assert t.node.max() < base.nodes and t.rank.max() < base.ranks_per_node
