"""The step in flight replayed in parallel (leto.core.replay, gloo's replay.py), for real:
a death before the vote with a step of 4 micro-batches, on 3 ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobs import HERE, assert_trace, digests_equal, explain, job

from leto.backends.gloo.harness import JobResult

SCRIPT = str(HERE / "scripts" / "replay_train.py")
STEPS = 8
# rank 1 dies after its first micro-batch's forward of step 5; ranks 0 and 2 are
# inside their compute then (rank 1's first micro-batch waits 0.5 s, so theirs of step 5
# have begun even on a loaded machine; their last waits 1.5 s first)
DEATH = [{"kind": "crash", "rank": 1, "step": 5, "phase": "forward"}]
SLOW = {"SLOW": "0,2:5:1.5;1:5:0.5:1"}


def _job(run_dir: Path, faults: list[dict[str, object]] | None = None, **env: str) -> JobResult:
    return job(
        run_dir, nproc=3, steps=STEPS, script=SCRIPT, faults=faults, env={"TOPO": "1x3", **env}
    )


def _calls(res: JobResult) -> dict[int, list[dict[str, int]]]:
    """Each rank's micro-batches run per step, one dict per process that ended."""
    out: dict[int, list[dict[str, int]]] = {}
    for p in sorted(res.run_dir.glob("calls-rank*")):
        rank = int(p.name.split("-")[1].removeprefix("rank"))
        out.setdefault(rank, []).append(json.loads(p.read_text()))
    return out


@pytest.fixture(scope="module")
def ref_replay(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    res = _job(tmp_path_factory.mktemp("replay") / "ref")
    assert res.ok and res.digests, explain(res)
    return res


def test_the_survivors_compute_the_lost_micro_batches_and_the_run_is_bitwise(
    tag: str, ref_replay: JobResult
) -> None:
    res = _job(Path(tag) / "run", DEATH, **SLOW)
    assert res.ok, explain(res)
    assert_trace(res.run_dir)
    (rec,) = res.recoveries
    assert (rec["kind"], rec["target"]) == ("inplace", 4), rec
    assert sorted((e["rank"], e["step"]) for e in res.of("compute_kept")) == [(0, 5), (2, 5)]
    # micro-batch i of rank 1's share is computed by rank (1 + i) mod 3, and the
    # replacement adds them in order
    who = sorted((e["rank"], e["owner"], e["step"], e["micro_batches"]) for e in res.of("replayed"))
    assert who == [(0, 1, 5, [2]), (1, 1, 5, [0, 3]), (2, 1, 5, [1])], who
    calls = _calls(res)
    assert calls[0] == [{str(s): 4 + (s == 5) for s in range(1, STEPS + 1)}], calls
    assert calls[2] == [{str(s): 4 + (s == 5) for s in range(1, STEPS + 1)}], calls
    # the replacement ran two micro-batches of step 5 (not four), then whole steps
    assert calls[1] == [{"5": 2, "6": 4, "7": 4, "8": 4}], calls
    assert digests_equal(res, ref_replay), "not bitwise equal to the failure-free run"


def test_with_the_replay_off_the_replacement_computes_its_share_alone(
    tag: str, ref_replay: JobResult
) -> None:
    res = _job(Path(tag) / "run", DEATH, REPLAY="0", **SLOW)
    assert res.ok, explain(res)
    assert_trace(res.run_dir)
    assert sorted((e["rank"], e["step"]) for e in res.of("compute_kept")) == [(0, 5), (2, 5)]
    assert res.of("replayed") == []
    calls = _calls(res)
    assert calls[1] == [{"5": 4, "6": 4, "7": 4, "8": 4}], calls
    assert calls[0] == [{str(s): 4 for s in range(1, STEPS + 1)}], calls
    assert digests_equal(res, ref_replay), "not bitwise equal to the failure-free run"


def test_a_model_that_draws_random_numbers_is_refused_with_the_setting_named(tag: str) -> None:
    res = _job(Path(tag) / "run", DROPOUT="1", STEPS="2")
    assert not res.ok
    assert "set parallel_replay = false" in explain(res), explain(res)


def test_a_second_death_after_the_replay_recovers_serially_and_stays_bitwise(
    tag: str, ref_replay: JobResult
) -> None:
    # the replacement of rank 1 dies too, once the micro-batches were gathered and added
    # (at its all-reduce of step 5): the survivors were past their computes, so every
    # rank computes step 5 afresh and nothing is replayed the second time
    faults = [*DEATH, {"kind": "crash", "rank": 1, "step": 5, "phase": "allreduce"}]
    res = _job(Path(tag) / "run", faults, **SLOW)
    assert res.ok, explain(res)
    assert len(res.recoveries) == 2, res.recoveries
    assert sorted((e["rank"], e["micro_batches"]) for e in res.of("replayed")) == [
        (0, [2]),
        (1, [0, 3]),
        (2, [1]),
    ]
    assert digests_equal(res, ref_replay), "not bitwise equal to the failure-free run"
