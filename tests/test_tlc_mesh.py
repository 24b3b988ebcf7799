"""TLC on spec/Mesh.tla: the placement rule on a device mesh keeps its promise (every
single failure, and two at once, over every small mesh); each mutant is caught; and
`leto spec check` runs these configs (leto.spec.cli.SIDE_SPECS) and fails a run whose
violations are not the expected ones."""

from __future__ import annotations

import argparse

import pytest
from test_tlc import needs_java

from leto.spec import cli
from leto.spec.location import SPEC_DIR
from leto.spec.tlc import run_tlc

RUNS = cli.SIDE_SPECS["Mesh.tla"]


def test_spec_check_runs_every_mesh_config_and_both_mutants() -> None:
    names = {cfg for cfg, _ in RUNS}
    assert names == {p.name for p in SPEC_DIR.glob("MCMesh*.cfg")}
    assert {cfg for cfg, want in RUNS if want == ("Promise",)} == {
        "MCMesh_parity_over_replicas.cfg",
        "MCMesh_replica_on_own_node.cfg",
    }


@needs_java
@pytest.mark.parametrize(("cfg", "expected"), RUNS, ids=[cfg for cfg, _ in RUNS])
def test_each_mesh_config_violates_exactly_what_it_must(
    cfg: str, expected: tuple[str, ...]
) -> None:
    res = run_tlc(cfg, spec="Mesh.tla", workers=1, timeout=300)
    assert res.error is None, res.error
    assert res.violations == list(expected), res.counterexample
    if not expected:
        assert res.ok and res.distinct_states is not None and res.distinct_states > 1000


@needs_java
def test_spec_check_fails_a_side_run_whose_violations_differ(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        cli, "SIDE_SPECS", {"Mesh.tla": (("MCMesh_replica_on_own_node.cfg", ("Complete",)),)}
    )
    args = argparse.Namespace(skip_mutants=False, workers=1, timeout=300.0)
    out: dict[str, object] = {"side": [], "side_failed": 0}
    cli._side_specs(args, SPEC_DIR, lambda msg: None, out)
    assert out["side_failed"] == 1
    (run,) = out["side"]  # type: ignore[misc]
    assert run["violations"] == ["Promise"] and not run["ok"]
    args.skip_mutants = True  # a config that must be violated is a mutant's: skipped
    out = {"side": [], "side_failed": 0}
    cli._side_specs(args, SPEC_DIR, lambda msg: None, out)
    assert out == {"side": [], "side_failed": 0}
