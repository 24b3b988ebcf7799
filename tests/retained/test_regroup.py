"""``leto.retained.regroup`` in one process: the step rule, the refusals, and a one-rank
FSDP2 model moved onto a new generation's group and trained on it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dtensor_cases import build
from torch.distributed.device_mesh import init_device_mesh

from leto.core.steps import StepAgreementError
from leto.retained import torch_private as private
from leto.retained.regroup import RegroupError, StepReport, agree_step, mesh_groups, regroup


def R(v: int, p: int) -> StepReport:
    return StepReport(version=v, prepared=p)


@pytest.mark.parametrize(
    ("reports", "target"),
    [
        ([R(2, 2)] * 4, 2),  # between steps
        ([R(2, 2), R(2, 3), R(2, 3), R(2, 3)], 2),  # one rank had not sealed: all back
        ([R(2, 3)] * 4, 3),  # every rank sealed: all forward
        ([R(1, 2), R(2, 2), R(2, 3), R(2, 2)], 2),  # one behind, sealed: it forward
    ],
)
def test_agree_step(reports: list[StepReport], target: int) -> None:
    assert agree_step(reports) == target


@pytest.mark.parametrize(
    "reports", [[], [R(1, 1), R(2, 2)], [R(0, 1), R(2, 2)], [R(1, 2), R(2, 3), R(3, 3)]]
)
def test_agree_step_refuses_ranks_that_cannot_agree(reports: list[StepReport]) -> None:
    with pytest.raises(StepAgreementError):
        agree_step(reports)


def _world(port_free_store: dist.Store) -> None:
    dist.init_process_group("gloo", store=port_free_store, rank=0, world_size=1)


def test_a_one_rank_model_moves_to_a_new_generation_and_trains() -> None:
    _world(dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        model = build("fsdp", mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        old = mesh.get_group("dp")
        with pytest.raises(RegroupError, match="no new process group for mesh dimension 'dp'"):
            regroup(model, {"tp": old})
        dist.destroy_process_group()
        _world(dist.HashStore())
        dist.new_group([0])  # the new generation's names differ from the old ones
        new = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        done = regroup(model, mesh_groups(new), meshes=[mesh])
        assert done.meshes >= 1 and done.mesh_infos >= 1
        assert private.dim_group_names(mesh) == private.dim_group_names(new)
        group = private.fsdp_param_groups(model)[0]
        assert {i.shard_process_group for i in private.mesh_infos(group)} == {new.get_group()}
        before = [p.to_local().clone() for p in model.parameters()]
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        assert any(
            not torch.equal(a, p.to_local())
            for a, p in zip(before, model.parameters(), strict=True)
        )
    finally:
        dist.destroy_process_group()


def test_a_mesh_without_dimension_names_is_refused() -> None:
    _world(dist.HashStore())
    try:
        with pytest.raises(RegroupError, match="without mesh_dim_names"):
            mesh_groups(init_device_mesh("cpu", (1,)))
    finally:
        dist.destroy_process_group()
