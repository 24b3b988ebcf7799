"""Periodic DCP checkpoints on real processes: a failure beyond both tiers falls back to
the latest durable checkpoint (not step 0), and a job whose every process was killed
resumes from its checkpoint (`leto launch --resume DIR`); both end bitwise equal to the
failure-free run (parameters, optimizer state, process state: ``training_done``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import TRAIN, digests_equal, explain, job

from leto.backends.gloo.harness import JobResult
from leto.backends.gloo.procs import free_port, processes_with, tie_to_parent
from leto.retained.checkpoint import CheckpointStore
from leto.retained.dcp_state import read_checkpoint

STEPS = 9


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    res = job(tmp_path_factory.mktemp("ref") / "run", steps=STEPS, env={"TIER2": "0"})
    assert res.ok and res.digests, explain(res)
    return res


def test_fallback_goes_to_the_latest_durable_checkpoint(tag: str, ref: JobResult) -> None:
    # tier 2 off, both ranks of the node lose their memory at step 5: beyond both tiers
    faults = [
        {"kind": "lose_memory", "rank": 0, "step": 5, "phase": "finish"},
        {"kind": "lose_memory", "rank": 1, "step": 5, "phase": "finish"},
    ]
    ckpt = Path(tag) / "ckpt"
    env = {"TIER2": "0", "CKPT": str(ckpt), "CKPT_EVERY": "2"}
    res = job(Path(tag) / "run", steps=STEPS, faults=faults, env=env)
    assert res.ok, explain(res)
    (rec,) = res.recoveries
    assert (rec["kind"], rec["target"]) == ("ckpt", 4), rec  # checkpoints at 2, 4 (not 0)
    assert [e["step"] for e in res.of("checkpoint")] == [2, 4, 6, 8]
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"
    # written once for the replica group: one DCP save, each rank's process state beside it
    step = CheckpointStore(ckpt).path(8)
    # a new checkpoint's writers keep the latest durable one: it is the fallback until then
    assert CheckpointStore(ckpt).durable_steps() == [6, 8]
    names = sorted(p.name for p in step.iterdir())
    assert ".metadata" in names and "leto-rank0.json" in names and "leto-rank1.json" in names
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(step)).read_metadata()
    assert "model.0.weight" in md.state_dict_metadata
    assert "optim.state.0.weight.exp_avg" in md.state_dict_metadata
    # DCP's planner writes each replicated tensor once, spread over the ranks: the two
    # ranks' files together are one copy (a single process's save of the same state), not 2
    both = sum((step / n).stat().st_size for n in names if n.endswith(".distcp"))
    state, _ = read_checkpoint(step)
    one = Path(tag) / "one"
    dcp.save(state, checkpoint_id=str(one), no_dist=True)
    single = sum(p.stat().st_size for p in one.iterdir() if p.name.endswith(".distcp"))
    assert both < 1.3 * single, (both, single)


def test_young_daly_interval_on_gloo(tag: str, ref: JobResult) -> None:
    # an MTBF of one second and 0.1 s steps: Young/Daly's interval, a few steps
    env = {"TIER2": "0", "CKPT": str(Path(tag) / "ckpt"), "CKPT_MTBF": "1", "STEP_SLEEP": "0.1"}
    res = job(Path(tag) / "run", steps=STEPS, env=env)
    assert res.ok, explain(res)
    steps = [e["step"] for e in res.of("checkpoint")]
    assert steps and all(s % steps[0] == 0 for s in steps), steps
    assert digests_equal(res, ref)


def _launch(run_dir: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "leto.cli", "launch", "--nnodes", "1", "--nproc-per-node", "2",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--run-dir", str(run_dir),
        "--quiet", "--hang-timeout", "3", "--heartbeat", "0.25", TRAIN,
    ]  # fmt: skip
    full = tie_to_parent({**os.environ, "TOPO": "1x2", **env})
    run_dir.mkdir(parents=True, exist_ok=True)
    out = open(run_dir / "launch.out", "w")  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=full,
                            start_new_session=True)  # fmt: skip


def _checkpointed(run_dir: Path, step: int) -> bool:
    log = run_dir / "events.jsonl"
    if not log.exists():
        return False
    for line in log.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "checkpoint" and e.get("step", -1) >= step:
            return True
    return False


def test_a_job_killed_whole_resumes_from_its_checkpoint(tag: str, ref: JobResult) -> None:
    ckpt = Path(tag) / "ckpt"
    env = {"TIER2": "0", "CKPT": str(ckpt), "CKPT_EVERY": "2", "STEPS": str(STEPS)}
    first = Path(tag) / "first"
    p = _launch(first, {**env, "STEP_SLEEP": "0.2"})
    try:
        deadline = time.monotonic() + 120
        while not _checkpointed(first, 4):
            assert p.poll() is None, (first / "launch.out").read_text()
            assert time.monotonic() < deadline, "no checkpoint of step 4 in time"
            time.sleep(0.05)
    finally:  # every process of the job: the launcher, its agent, trainers, keepers, shadows
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    deadline = time.monotonic() + 10
    while processes_with(str(first)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(str(first)) == []
    latest = CheckpointStore(ckpt).latest()
    assert latest is not None and 4 <= latest < STEPS
    res = job(Path(tag) / "resumed", steps=STEPS, env=env, extra=["--resume", str(ckpt)])
    assert res.ok, explain(res)
    (started,) = res.of("core_init")
    assert started["start"] == latest
    assert res.recoveries == []
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"


def test_resume_from_what_is_not_a_checkpoint_is_one_line(tag: str, tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "leto.cli", "launch", "--resume", str(tmp_path), TRAIN],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert f"{tmp_path} is not a torch.distributed.checkpoint directory" in lines[0]
