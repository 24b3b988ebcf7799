"""A generic-path optimizer (RMSprop: its whole step replayed from the retained before
copy) on real processes: SIGKILLs inside and after APPLY, bitwise the failure-free run."""

from __future__ import annotations

from pathlib import Path

from jobs import digests_equal, explain, job

STEPS = 7
RMSPROP = {"OPT": "RMSprop"}
KILLS = [
    {"phase": "decide", "where": "after"},  # committed, no chunk written: roll forward
    {"phase": "apply", "chunk": 2, "where": "mid_write"},  # chunks 0-1 written: replay
    {"phase": "parity", "chunk": 1},  # chunk 1 written, its undo kept, 2-4 not
    {"phase": "finish"},
]


def test_rmsprop_killed_during_apply_rolls_forward_bitwise(session_dir: Path) -> None:
    ref = job(session_dir / "rmsprop-ref", steps=STEPS, env=RMSPROP)
    assert ref.ok and ref.digests, explain(ref)
    faults = [{"kind": "crash", "rank": i % 2, "step": i + 2, **k} for i, k in enumerate(KILLS)]
    res = job(session_dir / "rmsprop-kills", steps=STEPS, faults=faults, env=RMSPROP)
    assert res.ok, explain(res)
    kinds = [r["kind"] for r in res.recoveries]
    assert kinds[:3] == ["forward"] * 3, kinds
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"
