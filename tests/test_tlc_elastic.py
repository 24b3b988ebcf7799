"""TLC on spec/Elastic.tla: the elastic world (shrink instead of restart, grow back)
passes every invariant and its liveness properties, reaches a shrink with a grow-back
and a stop below MIN (witnesses TLC must report violated), and each mutant is caught by
the invariant its cfg names (from_disk: a shrink carried out as a restart from the
latest disk checkpoint trains a step twice, caught by InPlace)."""

from __future__ import annotations

from pathlib import Path

import pytest

from leto.spec.tlc import SPEC_DIR, run_tlc
from tests.test_tlc import checked_invariants, needs_java

SPEC = "MCElastic.tla"
MUTANTS = {"below_min": "InRange", "stale_grow": "Equivalence", "from_disk": "InPlace"}


@needs_java
def test_the_elastic_world_passes_every_invariant_progress_and_ends() -> None:
    assert checked_invariants("MCElastic.cfg") == [
        "TypeOK",
        "Roles",
        "InRange",
        "Equivalence",
        "InPlace",
    ]
    res = run_tlc("MCElastic.cfg", SPEC, workers=1, timeout=300)
    assert res.ok, (res.violations, res.error, res.counterexample[-2000:])
    assert res.distinct_states > 5000  # 7511 on MCElastic.cfg's constants


@needs_java
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_each_elastic_mutant_is_caught_by_its_invariant(mutant: str) -> None:
    cfg = f"MCElastic_{mutant}.cfg"
    assert checked_invariants(cfg) == [MUTANTS[mutant]]
    res = run_tlc(cfg, SPEC, workers=1, timeout=300)
    assert not res.ok and res.violations == [MUTANTS[mutant]], (res.violations, res.error)
    assert ("Grow" if mutant == "stale_grow" else "Shrink") in res.counterexample


@needs_java
@pytest.mark.parametrize("witness", ["NeverRegrown", "NeverStopped"])
def test_a_shrink_with_a_grow_back_and_a_stop_below_min_are_reached(
    witness: str, tmp_path: Path
) -> None:
    text = (SPEC_DIR / "MCElastic.cfg").read_text()
    head = text.split("INVARIANTS")[0]
    cfg = tmp_path / f"MCElastic_{witness}.cfg"
    cfg.write_text(f"{head}INVARIANTS\n    {witness}\n")
    res = run_tlc(cfg, SPEC, workers=1, timeout=300)
    assert res.violations == [witness], (res.violations, res.error)
    if witness == "NeverRegrown":  # trained on 3, shrunk to 2, grown back to 3
        assert "sched = <<3, 2, 3>>" in res.counterexample, res.counterexample[-1500:]
        assert "Shrink" in res.counterexample and "Grow" in res.counterexample
