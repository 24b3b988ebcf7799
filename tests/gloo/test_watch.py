"""Seeing a job run (leto.backends.gloo.watch): the progress line, the Prometheus
metrics, TensorBoard scalars, all read from the run's event log; a watcher that fails
never stops the job."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
from jobs import explain, job

from leto.backends.gloo.eventlog import EventLog
from leto.backends.gloo.watch import Metrics, ProgressLine, TensorBoard, Watchers

STEP_S = 0.25


def records() -> list[dict[str, Any]]:
    """A run: three steps, a crash of rank 1 recovered in place (tier 1), two steps more."""
    out: list[dict[str, Any]] = []
    t = 100.0
    for step in (1, 2, 3):
        t += STEP_S
        out.append({"event": "step", "t": t, "step": step, "loss": 1.0 / step})
    out.append({"event": "failure", "t": t, "kind": "crash", "rank": 1})
    out.append({"event": "shadow", "t": t, "rank": 1, "state": "cold"})
    t += 1.0
    out.append({"event": "recovery_end", "t": t, "seconds": 0.75, "kind": "tier1", "resumed_at": 3})
    out.append({"event": "shadow", "t": t, "rank": 1, "state": "warm"})
    out.append({"event": "degraded", "t": t, "rank": 0, "reason": "x"})
    for step in (4, 5):
        t += STEP_S
        out.append({"event": "step", "t": t, "step": step, "loss": 1.0 / step})
    return out


def test_progress_line_is_rate_limited_and_shows_recoveries() -> None:
    lines: list[str] = []
    now = [0.0]
    p = ProgressLine(lines.append, every_s=10.0, clock=lambda: now[0])
    for rec in records()[:3]:
        p(rec)
    assert lines == []  # within the period: nothing yet
    now[0] = 11.0
    p(records()[3])  # a failure is not a step: still nothing
    assert lines == []
    for rec in records()[3:7]:
        p(rec)
    # the recovery's end shows at once: step, loss, the steps' pace, the count
    assert lines == ["step 3  loss 0.3333  0.250 s/step  recoveries 1"]
    now[0] = 22.0
    for rec in records()[7:]:
        p(rec)
    assert lines[-1].startswith("step 4  loss 0.2500  1.250 s/step  recoveries 1")


def scrape(address: str) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_follow_the_log_and_are_served_on_the_address_given(tmp_path: Path) -> None:
    log = EventLog(None)
    w = Watchers(
        log, say=lambda _: None, progress_every=None, metrics=("127.0.0.1", 0), tensorboard=None
    )
    try:
        assert w.address is not None and w.address.startswith("127.0.0.1:")
        for rec in records():
            log.write(rec.pop("event"), **rec)
        m = scrape(w.address)
    finally:
        w.close()
    assert m["leto_steps_total"] == 5
    assert m["leto_loss"] == pytest.approx(0.2)
    assert m["leto_step_seconds"] > 0
    assert m['leto_failures_total{kind="crash"}'] == 1
    assert m['leto_recoveries_total{kind="tier1"}'] == 1
    assert m["leto_recovery_seconds_count"] == 1 and m["leto_recovery_seconds_sum"] == 0.75
    assert m['leto_shadows{state="warm"}'] == 1 and m['leto_shadows{state="cold"}'] == 0
    assert m["leto_degraded_ranks"] == 1
    with pytest.raises(OSError):  # closed with the job
        scrape(w.address)


def test_a_watcher_that_raises_is_dropped_and_the_log_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = EventLog(None)
    seen: list[str] = []

    def broken(rec: dict[str, Any]) -> None:
        raise ValueError("no")

    log.listeners += [broken, lambda rec: seen.append(rec["event"])]
    log.write("step", step=1)
    log.write("step", step=2)
    assert seen == ["step", "step"] and len(log.listeners) == 1
    assert "stopped watching the job: ValueError: no" in capsys.readouterr().err
    log.listeners.append(Metrics())
    log.write("step")  # a step record without its step: the metrics stop, the log goes on
    log.write("step", step=3)
    assert len(log.records) == 4 and len(log.listeners) == 1
    assert "Metrics stopped watching the job: KeyError" in capsys.readouterr().err


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_tensorboard_scalars_by_step(tmp_path: Path) -> None:
    tb = TensorBoard(str(tmp_path))
    for rec in records():
        tb(rec)
    tb.close()
    s = scalars(tmp_path)
    assert [st for st, _ in s["leto/loss"]] == [1, 2, 3, 4, 5]
    assert s["leto/loss"][1][1] == pytest.approx(0.5)
    assert s["leto/recoveries"][-1] == (5, 1.0)
    assert s["leto/recovery_seconds"] == [(3, 0.75)]


def test_a_real_job_with_a_crash_writes_its_scalars(tmp_path: Path) -> None:
    tb = tmp_path / "tb"
    res = job(
        tmp_path / "run",
        steps=6,
        faults=[{"rank": 1, "step": 3, "kind": "crash", "phase": "backward"}],
        extra=["--tensorboard", str(tb), "--metrics", "127.0.0.1:0"],
    )
    assert res.ok, explain(res)
    assert len([e for e in res.events if e["event"] == "recovery_end"]) == 1
    s = scalars(tb)
    assert [st for st, _ in s["leto/loss"]] == [1, 2, 3, 4, 5, 6]
    assert s["leto/recoveries"][-1] == (6, 1.0)
    assert len(s["leto/recovery_seconds"]) == 1
