"""``leto bench goodput --rounds``: systems interleaved in rotated order, one failure
schedule per round shared by every system, the gain and its interval over the rounds.
The jobs are stubbed: what is tested is the bookkeeping, not the machine."""

from __future__ import annotations

from typing import Any

import pytest

from leto.bench import goodput
from leto.bench.report import goodput_table
from leto.bench.workload import BenchError, Workload

WL = Workload.for_params(20_000, world=2, batch=8)
STEPS = {"ckpt-disk": [80, 90, 70], "gemini": [85, 95, 75], "leto": [100, 99, 98]}


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    seen: list[tuple[str, int]] = []
    refs = iter([1.0, 1.0, 1.2, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])

    def result(system: str, schedule: list[dict[str, Any]]) -> dict[str, Any]:
        r = sum(1 for s, _ in seen if s == system)
        seen.append((system, len(schedule)))
        n = STEPS[system][r]
        return {"steps": n, "step_s": 1.0, "failures": len(schedule), "timeline": [(0.0, 0)]}

    monkeypatch.setattr(goodput, "plain_step_time", lambda wl: next(refs))
    monkeypatch.setattr(
        goodput, "run_leto", lambda wl, *, budget_s, schedule, progress: result("leto", schedule)
    )
    monkeypatch.setattr(
        goodput,
        "run_system",
        lambda system, wl, *, budget_s, mtbf_s, schedule, progress: result(system, schedule),
    )
    return seen


def test_rounds_rotate_the_order_and_share_each_rounds_schedule(calls: list[Any]) -> None:
    res = goodput.run_goodput(
        ["leto", "gemini", "ckpt-disk"], WL, budget_s=100.0, mtbf_s=20.0, rounds=3, progress=False
    )
    order = [s for s, _ in calls]
    first = order[:3]
    assert order[3:6] == first[1:] + first[:1] and order[6:] == first[2:] + first[:2]
    # one schedule per round (seed + round), the same for every system of the round
    assert res["schedules"] == [goodput.failure_times(100.0, 20.0, 2, r) for r in range(3)]
    for r in range(3):
        assert len({n for _, n in calls[3 * r : 3 * r + 3]}) == 1
    # ETTR: steps x the mean of the plain steps measured around the job / budget
    assert res["plain_step_s_runs"][:4] == [1.0, 1.0, 1.2, 1.0]
    leto = res["systems"]["leto"]
    assert len(leto["runs"]) == 3 and leto["ettr"] == pytest.approx(sum(leto["ettr_runs"]) / 3)
    assert res["best_baseline"] == "gemini"
    by_round = res["gain_pp_by_round"]
    assert len(by_round) == 3
    for r, g in enumerate(by_round):
        a, b = leto["runs"][r], res["systems"]["gemini"]["runs"][r]
        assert g == pytest.approx(100.0 * (a["ettr"] - b["ettr"]))
    assert res["gain_pp_vs_best_baseline"] == pytest.approx(sum(by_round) / 3)
    lo, hi = res["gain_pp_ci95"]
    assert lo < res["gain_pp_vs_best_baseline"] < hi
    assert "95% CI" in goodput_table(res) and "over 3 rounds" in goodput_table(res)


def test_one_round_has_no_interval(calls: list[Any]) -> None:
    res = goodput.run_goodput(["leto", "gemini"], WL, budget_s=100.0, mtbf_s=20.0, progress=False)
    assert res["rounds"] == 1 and res["gain_pp_ci95"] is None
    # gemini runs first (plain 1.0 before and after), then leto (plain 1.0 and 1.2)
    assert res["gain_pp_vs_best_baseline"] == pytest.approx(100.0 * (100 * 1.1 - 85 * 1.0) / 100)
    assert "95% CI" not in goodput_table(res)


def test_zero_rounds_is_refused() -> None:
    with pytest.raises(BenchError, match="at least one round"):
        goodput.run_goodput(["leto"], WL, budget_s=1.0, mtbf_s=1.0, rounds=0, progress=False)


def test_torchft_work_counts_each_step_once_by_its_quorums_share() -> None:
    ev = [
        {"ev": "step", "step": 5, "t": 1.0, "participants": 4},
        {"ev": "step", "step": 5, "t": 1.1, "participants": 4},  # another group's report
        {"ev": "discard", "step": 6, "t": 1.5},
        {"ev": "step", "step": 6, "t": 2.0, "participants": 3},  # a group healing
        {"ev": "step", "step": 7, "t": 3.0, "participants": 3},
        {"ev": "step", "step": 8, "t": 4.0, "participants": 4},
    ]
    got = goodput.torchft_work(ev, 4)
    assert got == [(1.0, 5, 1.0), (2.0, 6, 0.75), (3.0, 7, 0.75), (4.0, 8, 1.0)]
