"""Trace validation (``leto.spec.trace``, ``leto spec trace``) on logs written by hand.

A log the coordinator would write for a 1-node, 2-rank job with a crash and its
recovery replays; each way of doctoring it is refused at the line it touches; bad
input is exit 2 with one line. ``tests/gloo/test_trace.py`` does the same on the log
of a real job.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from leto.cli import main
from leto.core import events as ev
from leto.core.chunk import GARBAGE, LOST, NONE, TORN
from leto.core.errors import ProtocolError
from leto.core.recovery import Phase
from leto.spec.state_record import state_to_record
from leto.spec.trace import (
    Apply,
    Commit,
    CoreSetup,
    Retained,
    Snapshot,
    TraceError,
    adopt,
    decode,
    encode,
    rebuild,
    replay,
    run,
)

SETUP = CoreSetup(nodes=(2,), chunks=2, k=None)
ADOPT = {
    "data": [[1, 1], [1, 1]],
    "undo": [[NONE, NONE], [NONE, NONE]],
    "grad": [1, 1],
    "par": [[[1, 1], [1, 1]]],
    "gpar": [[1, 1]],
    "t2": 0,
    "t2lost": [],
}


def a_run() -> list[dict[str, Any]]:
    """Two steps, a crash of rank 1 after the first, an in-place recovery."""
    return [
        {"event": "job_start"},
        {"event": "core_init", **SETUP.to_record()},
        {"event": "training_started"},
        {"event": "core", "feed": [["Commit", 1]]},
        {"event": "core", "feed": [["Apply", 0, 1]]},
        {"event": "core", "feed": [["Apply", 1, 1]]},
        {"event": "step", "step": 1},
        {"event": "core", "feed": [["Crash", 1]]},
        {"event": "failure", "rank": 1, "phase": "running", "generation": 0, "step": 1},
        {"event": "core", "feed": [["Detect"]]},
        {"event": "recovery_start", "generation": 0, "from_step": 1},
        {"event": "core", "feed": [["Fence"]]},
        {"event": "fence", "generation": 1, "stale_killed": []},
        {"event": "core", "feed": [["Promote", 1]]},
        {"event": "promoted", "rank": 1, "generation": 1},
        {"event": "core", "feed": [["EndPromote"]]},
        {"event": "core", "adopt": ADOPT},
        {"event": "core", "feed": [["Reconcile"]]},
        {"event": "reconciled", "generation": 1, "kind": "inplace", "target": 1, "steps_lost": 0},
        {"event": "core", "feed": [["Rebuild"]]},
        {"event": "core", "feed": [["Resume"]]},
        {"event": "recovery_end", "generation": 1, "resumed_at": 1, "kind": "inplace"},
        {"event": "core", "feed": [["Commit", 2]]},
        {"event": "core", "feed": [["Apply", 0, 2]]},
        {"event": "core", "feed": [["Apply", 1, 2]]},
        {"event": "step", "step": 2},
        {"event": "training_done", "step": 2},
        {"event": "job_end"},
    ]


def numbered(records: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    return list(enumerate(records, 1))


def line_of(records: list[dict[str, Any]], event: str, nth: int = 0, **match: Any) -> int:
    hits = [
        n
        for n, r in numbered(records)
        if r["event"] == event and all(r.get(k) == v for k, v in match.items())
    ]
    return hits[nth]


def test_a_run_replays_with_every_record_checked() -> None:
    report = replay(numbered(a_run()))
    assert report.ok, report.line()
    # Commit and Apply replay as the aggregated CommitStep and ApplyStep: one event each
    commit, apply = 1, 1
    recovery = 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1  # Crash .. Resume (the adoption feeds none)
    assert report.events == 2 * commit + 4 * apply + recovery
    assert report.core_records == 15
    checked = {"step", "failure", "recovery_start", "fence", "promoted", "reconciled"}
    checked |= {"recovery_end", "training_done"}
    assert report.checked == sum(r["event"] in checked for r in a_run()) == 9
    assert report.line().startswith("trace OK: <records>: 14 events replayed")


def test_items_round_trip_and_malformed_items_are_refused() -> None:
    for item in (
        ev.Crash(1),
        ev.Detect(),
        ev.BeginChunk(0, 1),
        ev.LoseNode(0),
        Commit(3),
        Apply(1, 3),
        Snapshot(4),
        ev.CommitStep(3),
        ev.ApplyStep(3, (0, 2)),
    ):
        assert decode(json.loads(json.dumps(encode(item)))) == item
    assert encode(ev.ApplyStep(3, (0, 2))) == ["ApplyStep", 3, [0, 2]]
    for raw, why in [
        (["Melt", 1], "no event of the protocol"),
        (["Crash"], "takes 1 argument"),
        (["Crash", -1], "must be >= 0"),
        (["ApplyStep", 1, [2, 1]], "sorted and distinct"),
        (["Apply", 1, True], "must be an int"),
        ("Crash", "a feed item is"),
        ([], "a feed item is"),
    ]:
        with pytest.raises(TraceError, match=why):
            decode(raw)


def test_an_abbreviation_is_refused_at_a_step_the_model_is_not_at() -> None:
    model = SETUP.model()
    s = SETUP.initial(model)
    with pytest.raises(ProtocolError, match="next step is 1"):
        run(model, s, [Commit(2)])
    s, _ = run(model, s, [Commit(1)])
    with pytest.raises(ProtocolError, match="rank 0 is at step 0: it can finish step 1 only"):
        run(model, s, [Apply(0, 2)])
    # all or nothing: the refused batch names its inner event, the caller's state stands
    with pytest.raises(ProtocolError, match=r"ApplyStep\(step=2, ranks=\(1,\)\)") as exc:
        run(model, s, [Apply(0, 1), Apply(1, 1), Apply(1, 2)])
    assert "illegal in state TAIL" in str(exc.value)  # rank 1 finished step 1: in its tail
    s, _ = run(model, s, [Apply(0, 1), Apply(1, 1)])
    assert (s.committed, s.step) == (1, (1, 1))


def a_closed_run() -> list[dict[str, Any]]:
    """Two steps without a failure, as the gloo coordinator logs them: the votes of step
    2 show both ranks past their loop tail of step 1, so their closes come first."""
    return [
        {"event": "core_init", **SETUP.to_record()},
        {"event": "core", "feed": [["CommitStep", 1]]},
        {"event": "core", "feed": [["ApplyStep", 1, [0, 1]]]},
        {"event": "step", "step": 1},
        {"event": "core", "feed": [["Close", 0], ["Close", 1]]},
        {"event": "core", "feed": [["CommitStep", 2]]},
        {"event": "core", "feed": [["ApplyStep", 2, [0, 1]]]},
        {"event": "step", "step": 2},
        {"event": "training_done", "step": 2},
    ]


def test_a_step_begins_only_after_every_rank_closed_the_one_before() -> None:
    """The loop tail: the log of a run replays with each rank's Close between its finish
    and the next step's votes; the same log with a Close removed (a rank that never
    closed its step computed the next), or with a Close of a rank not in its tail, is
    refused at that line."""
    report = replay(numbered(a_closed_run()))
    assert report.ok, report.line()
    assert report.events == 2 + 2 + 2  # CommitStep, ApplyStep per step, and two closes
    recs = a_closed_run()
    recs[4]["feed"] = [["Close", 0]]  # rank 1's close removed
    d = replay(numbered(recs)).divergence
    assert d is not None and (d.line, d.event) == (6, "core"), d
    assert "CommitStep(step=2)" in d.why and "rank 1 is not idle" in d.why
    assert "txn ['idle', 'tail']" in d.state
    recs = a_closed_run()
    recs[4]["feed"] = [["Close", 0], ["Close", 1], ["Close", 1]]  # closed twice
    d = replay(numbered(recs)).divergence
    assert d is not None and (d.line, d.event) == (5, "core"), d
    assert "Close(rank=1)" in d.why and "illegal in state IDLE" in d.why


def test_the_gloo_feed_infers_the_closes_a_message_shows() -> None:
    """``model_feed.closes``: a rank acting in step s + 1 (the votes for it, its finish
    of it, a snapshot or checkpoint of the step boundary) has closed s; a message of
    another step shows nothing, and a rank not in its tail needs no close."""
    from leto.backends.gloo.model_feed import closes

    model = SETUP.model()
    s, _ = run(model, SETUP.initial(model), [ev.CommitStep(1), ev.ApplyStep(1, (0, 1))])
    assert closes(model, s, [ev.CommitStep(2)]) == [ev.Close(0), ev.Close(1)]
    assert closes(model, s, [Commit(2)]) == [ev.Close(0), ev.Close(1)]
    assert closes(model, s, [ev.ApplyStep(2, (1,))]) == [ev.Close(1)]
    assert closes(model, s, [Apply(0, 2)]) == [ev.Close(0)]
    assert closes(model, s, [Snapshot(1)]) == closes(model, s, [ev.BeginCheckpoint()])
    assert closes(model, s, [Snapshot(1)]) == [ev.Close(0), ev.Close(1)]
    for other in ([ev.CommitStep(3)], [ev.ApplyStep(1, (0,))], [Snapshot(0)], [ev.Crash(0)]):
        assert closes(model, s, other) == [], other
    s, _ = run(model, s, [ev.Close(0)])
    assert closes(model, s, [ev.CommitStep(2)]) == [ev.Close(1)]
    dead, _ = run(model, s, [ev.Crash(1)])  # a dead trainer closes nothing
    assert closes(model, dead, [ev.CommitStep(2)]) == []


def _recovering() -> tuple[Any, Any]:
    """The model reconciling after rank 1 lost its memory at step 1."""
    model = SETUP.model()
    s = SETUP.initial(model)
    s, _ = run(model, s, [Commit(1), Apply(0, 1), Apply(1, 1), ev.LoseMemory(1), ev.Detect()])
    s, _ = run(model, s, [ev.Fence(), ev.Promote(1), ev.EndPromote()])
    assert s.phase is Phase.RECONCILING
    return model, s


def test_adoption_is_checked() -> None:
    model, s = _recovering()
    lost = {**ADOPT, "data": [[1, 1], [LOST, LOST]], "grad": [1, LOST]}
    after = adopt(model, s, Retained.from_record(lost))
    assert after.data == ((1, 1), (LOST, LOST)) and model.plan(after).kind.value == "tier1"
    for change, why in [
        ({"data": [[1, 1], [1, 1]]}, "rank 1 chunk 0 is LOST in the model, reported 1"),
        ({"grad": [1, 1]}, "rank 1's gradients are LOST in the model"),
        ({"data": [[1, 1, 1], [LOST, LOST]]}, "rank 0: 2 chunks expected"),
        ({"data": [[1, -3], [LOST, LOST]]}, "rank 0 chunk 1: no chunk value -3"),
        ({"undo": [[NONE, TORN], [NONE, NONE]]}, f"rank 0 chunk 1: no undo value {TORN}"),
        ({"gpar": [[1, GARBAGE]]}, "node 0: no parity version"),
        ({"par": [[[1, 1]]]}, "node 0: parity of 2 chunks x 2 members expected"),
        ({"t2lost": [3]}, "lost blocks of nodes [3]"),
        # gradients released while the node's gradient parity still names them
        ({"grad": [NONE, LOST]}, "the reported state breaks ParityOK's gradient clause"),
    ]:
        with pytest.raises(ProtocolError, match=why.replace("[", r"\[").replace("]", r"\]")):
            adopt(model, s, Retained.from_record({**lost, **change}))
    # the same released gradients with the node's gradient parity LOST: a state of the spec
    released = adopt(model, s, Retained.from_record({**lost, "grad": [NONE, LOST], "gpar": [None]}))
    assert released.gpar == (None,) and released.grad == (NONE, LOST)
    running = SETUP.initial(model)
    with pytest.raises(ProtocolError, match="adopted only while reconciling"):
        adopt(model, running, Retained.from_record(lost))
    off = CoreSetup(nodes=(2,), chunks=2, k=None, tier1=False)
    m2 = off.model()
    s2, _ = run(m2, off.initial(m2), [ev.Crash(0), ev.Detect(), ev.Fence(), ev.Promote(0)])
    s2, _ = run(m2, s2, [ev.EndPromote()])
    assert adopt(m2, s2, Retained.from_record(ADOPT)).par == (None,)  # tier 1 off: no parity


Doctor = Callable[[list[dict[str, Any]]], tuple[int, str, str]]


def _remove_last_apply(recs: list[dict[str, Any]]) -> tuple[int, str, str]:
    n = line_of(recs, "step", step=1)
    del recs[n - 2]  # Apply(1, 1), just before: the step record moves up to its line
    return n - 1, "step", "the model's ranks are at [1, 0]"


def _renumber_step(recs: list[dict[str, Any]]) -> tuple[int, str, str]:
    n = line_of(recs, "step", step=2)
    recs[n - 1]["step"] = 3
    return n, "step", "every rank finished step 3; the model has committed step 2"


def _reorder(recs: list[dict[str, Any]]) -> tuple[int, str, str]:
    n = line_of(recs, "core", feed=[["Commit", 2]])
    recs[n - 1], recs[n] = recs[n], recs[n - 1]  # Apply(0, 2) before the votes are in
    return n, "core", "refuses Apply(rank=0, step=2)"


def _remove_failure(recs: list[dict[str, Any]]) -> tuple[int, str, str]:
    n = line_of(recs, "core", feed=[["Crash", 1]])
    del recs[n - 1]
    return n, "failure", "failure follows ApplyStep, not the event it reports"


def _other_kind(recs: list[dict[str, Any]]) -> tuple[int, str, str]:
    n = line_of(recs, "reconciled")
    recs[n - 1]["kind"] = "tier2"
    return n, "reconciled", "the log says tier2 to step 1"


def _resurrect(recs: list[dict[str, Any]]) -> tuple[int, str, str]:
    recs[line_of(recs, "core", feed=[["Crash", 1]]) - 1]["feed"] = [["LoseMemory", 1]]
    return line_of(recs, "core", adopt=ADOPT), "core", "chunk 0 is LOST in the model"


def _no_init(recs: list[dict[str, Any]]) -> tuple[int, str, str]:
    del recs[line_of(recs, "core_init") - 1]
    return line_of(recs, "core"), "core", "no core_init record before this one"


def _refused_by_the_coordinator(recs: list[dict[str, Any]]) -> tuple[int, str, str]:
    n = line_of(recs, "step", step=1)
    recs.insert(n, {"event": "job_failed", "error": "...", "feed": [["Apply", 0, 3]]})
    return n + 1, "job_failed", "the coordinator stopped the job"


def _tolerated(recs: list[dict[str, Any]]) -> tuple[int, str, str]:
    n = line_of(recs, "step", step=1)
    recs.insert(n, {"event": "model_mismatch", "error": "x", "feed": [["Apply", 0, 3]]})
    return n + 1, "model_mismatch", "let a refusal pass"


DOCTORS: dict[str, Doctor] = {
    "an event removed": _remove_last_apply,
    "a step renumbered": _renumber_step,
    "events reordered": _reorder,
    "a failure's event removed": _remove_failure,
    "another recovery kind": _other_kind,
    "lost memory found again": _resurrect,
    "no core_init": _no_init,
    "a refusal that stopped the job": _refused_by_the_coordinator,
    "a refusal let pass": _tolerated,
}


@pytest.mark.parametrize("name", sorted(DOCTORS))
def test_a_doctored_log_diverges_at_the_line_it_touches(name: str) -> None:
    recs = copy.deepcopy(a_run())
    line, event, why = DOCTORS[name](recs)
    report = replay(numbered(recs))
    d = report.divergence
    assert d is not None, f"{name}: the doctored log replays"
    assert (d.line, d.event) == (line, event), report.line()
    assert why in d.why, report.line()
    assert f"<records>:{line} ({event})" in report.line() and "[model: " in report.line()


def _write(path: Path, records: list[dict[str, Any]], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def test_leto_spec_trace_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _write(run_dir / "events.jsonl", a_run())
    assert main(["spec", "trace", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith(f"trace OK: {run_dir / 'events.jsonl'}: 14 events") and out.count("\n") == 1
    )
    assert main(["spec", "trace", str(run_dir / "events.jsonl"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ok"] is True and got["events"] == 14 and got["divergence"] is None
    # a writer killed half way through its last line: that line is skipped
    _write(run_dir / "events.jsonl", a_run(), tail='{"event": "core", "fe')
    assert main(["spec", "trace", str(run_dir)]) == 0
    capsys.readouterr()

    recs = copy.deepcopy(a_run())
    line, _, _ = _renumber_step(recs)
    bad = _write(tmp_path / "doctored.jsonl", recs)
    assert main(["spec", "trace", str(bad)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"trace DIVERGES at {bad}:{line} (step): ") and out.count("\n") == 1
    assert main(["spec", "trace", str(bad), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["divergence"]["line"] == line

    lines = [json.dumps(r) for r in a_run()]
    cases = {
        str(tmp_path / "nowhere"): "no such file or directory",
        str(tmp_path): "no event log at",
        str(_write(tmp_path / "none.jsonl", a_run()[:1] + a_run()[2:3])): "has no core records",
        str(_write(tmp_path / "mid.jsonl", [], "\n".join([*lines[:3], "{oops", *lines[3:]]))): (
            "mid.jsonl:4: not JSON"
        ),
        str(_write(tmp_path / "arr.jsonl", [], "[1, 2]\n")): 'naming its "event"',
    }
    for path, why in cases.items():
        assert main(["spec", "trace", path]) == 2, path
        err = capsys.readouterr().err
        assert err.startswith("leto spec trace: error: ") and why in err and err.count("\n") == 1


def test_a_take_over_goes_on_from_a_state_the_log_passed_through() -> None:
    """A coordinator that took over (``coordinator_took_over``) starts from the state its
    commit record rebuilt: one its predecessor was in lately (here, before rank 1's
    finish of step 1 reached etcd), and the replay goes on from there; a state the log
    never passed through is a divergence at that line."""
    recs = a_run()
    apply_1 = line_of(recs, "core", feed=[["Apply", 1, 1]])
    _, lagging = rebuild(recs[: apply_1 - 1])  # before rank 1's finish of step 1
    took = {"event": "coordinator_took_over", "state": state_to_record(lagging)}
    # the successor hears rank 1's finish again and carries on
    log = [*recs[:apply_1], took, *recs[apply_1 - 1 :]]
    report = replay(numbered(log))
    assert report.ok, report.line()
    _, done = rebuild(recs)  # committed step 2: never the state at the take-over
    bad = [*recs[:apply_1], {**took, "state": state_to_record(done)}, *recs[apply_1:]]
    report = replay(numbered(bad))
    assert not report.ok and report.divergence is not None
    assert report.divergence.line == apply_1 + 1
    assert "a state the log's coordinator was not in lately" in report.divergence.why
    # the successor's own log (a run directory of its own) replays from the record alone
    own = [{**took, "core_init": recs[1]}, *recs[apply_1 - 1 :]]
    report = replay(numbered(own))
    assert report.ok, report.line()
    assert report.core_records == sum(r["event"] == "core" for r in own)


# --- the commands a coordinator sent, checked against the effects -------------------------

COMMANDS_AFTER: dict[str, dict[str, Any]] = {  # a_run's core record -> the command it implies
    '[["Commit", 1]]': {"t": "commit", "step": 1, "gen": 0},
    '[["Detect"]]': {"t": "abort", "gen": 0},
    '[["Fence"]]': {"t": "fence", "gen": 1, "kill": []},
    '[["Promote", 1]]': {"t": "promote_rank", "rank": 1, "gen": 1, "warm": True},
    '[["Reconcile"]]': {"t": "reconcile", "gen": 1, "kind": "inplace", "target": 1}
    | {"repairs": [], "retake_t2": False, "diverged": []},
    '[["Rebuild"]]': {"t": "rebuild", "gen": 1},
    '[["Resume"]]': {"t": "resume", "gen": 1, "step": 1, "t2": 0},
    '[["Commit", 2]]': {"t": "commit", "step": 2, "gen": 1},
}


def a_run_with_commands() -> list[dict[str, Any]]:
    """:func:`a_run` as a coordinator that logs its commands writes it."""
    out = []
    for rec in a_run():
        out.append(rec)
        cmd = COMMANDS_AFTER.get(json.dumps(rec.get("feed")))
        if rec["event"] == "core" and cmd is not None:
            out.append({"event": "command", "to": None, "message": dict(cmd)})
    return out


def test_the_commands_sent_are_checked_against_the_effects() -> None:
    recs = a_run_with_commands()
    report = replay(numbered(recs))
    assert report.ok, report.line()
    assert report.checked == 9 + len(COMMANDS_AFTER)
    assert replay(numbered(a_run())).ok  # a log of no command records replays as before


def _doctor_command(recs: list[dict[str, Any]], t: str, **fields: Any) -> int:
    """Change the fields of the first ``t`` command; its line."""
    n = next(n for n, r in numbered(recs) if r["event"] == "command" and r["message"]["t"] == t)
    recs[n - 1]["message"].update(fields)
    return n


@pytest.mark.parametrize(
    ("t", "fields", "why"),
    [
        ("commit", {"step": 2}, "call for {'t': 'commit', 'step': 1, 'gen': 0}"),
        ("fence", {"kill": [1]}, "'kill': []"),
        ("promote_rank", {"warm": False}, "'warm': True"),
        (
            "reconcile",
            {"repairs": [{"what": "tier1", "rank": 1, "chunk": 0, "version": 1, "count": 1}]},
            "'repairs': []",
        ),
        ("resume", {"step": 0}, "'step': 1"),
        ("abort", {"gen": 1}, "'gen': 0"),
    ],
)
def test_a_doctored_command_diverges(t: str, fields: dict[str, Any], why: str) -> None:
    recs = a_run_with_commands()
    n = _doctor_command(recs, t, **fields)
    report = replay(numbered(recs))
    d = report.divergence
    assert d is not None, f"a doctored {t} replays"
    assert (d.line, d.event) == (n, "command"), report.line()
    assert "the coordinator sent" in d.why and why in d.why, report.line()


def test_a_command_no_effect_calls_for_diverges() -> None:
    recs = a_run_with_commands()
    n = line_of(recs, "command", 0)  # commit(1): sent twice
    recs.insert(n, copy.deepcopy(recs[n - 1]))
    report = replay(numbered(recs))
    assert report.divergence is not None and report.divergence.line == n + 1, report.line()
    assert "call for no (further) command" in report.divergence.why
    recs = a_run_with_commands()
    n = line_of(recs, "core", feed=[["Apply", 0, 1]])  # a finish implies no command
    recs.insert(
        n, {"event": "command", "to": None, "message": {"t": "commit", "step": 1, "gen": 0}}
    )
    report = replay(numbered(recs))
    assert report.divergence is not None and report.divergence.line == n + 1, report.line()
