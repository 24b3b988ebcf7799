"""Recovery breakdowns from event records: the phases partition the total."""

from __future__ import annotations

import pytest

from leto.bench.gloojob import leto_breakdown, step_time
from leto.bench.goodput import failure_times
from leto.bench.timeline import PHASES, restart_breakdown
from leto.bench.workload import BenchError


def _ev(ev: str, t: float, rank: int, gen: int, pid: int, **kw: object) -> dict[str, object]:
    return {"ev": ev, "t": t, "rank": rank, "gen": gen, "pid": pid, **kw}


def test_restart_breakdown_partitions_the_total() -> None:
    W = 2
    events = [_ev("step", 9.0, r, 0, 10 + r, step=11) for r in range(W)]
    events.append(_ev("fail", 10.0, 1, 0, 11, step=12))
    for r, dt in ((0, 0.0), (1, 0.5)):  # rank 1 is the slower one at every mark
        events += [
            _ev("main", 11.0 + dt, r, 1, 20 + r),
            _ev("torch", 13.0 + dt, r, 1, 20 + r),
            _ev("model", 14.0 + dt, r, 1, 20 + r),
            _ev("pg", 15.0 + dt, r, 1, 20 + r),
            _ev("loaded", 16.0 + dt, r, 1, 20 + r, step=8),
        ]
        events += [_ev("step", 17.0 + dt + 0.1 * i, r, 1, 20 + r, step=9 + i) for i in range(4)]
    failure = {"rank": 1, "pid": 11, "t_detect": 10.05, "t_respawn": 10.25, "new_gen": 1}
    b = restart_breakdown(events, failure, W)
    assert b["detection"] == pytest.approx(0.05)
    assert b["process_state"] == pytest.approx(14.5 - 10.05)
    assert b["communicator"] == pytest.approx(1.0)
    assert b["model_state"] == pytest.approx(1.0)
    assert b["lost_work"] == pytest.approx(17.5 + 0.3 - 16.5)  # steps 9..12 on the last rank
    assert sum(b[p] for p in PHASES) == pytest.approx(b["total"])
    assert b["total"] == pytest.approx(17.8 - 10.0)
    d = b["detail"]
    assert (d["failed_step"], d["resumed_from"], d["steps_recomputed"]) == (12, 8, 4)
    assert d["import_torch"] == pytest.approx(2.0)
    assert d["stop_workers"] == pytest.approx(0.2)


def test_restart_breakdown_needs_every_rank() -> None:
    events = [_ev("fail", 1.0, 0, 0, 5, step=3)]
    with pytest.raises(ValueError, match="reported"):
        restart_breakdown(events, {"rank": 0, "pid": 5, "t_detect": 1.1, "new_gen": 1}, 2)


def _leto_log() -> list[dict[str, object]]:
    ms = {
        "detect": 1.0,
        "fence": 5.0,
        "promote": 20.0,
        "rejoin": 100.0,
        "reconcile": 300.0,
        "rebuild": 4.0,
    }
    return [
        {"event": "step", "t": 99.5, "step": 11},
        {"event": "failure", "t": 100.04, "rank": 1},
        {"event": "recovery_end", "t": 100.04 + sum(ms.values()) / 1e3, "phases_ms": ms,
         "resumed_at": 11, "kind": "inplace", "steps_lost": 0, "promoted": [{"rank": 1}]},
        {"event": "step", "t": 100.9, "step": 12},
        {"event": "step", "t": 101.3, "step": 13},
    ]  # fmt: skip


def test_leto_breakdown_partitions_the_total() -> None:
    b = leto_breakdown(_leto_log(), {"t": 100.0, "rank": 1, "step": 12})
    assert b["detection"] == pytest.approx(0.041)
    assert b["process_state"] == pytest.approx(0.025)
    assert b["model_state"] == pytest.approx(0.300)
    assert b["communicator"] == pytest.approx(0.104)
    assert b["lost_work"] == pytest.approx(100.9 - 100.47)
    assert sum(b[p] for p in PHASES) == pytest.approx(b["total"]) == pytest.approx(0.9)
    assert b["detail"]["leto_phases_ms"]["rejoin"] == 100.0


def test_leto_breakdown_names_the_survivors_that_kept_their_compute() -> None:
    log = _leto_log()
    assert leto_breakdown(log, {"t": 100.0, "rank": 1, "step": 12})["detail"]["computes_kept"] == []
    end = log[2]["t"]
    assert isinstance(end, float)
    log[3:3] = [
        {"event": "compute_kept", "t": end + 0.001, "rank": 2, "step": 12},
        {"event": "compute_kept", "t": end + 0.002, "rank": 0, "step": 12},
        {"event": "compute_kept", "t": end - 5.0, "rank": 3, "step": 12},  # an earlier one
    ]
    b = leto_breakdown(log, {"t": 100.0, "rank": 1, "step": 12})
    assert b["detail"]["computes_kept"] == [0, 2]


def test_leto_breakdown_refuses_a_missing_record() -> None:
    with pytest.raises(BenchError, match="failure"):
        leto_breakdown(_leto_log(), {"t": 100.0, "rank": 3, "step": 12})


def test_step_time_from_committed_steps() -> None:
    log = [{"event": "step", "t": 10.0 + 0.5 * s, "step": s} for s in range(1, 21)]
    assert step_time(log, 5) == pytest.approx(0.5)
    assert step_time(log, 5, 9) == pytest.approx(0.5)
    with pytest.raises(BenchError):
        step_time(log, 20)


def test_failure_times_are_poisson_and_seeded() -> None:
    a = failure_times(10_000.0, 50.0, 4, seed=3)
    assert a == failure_times(10_000.0, 50.0, 4, seed=3)
    assert a != failure_times(10_000.0, 50.0, 4, seed=4)
    assert all(0 < f["t"] < 10_000.0 and 0 <= f["rank"] < 4 for f in a)
    assert [f["t"] for f in a] == sorted(f["t"] for f in a)
    assert len(a) == pytest.approx(200, rel=0.25)  # budget / MTBF
    with pytest.raises(BenchError, match="MTBF"):
        failure_times(100.0, 0.0, 4, seed=0)


def test_leto_breakdown_of_a_step_rolled_forward_loses_no_work() -> None:
    # a death after the vote: the recovery keeps the step (resumed at it), so the
    # recovery's end is when training runs again, and nothing is computed again
    log = _leto_log()
    log[2] = {**log[2], "resumed_at": 12, "kind": "forward"}
    b = leto_breakdown(log, {"t": 100.0, "rank": 1, "step": 12})
    assert b["lost_work"] == 0.0
    assert b["total"] == pytest.approx(0.47)
    assert sum(b[p] for p in PHASES) == pytest.approx(b["total"])
    assert b["detail"]["resumed_at"] == 12 and b["detail"]["steps_lost"] == 0


def _torchft_log() -> list[dict[str, object]]:
    """Three groups train at 10 steps/s; group 1 dies at 2.05 s in step 21 (after its
    forward), the others wait for the quorum, commit steps 21 and 22 at 3/4 width, and
    the restarted group heals to step 22 and commits step 23 with them."""
    W, ev = 3, []
    for s in range(11, 21):  # steady: every group, every 0.1 s
        ev += [_ev("step", s * 0.1, r, 0, 10 + r, step=s, participants=W) for r in range(W)]
    ev.append(_ev("fail", 2.05, 1, 0, 11, step=21))
    ev += [_ev("discard", 2.06, r, 0, 10 + r, step=21) for r in (0, 2)]
    ev += [
        _ev("step", 4.0 + s * 0.1, r, 0, 10 + r, step=21 + s, participants=2)
        for s in (0, 1)
        for r in (0, 2)
    ]
    new = [("main", 2.5), ("torch", 3.0), ("model", 3.5), ("pg", 3.6)]
    new += [("heal_start", 4.15), ("heal_recv", 4.25)]
    ev += [_ev(name, t, 1, 1, 21) for name, t in new]
    ev.append(_ev("loaded", 4.3, 1, 1, 21, step=22))
    ev += [
        _ev("step", 4.35, r, g, p, step=23, participants=W)
        for r, g, p in ((1, 1, 21), (0, 0, 10), (2, 0, 12))
    ]
    return ev


def test_torchft_breakdown_partitions_the_total_and_counts_the_survivors() -> None:
    from leto.bench.ftjob import torchft_breakdown

    failure = {"rank": 1, "pid": 11, "t_detect": 2.1, "t_respawn": 2.4, "new_gen": 1}
    b = torchft_breakdown(_torchft_log(), failure, world=3, batch=8)
    assert b["detection"] == pytest.approx(0.05)
    assert b["process_state"] == pytest.approx(3.5 - 2.1)
    assert b["communicator"] == pytest.approx(4.15 - 3.5)  # manager up + the quorum
    assert b["model_state"] == pytest.approx(4.3 - 4.15)  # the heal: received and applied
    assert b["lost_work"] == pytest.approx(0.05)
    assert b["total"] == pytest.approx(4.35 - 2.05)
    assert sum(b[p] for p in PHASES) == pytest.approx(b["total"])
    d = b["detail"]
    assert (d["failed_step"], d["healed_to"], d["rejoined_at"]) == (21, 22, 23)
    assert d["quorum_wait"] == pytest.approx(0.55) and d["transfer"] == pytest.approx(0.1)
    s = d["survivors"]
    # steps 21, 22 (2 groups) and 23 (the survivors' first report comes with the new one's)
    assert s["steps"] == 3 and s["first_commit_after"] == pytest.approx(4.0 - 2.05)
    assert s["steady_steps_per_s"] == pytest.approx(10.0)
    assert s["rows_per_s"] == pytest.approx((2 + 2 + 3) * 8 / 2.3)
    assert s["fraction_of_steady"] == pytest.approx(3 / 2.3 / 10.0)


def test_torchft_breakdown_needs_the_heal() -> None:
    from leto.bench.ftjob import torchft_breakdown

    log = [e for e in _torchft_log() if e["ev"] != "heal_start"]
    failure = {"rank": 1, "pid": 11, "t_detect": 2.1, "t_respawn": 2.4, "new_gen": 1}
    with pytest.raises(ValueError, match="heal_start"):
        torchft_breakdown(log, failure, world=3, batch=8)
