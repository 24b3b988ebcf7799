"""The overhead benchmark's CPU accounting: probes at two steps -> ms per step."""

from __future__ import annotations

import os

import pytest

from leto.bench.cpu import cpu_seconds, cpu_seconds_of, leto_cpu_report, plain_cpu_report
from leto.bench.overhead import cpu_summary
from leto.bench.workload import BenchError


def _probe(rank: int, step: int, pid: int, cpu: float, phases: dict[str, float], job=None):
    # wall time: twice the CPU in every phase, plus 1 s waiting in "decide"
    wall = {k: 2 * v for k, v in phases.items()} | {"decide": 1.0 * step}
    r = {"rank": rank, "step": step, "pid": pid, "cpu": cpu, "phases": phases, "phases_wall": wall}
    if job is not None:
        r["job"] = job
    return r


def test_leto_report_splits_trainers_phases_and_other_processes() -> None:
    recs = [
        # rank 0 sees every process of the job: itself (10), rank 1 (11), an agent (20)
        _probe(0, 5, 10, 3.0, {"forward": 1.0, "apply": 0.5},
               job={"10": 3.0, "11": 2.9, "20": 1.0}),
        _probe(1, 5, 11, 2.9, {"forward": 1.0, "apply": 0.4}),
        _probe(0, 15, 10, 13.0, {"forward": 5.0, "apply": 0.7, "snapshot": 0.1},
               job={"10": 13.0, "11": 13.1, "20": 1.5, "99": 7.0}),
        _probe(1, 15, 11, 13.1, {"forward": 5.2, "apply": 0.6}),
    ]  # fmt: skip
    rep = leto_cpu_report(recs, 5, 15)
    assert rep["trainer_ms_by_rank"] == pytest.approx([1000.0, 1020.0])
    assert rep["trainer_ms"] == pytest.approx(1010.0)
    # forward: (4.0 + 4.2) / 2 s over 10 steps; a phase new since the first probe counts whole
    assert rep["phases_ms"]["forward"] == pytest.approx(410.0)
    assert rep["phases_ms"]["apply"] == pytest.approx(20.0)
    assert rep["phases_ms"]["snapshot"] == pytest.approx(5.0)
    assert rep["phases_wall_ms"]["forward"] == pytest.approx(820.0)
    assert rep["phases_wall_ms"]["decide"] == pytest.approx(1000.0)
    assert "decide" not in rep["phases_ms"]
    # others: the agent only (trainers excluded; pid 99 started after the first probe)
    assert rep["others_ms"] == pytest.approx(50.0) and rep["others_procs"] == 1


def test_leto_report_skips_a_replaced_rank_and_refuses_no_probes() -> None:
    recs = [
        _probe(0, 1, 10, 1.0, {}, job={"10": 1.0}),
        _probe(0, 3, 10, 3.0, {}, job={"10": 3.0}),
        _probe(1, 1, 11, 1.0, {}),
        _probe(1, 3, 12, 0.1, {}),  # another process took rank 1's place
    ]
    rep = leto_cpu_report(recs, 1, 3)
    assert rep["trainer_ms_by_rank"] == pytest.approx([1000.0])
    with pytest.raises(BenchError, match="no trainer CPU probes at steps 1 and 4"):
        leto_cpu_report(recs, 1, 4)


def test_plain_report_uses_step_stamps() -> None:
    ev = [
        {"ev": "step", "rank": r, "step": s, "t": 0.0, "cpu": c}
        for r, s, c in [(0, 5, 2.0), (0, 9, 6.0), (1, 5, 2.0), (1, 9, 7.0), (1, 7, 0.0)]
    ]
    rep = plain_cpu_report(ev + [{"ev": "loaded", "rank": 0}], 5, 9)
    assert rep["trainer_ms_by_rank"] == pytest.approx([1000.0, 1250.0])
    with pytest.raises(BenchError, match="no CPU stamps"):
        plain_cpu_report(ev, 5, 10)


def test_cpu_summary_extra_is_the_job_cpu_ratio() -> None:
    cpus = {
        "plain": [{"trainer_ms": 1000.0}, {"trainer_ms": 1100.0}],
        "leto": [
            {
                "trainer_ms": 1060.0,
                "phases_ms": {"apply": 20.0},
                "phases_wall_ms": {"apply": 30.0, "decide": 8.0},
                "others_ms": 30.0,
            },
            {
                "trainer_ms": 1140.0,
                "phases_ms": {"apply": 10.0},
                "phases_wall_ms": {"apply": 20.0},
                "others_ms": 50.0,
            },
        ],
    }
    s = cpu_summary(cpus, world=4)
    assert s["plain"]["job_ms"] == pytest.approx(4 * 1050.0)
    assert s["leto"]["job_ms"] == pytest.approx(4 * 1100.0 + 40.0)
    assert s["leto"]["phases_ms"] == {"apply": pytest.approx(15.0)}
    assert s["leto"]["phases_wall_ms"] == {"apply": pytest.approx(25.0), "decide": 4.0}
    assert s["leto"]["extra_pct"] == pytest.approx(100.0 * (4440.0 / 4200.0 - 1.0))
    assert "extra_pct" not in s["plain"]
    assert "unused_core_ms" not in s["leto"]  # no step times given
    s = cpu_summary(cpus, world=4, step_s={"plain": 2.2, "leto": 2.3}, cores=2)
    assert s["plain"]["unused_core_ms"] == pytest.approx(4400.0 - 4200.0)
    assert s["leto"]["unused_core_ms"] == pytest.approx(4600.0 - 4440.0)


def test_cpu_seconds_reads_this_process() -> None:
    mine = cpu_seconds(os.getpid())
    assert mine is not None and mine > 0
    assert cpu_seconds(2**22 + 12345) is None  # above any pid_max: no such process
    assert str(os.getpid()) in cpu_seconds_of("no-process-has-this-tag-" + "x" * 8)


def test_overhead_interval_from_the_rounds() -> None:
    from leto.bench.overhead import ci95

    assert ci95([4.0]) is None  # one round: no interval
    lo, hi = ci95([1.0, 3.0])  # mean 2, sd sqrt(2), t(1) = 12.706
    assert (lo, hi) == pytest.approx((2 - 12.706, 2 + 12.706))
    lo, hi = ci95([2.0, 4.0, 6.0, 8.0, 10.0])  # mean 6, sd sqrt(10), t(4) = 2.776
    assert (lo, hi) == pytest.approx((6 - 2.776 * 10**0.5 / 5**0.5, 6 + 2.776 * 10**0.5 / 5**0.5))
    same = ci95([5.0] * 40)  # no spread: the interval is the mean (t beyond 30 df: 30's)
    assert same == pytest.approx([5.0, 5.0])


def test_plain_report_gives_forward_cpu_only_when_every_rank_stamped_it() -> None:
    ev = [
        {"ev": "step", "rank": r, "step": s, "cpu": c, "fwd": f}
        for r in (0, 1)
        for s, c, f in ((2, 10.0, 3.0), (4, 12.0, 3.8 + 0.2 * r))
    ]
    rep = plain_cpu_report(ev, 2, 4)
    assert rep["trainer_ms"] == pytest.approx(1000.0)
    assert rep["forward_ms"] == pytest.approx((400.0 + 500.0) / 2)
    del ev[-1]["fwd"]
    assert "forward_ms" not in plain_cpu_report(ev, 2, 4)


def test_adjusted_overhead_takes_the_machines_speed_out() -> None:
    from leto.bench.overhead import adjusted_by_round

    # round 2's machine is 10% slower for everything: the raw ratio moves, the
    # adjusted one (step per forward CPU) does not
    times = {"plain": [2.0, 2.2], "leto": [2.06, 2.266], "leto-no-tier2": [2.0, 2.2]}
    cpus = {
        "plain": [{"forward_ms": 500.0}, {"forward_ms": 550.0}],
        "leto": [{"phases_ms": {"forward": 500.0}}, {"phases_ms": {"forward": 550.0}}],
        "leto-no-tier2": [{"phases_ms": {"forward": 500.0}}, {"phases_ms": {"forward": 500.0}}],
    }
    adj = adjusted_by_round(times, cpus)
    assert adj["leto"] == pytest.approx([3.0, 3.0])
    # a job whose forward passes cost less for the same step time is slower per unit
    assert adj["leto-no-tier2"] == pytest.approx([0.0, 10.0])
    # a job without the gauge leaves its configuration out rather than guess
    cpus["leto"][1] = {"phases_ms": {}}
    assert set(adjusted_by_round(times, cpus)) == {"leto-no-tier2"}


def test_steal_share_between_two_readings() -> None:
    from leto.bench.overhead import machine_ticks, steal_pct

    now = machine_ticks()
    assert now is not None and 0 <= now[0] <= now[1]
    assert steal_pct((100, 10_000), (150, 11_000)) == pytest.approx(5.0)
    assert steal_pct((100, 10_000), (100, 12_000)) == 0.0
    # no reading, or no time between them: no figure rather than a guess
    assert steal_pct(None, now) is None and steal_pct(now, now) is None
