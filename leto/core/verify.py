"""The core's verification runs: the configurations the checker explores, and mutants.

No single small configuration reaches every interesting state in a time a test can
afford in Python, so the checker runs a few, each exhaustive: three ranks on two nodes
with one fault (tier-1 repair needs two ranks on a node), two ranks on two nodes with
two faults (fallback and failure during recovery need two), and one with shadow
memory reclaim on. A "sometimes" property counts as reached when any of them reaches
it. TLC checks the larger configuration (``spec/MCLeto.cfg``) on the TLA+ side.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs

from leto.core.checker import CheckResult, check
from leto.core.cluster import ClusterConfig, ClusterModel, Mutant
from leto.core.erasure import Topology

CHECK_CONFIGS: Mapping[str, ClusterConfig] = {
    "three-ranks": ClusterConfig(
        topology=Topology((2, 1)), chunks=2, max_step=1, max_faults=1, reclaim=False
    ),
    "two-faults": ClusterConfig(
        topology=Topology((1, 1)), chunks=1, max_step=1, max_faults=2, reclaim=False
    ),
    "reclaim": ClusterConfig(
        topology=Topology((1, 1)), chunks=1, max_step=1, max_faults=1, reclaim=True
    ),
    "tier1-off": ClusterConfig(
        topology=Topology((2, 1)), chunks=1, max_step=1, max_faults=1, reclaim=False, tier1=False
    ),
    # two parities across three nodes: two nodes lost at once are restored from tier 2
    "tier2-m2": ClusterConfig(
        topology=Topology((1, 1, 1)),
        chunks=1,
        max_step=1,
        max_faults=2,
        faults=frozenset(("lose_node",)),
        reclaim=False,
        tier2_parity=2,
    ),
    # the recovery deadline: GiveUp in every recovery phase ends the job (FAILED)
    "deadline": ClusterConfig(
        topology=Topology((1, 1)), chunks=1, max_step=1, max_faults=1, reclaim=False, deadline=True
    ),
}

# what a configuration must never reach ('sometimes' properties, by name): with two
# parities, two nodes lost at once are restored from tier 2, never from the disk
NEVER: Mapping[str, tuple[str, ...]] = {"tier2-m2": ("Fallback",)}

MUTANT_CONFIG = "three-ranks"
# mutants whose catch needs a fallback, which needs two faults; or the deadline; or
# whose shortest counterexample is long (stale_tail: a whole step applied on a rank
# before it dies in its loop tail: 25 events and 11 s in three-ranks, 19 and 3 s here)
MUTANT_CONFIGS: Mapping[Mutant, str] = {
    Mutant.EARLY_DURABLE: "two-faults",
    Mutant.NO_TIMEOUT: "deadline",
    Mutant.STALE_TAIL: "reclaim",
}
MUTANTS: tuple[Mutant, ...] = tuple(m for m in Mutant if m is not Mutant.NONE)


@attrs.frozen
class CoreReport:
    results: Mapping[str, CheckResult]
    unreached: tuple[str, ...]  # sometimes-properties no configuration reached
    forbidden: tuple[str, ...] = ()  # "config: property" reached where NEVER forbids it

    @property
    def states(self) -> int:
        return sum(r.states for r in self.results.values())

    @property
    def violations(self) -> int:
        return sum(len(r.violations) for r in self.results.values()) + len(self.forbidden)

    @property
    def ok(self) -> bool:
        return self.violations == 0 and not self.unreached


@attrs.frozen
class MutantResult:
    mutant: Mutant
    caught_by: tuple[str, ...]  # invariants violated (empty: the mutant survived)
    counterexample: str
    states: int

    @property
    def caught(self) -> bool:
        return bool(self.caught_by)


def check_core(
    configs: Mapping[str, ClusterConfig] = CHECK_CONFIGS,
    on_config: Callable[[str], None] | None = None,
    never: Mapping[str, tuple[str, ...]] = NEVER,
) -> CoreReport:
    """Every configuration explored: its violations, the 'sometimes' properties no
    configuration reached, and those a configuration reached that ``never`` forbids it
    (each counts as a violation)."""
    results: dict[str, CheckResult] = {}
    reached: set[str] = set()
    names: list[str] = []
    forbidden: list[str] = []
    for name, cfg in configs.items():
        if on_config is not None:
            on_config(name)
        res = check(ClusterModel(cfg))
        results[name] = res
        reached |= set(res.reached)
        forbidden += [f"{name}: {p}" for p in never.get(name, ()) if p in res.reached]
        for prop in (*res.reached, *res.unreached):
            if prop not in names:
                names.append(prop)
    return CoreReport(
        results=results,
        unreached=tuple(n for n in names if n not in reached),
        forbidden=tuple(forbidden),
    )


def check_mutant(mutant: Mutant, config: ClusterConfig | None = None) -> MutantResult:
    base = (
        config if config is not None else CHECK_CONFIGS[MUTANT_CONFIGS.get(mutant, MUTANT_CONFIG)]
    )
    res = check(ClusterModel(attrs.evolve(base, mutant=mutant)), stop_at_first=True)
    first = res.violations[0].describe() if res.violations else ""
    return MutantResult(
        mutant=mutant,
        caught_by=tuple(v.name for v in res.violations),
        counterexample=first,
        states=res.states,
    )
