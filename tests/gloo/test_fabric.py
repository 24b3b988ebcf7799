"""A Lightning Fabric loop under `leto launch` (examples/fabric_loop.py: `fabric.setup`,
`fabric.backward` under `session.no_sync`, `fabric.clip_gradients`, the Fabric
optimizer's step) SIGKILLed at every phase of a step: bitwise its failure-free run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from jobs import LOOP_POINTS, digests_equal, explain, kills, script_job

from leto.backends.gloo.harness import JobResult

pytest.importorskip("lightning", reason="examples/fabric_loop.py needs lightning")

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "fabric_loop.py")
STEPS = len(LOOP_POINTS) + 2


def _run(run_dir: Path, faults: list[dict[str, Any]] | None) -> JobResult:
    settings = "chunk_size = 256\ntier2_interval = 3\n"
    return script_job(EXAMPLE, run_dir, settings, ["--steps", str(STEPS)], faults)


@pytest.mark.soak  # the user loop's path (tests/gloo/test_loop.py), through Fabric
def test_fabric_loop_killed_at_every_phase_is_bitwise(session_dir: Path) -> None:
    ref = _run(session_dir / "fabric-ref", None)
    assert ref.ok and ref.digests, explain(ref)
    assert "recoveries 0" in "".join(ref.text(n) for n in ref.output)
    res = _run(session_dir / "fabric-kills", kills(LOOP_POINTS))
    assert res.ok, explain(res)
    assert len(res.recoveries) == len(LOOP_POINTS), res.recoveries
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"
