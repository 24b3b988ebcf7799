"""Module buffers on real processes: a model with BatchNorm in the user's loop, a rank
killed where the step rolls back (prepare), forward (decide, after) and mid-write:
bitwise the failure-free run, running statistics included (the digest covers the
process state, which holds them)."""

from __future__ import annotations

from pathlib import Path

from jobs import digests_equal, explain

from leto.backends.gloo.harness import run_local

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "batchnorm.py")
STEPS = 8


def _run(run_dir: Path, faults: list | None):  # type: ignore[no-untyped-def]
    cfg = run_dir.parent / f"{run_dir.name}.toml"
    cfg.write_text('[leto]\nbackend = "gloo"\ntopology = "1x2"\nchunk_size = 128\n')
    res = run_local(
        SCRIPT,
        run_dir=run_dir,
        faults=faults,
        extra=["--quiet", "--hang-timeout", "3", "--heartbeat", "0.25"],
        script_args=["--config", str(cfg), "--steps", str(STEPS)],
        timeout=180,
    )
    assert not res.leftovers, res.leftovers
    return res


def test_batchnorm_statistics_survive_kills_bitwise(session_dir: Path) -> None:
    ref = _run(session_dir / "bn-ref", None)
    assert ref.ok and ref.digests, explain(ref)
    faults = [
        {"kind": "crash", "rank": 1, "step": 2, "phase": "prepare"},
        {"kind": "crash", "rank": 0, "step": 4, "phase": "decide", "where": "after"},
        {"kind": "crash", "rank": 1, "step": 6, "phase": "apply", "chunk": 0, "where": "mid_write"},
    ]
    res = _run(session_dir / "bn-kills", faults)
    assert res.ok, explain(res)
    assert len(res.recoveries) == len(faults), res.recoveries
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"
