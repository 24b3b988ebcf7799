"""``leto launch --slurm`` under a real Slurm: the test starts its own munged,
slurmctld and slurmd (Debian's slurm-wlm, a one-node cluster described by a minimal
slurm.conf in the test's directory, on free ports, its own munge key and socket), then
``srun`` starts the job's one node with a trainer SIGKILLed mid-step; it must end
bitwise equal to the same job started by hand. Skipped with the reason where Slurm is
not installed (the README's set-up installs no system package) or the test is not root
(slurmd runs the step as the submitting user and needs root to do so)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs import TRAIN, assert_trace, job

from leto.backends.gloo.harness import JobResult
from leto.backends.gloo.procs import free_port

NEEDED = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "sinfo")
MISSING = [n for n in NEEDED if shutil.which(n) is None]
pytestmark = pytest.mark.skipif(
    bool(MISSING) or os.geteuid() != 0,
    reason=f"Slurm is not installed here (no {', '.join(MISSING)}; apt install slurm-wlm)"
    if MISSING
    else "a one-node Slurm cluster needs root (slurmd runs steps as their user)",
)
STEPS = 5


def _conf(d: Path) -> str:
    host = socket.gethostname().split(".")[0]
    return "\n".join(
        [
            "ClusterName=letotest",
            f"SlurmctldHost={host}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={d / 'munge.sock'}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'ctld.pid'}",
            f"SlurmdPidFile={d / 'd.pid'}",
            f"SlurmctldLogFile={d / 'ctld.log'}",
            f"SlurmdLogFile={d / 'd.log'}",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "MpiDefault=none",
            f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
            f"PartitionName=t Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


@pytest.fixture
def slurm(tag: str) -> Iterator[dict[str, str]]:
    """A one-node Slurm cluster of the test's own: the environment srun needs."""
    d = Path(tag) / "slurm"
    for sub in ("state", "spool"):
        (d / sub).mkdir(parents=True)
    conf = d / "slurm.conf"
    conf.write_text(_conf(d))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run(["mungekey", "-c", "-k", str(d / "munge.key")], check=True)
    daemons = [
        subprocess.Popen(
            [
                "munged",
                "-F",
                "-f",
                f"--socket={d / 'munge.sock'}",
                f"--key-file={d / 'munge.key'}",
                f"--pid-file={d / 'munged.pid'}",
                f"--log-file={d / 'munged.log'}",
                f"--seed-file={d / 'munged.seed'}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
    ]
    try:
        deadline = time.monotonic() + 10
        while not (d / "munge.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        for daemon in ("slurmctld", "slurmd"):
            daemons.append(
                subprocess.Popen(
                    [daemon, "-D", "-c", "-f", str(conf)],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )  # fmt: skip
            )
        deadline = time.monotonic() + 30
        state = ""
        while time.monotonic() < deadline:
            r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
            state = r.stdout.strip()
            if state == "idle":
                break
            time.sleep(0.3)
        assert state == "idle", f"the test's Slurm node did not come up: {state!r} {r.stderr}"
        yield env
    finally:
        for p in reversed(daemons):
            p.terminate()
        for p in reversed(daemons):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_srun_starts_the_job_and_it_recovers_bitwise(tag: str, slurm: dict[str, str]) -> None:
    ref = job(Path(tag) / "ref", nnodes=1, nproc=2, steps=STEPS)
    run = Path(tag) / "run"
    crash = [{"kind": "crash", "rank": 1, "step": 3, "phase": "backward"}]
    r = subprocess.run(
        ["srun", "-N1", "--ntasks-per-node=1", f"-c{os.cpu_count()}", sys.executable, "-m",
         "leto.cli", "launch",
         "--slurm", "--nproc-per-node", "2", "--master-port", str(free_port()), "--run-dir",
         str(run), "--quiet", "--no-echo", "--hang-timeout", "3", "--heartbeat", "0.25",
         "--faults", json.dumps(crash), TRAIN],
        env={**slurm, "TOPO": "1x2", "STEPS": str(STEPS)}, capture_output=True, text=True,
        timeout=150,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    res = JobResult(run_dir=run, codes={0: [0]}, events=events, seconds=0.0)
    assert len(res.recoveries) == 1, [e.get("event") for e in events]
    assert res.digests is not None and res.digests == ref.digests  # bitwise
    assert_trace(run)
