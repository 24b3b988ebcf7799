"""``leto spec trace`` on the log of a real gloo job with failures, and on doctored copies.

The job (1 node x 2 ranks) has a SIGKILL mid-chunk (rolled forward), a keeper lost
while its parity is updated (rebuilt from tier 1) and a hang in the all-reduce
(fenced, killed, promoted). Its log replays through the core's model; each doctored
copy (an event removed, a step renumbered, events reordered, a fence command that
kills no one) is refused at the line it touches, with exit status 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jobs import explain, job

from leto.backends.gloo.harness import JobResult
from leto.cli import main

FAULTS = [
    {"kind": "crash", "rank": 1, "step": 3, "phase": "apply", "chunk": 2, "where": "mid_write"},
    {"kind": "lose_memory", "rank": 0, "step": 5, "phase": "parity", "chunk": 1},
    {"kind": "hang", "rank": 1, "step": 7, "phase": "allreduce"},
]


@pytest.fixture(scope="module")
def faulted(session_dir: Path) -> JobResult:
    res = job(session_dir / "trace-faults", steps=9, faults=FAULTS)
    assert res.ok and len(res.recoveries) == len(FAULTS), explain(res)
    return res


def records(res: JobResult) -> list[dict[str, Any]]:
    lines = (res.run_dir / "events.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x]


def trace(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["spec", "trace", str(path)])
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out
    return code, out


def test_the_log_of_a_job_with_failures_replays(
    faulted: JobResult, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = trace(faulted.run_dir, capsys)
    assert code == 0 and out.startswith("trace OK: "), out
    recs = records(faulted)
    feeds = [x for r in recs if r["event"] == "core" for x in r.get("feed", [])]
    names = {f[0] for f in feeds}
    assert {
        "CommitStep",
        "ApplyStep",
        "Crash",
        "LoseMemory",
        "Hang",
        "Reconcile",
        "Resume",
    } <= names
    assert sum("adopt" in r for r in recs) == len(FAULTS)  # one adoption per recovery
    # the commands sent, each logged (and checked: leto.spec.trace)
    sent = [r["message"] for r in recs if r["event"] == "command"]
    assert {"commit", "abort", "fence", "promote_rank", "reconcile", "rebuild", "resume"} <= {
        m["t"] for m in sent
    }
    assert [m["kill"] for m in sent if m["t"] == "fence"] == [[], [], [1]]  # the hung rank
    # O(ranks) per step: a record for the votes and one for the finished ranks, no more
    steps = sum(r["event"] == "step" for r in recs)
    per_step = [f for f in feeds if f[0] in ("CommitStep", "ApplyStep")]
    assert len(per_step) <= 3 * (steps + len(FAULTS)), len(per_step)
    report = json.loads(out_json(faulted.run_dir, capsys))
    assert report["ok"] and report["checked"] >= steps + 4 * len(FAULTS), report


def out_json(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["spec", "trace", str(path), "--json"]) == 0
    return capsys.readouterr().out


def _line(recs: list[dict[str, Any]], pred: Any) -> int:
    """The 1-based line of the first record matching ``pred``."""
    return next(n for n, r in enumerate(recs, 1) if pred(r))


def _feed_is(name: str) -> Any:
    return lambda r: r["event"] == "core" and r.get("feed", [[None]])[0][0] == name


def _event_removed(recs: list[dict[str, Any]]) -> tuple[int, str]:
    # the ranks' ApplyStep of step 2: the step record moves up into its line
    n = _line(recs, lambda r: r["event"] == "step" and r["step"] == 2)
    assert recs[n - 2]["feed"][0][0] == "ApplyStep", recs[n - 2]
    del recs[n - 2]
    return n - 1, "step"


def _step_renumbered(recs: list[dict[str, Any]]) -> tuple[int, str]:
    n = _line(recs, lambda r: r["event"] == "step" and r["step"] == 4)
    recs[n - 1]["step"] = 5
    return n, "step"


def _events_reordered(recs: list[dict[str, Any]]) -> tuple[int, str]:
    # the fence fed before the failure's Detect
    n = _line(recs, _feed_is("Detect"))
    m = _line(recs, _feed_is("Fence"))
    recs[n - 1], recs[m - 1] = recs[m - 1], recs[n - 1]
    return n, "core"


def _fence_kills_another(recs: list[dict[str, Any]]) -> tuple[int, str]:
    # the hang's fence: the agents told to kill no one
    n = _line(recs, lambda r: r["event"] == "command" and r["message"].get("kill"))
    recs[n - 1]["message"]["kill"] = []
    return n, "command"


@pytest.mark.parametrize(
    "doctor",
    [_event_removed, _step_renumbered, _events_reordered, _fence_kills_another],
    ids=lambda f: f.__name__[1:],
)
def test_a_doctored_copy_of_the_log_fails_naming_the_line(
    faulted: JobResult, tmp_path: Path, capsys: pytest.CaptureFixture[str], doctor: Any
) -> None:
    recs = records(faulted)
    line, event = doctor(recs)
    path = tmp_path / "doctored.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    code, out = trace(path, capsys)
    assert code == 1, out
    assert out.startswith(f"trace DIVERGES at {path}:{line} ({event}): "), out
    assert "[model: phase " in out, out


def test_the_log_is_a_behaviour_of_the_tla_spec_under_tlc(
    faulted: JobResult, capsys: pytest.CaptureFixture[str]
) -> None:
    """TraceLeto.tla: every event the coordinator fed, expanded to the spec's actions,
    is one TLC step of Leto.tla; a copy with two events swapped deadlocks there."""
    from leto.spec.tlatrace import run_module, to_tla
    from leto.spec.trace import read

    code = main(["spec", "trace", str(faulted.run_dir), "--tlc"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and out[0].startswith("trace OK: ") and out[1].startswith("TLC trace OK: ")
    module, cfg, n = to_tla(read(faulted.run_dir)[1])
    head, body = module.split("Trace == <<\n    ", 1)
    events = body.removesuffix("\n>>\n====\n").split(",\n    ")
    assert len(events) == n > 100
    # the first Finish before the last chunk's ParityChunk of the same rank and step
    i = next(k for k, e in enumerate(events) if e.startswith('[a |-> "Finish"'))
    events[i - 1], events[i] = events[i], events[i - 1]
    doctored = head + "Trace == <<\n    " + ",\n    ".join(events) + "\n>>\n====\n"
    bad = run_module(doctored, cfg, n)
    assert not bad.ok and "Deadlock" in bad.result.violations
    assert bad.replayed == i - 1, (bad.replayed, i)
    assert bad.line().startswith(f"TLC trace DIVERGES at event {i} of {n}")


# The demo's failure during a recovery: rank 3 dies in the backward of step 5, then
# rank 1 before carrying out that recovery's Reconcile, so the survivors' reconcile is
# interrupted. The node's gradient parity must not outlive the gradients it names.
INTERRUPTED = [
    {"kind": "crash", "rank": 3, "step": 5, "phase": "backward"},
    {"kind": "crash", "rank": 1, "step": 5, "phase": "recovery", "where": "Reconcile"},
]


def test_an_interrupted_reconcile_replays_under_tlc(
    session_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    res = job(session_dir / "trace-interrupted", nnodes=2, nproc=2, steps=7, faults=INTERRUPTED)
    assert res.ok, explain(res)
    recs = records(res)
    assert [r["in_phase"] for r in recs if r["event"] == "failure"] == ["backward", "reconcile"]
    code = main(["spec", "trace", str(res.run_dir), "--tlc"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0, out
    assert out[0].startswith("trace OK: ") and out[1].startswith("TLC trace OK: "), out
