"""Survivors keep their modules: a live FSDP2 / tensor-parallel model moved onto a new
generation of process groups, without re-wrapping (issue 40).

A recovery destroys every process group (a gloo group that lost a peer cannot be used
again) and forms the next generation's. The user's ``fully_shard`` and
``parallelize_module`` objects, their DTensors and the optimizer all reach the groups
through the ``DeviceMesh`` objects they were built on, and FSDP2 also caches the
``ProcessGroup`` objects themselves in its mesh infos. :func:`regroup` re-points both:

* every mesh the model uses (its DTensor parameters' meshes, FSDP2's meshes, their root
  meshes, and any the caller passes) resolves each named dimension through the new
  group of that name (``DeviceMesh._dim_group_names`` and the root's ``_pg_registry``);
* every FSDP2 mesh info re-reads ``shard_process_group`` / ``replicate_process_group``
  from its mesh.

The new groups are matched by dimension name and checked to hold the same ranks as the
mesh's dimension through this rank (``DeviceMesh.mesh`` and ``get_coordinate``, public):
a recovery keeps the mesh's shape and every rank's coordinates, a replacement process
taking the dead rank's. The private attributes are those of
:mod:`~leto.retained.torch_private`. Found by ``docs/research/fsdp2/proto_regroup.py``.

:func:`agree_step` is the rule the ranks apply after regrouping to end an interrupted
retained step all alike (rolled back, or forward where every rank sealed its gradients);
a pure protocol rule, it lives in the core (:mod:`leto.core.steps`) and is re-exported
here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from leto.core.steps import StepAgreementError, StepReport, agree_step

from . import torch_private as private

__all__ = [
    "RegroupError",
    "Regrouped",
    "StepAgreementError",
    "StepReport",
    "agree_step",
    "mesh_groups",
    "meshes_of",
    "regroup",
]


class RegroupError(ValueError):
    """A model's meshes cannot be moved onto the given process groups."""


@dataclass(frozen=True)
class Regrouped:
    """What :func:`regroup` re-pointed: meshes and FSDP2 mesh infos."""

    meshes: int
    mesh_infos: int


def mesh_groups(mesh: DeviceMesh) -> dict[str, dist.ProcessGroup]:
    """The process group of each named dimension of ``mesh`` (e.g. a mesh made over the
    new generation's world by ``init_device_mesh``, as the first one was)."""
    names = mesh.mesh_dim_names
    if names is None:
        raise RegroupError("a DeviceMesh without mesh_dim_names cannot be matched by name")
    return {d: mesh.get_group(d) for d in names}


def meshes_of(model: nn.Module, extra: Iterable[DeviceMesh] = ()) -> list[DeviceMesh]:
    """Every mesh ``model`` reaches its groups through: its DTensor parameters', FSDP2's,
    their roots, and ``extra``; each once."""
    found: dict[int, DeviceMesh] = {}

    def add(mesh: DeviceMesh) -> None:
        for m in (mesh, private.root_mesh(mesh)):
            found.setdefault(id(m), m)

    for mesh in extra:
        add(mesh)
    for p in model.parameters():
        if isinstance(p, DTensor):
            add(p.device_mesh)
    for info in _mesh_infos(model):
        add(info.mesh)
    return list(found.values())


def _mesh_infos(model: nn.Module) -> list[Any]:
    found: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in private.fsdp_param_groups(module):
                for info in private.mesh_infos(group):
                    found.setdefault(id(info), info)
    return list(found.values())


def _dim_ranks(mesh: DeviceMesh, dim: int) -> list[int]:
    """The ranks along dimension ``dim`` of ``mesh`` through this rank's coordinate."""
    coord = mesh.get_coordinate()
    if coord is None:
        raise RegroupError(f"this rank is not in the mesh {mesh.mesh.tolist()}")
    index = tuple(slice(None) if d == dim else c for d, c in enumerate(coord))
    return sorted(int(r) for r in mesh.mesh[index].reshape(-1).tolist())


def _new_groups(
    mesh: DeviceMesh, groups: Mapping[str, dist.ProcessGroup]
) -> list[dist.ProcessGroup]:
    names = mesh.mesh_dim_names
    if names is None:
        raise RegroupError("a DeviceMesh without mesh_dim_names cannot be matched by name")
    flat = private.flattened_dims(mesh)
    if flat:
        raise RegroupError(f"mesh dimension(s) {flat} were flattened: not regrouped")
    out = []
    for d, name in enumerate(names):
        if name not in groups:
            raise RegroupError(
                f"no new process group for mesh dimension {name!r} (given: {sorted(groups)})"
            )
        want, got = _dim_ranks(mesh, d), sorted(dist.get_process_group_ranks(groups[name]))
        if want != got:
            raise RegroupError(
                f"the new group for mesh dimension {name!r} holds ranks {got}, "
                f"the mesh's dimension through this rank {want}"
            )
        out.append(groups[name])
    return out


def regroup(
    model: nn.Module,
    groups: Mapping[str, dist.ProcessGroup],
    *,
    meshes: Sequence[DeviceMesh] = (),
) -> Regrouped:
    """Move ``model`` (``fully_shard`` / ``parallelize_module`` already applied, trained
    or not) and ``meshes`` onto ``groups``, one per mesh dimension name. Checks every
    mesh before changing any: on :class:`RegroupError` nothing was changed."""
    found = meshes_of(model, meshes)
    plan = [(m, _new_groups(m, groups)) for m in found]
    for mesh, new in plan:
        private.set_dim_groups(mesh, new)
    infos = _mesh_infos(model)
    for info in infos:
        private.set_mesh_info_groups(info)
    return Regrouped(meshes=len(found), mesh_infos=len(infos))
