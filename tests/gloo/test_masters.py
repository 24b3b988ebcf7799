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
import torch
import torch.distributed.checkpoint as dcp
from jobs import (
    LOOP_POINTS,
    assert_trace,
    digests_equal,
    explain,
    kills,
    params_of,
    script_job,
    story,
)

from leto.backends.gloo.harness import JobResult
from leto.retained.checkpoint import CheckpointStore
from leto.retained.dcp_state import read_checkpoint

LOOP = str(Path(__file__).resolve().parent / "scripts" / "shard_loop.py")
STEPS = len(LOOP_POINTS) + 2
# both ranks' memory lost at step 5 with tier 2 off: beyond tier 1, back to the disk
# checkpoint (tier 3) of step 4; the checkpoints of 8 and 10 are not written: each of
# those steps commits through a recovery (rolled forward: a SIGKILL after its decision);
# step 6's is written or not as :func:`checkpointed` says
BEYOND_TIER1 = [{"kind": "lose_memory", "rank": r, "step": 5, "phase": "finish"} for r in (0, 1)]


def checkpointed(res: JobResult) -> list[int]:
    """The checkpoints written: [2, 4] and the last step's, and 6 when rank 0's death after its vote in step
    6 reached the coordinator before its node's votes did (step 6 is rolled back, then
    reruns and commits normally, its checkpoint written) rather than after them (step 6
    is rolled forward: committed by a recovery). Both are the protocol's; which one is
    a race between the agent's two messages (the death is seen within milliseconds)."""
    recs = res.recoveries
    after = recs[next(i for i, r in enumerate(recs) if r["kind"] == "ckpt") + 1]
    assert after["kind"] in ("back", "forward"), after
    last = [STEPS] if STEPS % 2 == 0 else []  # the last step's, no fault after it
    return ([2, 4, 6] if after["kind"] == "back" else [2, 4]) + last


def _ckpt(directory: Path) -> str:
    return f'checkpoint_dir = "{directory}"\ncheckpoint_interval = 2\ntier2 = false\n'


def _run(
    run_dir: Path,
    masters: bool,
    clip: str,
    faults: list[dict[str, Any]] | None = None,
    steps: int = STEPS,
    shard: bool = False,
    more: str = "",
) -> JobResult:
    settings = f"chunk_size = 128\ntier2_interval = 3\nmaster_weights = {str(masters).lower()}\n"
    if shard:
        settings += 'shard = true\ntier1_code = "parity"\n'
    args = ["--steps", str(steps), "--clip", clip, "--bf16"]
    return script_job(LOOP, run_dir, settings + more, args, faults)


def test_bf16_with_float32_masters_killed_at_every_phase_is_bitwise(session_dir: Path) -> None:
    plain = _run(session_dir / "bf16-plain", False, "session")  # bf16 trained in bf16
    ref = _run(session_dir / "bf16-masters", True, "session")
    assert plain.ok and ref.ok and ref.digests, explain(plain if not plain.ok else ref)
    # the masters change the math: the update is float32, rounded once per step
    assert params_of(ref) != params_of(plain) and params_of(ref)[0] == params_of(ref)[1]
    faults = kills(LOOP_POINTS) + BEYOND_TIER1
    ckpt = session_dir / "bf16-masters-ckpt"
    res = _run(session_dir / "bf16-masters-kills", True, "session", faults, more=_ckpt(ckpt))
    assert res.ok, explain(res)
    assert len(res.recoveries) == len(LOOP_POINTS) + 1, story(res)
    assert ("ckpt", 4) in [(r["kind"], r["target"]) for r in res.recoveries], story(res)
    assert [e["step"] for e in res.of("checkpoint")] == checkpointed(res)
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"
    assert params_of(res) == params_of(ref)  # the bf16 parameters too: cast from the masters
    state, _ = read_checkpoint(ckpt)
    assert state["master_weights"]["0.weight"].dtype == torch.float32
    assert torch.equal(
        state["model"]["0.weight"], state["master_weights"]["0.weight"].to(torch.bfloat16)
    )


@pytest.fixture(scope="module")
def shard_ref(session_dir: Path) -> JobResult:
    ref = _run(session_dir / "shard-masters", True, "session", shard=True)
    assert ref.ok and ref.digests, explain(ref)
    return ref


@pytest.fixture(scope="module")
def shard_faults(session_dir: Path) -> JobResult:
    """The sharded masters killed at every phase, beyond tier 1 at step 5 (back to its
    checkpoint of step 4), and a rank's keeper lost at the last step."""
    faults = kills(LOOP_POINTS) + BEYOND_TIER1
    # a rank's keeper lost: its float32 shard rebuilt from the node's parity
    faults.append({"kind": "lose_memory", "rank": 1, "step": STEPS, "phase": "prepare"})
    ckpt = session_dir / "shard-masters-ckpt"
    res = _run(session_dir / "shard-masters-kills", True, "session", faults, shard=True,
               more=_ckpt(ckpt))  # fmt: skip
    assert res.ok, explain(res)
    assert_trace(res.run_dir)  # the fallback and the checkpoints replay through the model
    return res


def test_sharded_bf16_with_float32_masters_killed_at_every_phase_is_bitwise(
    shard_ref: JobResult, shard_faults: JobResult
) -> None:
    """Each rank retains its shard of the float32 masters, gradients and AdamW state; the
    bf16 parameters are all-gathered (the shards cast to bf16) after every step."""
    ref, res = shard_ref, shard_faults
    assert ref.digests is not None
    assert params_of(ref)[0] == params_of(ref)[1]  # every rank's model: the same cast
    assert ref.digests["0"]["param"] != ref.digests["1"]["param"]  # different shards
    kinds = [f["kind"] for f in res.of("failure")]
    lost = ["keeper_lost"] * 2
    assert kinds == ["crash"] * 4 + lost + ["crash"] * (len(LOOP_POINTS) - 4) + lost[:1], kinds
    assert len(res.recoveries) == len(LOOP_POINTS) + 2, story(res)
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


def test_sharded_masters_fall_back_to_their_disk_checkpoint_and_resume_from_it(
    session_dir: Path, shard_ref: JobResult, shard_faults: JobResult
) -> None:
    """Tier 3 of sharded float32 masters: both ranks of the node lose their memory (tier
    2 off), beyond tier 1: the job goes back to its latest checkpoint, each rank its own
    shard, and ends bitwise the failure-free run (``shard_faults``); a job resumed from
    that checkpoint does too (at another world size it is refused in one line:
    tests/retained/test_retained_shard.py)."""
    res = shard_faults
    assert ("ckpt", 4) in [(r["kind"], r["target"]) for r in res.recoveries], res.recoveries
    assert [e["step"] for e in res.of("checkpoint")] == checkpointed(res)
    ckpt = session_dir / "shard-masters-ckpt"
    durable = CheckpointStore(ckpt).durable_steps()
    assert durable == checkpointed(res)[-2:]
    # the older of the two kept: step 4's, or step 6's where step 6 was rolled back and
    # rerun (then step 4's was pruned: two are kept)
    first = durable[0]
    assert first in (4, 6), durable
    step = CheckpointStore(ckpt).path(first)
    # each rank wrote its own shard: the first weight's optimizer state spans both ranks'
    # shards, and its chunks lie in both ranks' files
    md = dcp.FileSystemReader(str(step)).read_metadata()
    files = {
        md.storage_data[i].relative_path
        for i in md.storage_data
        if i.fqn == "optim.state.0.weight.exp_avg"
    }
    assert files == {"__0_0.distcp", "__1_0.distcp"}, files
    # and any DCP user reads it whole: the float32 masters, the bf16 model their cast
    state, meta = read_checkpoint(step)
    assert meta is not None and meta["world_size"] == 2
    master, model = state["master_weights"]["0.weight"], state["model"]["0.weight"]
    assert master.dtype == torch.float32 and master.shape == (48, 12)
    assert torch.equal(model, master.to(torch.bfloat16))
    assert state["optim"]["state"]["0.weight"]["exp_avg"].shape == (48, 12)
    resumed = _run(
        session_dir / "shard-masters-resumed", True, "session", shard=True,
        more=f'resume = "{step}"\n',
    )  # fmt: skip
    assert resumed.ok, explain(resumed)
    assert_trace(resumed.run_dir)
    (started,) = resumed.of("core_init")
    assert started["start"] == first and resumed.recoveries == []
    assert digests_equal(resumed, shard_ref), "not bitwise equal to the failure-free run"
    assert params_of(resumed) == params_of(shard_ref)


def test_fp16_masters_with_a_grad_scaler_skip_alike_and_recover_bitwise(
    session_dir: Path,
) -> None:
    """fp16 parameters, float32 masters and a GradScaler whose first scale overflows
    fp16 (steps 1-3 skipped): the scaler unscales the float32 gradients in retained
    memory; sharded, every rank's inf/NaN finding is all-reduced, so every rank skips the
    same steps (without the all-reduce the job fails: a shard alone sees an inf). On two
    ranks sharded training is bitwise unsharded's, so the sharded run, killed after the
    decision of a skipped step, in the reduce of another and mid-apply of a real one,
    ends with the parameters and scale of the unsharded failure-free run."""
    args = ["--steps", "6", "--clip", "none", "--fp16-scaler"]
    settings = 'chunk_size = 128\nmaster_weights = true\ntier1_code = "parity"\n'
    ref = script_job(LOOP, session_dir / "fp16-scaler", settings, args)
    assert ref.ok and ref.digests, explain(ref)
    scales = [(ref.run_dir / f"scale-rank{r}").read_text() for r in (0, 1)]
    assert scales[0] == scales[1] and float(scales[0]) < 2.0**21, scales  # steps skipped
    assert params_of(ref)[0] == params_of(ref)[1]
    # step 2, skipped, rolled forward: its scaler update() replayed as a backoff; step 4,
    # the first real step, rolled forward: the optimizer's step and a finite update()
    points = [
        {"phase": "decide", "where": "after"},
        {"phase": "allreduce"},
        {"phase": "apply", "chunk": 1, "where": "mid_write"},
    ]
    faults = kills(points)
    res = script_job(
        LOOP, session_dir / "fp16-scaler-kills", settings + "shard = true\n", args, faults
    )
    assert res.ok, explain(res)
    assert_trace(res.run_dir)
    # every kill fired (the second may come during the first's recovery: one recovery)
    assert [f["kind"] for f in res.of("failure")] == ["crash"] * len(points)
    assert res.recoveries and res.recoveries[-1]["kind"] == "forward", res.recoveries
    assert params_of(res) == params_of(ref)
    assert [(res.run_dir / f"scale-rank{r}").read_text() for r in (0, 1)] == scales
