"""leto.wrap: the training-script API on the fake backend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leto
from leto.adapters.config import ConfigError
from leto.retained.layout import LayoutError, ShapeMismatchError
from leto.retained.optim import WholeStepOptimizer
from leto.retained.process_state import ResumableBatchSampler

CFG = {"backend": "fake", "topology": "2x2", "chunk_size": 16, "tier2_interval": 2}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def job(hidden: int = 4, seed: int = 0, opt_cls: Any = torch.optim.SGD) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 2))
    if opt_cls is torch.optim.SGD:
        opt = opt_cls(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = opt_cls(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(40, 3, generator=g), torch.randint(0, 2, (40,), generator=g)

    def step_fn(m: nn.Module, idx: list[int]) -> torch.Tensor:
        i = torch.tensor(idx)
        return F.cross_entropy(m(X[i]), Y[i])

    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "sampler": ResumableBatchSampler(40, 8, seed=2),
        "step_fn": step_fn,
        "X": X,
        "Y": Y,
    }


def wrap(j: dict[str, Any], **kw: Any) -> leto.adapters.api.Session:  # type: ignore[name-defined]
    kw.setdefault("config", CFG)
    return leto.wrap(j["model"], j["optimizer"], j["scheduler"], j["sampler"], **kw)


def test_a_plain_loop_equals_torch_data_parallel_bitwise() -> None:
    """No faults: leto's step is exactly a data-parallel SGD step of torch."""
    j = job()
    session = wrap(j)
    for _ in range(6):
        session.run_step(j["step_fn"])
    assert session.step == 6
    # the same in plain torch: 4 ranks' gradients, summed in rank order, / 4
    t = job()
    batches = iter(ResumableBatchSampler(40, 8, seed=2))
    for _ in range(6):
        idx = next(batches)
        grads = []
        for r in range(4):
            t["model"].zero_grad()
            t["step_fn"](t["model"], idx[r::4]).backward()
            grads.append([p.grad.clone() for p in t["model"].parameters()])
        for i, p in enumerate(t["model"].parameters()):
            g = grads[0][i].clone()
            for r in range(1, 4):
                g.add_(grads[r][i])
            p.grad = g.div_(4)
        t["optimizer"].step()
        t["scheduler"].step()
    for a, b in zip(session.model.parameters(), t["model"].parameters(), strict=True):
        assert torch.equal(a, b)
    assert session.model is j["model"]  # rank 0 uses the objects passed in
    assert session.optimizer.param_groups[0]["lr"] == t["optimizer"].param_groups[0]["lr"]


def test_wrap_recovers_in_place_from_planned_faults(tmp_path: Path) -> None:
    j = job(opt_cls=torch.optim.AdamW)
    cfg = dict(CFG, checkpoint_dir=str(tmp_path / "ck"))
    s = wrap(j, config=cfg)
    s.faults.fail_at(rank=3, step=2, phase="apply", chunk=1, where="mid_write").lose_memory(
        rank=0, step=4, phase="prepare"
    )
    stats = s.train(j["step_fn"], 6)
    assert stats["recoveries"] == 2 and s.faults.counters()["recovered"] == 2
    ref = wrap(job(opt_cls=torch.optim.AdamW))
    ref.train(j["step_fn"], 6)
    for a, b in zip(s.retained_state(), ref.retained_state(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert [e["event"] for e in s.timeline].count("fault") == 2
    assert (tmp_path / "ck" / "step-0" / "leto.json").is_file()


def test_any_torch_optimizer_is_wrapped_through_the_generic_path() -> None:
    j = job(opt_cls=torch.optim.RMSprop)
    s = leto.wrap(j["model"], j["optimizer"], j["scheduler"], j["sampler"], config=CFG)
    assert isinstance(s.optimizer, WholeStepOptimizer)
    s.train(j["step_fn"], 2)
    assert s.step == 2


def test_unsupported_optimizer_backend_and_scheduler_are_refused() -> None:
    j = job()
    with pytest.raises(TypeError, match="^optimizer: LBFGS cannot be retained by leto: .*closure"):
        leto.wrap(j["model"], torch.optim.LBFGS(j["model"].parameters()), config=CFG)
    # gloo outside `leto launch` (no agent connection): says how to start it
    with pytest.raises(ConfigError) as gloo:
        leto.wrap(j["model"], j["optimizer"], config={"backend": "gloo"})
    assert str(gloo.value) == (
        "leto config: backend: 'gloo' runs one process per rank: start this script with `leto launch "
        "--nproc-per-node N [--nnodes M ...] script.py` (or use backend='fake')"
    )
    other = torch.optim.SGD(j["model"].parameters(), lr=1.0)
    with pytest.raises(ValueError, match="scheduler is bound to another optimizer"):
        leto.wrap(j["model"], other, j["scheduler"], config=CFG)
    with pytest.raises(ConfigError, match="chunk_size: must be positive"):
        leto.wrap(j["model"], j["optimizer"], config={"chunk_size": -4})


def test_arguments_in_the_wrong_place_are_refused_in_one_line_naming_them() -> None:
    """A data loader given as the scheduler (the third positional argument) is refused at
    wrap, naming where it goes, on the fake backend and before a gloo trainer connects
    (the check comes first); so are a model or an optimizer that are not one."""
    j = job()
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    for cfg in (CFG, {"backend": "gloo"}):
        with pytest.raises(ValueError) as e:
            leto.wrap(j["model"], j["optimizer"], loader, config=cfg)
        line = str(e.value)
        assert line.startswith("leto.wrap: scheduler (the third argument) is a DataLoader")
        assert "the fourth argument" in line and "\n" not in line
    with pytest.raises(ValueError, match="^leto.wrap: scheduler .* is a int, with no step"):
        leto.wrap(j["model"], j["optimizer"], 3, config=CFG)
    with pytest.raises(ValueError, match="^leto.wrap: model is a dict, not a torch.nn.Module"):
        leto.wrap({}, j["optimizer"], config=CFG)
    with pytest.raises(ValueError, match="^leto.wrap: optimizer is a list, not a torch.optim"):
        leto.wrap(j["model"], [], config=CFG)


def test_wrap_reads_a_toml_config(tmp_path: Path) -> None:
    p = tmp_path / "leto.toml"
    p.write_text('[leto]\nbackend = "fake"\ntopology = "1x2"\nchunk_size = 8\n')
    j = job()
    s = wrap(j, config=p)
    assert s.backend.world_size == 2 and s.engine.procs[0].layout.chunk_numel == 8


class _Trained:
    def __init__(self) -> None:
        self.j = job()
        self.session = wrap(self.j)
        self.session.train(self.j["step_fn"], 3)


def test_attach_with_a_model_of_other_shapes_fails_and_modifies_nothing() -> None:
    t = _Trained()
    backend = t.session.backend
    before = backend.retained_bytes()
    other = job(hidden=5)
    with pytest.raises(
        ShapeMismatchError, match=r"parameter '0.weight': the model has shape \(5, 3\)"
    ):
        wrap(other, backend=backend)
    assert backend.retained_bytes() == before
    with pytest.raises(
        ConfigError, match="chunk_size: 32 elements, but the retained state is chunked by 16"
    ):
        wrap(job(), backend=backend, config=dict(CFG, chunk_size=32))
    with pytest.raises(ConfigError, match="topology: 1x4, but the retained job has node sizes"):
        wrap(job(), backend=backend, config=dict(CFG, topology="1x4"))
    assert backend.retained_bytes() == before


def test_a_new_trainer_attaches_and_continues_bitwise() -> None:
    t = _Trained()
    fresh = job(seed=123)  # other initial values: the retained state wins
    s2 = wrap(fresh, backend=t.session.backend)
    assert s2.step == 3
    s2.train(fresh["step_fn"], 6)
    ref = job()
    r = wrap(ref)
    r.train(ref["step_fn"], 6)
    for a, b in zip(s2.retained_state(), r.retained_state(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert s2.engine.process_states() == r.engine.process_states()


def test_master_weights_are_a_config_setting() -> None:
    """A model mixing bf16 and float32 parameters: refused in one line naming the
    setting without it; with ``master_weights = true`` it trains through a fault,
    bitwise the failure-free run, its bf16 parameters staying bf16."""

    def mixed_job() -> dict[str, Any]:
        j = job()
        j["model"][0].bfloat16()
        X, Y = j["X"], j["Y"]

        def step_fn(m: nn.Module, idx: list[int]) -> torch.Tensor:
            i = torch.tensor(idx)
            h = m[1](m[0](X[i].bfloat16())).float()
            return F.cross_entropy(m[2](h), Y[i])

        j["step_fn"] = step_fn
        return j

    j = mixed_job()
    with pytest.raises(LayoutError, match=r"^parameter '2\.weight' has dtype.*master_weights=True"):
        wrap(j)
    cfg = dict(CFG, master_weights=True)
    j = mixed_job()
    s = wrap(j, config=cfg)
    s.faults.fail_at(rank=1, step=2, phase="apply", chunk=0, where="mid_write")
    s.train(j["step_fn"], 4)
    assert s.faults.counters()["recovered"] == 1
    assert s.model[0].weight.dtype == torch.bfloat16
    r = mixed_job()
    ref = wrap(r, config=cfg)
    ref.train(r["step_fn"], 4)
    for a, b in zip(s.retained_state(), ref.retained_state(), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "model.0.weight" in a


def test_an_fsdp_wrapped_model_is_refused_naming_shard() -> None:
    """FSDP2 runs on gloo/CPU (torch 2.13), but its sharded storage is its own: leto
    refuses the wrapped model in one line and names its own sharding."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(
            TypeError, match=r"^leto.wrap: the model is FSDP-wrapped .* set shard = true"
        ):
            leto.wrap(model, opt, config={"backend": "fake"})
    finally:
        dist.destroy_process_group()
