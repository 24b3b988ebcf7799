"""Every private torch attribute leto uses for FSDP2/DTensor, checked on this torch.

One test per attribute (``test_private_attribute_is_there[FSDPParam-sharded_size]``), so a
torch upgrade that moves one fails by name; then the behaviour leto relies on that no
attribute check covers (a bound shard survives ``reset_sharded_param``; the
reduce-scatter's output becomes the gradients, as ``as_strided`` views of its storage).
All in this process, on a world of one rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dtensor_cases import build, one_rank_group
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from leto.retained import dtensor_layout as dl
from leto.retained import torch_private as private


@pytest.fixture
def model() -> Iterator[Any]:
    with one_rank_group() as mesh:
        yield build("fsdp", mesh)


def hsdp_mesh_info() -> Any:
    """The mesh info of a model given a (replicate, shard) mesh, here 1 x 1."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("rep", "shard"))
    torch.manual_seed(0)
    lin = torch.nn.Linear(2, 2)
    fully_shard(lin, mesh=mesh)
    return private.mesh_infos(private.fsdp_param_groups(lin)[0])[0]


def live_objects(model: Any) -> dict[str, Any]:
    """One live object of each kind :data:`private.PRIVATE` names."""
    group = private.fsdp_param_groups(model)[0]
    fp = private.fsdp_params(group)[0]
    return {
        "FSDPModule": model,
        "FSDPState": model._get_fsdp_state(),
        "FSDPParamGroup": group,
        "FSDPParam": fp,
        "DTensor": private.sharded_param(fp),
        "DeviceMesh": private.sharded_param(fp).device_mesh,
        "HSDPMeshInfo": hsdp_mesh_info(),
    }


@pytest.mark.parametrize(
    ("kind", "name"), [(k, n) for k, names in private.PRIVATE.items() for n in names]
)
def test_private_attribute_is_there(model: Any, kind: str, name: str) -> None:
    obj = live_objects(model)[kind]
    assert type(obj).__name__.endswith(kind) or kind == "FSDPModule"
    assert hasattr(obj, name), f"{kind}.{name} is gone in torch {torch.__version__}"


def test_the_whole_check_passes_and_each_reader_gives_its_shape(model: Any) -> None:
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    private.check_torch(modules)
    for m in modules:
        (group,) = private.fsdp_param_groups(m)
        assert private.mp_policy(group).reduce_dtype is None
        for fp in private.fsdp_params(group):
            p = private.sharded_param(fp)
            assert isinstance(p, DTensor) and p in set(m.parameters())
            assert isinstance(private.padded_shard_size(fp), torch.Size)
            assert private.sharded_size(fp) == p.to_local().shape
            assert private.shard_dim(fp) == 0 and private.offloads_to_cpu(fp) is False
        infos = private.mesh_infos(group)
        assert infos and all(isinstance(i.shard_process_group, dist.ProcessGroup) for i in infos)
    mesh = next(model.parameters()).device_mesh
    assert private.root_mesh(mesh) is mesh and isinstance(mesh, DeviceMesh)
    names = private.dim_group_names(mesh)
    assert len(names) == 1 and isinstance(names[0], str)
    assert issubclass(dl.RegionReduceScatter, private.ReduceScatter)


def test_a_bound_shard_is_computed_on_and_survives_reset_sharded_param(model: Any) -> None:
    fp = private.fsdp_params(private.fsdp_param_groups(model)[0])[0]
    padded = torch.zeros(private.padded_shard_size(fp))
    with torch.no_grad():
        padded.copy_(private.sharded_param(fp).to_local())
    private.set_local_shard(fp, padded)
    fp.reset_sharded_param()
    assert fp._sharded_param_data.data_ptr() == padded.data_ptr()
    assert private.sharded_param(fp).to_local().data_ptr() == padded.data_ptr()
    with torch.no_grad():  # as the optimizer and a recovery write the buffers
        padded.fill_(0.5)
    model(torch.ones(2, 8)).sum().backward()  # all-gathers from the bound shard
    assert torch.equal(private.sharded_param(fp).to_local(), torch.full((16, 8), 0.5))
    assert private.sharded_param(fp).grad is not None
    with pytest.raises(
        private.TorchPrivateError, match=r"^a padded shard of \(16, 8\) expected, got \(3,\)$"
    ):
        private.set_local_shard(fp, torch.zeros(3))


def test_the_reduce_scatter_output_becomes_the_gradients(model: Any) -> None:
    # FSDP2's foreach_reduce: input allocated first, then output, and each sharded
    # gradient an as_strided view of the output's storage
    layout = dl.plan_layout(model)
    grads = torch.zeros(layout.numel)
    comms = dl.bind_grads(model, layout, grads)
    model(torch.ones(2, 8)).sum().backward()
    assert [c.hits for c in comms] == [1, 1, 1]
    params = dict(model.named_parameters())
    for comm, region in zip(comms, layout.groups, strict=True):
        for slot in region.slots:
            g = params[slot.fqn].grad.to_local()
            assert g.untyped_storage().data_ptr() == comm.region.data_ptr(), slot.fqn
            assert torch.equal(dl.shard_view(layout, grads, slot.fqn), g), slot.fqn


def test_a_stand_in_missing_an_attribute_is_rejected_in_one_line() -> None:
    fp = SimpleNamespace(sharded_param=None, padded_sharded_param_size=(2,))
    with pytest.raises(private.TorchPrivateError) as e:
        private.check_object(fp, "FSDPParam")
    assert str(e.value) == (
        f"SimpleNamespace has no attribute '_sharded_param_data' (torch {torch.__version__}):"
        " leto.retained.torch_private needs updating"
    )
    with pytest.raises(
        private.TorchPrivateError, match="^SimpleNamespace has no attribute 'fsdp_placement'"
    ):
        private.shard_dim(fp)
    with pytest.raises(private.TorchPrivateError, match="^FSDPParamGroup.mp_policy is a dict$"):
        private.mp_policy(SimpleNamespace(mp_policy={}))
