"""Mixed precision on the fake backend: bf16 parameters with float32 master weights, a
model mixing float32 and bf16 parameters, and a model with BatchNorm, each through a
fault at every phase of a step: bitwise the failure-free run (the master weights and
optimizer state, the model's bf16 parameters derived from them, the BatchNorm running
statistics, the process state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fakejob import every_fault_point, make_engine, same_state
from torch import nn

from leto.backends.fake.engine import Engine
from leto.retained.checkpoint import DCPCheckpointer
from leto.retained.dcp_state import read_checkpoint


class Cast(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def bf16() -> nn.Module:
    return nn.Sequential(
        Cast(torch.bfloat16),
        nn.Linear(3, 4).bfloat16(),
        nn.Tanh(),
        nn.Dropout(0.2),
        nn.Linear(4, 2).bfloat16(),
        Cast(torch.float32),
    )


def mixed() -> nn.Module:
    return nn.Sequential(
        Cast(torch.bfloat16),
        nn.Linear(3, 4).bfloat16(),
        nn.Tanh(),
        nn.Dropout(0.2),
        Cast(torch.float32),
        nn.Linear(4, 2),
    )


def batchnorm() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))


MODELS: dict[str, tuple[Any, bool]] = {  # name: (model, master weights)
    "bf16": (bf16, True),
    "fp32+bf16": (mixed, True),
    "batchnorm": (batchnorm, False),
}
STEPS = 4


def engine(name: str) -> Engine:
    make_model, mw = MODELS[name]
    return make_engine(make_model=make_model, master_weights=mw)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_faults_at_every_phase_are_bitwise_the_failure_free_run(name: str) -> None:
    ref = engine(name)
    lay = ref.procs[0].layout
    model = ref.procs[0].replica.model
    start = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    assert lay.dtype == torch.float32
    assert len(lay.derived) == {"bf16": 4, "fp32+bf16": 2, "batchnorm": 0}[name]
    ref.train(STEPS)
    after = [t.detach() for t in (*model.parameters(), *model.buffers())]
    assert all(not torch.equal(a, b) for a, b in zip(start, after, strict=True))  # it trained
    for eng, label in every_fault_point(lambda: engine(name), ref, STEPS, name):
        for p in eng.procs:  # the model holds the cast of its master weights
            for i in p.layout.derived:
                assert torch.equal(p.layout.params[i], p.layout.param_view(i).to(torch.bfloat16)), (
                    label
                )


def test_lost_memory_and_a_promoted_shadow_keep_buffers_and_derived_parameters() -> None:
    """A node's memory lost (tier 2 restores) and a killed rank (a shadow takes over)."""
    for name in ("fp32+bf16", "batchnorm"):
        ref = engine(name)
        ref.train(STEPS + 2)
        eng = engine(name)
        eng.injector.lose_node(node=1, step=3, phase="apply", chunk=0, where="written")
        eng.injector.fail_at(rank=0, step=5, phase="backward")
        eng.train(STEPS + 2)
        assert eng.injector.unfired() == [] and eng.injector.unrecovered() == [], name
        assert same_state(eng, ref) == [], name


def test_a_fallback_to_a_dcp_checkpoint_keeps_the_master_weights(tmp_path: Path) -> None:
    """Beyond both tiers: the checkpoint holds the float32 master weights (not only the
    model's bf16 parameters), so the run from it is bitwise the failure-free one; a
    new job resumes from it the same way."""
    kw: dict[str, Any] = dict(make_model=mixed, master_weights=True, checkpoint_interval=2)
    eng = make_engine(checkpointer=DCPCheckpointer(tmp_path / "ckpt"), **kw)
    eng.injector.lose_node(node=0, step=5, phase="prepare")
    eng.injector.lose_node(node=1, step=5, phase="recovery", where="Promote", rank=0)
    eng.train(STEPS + 3)
    assert [r["kind"] for r in eng.recoveries] == ["ckpt"]
    plain = make_engine(**kw)
    plain.train(STEPS + 3)
    assert same_state(eng, plain) == []
    state, meta = read_checkpoint(tmp_path / "ckpt")
    assert sorted(state["master_weights"]) == ["1.bias", "1.weight"]
    restarted = make_engine(resume=(state, meta, "ckpt"), **kw)
    assert restarted.state.committed == STEPS + 2
    restarted.train(STEPS + 3)
    assert same_state(restarted, plain) == []
