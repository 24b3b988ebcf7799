"""Float32 master weights on gloo (``master_weights = true``): a bfloat16 model in the
user's own loop keeps float32 masters, gradients and optimizer state in retained memory
(with ``shard = true``, each rank its shard of them); its parameters are cast from the
masters after every step and every recovery. Killed at every phase of a step it ends
bitwise its failure-free run, sharded or not; torch's clip on a bf16
``.grad`` is refused in one line naming ``session.clip_grad_norm_``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from jobs import LOOP_POINTS, digests_equal, explain, kills, params_of, script_job

from leto.backends.gloo.harness import JobResult

LOOP = str(Path(__file__).resolve().parent / "scripts" / "shard_loop.py")
STEPS = len(LOOP_POINTS) + 2


def _run(
    run_dir: Path,
    masters: bool,
    clip: str,
    faults: list[dict[str, Any]] | None = None,
    steps: int = STEPS,
    shard: bool = False,
) -> JobResult:
    settings = f"chunk_size = 128\ntier2_interval = 3\nmaster_weights = {str(masters).lower()}\n"
    if shard:
        settings += 'shard = true\ntier1_code = "parity"\n'
    args = ["--steps", str(steps), "--clip", clip, "--bf16"]
    return script_job(LOOP, run_dir, settings, args, faults)


def test_bf16_with_float32_masters_killed_at_every_phase_is_bitwise(session_dir: Path) -> None:
    plain = _run(session_dir / "bf16-plain", False, "session")  # bf16 trained in bf16
    ref = _run(session_dir / "bf16-masters", True, "session")
    assert plain.ok and ref.ok and ref.digests, explain(plain if not plain.ok else ref)
    # the masters change the math: the update is float32, rounded once per step
    assert params_of(ref) != params_of(plain) and params_of(ref)[0] == params_of(ref)[1]
    faults = kills(LOOP_POINTS)
    res = _run(session_dir / "bf16-masters-kills", True, "session", faults)
    assert res.ok, explain(res)
    assert len(res.recoveries) == len(LOOP_POINTS), res.recoveries
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"
    assert params_of(res) == params_of(ref)  # the bf16 parameters too: cast from the masters


def test_sharded_bf16_with_float32_masters_killed_at_every_phase_is_bitwise(
    session_dir: Path,
) -> None:
    """Each rank retains its shard of the float32 masters, gradients and AdamW state; the
    bf16 parameters are all-gathered (the shards cast to bf16) after every step."""
    ref = _run(session_dir / "shard-masters", True, "session", shard=True)
    assert ref.ok and ref.digests, explain(ref)
    assert params_of(ref)[0] == params_of(ref)[1]  # every rank's model: the same cast
    assert ref.digests["0"]["param"] != ref.digests["1"]["param"]  # different shards
    faults = kills(LOOP_POINTS)
    # and a rank's keeper lost: its float32 shard rebuilt from the node's parity
    faults.append({"kind": "lose_memory", "rank": 1, "step": STEPS, "phase": "prepare"})
    res = _run(session_dir / "shard-masters-kills", True, "session", faults, shard=True)
    assert res.ok, explain(res)
    kinds = [f["kind"] for f in res.of("failure")]
    assert kinds == ["crash"] * len(LOOP_POINTS) + ["keeper_lost"], kinds
    assert len(res.recoveries) == len(faults), res.recoveries
    assert res.recoveries[-1].get("chunks_repaired_tier1", 0) > 0, res.recoveries[-1]
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"
    assert params_of(res) == params_of(ref)


@pytest.mark.parametrize("shard", [False, True], ids=["whole", "sharded"])
def test_torch_clip_on_a_bf16_grad_is_refused_in_one_line(session_dir: Path, shard: bool) -> None:
    res = _run(session_dir / f"bf16-torch-clip-{shard}", True, "torch", steps=2, shard=shard)
    assert not res.ok
    (failed,) = res.of("job_failed")
    why = (
        "shard = true: a parameter's .grad holds no gradient after the reduce"
        if shard
        else "master_weights = true: a bf16/fp16 parameter's .grad holds no gradient"
    )
    assert why in str(failed) and "session.clip_grad_norm_(max_norm)" in str(failed), failed
