"""A real client: examples/hf_gpt2.py (a Hugging Face `transformers` GPT-2 built from a
config in code, its own loop: accumulation under no_sync, clipping, AdamW with weight
decay groups, a warm-up + cosine schedule, a StatefulDataLoader) under `leto launch` on
gloo, SIGKILLed at every phase of a step: bitwise the failure-free run."""

from __future__ import annotations

from pathlib import Path

from jobs import LOOP_POINTS, digests_equal, explain

from leto.backends.gloo.harness import JobResult, run_local

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "hf_gpt2.py")
STEPS = len(LOOP_POINTS) + 3


def _run(run_dir: Path, faults: list | None) -> JobResult:  # type: ignore[type-arg]
    cfg = run_dir.parent / f"{run_dir.name}.toml"
    cfg.write_text(
        '[leto]\nbackend = "gloo"\ntopology = "1x2"\nchunk_size = 8192\ntier2_interval = 4\n'
    )
    res = run_local(
        EXAMPLE,
        run_dir=run_dir,
        faults=faults,
        extra=["--quiet", "--hang-timeout", "5", "--heartbeat", "0.25"],
        script_args=["--config", str(cfg), "--steps", str(STEPS)],
        timeout=300,
    )
    assert not res.leftovers, res.leftovers
    return res


def test_hf_gpt2_killed_at_every_phase_is_bitwise(session_dir: Path) -> None:
    ref = _run(session_dir / "hf-ref", None)
    assert ref.ok and ref.digests, explain(ref)
    faults = [
        {"kind": "crash", "rank": i % 2, "step": i + 2, **k} for i, k in enumerate(LOOP_POINTS)
    ]
    res = _run(session_dir / "hf-kills", faults)
    assert res.ok, explain(res)
    assert len(res.recoveries) == len(LOOP_POINTS), res.recoveries
    kinds = {r["kind"] for r in res.recoveries}
    assert "forward" in kinds, kinds  # a death after COMMIT is rolled forward
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"
    lines = [r for r in (res.run_dir / "events.jsonl").read_text().splitlines() if '"step"' in r]
    assert lines and all('"loss": null' in x for x in lines if '"event": "step"' in x)
