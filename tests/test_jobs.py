"""A run directory used for two jobs (``leto.jobs``): ``leto report`` and ``leto spec
trace`` take the latest job's records, or ``--job ID``'s, and say in one line that the
directory holds several; a log whose records name no job is one job, as before.
``tests/gloo/test_launch.py`` runs two real jobs in one run directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_spec_trace import a_run

from leto.cli import main
from leto.jobs import NoSuchJob, choose

FIRST, SECOND = "1a2b3c4d00000001", "9f8e7d6c00000002"


def _job(records: list[dict[str, Any]], job: str, t0: float) -> list[dict[str, Any]]:
    return [{"t_rel": t0 + i * 0.1, **r, "job": job} for i, r in enumerate(records)]


def _write(run_dir: Path, records: list[dict[str, Any]]) -> Path:
    run_dir.mkdir(exist_ok=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_the_latest_job_or_the_one_named() -> None:
    recs = [{"job": "aa11"}, {"job": "bb22"}, {"job": "aa11"}, {"job": "bb33"}]
    latest = choose(recs)
    assert (latest.job, latest.jobs, latest.latest) == ("bb33", ("aa11", "bb22", "bb33"), True)
    assert latest.note("runs/x") == (
        "runs/x holds 3 jobs; this is the latest, job bb33 (--job ID for another: aa11, bb22)"
    )
    assert [r for r in recs if choose(recs, "a").holds(r)] == [{"job": "aa11"}] * 2
    assert choose(recs, "bb22").note("d") == "d holds 3 jobs; this is job bb22, the 2nd to start"
    with pytest.raises(NoSuchJob, match=r"--job bb: names 2 jobs \(bb22, bb33\)"):
        choose(recs, "bb")
    with pytest.raises(NoSuchJob, match=r"--job cc: no such job in the log \(its jobs: aa11,"):
        choose(recs, "cc")
    with pytest.raises(NoSuchJob):
        choose(recs, "")  # not a prefix of every job
    # a log written before records named their job: one job, no line about it
    old = choose([{"event": "step"}, {"event": "job_end"}])
    assert (old.job, old.jobs, old.note("d")) == ("", ("",), None)


def test_report_shows_the_latest_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = [
        {"event": "job_start", "nodes": 1, "nproc_per_node": 2, "script": "a.py"},
        {"event": "failure", "kind": "crash", "rank": 1, "step": 3},
        {"event": "job_end", "status": "failed"},
    ]
    second = [
        {"event": "job_start", "nodes": 1, "nproc_per_node": 2, "script": "b.py"},
        {"event": "training_done", "step": 5},
        {"event": "job_end", "status": "ok"},
    ]
    run = _write(tmp_path / "run", _job(first, FIRST, 0.0) + _job(second, SECOND, 0.0))
    assert main(["report", str(run), "--no-plot"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        f"{run} holds 2 jobs; this is the latest, job {SECOND} (--job ID for another: {FIRST})"
    )
    assert "b.py" in out[1] and not any("a.py" in line or "FAILURE" in line for line in out)
    assert "0 failure(s)" in "\n".join(out) and "status: ok" in out[-1]

    assert main(["report", str(run), "--no-plot", "--job", FIRST[:4], "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["job"], got["jobs"], got["failures"], got["status"]) == (FIRST, 2, 1, "failed")

    assert main(["report", str(run), "--no-plot", "--job", "77"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--job 77: no such job in the log" in err

    # one job: no line about jobs
    _write(run, _job(second, SECOND, 0.0))
    assert main(["report", str(run), "--no-plot"]) == 0
    assert "holds" not in capsys.readouterr().out


def test_trace_replays_the_latest_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = a_run()
    bad = a_run()
    bad[next(i for i, r in enumerate(bad) if r["event"] == "step")]["step"] = 7
    run = _write(tmp_path / "run", _job(good, FIRST, 0.0) + _job(bad, SECOND, 0.0))
    log = run / "events.jsonl"
    # the two jobs' records together would not replay: each job's own do (or not)
    assert main(["spec", "trace", str(run)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"trace DIVERGES at {log} (job {SECOND}, of the 2 jobs it holds):")
    assert main(["spec", "trace", str(run), "--job", FIRST]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"trace OK: {log} (job {FIRST}, of the 2 jobs it holds): 14 events")
    assert out.count("\n") == 1
    assert main(["spec", "trace", str(run), "--job", "f", "--json"]) == 2
    err = capsys.readouterr().err
    assert "--job f: no such job" in err and err.count("\n") == 1
    # a later job that stopped before training started has nothing to replay
    _write(run, _job(good, FIRST, 0.0) + _job([{"event": "job_start"}], SECOND, 0.0))
    assert main(["spec", "trace", str(run)]) == 2
    assert f"has no core records of job {SECOND}" in capsys.readouterr().err


def test_report_tells_a_split_its_repair_and_a_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new user's trial: the report said "0 failure(s), 0 restart(s)" of a job whose
    replicas disagreed and that restarted from its checkpoint."""
    events = [
        {"event": "job_start", "nodes": 1, "nproc_per_node": 3, "script": "a.py"},
        {"event": "replicas_disagree", "step": 6, "groups": [[0, 2], [1]], "repair": [[1, 0]]},
        {"event": "failure", "kind": "diverged", "rank": 1, "step": 6, "detected_by": "x"},
        {"event": "replicas_disagree", "step": 9, "groups": [[0, 2], [1]]},
        {"event": "job_restart", "attempt": 1, "of": 2, "cause": "the replicas disagree"},
        {"event": "job_end", "status": "restarting"},
    ]
    run = _write(tmp_path / "run", _job(events, FIRST, 0.0))
    assert main(["report", str(run), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert (
        "SPLIT    replicas disagree after step 6 ({0, 2} / {1}): rank 1 copied from rank 0" in out
    )
    assert "SPLIT    replicas disagree after step 9 ({0, 2} / {1}): not repaired" in out
    assert "RESTART  the job starts again from its checkpoint (restart 1 of 2)" in out
    assert "differed from its replicas" in out
    assert (
        "replicas disagreed 2 time(s), 1 rank(s) repaired from the majority; "
        "the job restarted from its checkpoint 1 time(s)"
    ) in out
    assert main(["report", str(run), "--no-plot", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["replica_splits"], got["replica_repairs"], got["job_restarts"]) == (2, 1, 1)
