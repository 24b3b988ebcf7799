"""nvidia-resiliency-ext's in-process restart as a system of ``leto bench recovery``
(:mod:`leto.bench.nvrejob`): its breakdown on a recorded log, and one real job on
gloo where the package imports (it is not one of leto's dependencies)."""

from __future__ import annotations

from typing import Any

import pytest

from leto.bench.nvrejob import missing, nvre_breakdown, run_job
from leto.bench.timeline import PHASES
from leto.bench.workload import Workload


def _log() -> list[dict[str, Any]]:
    """Two ranks and a reserve (process 2); rank 1 dies at step 6 of iteration 0."""
    ev: list[dict[str, Any]] = []

    def e(ev_: str, t: float, proc: int, it: int, **kw: Any) -> None:
        ev.append({"ev": ev_, "t": t, "proc": proc, "pid": 100 + proc, "it": it, **kw})

    for p in (0, 1):
        e("enter", 1.0, p, 0, rank=p)
    e("fail", 10.0, 1, 0, step=6, rank=1)
    e("abort", 10.5, 0, 0)
    e("abort", 10.9, 2, 0)
    for p, r in ((0, 0), (2, 1)):
        e("enter", 12.0 + p / 10, p, 1, rank=r)
        e("pg", 12.5 + p / 10, p, 1, rank=r)
        e("loaded", 13.0 + p / 10, p, 1, rank=r, step=5)
        e("step", 14.0 + p / 10, p, 1, rank=r, step=6)
    return ev


def test_breakdown_partitions_the_total_on_the_critical_path() -> None:
    b = nvre_breakdown(_log(), 0, world=2)
    assert b["detection"] == pytest.approx(0.9)  # the reserve's abort came last
    assert b["process_state"] == pytest.approx(12.2 - 10.9)
    assert b["communicator"] == pytest.approx(0.5)
    assert b["model_state"] == pytest.approx(0.5)
    assert b["lost_work"] == pytest.approx(1.0)
    assert sum(b[p] for p in PHASES) == pytest.approx(b["total"]) == pytest.approx(4.2)
    d = b["detail"]
    assert (d["failed_step"], d["restored_to"], d["reserve"], d["reserve_rank"]) == (6, 5, [2], [1])


def test_breakdown_needs_every_process_to_have_aborted() -> None:
    log = [e for e in _log() if not (e["ev"] == "abort" and e["proc"] == 2)]
    with pytest.raises(ValueError, match=r"processes \[2\] never aborted"):
        nvre_breakdown(log, 0, world=2)


def _digests(events: list[dict[str, Any]], it: int) -> dict[int, str]:
    return {e["rank"]: e["sha256"] for e in events if e["ev"] == "trained" and e["it"] == it}


_WL = Workload(width=64, layers=2, world=2, batch=8)
needs_nvre = pytest.mark.skipif(missing() is not None, reason=str(missing()))


@pytest.fixture(scope="module")
def undisturbed() -> str:
    """The state's digest of a job that never failed, at step 9."""
    clean = _digests(run_job(_WL, [], 9, timeout=150), 0)
    assert sorted(clean) == [0, 1] and len(set(clean.values())) == 1
    return clean[0]


@needs_nvre
@pytest.mark.parametrize(
    ("fail", "restored"),
    [({"rank": 1, "step": 6}, 5), ({"rank": 0, "step": 6, "at": "update"}, 6)],
    ids=["forward", "update-rank0"],
)
def test_a_killed_rank_is_replaced_in_place_and_training_matches_an_undisturbed_run(
    fail: dict[str, Any], restored: int, undisturbed: str
) -> None:
    events = run_job(_WL, [fail], 9, timeout=150)
    b = nvre_breakdown(events, 0, world=2)
    assert sum(b[p] for p in PHASES) == pytest.approx(b["total"])
    assert all(b[p] >= 0 for p in PHASES) and b["total"] < 60
    d = b["detail"]
    # a death after the update's all-reduce: the survivor applied the step
    assert (d["failed_step"], d["restored_to"]) == (6, restored)
    assert (d["reserve"], d["reserve_rank"]) == ([2], [fail["rank"]])
    # the same state, bit for bit, on both ranks and as a job that never failed
    assert _digests(events, 1) == {0: undisturbed, 1: undisturbed}
