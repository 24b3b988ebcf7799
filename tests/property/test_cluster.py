"""The whole protocol under random steps and faults, against the plain model; and the
same machine catching every mutant."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from leto.core.cluster import ClusterConfig, Mutant
from leto.core.erasure import Topology
from leto.testing.cluster import ClusterMachine, machine_for

SETTINGS = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

THREE_RANKS = ClusterConfig(topology=Topology((2, 1)), chunks=2, max_step=3, max_faults=3)
FOUR_RANKS = ClusterConfig(topology=Topology((2, 2)), chunks=2, max_step=3, max_faults=2)


@pytest.mark.parametrize("config", [THREE_RANKS, FOUR_RANKS], ids=["2+1", "2+2"])
def test_cluster_against_plain_model(config: ClusterConfig) -> None:
    run_state_machine_as_test(machine_for(config), settings=SETTINGS)


@pytest.mark.parametrize("mutant", [m for m in Mutant if m is not Mutant.NONE], ids=str)
def test_hypothesis_catches_mutant(mutant: Mutant) -> None:
    broken = machine_for(attrs.evolve(THREE_RANKS, mutant=mutant))
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            broken,
            settings=settings(
                SETTINGS,
                max_examples=400,
                derandomize=True,
                database=None,
                print_blob=False,
                # Finding the bug is the point; shrinking it costs minutes.
                phases=[Phase.generate],
            ),
        )


def test_default_machine_is_the_three_rank_cluster() -> None:
    assert ClusterMachine.config.ranks == 3
