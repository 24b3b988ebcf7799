"""The user's own loop (examples/ddp_loop.py: micro-batches under no_sync, clipping,
optimizer.step(), scheduler.step(), a StatefulDataLoader over a DistributedSampler)
killed at every phase of a step on real processes: bitwise the failure-free run."""

from __future__ import annotations

from pathlib import Path

from jobs import LOOP_POINTS, digests_equal, explain, kills, script_job

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "ddp_loop.py")
STEPS = 12
POINTS = LOOP_POINTS


def _run(run_dir: Path, code: str, faults: list | None, args: list[str]):  # type: ignore[no-untyped-def]
    settings = f'chunk_size = 256\ntier2_interval = 3\ntier1_code = "{code}"\n'
    return script_job(EXAMPLE, run_dir, settings, ["--steps", str(STEPS), *args], faults)


def test_user_loop_killed_at_every_phase_is_bitwise(session_dir: Path) -> None:
    ref = _run(session_dir / "loop-ref", "auto", None, [])
    assert ref.ok and ref.digests, explain(ref)
    faults = kills(POINTS)
    res = _run(session_dir / "loop-kills", "auto", faults, [])
    assert res.ok, explain(res)
    assert len(res.recoveries) == len(POINTS), res.recoveries
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"


def test_user_loop_with_grad_scaler_and_parity_is_bitwise(session_dir: Path) -> None:
    ref = _run(session_dir / "scaler-ref", "parity", None, ["--scaler"])
    assert ref.ok and ref.digests, explain(ref)
    faults = [
        {"kind": "crash", "rank": 1, "step": 3, "phase": "backward"},
        {"kind": "crash", "rank": 0, "step": 5, "phase": "apply", "chunk": 2, "where": "mid_write"},
        {"kind": "crash", "rank": 1, "step": 7, "phase": "prepare"},
    ]
    res = _run(session_dir / "scaler-kills", "parity", faults, ["--scaler"])
    assert res.ok, explain(res)
    # each death placed where it happened (a backward's is not "in forward")
    assert [f.get("in_phase") for f in res.of("failure")] == ["backward", "apply", "prepare"]
    assert len(res.recoveries) == len(faults), res.recoveries
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"
