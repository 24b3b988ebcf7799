"""TLC on spec/Replay.tla: the parallel replay of the step in flight keeps ReplayOK (the
owner's sum is, addition by addition, its own) and completes; each mutant is caught."""

from __future__ import annotations

import pytest

from leto.spec import tlc
from leto.spec.tlc import run_tlc


def _has_java() -> bool:
    try:
        tlc.find_java()
    except tlc.TLCNotAvailable:
        return False
    return True


needs_java = pytest.mark.skipif(not _has_java(), reason="TLC needs a Java runtime")


@needs_java
def test_the_replay_keeps_the_owners_sum_and_completes() -> None:
    res = run_tlc("MCReplay.cfg", spec="Replay.tla", workers=1, timeout=300)
    assert res.ok, res.error or res.counterexample
    assert res.violations == []
    assert res.distinct_states is not None and res.distinct_states > 10


@needs_java
@pytest.mark.parametrize("mutant", ["out_of_order", "own_rng", "stale_params"])
def test_each_mutant_of_the_replay_is_caught(mutant: str) -> None:
    res = run_tlc(f"MCReplay_{mutant}.cfg", spec="Replay.tla", workers=1, timeout=300)
    assert not res.ok
    assert res.violations == ["ReplayOK"], res.error or res.counterexample
