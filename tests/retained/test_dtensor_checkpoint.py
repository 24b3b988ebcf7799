"""``leto.retained.dtensor_checkpoint`` in one process (a 1 x 1 ``("dp", "tp")`` mesh: FSDP2
and TP over worlds of one): a retained Llama saved and loaded into a new one is the same
state, sealed at the checkpoint's step, and trains on as the saved one does; loads it
cannot do right are refused in one line. The 4-rank cases (torch's keys, other mesh
shapes) are in ``test_llama_fsdp_tp.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from dtensor_cases import one_rank_group, same_bytes
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from leto.retained import dtensor_checkpoint as ckpt
from leto.retained.alloc import InMemorySegments
from leto.retained.dtensor_retained import RetainedShards, retain_shards
from leto.retained.errors import LayoutError
from leto.testing.llama import Llama, LlamaConfig, loss_of, parallelize_llama

CFG = LlamaConfig(dim=32, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=8)


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    with one_rank_group():
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))


def _retained(mesh: DeviceMesh) -> tuple[torch.nn.Module, torch.optim.Optimizer, RetainedShards]:
    model = parallelize_llama(Llama(CFG), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, retain_shards(model, opt, chunk_numel=1024, alloc=InMemorySegments())


def _train(model: torch.nn.Module, rs: RetainedShards, steps: range) -> list[torch.Tensor]:
    out = []
    for s in steps:
        loss = loss_of(model, CFG, s, 0)
        loss.backward()
        rs.step()
        rs.zero_grad()
        out.append(loss.detach())
    return out


def _flat(sd: dict[str, object]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.to_local().clone() for k, v in sd["model"].items()}  # type: ignore[attr-defined]
    for fqn, st in sd["optimizer"]["state"].items():  # type: ignore[index]
        out.update(
            {f"{fqn}.{k}": getattr(v, "to_local", lambda v=v: v)().clone() for k, v in st.items()}
        )
    return out


def test_a_loaded_checkpoint_is_the_saved_state_sealed_and_trains_on_alike(
    mesh: DeviceMesh, tmp_path: Path
) -> None:
    model, opt, rs = _retained(mesh)
    _train(model, rs, range(2))
    opt.param_groups[0]["lr"] = 3e-3  # a hyper-parameter changed after the start is saved
    ckpt.save(rs, model, opt, tmp_path / "c")
    saved = _flat(ckpt.state_dict(rs, model, opt))
    model2, opt2, rs2 = _retained(mesh)
    assert not all(
        same_bytes(saved[k], v) for k, v in _flat(ckpt.state_dict(rs2, model2, opt2)).items()
    )
    ckpt.load(rs2, model2, opt2, tmp_path / "c")
    loaded = _flat(ckpt.state_dict(rs2, model2, opt2))
    assert sorted(loaded) == sorted(saved) and all(same_bytes(saved[k], loaded[k]) for k in saved)
    assert rs2.optimizer.version == 2 and rs2.layout.verify() == []
    assert opt2.param_groups[0]["lr"] == 3e-3
    a, b = _train(model, rs, range(2, 4)), _train(model2, rs2, range(2, 4))
    assert all(same_bytes(x, y) for x, y in zip(a, b, strict=True))


def test_loads_it_cannot_do_right_are_refused_in_one_line(mesh: DeviceMesh, tmp_path: Path) -> None:
    model, opt, rs = _retained(mesh)
    _train(model, rs, range(1))
    first = rs.layout.params[0]
    rs.optimizer.state[first]["step"] = torch.tensor(5.0)  # step counts that disagree
    ckpt.save(rs, model, opt, tmp_path / "c")
    model2, opt2, rs2 = _retained(mesh)
    with pytest.raises(LayoutError, match=r"step counts are \[1.0, 5.0\], not one: pass step="):
        ckpt.load(rs2, model2, opt2, tmp_path / "c")
    ckpt.load(rs2, model2, opt2, tmp_path / "c", step=1)
    assert rs2.optimizer.version == 1 and rs2.layout.verify() == []
    loss_of(model2, CFG, 1, 0).backward()
    rs2.present()
    rs2.optimizer.prepare(2)
    with pytest.raises(LayoutError, match="step 2 is prepared or under way; load between steps"):
        ckpt.load(rs2, model2, opt2, tmp_path / "c", step=1)
