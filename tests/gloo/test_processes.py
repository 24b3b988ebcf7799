"""Which job: a run directory used by two jobs keeps each job's records and logs apart
(``leto report`` shows the latest)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobs import explain, job

from leto.cli import main


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
