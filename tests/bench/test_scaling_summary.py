"""``summarize_scaling``: how recovery grows with the state, from per-size results."""

from __future__ import annotations

import pytest

from leto.bench.recovery import summarize_scaling
from leto.bench.report import scaling_table
from leto.bench.workload import BenchError

GIB = 2**30


def _result(phases: dict[str, tuple[float, float]]) -> dict[str, object]:
    """One size's recovery result: system -> (total, lost work)."""
    return {
        "systems": {
            n: {"total_s": t, "phases": {"total": t, "lost_work": lost}}
            for n, (t, lost) in phases.items()
        }
    }


def _scaling(sizes_gib: list[float], rows: list[dict[str, tuple[float, float]]]) -> dict:
    return {
        "sizes": [f"{g}G" for g in sizes_gib],
        "state_bytes_per_rank": [int(g * GIB) for g in sizes_gib],
        "totals": {n: [r[n][0] for r in rows] for n in rows[0]},
        "results": [_result(r) for r in rows],
    }


def test_slopes_split_resume_and_lost_work() -> None:
    res = summarize_scaling(
        _scaling(
            [0.0, 0.5, 1.0],
            [
                {"ckpt-disk": (10.0, 2.0), "leto": (1.0, 0.5)},
                {"ckpt-disk": (15.0, 5.0), "leto": (1.5, 0.75)},
                {"ckpt-disk": (20.0, 8.0), "leto": (2.0, 1.0)},
            ],
        )
    )
    assert res["slope_s_per_gib"]["total"] == pytest.approx({"ckpt-disk": 10.0, "leto": 1.0})
    assert res["slope_s_per_gib"]["lost_work"] == pytest.approx({"ckpt-disk": 6.0, "leto": 0.5})
    assert res["resume"] == {"ckpt-disk": [8.0, 10.0, 12.0], "leto": [0.5, 0.75, 1.0]}
    assert res["added_s"]["total"] == {"ckpt-disk": 10.0, "leto": 1.0}
    assert res["leto_slope_vs_disk"] == pytest.approx(0.1)
    table = scaling_table(res)
    assert "leto's total grows 10.0x slower than ckpt-disk's" in table
    assert table.count("ckpt-disk") >= 3  # total, resume and lost work blocks
    assert "deaths at the update" not in table  # the default: after the forward pass
    upd = scaling_table({**res, "fail_at": "update"})
    assert upd.splitlines()[0].endswith("deaths at the update, after the step's vote and commit")


def test_a_single_size_has_no_slope() -> None:
    with pytest.raises(BenchError, match="two different model sizes"):
        summarize_scaling(_scaling([0.5, 0.5], [{"leto": (1.0, 0.5)}, {"leto": (2.0, 1.0)}]))


def test_resume_is_the_median_of_each_recoverys_own_resume() -> None:
    """Not median(total) - median(lost work): those may come from different recoveries."""
    res = _scaling([0.0, 1.0], [{"leto": (3.0, 2.0)}, {"leto": (3.0, 2.0)}])
    runs = [{"total": 1.0, "lost_work": 0.4}, {"total": 5.0, "lost_work": 4.9}]
    runs.append({"total": 3.0, "lost_work": 2.0})
    res["results"][1]["systems"]["leto"]["runs"] = runs  # type: ignore[index]
    out = summarize_scaling(res)
    # per recovery 0.6, 0.1, 1.0: the median 0.6, where the medians' difference is 1.0
    assert out["resume"]["leto"] == pytest.approx([1.0, 0.6])
    assert out["slope_s_per_gib"]["resume"]["leto"] == pytest.approx(-0.4)
