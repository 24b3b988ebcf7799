"""Which job, which process: a run directory used by two jobs keeps each job's records
and logs apart (``leto report`` shows the latest); every process of a job names itself
in ``ps`` and the event log records its pid, a promotion's too; a script that never
calls ``leto.wrap`` is told so while it runs, in one line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from jobs import HERE, TRAIN, explain, job

from leto.backends.gloo.procs import processes_with
from leto.cli import main

PLAIN = str(HERE / "scripts" / "plain.py")
PLAIN_DDP = str(HERE / "scripts" / "plain_ddp.py")
WARNING = "script runs without leto.wrap"


def test_two_jobs_in_one_run_directory(tag: str, capsys: pytest.CaptureFixture[str]) -> None:
    run = Path(tag) / "run"
    first = job(run, steps=2)
    second = job(run, steps=3)
    assert first.ok and second.ok, explain(second)
    events = second.events  # the whole log: both jobs' records
    ids = list(dict.fromkeys(e.get("job") for e in events))
    assert len(ids) == 2 and all(isinstance(i, str) and len(i) == 16 for i in ids), ids
    # every record names its job, the first job's records all come before the second's
    n_first = sum(e.get("job") == ids[0] for e in events)
    assert [e["job"] for e in events] == [ids[0]] * n_first + [ids[1]] * (len(events) - n_first)
    assert [e["event"] for e in events].count("job_start") == 2
    # each job's process logs in a folder of its own
    for i in ids:
        assert (run / "logs" / i / "node0-trainer0-1.log").exists(), sorted(run.rglob("*.log"))
    assert not list((run / "logs").glob("*.log"))
    # the report is the latest job's, and says the directory holds two
    assert main(["report", str(run), "--no-plot"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0]
        == f"{run} holds 2 jobs; this is the latest, job {ids[1]} (--job ID for another: {ids[0]})"
    )
    assert sum("JOB" in line for line in out) == 1 and f"job {ids[1]}" in out[1]
    assert "DONE     step 3" in "\n".join(out)
    assert main(["report", str(run), "--no-plot", "--job", ids[0][:8], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["final_step"] == 2
    # a script that calls leto.wrap is not told it does not
    assert not any(e["event"] == "unprotected" for e in events)
    assert WARNING not in second.text(0)


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().rstrip(b"\0").replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _titles(tag: str) -> dict[str, int]:
    """The job's processes by title, without the command in parentheses."""
    return {
        _title(p).split(" (")[0]: p for p in processes_with(tag) if _title(p).startswith("leto ")
    }


def _events(run: Path) -> list[dict[str, Any]]:
    try:
        text = (run / "events.jsonl").read_text()
    except OSError:
        return []
    return [json.loads(x) for x in text.splitlines() if x.endswith("}")]


def _wait(what: str, until: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = until()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_every_process_says_what_it_is(tag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A 1x2 job: in ps, the agent, the zygote, the keepers, the trainers and the shadows
    each name themselves; rank 1's trainer, found by its title and SIGKILLed, is replaced
    by its shadow, which is then titled trainer; the event log names every pid, and the
    promotion's old and new one."""
    run = Path(tag) / "run"
    env = {**os.environ, "TOPO": "1x2", "STEPS": "100000", "STEP_SLEEP": "0.05"}
    p = subprocess.Popen(
        [sys.executable, "-m", "leto.cli", "launch", "--nproc-per-node", "2", "--quiet",
         "--no-echo", "--run-dir", str(run), TRAIN],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait("a step", lambda: any(e["event"] == "step" for e in _events(run)))
        job_id = _events(run)[0]["job"]
        j = f"job {job_id[:8]}"
        want = {
            f"leto agent node 0 {j}",
            f"leto zygote node 0 {j}",
            *(
                f"leto {role} rank {r} {j}"
                for role in ("keeper", "trainer", "shadow")
                for r in (0, 1)
            ),
        }
        titles = _wait("every title", lambda: (t := _titles(tag)).keys() >= want and t)
        assert set(titles) == want, sorted(titles)
        assert titles[f"leto agent node 0 {j}"] == p.pid
        whole = _title(titles[f"leto trainer rank 1 {j}"])
        # the command is still there (pgrep -f finds it), cut at most at its end
        assert whole.startswith(f"leto trainer rank 1 {j} (leto launch --nproc-per-node 2 ")
        assert f"--run-dir {run} {TRAIN}" in whole
        with open(f"/proc/{titles[f'leto trainer rank 1 {j}']}/comm") as f:
            assert f.read().strip() == "leto trainer 1"

        def started() -> dict[tuple[str, int | None], int]:
            recs = [e for e in _events(run) if e["event"] == "process_started"]
            return {(e["role"], e.get("rank")): e["pid"] for e in recs}

        for (role, rank), pid in _wait(
            "8 process records", lambda: len(started()) == 8 and started()
        ).items():
            what = f"leto {role} node 0 {j}" if rank is None else f"leto {role} rank {rank} {j}"
            assert titles[what] == pid, (role, rank)

        old, shadow = titles[f"leto trainer rank 1 {j}"], titles[f"leto shadow rank 1 {j}"]
        os.kill(old, signal.SIGKILL)
        promoted = _wait(
            "the promotion",
            lambda: [e for e in _events(run) if e["event"] == "promoted"],
        )
        assert promoted[0]["rank"] == 1
        assert (promoted[0]["old_pid"], promoted[0]["pid"]) == (old, shadow), promoted
        now = _wait(
            "the promoted shadow's title",
            lambda: (t := _titles(tag)).get(f"leto trainer rank 1 {j}") == shadow and t,
        )
        assert now[f"leto trainer rank 0 {j}"] == titles[f"leto trainer rank 0 {j}"]
        # and leto report names both processes
        _wait("the recovery's end", lambda: any(e["event"] == "recovery_end" for e in _events(run)))
        assert main(["report", str(run), "--no-plot"]) == 0
        out = capsys.readouterr().out
        assert f"rank 1 (pid {old}) died" in out and f"(pid {old} -> {shadow})" in out, out
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_a_ddp_script_without_leto_wrap_is_told_at_its_process_group(tag: str) -> None:
    # (no shadows: each would run the plain script too, beside its trainer)
    res = job(Path(tag) / "run", steps=3, script=PLAIN_DDP, extra=["--no-shadows"])
    out = res.text(0)
    lines = [line for line in out.splitlines() if WARNING in line]
    assert len(lines) == 1, out  # the first rank's, on the node's console
    assert re.fullmatch(
        r"leto\[node 0\]: warning: rank [01]'s script runs without leto\.wrap \(it formed its "
        r"own process group\): nothing is protected, a failure ends the job; give your model, "
        r"optimizer and data to leto\.wrap and train through the session it returns "
        r"\(docs/loop\.md\)",
        lines[0],
    ), lines[0]
    told = res.of("unprotected")
    assert sorted(e["rank"] for e in told) == [0, 1], told
    assert all(e["detail"] == "it formed its own process group" for e in told)
    # it ran to its end all the same (and is then stopped, as before)
    assert out.index(WARNING) < out.index("without calling leto.wrap with backend='gloo'")


def test_a_script_without_collectives_is_told_within_seconds(tag: str) -> None:
    res = job(Path(tag) / "run", steps=1, script=PLAIN, env={"SLEEP": "6"}, extra=["--no-shadows"])
    told = res.of("unprotected")
    assert [e["detail"] for e in told] == ["it has run 3 s and refers to leto nowhere"] * 2, told
    first = min(e["t_rel"] for e in told)
    end = next(e["t_rel"] for e in res.events if e["event"] == "job_failed")
    assert end - first > 2.0  # told while it ran, not at its end
    assert res.text(0).count(WARNING) == 1, res.text(0)
