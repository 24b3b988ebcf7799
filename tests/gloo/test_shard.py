"""Sharded state (``shard = true``) on real processes: each rank retains its 1/W shard,
steps it alone and all-gathers the parameters; the model's parameters are bitwise pure
data-parallel training's, and a SIGKILL at every phase of a step, or a rank's retained
memory lost (its shard rebuilt from the node's parity), ends bitwise the failure-free run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from jobs import STEPS_2x2, digests_equal, explain, job, kills, params_of, script_job
from test_recovery import PHASES  # every point of a step

from leto.backends.gloo.harness import JobResult

STEPS = 15
ENV = {"CHUNK": "32"}  # 258 elements: 9 chunks unsharded, 5 per rank sharded over 2
FAULTS = kills(PHASES) + [
    {
        "kind": "lose_memory",
        "rank": 0,
        "step": 13,
        "phase": "apply",
        "chunk": 3,
        "where": "written",
    },
    {"kind": "lose_memory", "rank": 1, "step": 14, "phase": "prepare"},
]


@pytest.fixture(scope="module")
def runs(session_dir: Path) -> dict[str, JobResult]:
    out = {
        "dp": job(session_dir / "dp", steps=STEPS, env={**ENV, "SHARD": "0"}),
        "shard": job(session_dir / "shard", steps=STEPS, env={**ENV, "SHARD": "1"}),
        "faults": job(
            session_dir / "shard-faults",
            steps=STEPS,
            faults=FAULTS,
            env={**ENV, "SHARD": "1", "LETO_CHECK_KEPT_PARITY": "1"},
        ),
    }
    for name, res in out.items():
        assert res.ok and res.digests, f"{name}: {explain(res)}"
    return out


def test_sharded_training_is_bitwise_pure_data_parallel(runs: dict[str, JobResult]) -> None:
    dp, sh = runs["dp"], runs["shard"]
    assert params_of(sh) == params_of(dp) and params_of(sh)[0] == params_of(sh)[1]
    # each rank retains its own shard: the ranks' parameter buffers differ, pure DP's agree
    assert dp.digests is not None and sh.digests is not None
    assert dp.digests["0"]["param"] == dp.digests["1"]["param"]
    assert sh.digests["0"]["param"] != sh.digests["1"]["param"]


def test_sharded_faults_at_every_phase_are_bitwise(runs: dict[str, JobResult]) -> None:
    res = runs["faults"]
    kinds = [f["kind"] for f in res.of("failure")]
    assert kinds == ["crash"] * len(PHASES) + ["keeper_lost"] * 2, kinds
    recs = res.recoveries
    assert len(recs) == len(FAULTS), recs
    assert sum(r.get("chunks_repaired_tier1", 0) for r in recs) >= 5, recs
    assert digests_equal(res, runs["shard"]), "not bitwise equal to the failure-free run"
    assert params_of(res) == params_of(runs["dp"])


def test_sharded_over_two_nodes_a_crash_and_a_lost_node_are_bitwise(session_dir: Path) -> None:
    """2 nodes x 2 ranks, each rank a quarter of the state: a crash (tier 1 as parity
    across the node's shards keeps the rank's memory) and a whole node lost (its two
    shards restored from the tier-2 snapshot on the other node) end bitwise equal to
    the failure-free sharded run."""
    env = {**ENV, "SHARD": "1"}
    ref = job(session_dir / "shard-2x2", nnodes=2, nproc=2, steps=STEPS_2x2, env=env)
    faults = [
        {"kind": "crash", "rank": 3, "step": 4, "phase": "apply", "chunk": 1, "where": "written"},
        {"kind": "lose_node", "rank": 2, "step": 7, "phase": "prepare"},
    ]
    res = job(
        session_dir / "shard-2x2-faults",
        nnodes=2,
        nproc=2,
        steps=STEPS_2x2,
        env=env,
        faults=faults,
        extra=["--spare-timeout", "60"],
    )
    assert ref.ok and res.ok, f"{explain(ref)}\n{explain(res)}"
    assert [f["kind"] for f in res.of("failure")] == ["crash", "node_lost"]
    recs = res.recoveries
    assert recs[-1]["kind"] == "tier2" and recs[-1]["chunks_restored"] > 0, recs
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"
    assert len(set(params_of(ref, 4))) == 1  # the model's parameters: every rank's alike
    assert params_of(res, 4) == params_of(ref, 4)


LOOP = str(Path(__file__).resolve().parent / "scripts" / "shard_loop.py")
LOOP_STEPS = 10
LOOP_POINTS: list[dict[str, Any]] = [
    {"phase": "forward"},
    {"phase": "backward"},  # the first micro-batch's: between micro-batches
    {"phase": "allreduce"},
    {"phase": "prepare"},
    {"phase": "decide", "where": "after"},
    {"phase": "apply", "chunk": 1, "where": "mid_write"},
    {"phase": "parity", "chunk": 0},
    {"phase": "finish"},
]


def _loop(
    run_dir: Path,
    shard: bool,
    clip: str,
    faults: list[dict[str, Any]] | None = None,
    steps: int = LOOP_STEPS,
) -> JobResult:
    settings = f'chunk_size = 256\ntier2_interval = 3\ntier1_code = "parity"\nshard = {str(shard).lower()}\n'
    return script_job(LOOP, run_dir, settings, ["--steps", str(steps), "--clip", clip], faults)


def test_user_loop_sharded_is_bitwise_pure_dp_and_recovers_with_session_clip(
    session_dir: Path,
) -> None:
    dp = _loop(session_dir / "loop-dp", False, "none")
    sh = _loop(session_dir / "loop-shard", True, "none")
    assert dp.ok and sh.ok, explain(dp if not dp.ok else sh)
    assert params_of(sh) == params_of(dp)
    ref = _loop(session_dir / "loop-clip", True, "session")
    assert ref.ok and ref.digests, explain(ref)
    assert params_of(ref) != params_of(sh)  # the clip changed the steps
    faults = kills(LOOP_POINTS)
    res = _loop(session_dir / "loop-clip-kills", True, "session", faults)
    assert res.ok, explain(res)
    assert len(res.recoveries) == len(LOOP_POINTS), res.recoveries
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"
    assert params_of(res) == params_of(ref)


def test_torch_clip_on_sharded_grads_is_refused_in_one_line(session_dir: Path) -> None:
    res = _loop(session_dir / "loop-torch-clip", True, "torch", steps=2)
    assert not res.ok
    (failed,) = res.of("job_failed")
    assert "session.clip_grad_norm_(max_norm), not torch.nn.utils.clip_grad_norm_" in str(failed), (
        failed
    )
