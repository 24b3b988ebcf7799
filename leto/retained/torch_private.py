"""Every private torch attribute leto uses for FSDP2 and DTensor, each behind one function.

FSDP2 exposes no public way to put a parameter's local shard in memory of our choosing,
nor to list its parameter groups, nor to refresh the process groups it caches; the
feasibility study (``docs/research/fsdp2/README.md``) found the attributes below do it
on torch 2.13. They move between releases, so they live here and nowhere else in leto:
each read goes through :func:`_get`, which turns a missing attribute into one
:class:`TorchPrivateError` naming the class, the attribute and the torch version, and
:func:`check_torch` walks the whole list (``tests/retained/test_torch_private.py``
runs it on a real FSDP2 model, so a torch upgrade that moves one fails there, by name).

Behaviour relied on that no attribute shows, of FSDP2's ``foreach_reduce``: it allocates
the reduce-scatter input, then the output, through the custom ``ReduceScatter``; it cuts
each sharded gradient out of the output with ``as_strided`` counted from the output's
storage start; it adds into an existing gradient; HSDP without all-reduce keeps the
output as a partial sum. ``test_torch_private.py`` checks the first three on one rank,
``test_dtensor_layout_ranks.py`` all of them on four.

What is public and therefore not here: ``fully_shard``, ``FSDPModule``,
``FSDPModule.set_custom_reduce_scatter``, ``MixedPrecisionPolicy``,
``CPUOffloadPolicy``, ``DTensor.from_local``, ``DeviceMesh``'s documented methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

# the base class a custom reduce-scatter derives from: public in use
# (set_custom_reduce_scatter takes one) but defined in a private module
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor

__all__ = [
    "PRIVATE",
    "ReduceScatter",
    "TorchPrivateError",
    "check_object",
    "check_torch",
    "dim_group_names",
    "flattened_dims",
    "set_dim_groups",
    "set_mesh_info_groups",
    "fsdp_param_groups",
    "fsdp_params",
    "keeps_partial_reduce",
    "mesh_infos",
    "mp_policy",
    "offloads_to_cpu",
    "padded_shard_size",
    "root_mesh",
    "set_local_shard",
    "shard_dim",
    "sharded_param",
    "sharded_size",
]


class TorchPrivateError(RuntimeError):
    """A private torch attribute leto relies on is missing or changed its shape."""


PRIVATE: dict[str, tuple[str, ...]] = {
    # the kind of object -> the attributes leto reads or writes on it
    "FSDPModule": ("_get_fsdp_state",),
    "FSDPState": ("_fsdp_param_groups",),
    "FSDPParamGroup": (
        "fsdp_params",
        "mp_policy",
        "mesh_info",
        "post_forward_mesh_info",
        "all_reduce_grads",
    ),
    "FSDPParam": (
        "sharded_param",
        "_sharded_param_data",
        "padded_sharded_param_size",
        "sharded_size",
        "fsdp_placement",
        "offload_to_cpu",
        "mesh_info",
        "reset_sharded_param",
    ),
    "DTensor": ("_local_tensor",),
    "HSDPMeshInfo": (
        "mesh",
        "shard_mesh_dim",
        "replicate_mesh_dim",
        "shard_process_group",
        "reduce_scatter_process_group",
        "replicate_process_group",
    ),
    "DeviceMesh": ("_dim_group_names", "_get_root_mesh", "_pg_registry", "_flatten_mapping"),
}
"""What :func:`check_torch` verifies, by kind; the functions below read only these."""


def _get(obj: object, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise TorchPrivateError(
            f"{type(obj).__name__} has no attribute {name!r} (torch {torch.__version__}):"
            " leto.retained.torch_private needs updating"
        ) from None


def check_object(obj: object, kind: str) -> None:
    """Raise :class:`TorchPrivateError` naming the first of ``PRIVATE[kind]`` ``obj`` lacks."""
    for name in PRIVATE[kind]:
        _get(obj, name)


def fsdp_param_groups(module: FSDPModule) -> list[Any]:
    """The ``FSDPParamGroup``\\ s of one ``fully_shard``-ed module (more than one only
    with a per-parameter mesh from ``shard_placement_fn``)."""
    return list(_get(_get(module, "_get_fsdp_state")(), "_fsdp_param_groups"))


def fsdp_params(group: Any) -> list[Any]:
    """The group's ``FSDPParam``\\ s, in the order of its all-gather and reduce-scatter
    buffers: a group's reduce-scatter output is their padded shards in this order."""
    return list(_get(group, "fsdp_params"))


def mp_policy(group: Any) -> MixedPrecisionPolicy:
    """The group's mixed precision policy (``param_dtype``, ``reduce_dtype``)."""
    policy = _get(group, "mp_policy")
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TorchPrivateError(f"FSDPParamGroup.mp_policy is a {type(policy).__name__}")
    return policy


def sharded_param(fp: Any) -> DTensor:
    """The module's registered parameter: an ``nn.Parameter`` holding a DTensor."""
    p = _get(fp, "sharded_param")
    if not isinstance(p, nn.Parameter) or not isinstance(p, DTensor):
        raise TorchPrivateError(f"FSDPParam.sharded_param is a {type(p).__name__}")
    return p


def padded_shard_size(fp: Any) -> torch.Size:
    """The local shard's size padded to equal size on every rank of the shard group."""
    return torch.Size(_get(fp, "padded_sharded_param_size"))


def sharded_size(fp: Any) -> torch.Size:
    """The local shard's true size (its ``shard_dim`` may be shorter than padded)."""
    return torch.Size(_get(fp, "sharded_size"))


def shard_dim(fp: Any) -> int:
    """The dimension FSDP shards (``Shard(d)`` placement; 0 unless ``shard_placement_fn``)."""
    return int(_get(_get(fp, "fsdp_placement"), "dim"))


def offloads_to_cpu(fp: Any) -> bool:
    """Whether the parameter's group was given a ``CPUOffloadPolicy``."""
    return bool(_get(fp, "offload_to_cpu"))


@torch.no_grad()
def set_local_shard(fp: Any, padded: torch.Tensor) -> None:
    """Make ``padded`` (of :func:`padded_shard_size`) the parameter's storage, no copy.

    FSDP2 all-gathers from ``_sharded_param_data`` (the padded shard, flat) and computes
    on ``sharded_param._local_tensor`` (its unpadded prefix); both are set to views of
    ``padded``. ``reset_sharded_param`` (FSDP2's own re-pad after ``_apply`` or
    ``load_state_dict``) then sees the same storage and keeps it, so it is called to
    make sure of that.
    """
    size = padded_shard_size(fp)
    if padded.shape != size:
        raise TorchPrivateError(
            f"a padded shard of {tuple(size)} expected, got {tuple(padded.shape)}"
        )
    d = shard_dim(fp)
    local = padded.narrow(d, 0, sharded_size(fp)[d])
    p = sharded_param(fp)
    _get(p, "_local_tensor")
    fp._sharded_param_data = padded.view(-1)
    p._local_tensor = local
    _get(fp, "reset_sharded_param")()
    if _get(fp, "_sharded_param_data").data_ptr() != padded.data_ptr():
        raise TorchPrivateError("FSDPParam.reset_sharded_param replaced the bound shard")


def keeps_partial_reduce(group: Any) -> bool:
    """Whether the group's next reduce-scatter output is kept as a partial sum rather than
    becoming gradients: HSDP with ``set_requires_all_reduce(False)`` (FSDP2 then adds
    the next output to it, so the two must not be one tensor)."""
    replicated = _get(_get(group, "mesh_info"), "replicate_mesh_dim") is not None
    return replicated and not _get(group, "all_reduce_grads")


def mesh_infos(group: Any) -> list[Any]:
    """The distinct mesh-info objects of a group (its own, post-forward, its params'):
    where FSDP2 caches ``ProcessGroup`` objects (``shard_process_group``,
    ``replicate_process_group``, ``reduce_scatter_process_group``) that a new
    generation of groups must replace."""
    found: dict[int, Any] = {}
    infos = [_get(group, "mesh_info"), _get(group, "post_forward_mesh_info")]
    infos += [_get(fp, "mesh_info") for fp in fsdp_params(group)]
    for info in infos:
        if info is not None:
            found.setdefault(id(info), info)
    return list(found.values())


def dim_group_names(mesh: DeviceMesh) -> list[str]:
    """The c10d group names a mesh resolves its dimensions through, at each ``get_group``."""
    return list(_get(mesh, "_dim_group_names"))


def set_dim_groups(mesh: DeviceMesh, groups: Sequence[dist.ProcessGroup]) -> None:
    """Make ``mesh`` resolve its dimensions, in order, through ``groups``: its
    ``_dim_group_names`` (what ``get_group`` resolves outside ``torch.compile``) and its
    root mesh's ``_pg_registry`` (what it resolves inside) name them."""
    names = [g.group_name for g in groups]
    old = dim_group_names(mesh)
    if len(old) != len(names):
        raise TorchPrivateError(f"DeviceMesh has {len(old)} dimension group(s), {len(names)} given")
    mesh._dim_group_names = names
    registry = _get(root_mesh(mesh), "_pg_registry")
    for name in old:
        registry.pop(name, None)
    registry.update(zip(names, groups, strict=True))


def flattened_dims(mesh: DeviceMesh) -> list[str]:
    """The names of the dimensions flattened (``_flatten``) from ``mesh``'s root mesh."""
    return sorted(_get(root_mesh(mesh), "_flatten_mapping"))


def set_mesh_info_groups(info: Any) -> None:
    """Re-read an FSDP2 mesh info's cached groups from its mesh (after
    :func:`set_dim_groups`): ``shard_process_group`` and, for HSDP,
    ``replicate_process_group``. A ``reduce_scatter_process_group`` of its own (set by
    ``set_separate_reduce_scatter_group``) has no dimension to be matched by: refused."""
    mesh = _get(info, "mesh")
    shard_dim = getattr(info, "shard_mesh_dim", None)
    if shard_dim is not None:
        if _get(info, "reduce_scatter_process_group") is not None:
            raise TorchPrivateError(
                "an FSDP2 group reduce-scatters over a separate process group "
                "(set_separate_reduce_scatter_group): it cannot be regrouped"
            )
        info.shard_process_group = mesh.get_group(shard_dim)
    replicate_dim = getattr(info, "replicate_mesh_dim", None)
    if replicate_dim is not None:
        info.replicate_process_group = mesh.get_group(replicate_dim)


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself if it was not)."""
    root = _get(mesh, "_get_root_mesh")()
    if not isinstance(root, DeviceMesh):
        raise TorchPrivateError(f"DeviceMesh._get_root_mesh() gave a {type(root).__name__}")
    return root


def check_torch(modules: Sequence[FSDPModule]) -> None:
    """Check every attribute of :data:`PRIVATE` on live objects of ``modules`` (``fully_shard``
    already called); raise one :class:`TorchPrivateError` naming the first one missing."""
    for module in modules:
        check_object(module, "FSDPModule")
        check_object(_get(module, "_get_fsdp_state")(), "FSDPState")
        for group in fsdp_param_groups(module):
            check_object(group, "FSDPParamGroup")
            mp_policy(group)
            for fp in fsdp_params(group):
                check_object(fp, "FSDPParam")
                check_object(sharded_param(fp), "DTensor")
                check_object(sharded_param(fp).device_mesh, "DeviceMesh")
                for read in (padded_shard_size, sharded_size, shard_dim):
                    read(fp)
            for info in mesh_infos(group):
                _get(info, "mesh")
                if _get(info, "shard_mesh_dim") is not None:
                    _get(info, "shard_process_group")
                    _get(info, "reduce_scatter_process_group")
                if _get(info, "replicate_mesh_dim") is not None:
                    _get(info, "replicate_process_group")
