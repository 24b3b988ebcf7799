"""Periodic DCP checkpoints on the fake backend: written as the protocol's events, of
the model's and optimizer's own state dicts; a failure beyond both tiers falls back to
the latest durable one (not step 0), bitwise the failure-free run restarted from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fakejob import make_engine, same_state

from leto.retained.checkpoint import DCPCheckpointer, MemoryCheckpointer
from leto.retained.dcp_state import CheckpointError, read_checkpoint, young_daly_interval

STEPS = 7
BEYOND_BOTH_TIERS_AT_5 = [
    ("lose_node", dict(node=0, step=5, phase="prepare")),
    ("lose_node", dict(node=1, step=5, phase="recovery", where="Promote", rank=0)),
]


def test_fallback_goes_to_the_latest_durable_checkpoint(tmp_path: Path) -> None:
    eng = make_engine(checkpointer=DCPCheckpointer(tmp_path / "ckpt"), checkpoint_interval=2)
    for method, args in BEYOND_BOTH_TIERS_AT_5:
        getattr(eng.injector, method)(**args)
    eng.train(STEPS)
    assert eng.injector.unfired() == [] and eng.injector.unrecovered() == []
    (rec,) = eng.recoveries
    assert rec["kind"] == "ckpt" and rec["resumed_at"] == 4  # checkpoints at 2 and 4
    assert rec["steps_lost"] == 0  # step 5 was not committed: nothing committed lost
    assert eng.stats["checkpoint_restores"] == 1
    # the events: step 0 at the start, then 2, 4, (fallback to 4), 6
    assert eng.stats["checkpoints_durable"] == 4
    assert eng.state.ckpt == 6 and DCPCheckpointer(tmp_path / "ckpt").durable_steps() == [6]
    assert eng.mismatches() == [] and eng.parity_exact() == []

    # the failure-free run with the same checkpoints, stopped at step 4 ...
    first = make_engine(checkpointer=DCPCheckpointer(tmp_path / "ff"), checkpoint_interval=2)
    first.train(4)
    # ... restarted from its checkpoint by a new job, and trained to the end
    state, meta = read_checkpoint(tmp_path / "ff")
    assert meta is not None and meta["step"] == 4
    restarted = make_engine(checkpointer=MemoryCheckpointer(), resume=(state, meta, "ff"))
    assert restarted.state.committed == 4
    restarted.train(STEPS)
    assert same_state(eng, restarted) == []
    plain = make_engine(checkpointer=MemoryCheckpointer())
    plain.train(STEPS)
    assert same_state(eng, plain) == []


def test_the_checkpoint_holds_the_models_own_names(tmp_path: Path) -> None:
    eng = make_engine(checkpointer=DCPCheckpointer(tmp_path / "ckpt"), checkpoint_interval=3)
    eng.train(3)
    step = tmp_path / "ckpt" / "step-3"
    assert (step / "leto.json").is_file() and not (tmp_path / "ckpt" / "step-0").exists()
    files = sorted(p.name for p in step.iterdir())
    assert files == [".metadata", "__0_0.distcp", "leto.json"]  # written once, not per rank
    import torch.distributed.checkpoint as dcp

    model = eng.procs[0].replica.model
    fresh = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(fresh, checkpoint_id=str(step))  # any DCP user, by the model's names
    for k, v in model.state_dict().items():
        assert torch.equal(fresh["model"][k], v), k
    state, meta = read_checkpoint(step)
    assert set(state["optim"]["state"]) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    assert meta is not None and meta["step"] == 3
    assert json.loads(meta["process_states"]["0"])["step"] == 3


def test_a_directory_that_is_not_a_checkpoint_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'nope'} is not a checkpoint directory"):
        read_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir(mode=0o700)
    with pytest.raises(CheckpointError, match="not a torch.distributed.checkpoint directory"):
        read_checkpoint(tmp_path / "empty")


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    other = torch.nn.Linear(5, 5)
    dcp.save({"model": other.state_dict()}, checkpoint_id=str(tmp_path / "other"), no_dist=True)
    state, meta = read_checkpoint(tmp_path / "other")
    assert meta is None
    with pytest.raises(
        CheckpointError,
        match=r"is not a checkpoint of this model: it has no '0.bias' \(and 3 more\)",
    ) as e:
        make_engine(checkpointer=None, resume=(state, meta, str(tmp_path / "other")))
    assert "\n" not in str(e.value)


def test_young_daly_interval_from_the_measured_save_cost() -> None:
    # an MTBF of a millisecond: a checkpoint every step (the interval is at least 1)
    eng = make_engine(checkpointer=MemoryCheckpointer(), checkpoint_mtbf=1e-3)
    eng.train(5)
    assert eng.checkpoints.interval == 1 and eng.state.ckpt == 5
    # a year: none within 5 steps
    eng = make_engine(checkpointer=MemoryCheckpointer(), checkpoint_mtbf=3.2e7)
    eng.train(5)
    assert eng.checkpoints.interval > 5 and eng.state.ckpt == 0


def test_young_daly() -> None:
    assert young_daly_interval(2.0, 3600.0, 1.0) == 120  # sqrt(2 * 2 * 3600) = 120 s
    assert young_daly_interval(0.001, 10.0, 5.0) == 1
    with pytest.raises(ValueError, match="mtbf must be a positive number"):
        young_daly_interval(1.0, 0.0, 1.0)


def test_resume_from_any_dcp_checkpoint_of_the_same_model(tmp_path: Path) -> None:
    """A checkpoint leto did not write (a plain dcp.save of the model and its optimizer
    by name): the job starts at step 0 from its weights and optimizer state."""
    import torch.distributed.checkpoint as dcp

    from leto.retained.dcp_state import optimizer_state_by_name

    donor = make_engine(checkpointer=None)
    donor.train(3)
    p = donor.procs[0]
    state = {
        "model": {k: v.clone() for k, v in p.replica.model.state_dict().items()},
        "optimizer": optimizer_state_by_name(p.replica.model, p.ropt),
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "theirs"), no_dist=True)
    got, meta = read_checkpoint(tmp_path / "theirs")
    assert meta is None
    eng = make_engine(checkpointer=None, resume=(got, meta, "theirs"))
    assert eng.state.committed == 0
    for q in eng.procs:
        for k, v in q.replica.model.state_dict().items():
            assert torch.equal(v, state["model"][k]), k
        exp = q.ropt.state[q.replica.model[0].weight]["exp_avg"]
        assert torch.equal(exp, state["optimizer"]["state"]["0.weight"]["exp_avg"])
    eng.train(2)  # and it trains on
