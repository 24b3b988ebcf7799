"""A two-node job started as srun starts it: one ``leto launch --slurm`` per node, each
with only the variables srun would give its task (no --nnodes, --node-rank or endpoint
on the command line), a trainer SIGKILLed mid-step; it ends bitwise equal to the same
job started with torchrun's flags and no failure. Slurm itself is not installed by the
README's set-up, so srun's variables are set by the test (docs/launch.md says so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from jobs import TRAIN, assert_trace, job

from leto.backends.gloo.harness import JobResult
from leto.backends.gloo.procs import free_port, tie_to_parent

STEPS = 5


def test_srun_tasks_make_the_job_and_it_recovers_bitwise(tag: str) -> None:
    ref = job(Path(tag) / "ref", nnodes=2, nproc=1, steps=STEPS)
    run = Path(tag) / "slurm"
    port = free_port()
    crash = [{"kind": "crash", "rank": 1, "step": 3, "phase": "backward"}]
    common = {
        "TOPO": "2x1",
        "STEPS": str(STEPS),
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "127.0.0.1,127.0.0.1",  # both "nodes" are this machine
    }
    env = tie_to_parent({k: v for k, v in os.environ.items() if not k.startswith("SLURM")})
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "leto.cli",
                "launch",
                "--slurm",
                "--master-port",
                str(port),
                "--run-dir",
                str(run),
                "--quiet",
                "--no-echo",
                "--hang-timeout",
                "3",
                "--heartbeat",
                "0.25",
                "--faults",
                json.dumps(crash),
                TRAIN,
            ],
            env={**env, **common, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    res = JobResult(run_dir=run, codes={0: [0], 1: [0]}, events=events, seconds=0.0)
    assert len(res.recoveries) == 1, [e.get("event") for e in events]
    assert res.digests is not None and res.digests == ref.digests  # bitwise
    assert_trace(run)
