"""Bad input to ``leto launch``: a clear error and a clean exit, nothing left behind."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from jobs import HERE, TRAIN, explain, job

from leto.backends.gloo.harness import run_local
from leto.cli import main

ENV_SCRIPT = str(HERE / "scripts" / "torchrun_env.py")


def launch(args: list[str], capsys: pytest.CaptureFixture[str]) -> SimpleNamespace:
    """``leto launch`` in this process: these cases end before any process is started."""
    code = main(["launch", *args])
    captured = capsys.readouterr()
    return SimpleNamespace(returncode=code, stderr=captured.err, stdout=captured.out)


def test_missing_script_bad_endpoint_bad_fault_plan(
    tag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    r = launch(["--run-dir", tag, "no/such/script.py"], capsys)
    assert r.returncode == 2 and "not found" in r.stderr
    r = launch(["--run-dir", tag, "--rdzv-endpoint", "localhost", TRAIN], capsys)
    assert r.returncode == 2 and "HOST:PORT" in r.stderr
    for fault, why in [
        ('"kind": "melt", "phase": "forward"', "kind 'melt'"),
        ('"kind": "crash", "phase": "forward", "chunk": 1', "phase 'forward' takes no chunk"),
        ('"kind": "corrupt", "phase": "forward", "chunk": -1', "chunk: -1 is not a chunk index"),
        (
            '"kind": "corrupt", "phase": "prepare", "chunk": 1',
            "at phase 'prepare' would be sealed unseen",
        ),
    ]:
        plan = '[{"rank": 0, "step": 1, ' + fault + "}]"
        r = launch(["--run-dir", tag, "--faults", plan, TRAIN], capsys)
        assert r.returncode == 2 and why in r.stderr, (fault, r.stderr)
    r = launch(["--run-dir", tag, "--nnodes", "2", TRAIN], capsys)
    assert r.returncode == 2 and "--rdzv-endpoint" in r.stderr
    r = launch(["--run-dir", tag, "--node-rank", "3", TRAIN], capsys)
    assert r.returncode == 2 and "--node-rank 3" in r.stderr


def test_port_in_use(tag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t = time.monotonic()
        r = launch(["--run-dir", tag, "--rdzv-endpoint", f"127.0.0.1:{port}", TRAIN], capsys)
    assert r.returncode == 1
    assert f"127.0.0.1:{port} is in use" in r.stderr
    assert time.monotonic() - t < 10


def test_wrong_rendezvous_endpoint(tag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: nobody answers there
        r = launch(
            ["--run-dir", tag, "--nnodes", "2", "--node-rank", "1", "--rdzv-timeout", "1.5",
             "--rdzv-endpoint", f"127.0.0.1:{port}", TRAIN],
            capsys,
        )  # fmt: skip
    assert r.returncode == 1
    assert "cannot reach the rendezvous endpoint" in r.stderr


def test_script_that_crashes_at_import(tag: str) -> None:
    res = job(Path(tag) / "run", steps=3, script=str(HERE / "scripts" / "crash_at_import.py"))
    assert res.codes[0] == [1], explain(res)
    assert res.error is not None and "broken at import" in res.error
    assert "failed before training started" in res.error
    (fail,) = res.of("job_failed")
    assert "RuntimeError: this script is broken at import" in fail.get("traceback", "")


def test_model_that_differs_from_the_retained_state(tag: str) -> None:
    # two crashes of rank 1: the second promotes a shadow started after the first
    # (incarnation > 4), whose model is wider than what rank 1 retains
    faults = [
        {"kind": "crash", "rank": 1, "step": 2, "phase": "forward"},
        {"kind": "crash", "rank": 1, "step": 3, "phase": "forward"},
    ]
    res = job(
        Path(tag) / "run", steps=6, faults=faults, script=str(HERE / "scripts" / "mismatch.py")
    )
    assert res.codes[0] == [1], explain(res)
    assert res.error is not None
    assert "does not match the retained state" in res.error
    assert "(24, 8)" in res.error and "(16, 8)" in res.error


def test_topology_that_differs_from_the_launch(tag: str) -> None:
    res = job(Path(tag) / "run", steps=3, env={"TOPO": "2x2"})
    assert res.codes[0] == [1], explain(res)
    assert res.error is not None and "topology" in res.error


def test_script_without_leto_wrap(tag: str) -> None:
    res = job(Path(tag) / "run", steps=1, script=str(HERE / "scripts" / "plain.py"))
    assert res.codes[0] == [1], explain(res)
    assert res.error is not None and "without calling leto.wrap" in res.error


def test_torchruns_flags_on_real_processes(tag: str) -> None:
    """--local-ranks-filter shows rank 1's output only (rank 0's is in its log), the
    trainers see --rdzv-id and --role as torchrun's variables, and a config dict that
    names no topology takes the launched one."""
    flags = ["--quiet", "--local-ranks-filter", "1", "--rdzv-id", "job-7", "--role", "trn"]
    res = run_local(ENV_SCRIPT, run_dir=Path(tag) / "run", extra=flags, timeout=120)
    assert res.ok and not res.leftovers, explain(res)
    out = res.output[0][-1]
    assert "[rank 1] torchrun 1 job-7 trn 0" in out and "[rank 1] wrapped gloo 1 2" in out
    assert "[rank 0]" not in out, out
    (log,) = [p for p in res.run_dir.rglob("*trainer0-*.log")]
    assert "torchrun 0 job-7 trn 0" in log.read_text()


def test_config_file_without_topology_and_with_a_typo(tag: str) -> None:
    """A file given to leto.wrap(config=...) that names no topology takes the launched
    one; a key's typo is one line naming the key it meant, and the job ends promptly."""
    good, typo = Path(tag) / "good.toml", Path(tag) / "typo.toml"
    good.write_text("[leto]\nchunk_size = 64\n")
    typo.write_text('[leto]\nbackend = "gloo"\nchekpoint_dir = "ck"\n')
    res = run_local(ENV_SCRIPT, run_dir=Path(tag) / "good", script_args=[str(good)])
    assert res.ok and not res.leftovers, explain(res)
    assert "[rank 0] wrapped gloo 1 2" in res.output[0][-1]
    res = run_local(ENV_SCRIPT, run_dir=Path(tag) / "typo", script_args=[str(typo)])
    assert res.codes[0] == [1] and not res.leftovers, explain(res)
    out = res.output[0][-1]
    line = f"leto config ({typo}): chekpoint_dir: unknown setting (did you mean checkpoint_dir?)"
    assert f"] {line}\n" in out and "Traceback" not in out, out
    assert res.seconds < 30


def test_sigkill_of_the_launcher_leaves_nothing_behind(tag: str) -> None:
    """The agent is SIGKILLed mid-training: its keepers, zygote, trainers and shadows
    die with it (parent-death signals) and their memfd memory is freed; no /dev/shm entry
    (the ``tag`` fixture checks both)."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from leto.backends.gloo.procs import processes_with

    run = Path(tag) / "run"
    env = {**os.environ, "TOPO": "1x2", "STEPS": "100000"}
    p = subprocess.Popen(
        [sys.executable, "-m", "leto.cli", "launch", "--nproc-per-node", "2", "--quiet",
         "--no-echo", "--run-dir", str(run), TRAIN],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    started = False
    while time.monotonic() < deadline and not started:
        time.sleep(0.2)
        log = run / "events.jsonl"
        if log.exists():
            started = any(
                json.loads(x)["event"] == "step" for x in log.read_text().splitlines() if x
            )
    assert started, "training did not start"
    procs = processes_with(tag)
    assert len(procs) >= 6  # the agent, 2 keepers, the zygote, 2 trainers (+ shadows)
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.monotonic() + 5
    while processes_with(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(tag) == []


def test_a_spare_of_an_etcd_job_is_started_with_its_etcd_rendezvous(tmp_path: Path) -> None:
    """`--spares` with `--rdzv-backend etcd`: each spare's command line names the same
    etcd members and job id, and parses back to the same rendezvous (nothing started)."""
    import argparse

    from leto.adapters.launch import _check, configure, spare_command

    parser = argparse.ArgumentParser()
    configure(parser)
    run_dir = str(tmp_path / "run")
    members = "127.0.0.1:12379,127.0.0.1:22379,127.0.0.1:32379"
    args = parser.parse_args(
        [
            "--nnodes",
            "2",
            "--spares",
            "1",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            members,
            "--rdzv-id",
            "job-7",
            "--run-dir",
            run_dir,
            TRAIN,
        ]  # fmt: skip
    )
    checked = _check(args)
    assert not isinstance(checked, int)
    host, port, _, _, etcd = checked
    assert etcd is not None and (host, port) == ("127.0.0.1", 0) and etcd.local == "127.0.0.1"
    cmd = spare_command(args, host, port, run_dir)
    spare = parser.parse_args(cmd[cmd.index("launch") + 1 :])
    assert spare.spare and spare.rdzv_backend == "etcd" and spare.rdzv_endpoint == members
    again = _check(spare)
    assert not isinstance(again, int) and again[4] == etcd
