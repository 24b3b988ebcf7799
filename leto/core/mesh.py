"""Protection by the mesh: where tier 1 is parity, where it is replicas (issue 40).

Theory of operation
-------------------
A job on a device mesh (FSDP2, tensor parallel, HSDP) names its dimensions, e.g.
``("replicate", "shard", "tp")`` with shape ``(R, S, T)``; ranks are numbered row-major
over the mesh, and a node holds ``ranks_per_node`` consecutive ranks. Two ranks hold
identical retained state exactly when their coordinates differ only along replicate
dimensions (data parallel, HSDP's replicate dimension); along any other dimension their
shards differ. So every rank has a *state* (its coordinates with the replicate ones
dropped), and the ranks of one state are *replicas* of each other.

:func:`place_mesh` is the rule that protects such a job, on the blocks of
:mod:`leto.core.erasure`:

* **Replicas.** A lost DataBlock is copied from any live replica, on its node or on
  another node (:attr:`Placement.replicas`; :func:`~leto.core.erasure.decode` plans it as
  a tier-1 ``replica`` copy). A rank with a replica on another node is thus restored at
  the current step even when its whole node is lost (HSDP's cross-node replicas).
* **Tier 1, parity inside a node over the states that differ.** A node's parity group has
  one member per state on the node (its lowest rank there): ranks that are replicas of
  each other need no parity among themselves, and a single parity counting two equal
  blocks would cancel them out (``A xor A = 0``) and rebuild neither when both are lost.
  A node holding one state gets no parity group (its ranks copy each other, or a replica
  elsewhere), except a node holding a state no other rank holds: it keeps its mirror in
  host memory, as :func:`~leto.core.erasure.place` does for a one-rank node.
* **Tier 2, across nodes, as today**: every node's lagging snapshot, in rotated stripes
  (:func:`~leto.core.erasure.tier2_stripes`). It is what recovers a node loss when some
  rank of the node has no replica off the node.

What it promises (checked by ``tests/test_core_mesh.py`` against a brute-force model and
by TLC on ``spec/Mesh.tla``): every single rank failure is recovered at the current step;
a single node failure is recovered at the current step exactly when every rank of the
node has a replica on another node, else by a tier-2 rollback (tier 3 where tier 2 has no
cross-node parity).

Pure: no torch, no IO, no clock, no randomness.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from leto.core.erasure import (
    DataBlock,
    Group,
    Placement,
    Tier1Parity,
    Topology,
    check_tier2,
    tier2_stripes,
)

__all__ = ["Mesh", "place_mesh"]


def _str_tuple(value: Any) -> tuple[Any, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _int_tuple(value: Any) -> tuple[Any, ...]:
    if isinstance(value, int):
        return (value,)
    return tuple(value)


@attrs.frozen
class Mesh:
    """A device mesh as the protection rule sees it: named dimensions and their sizes,
    which of them replicate the state, and how many consecutive ranks share a node."""

    dims: tuple[str, ...] = attrs.field(converter=_str_tuple)
    shape: tuple[int, ...] = attrs.field(converter=_int_tuple)
    replicate: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    ranks_per_node: int = 1

    def __attrs_post_init__(self) -> None:
        if not self.dims:
            raise ValueError("Mesh: dims must name at least one dimension, got ()")
        for d in self.dims:
            if not isinstance(d, str) or not d:
                raise ValueError(f"Mesh: every dimension name must be a non-empty str, got {d!r}")
        if len(set(self.dims)) != len(self.dims):
            raise ValueError(f"Mesh: dimension names must be unique, got {self.dims}")
        if len(self.shape) != len(self.dims):
            raise ValueError(
                f"Mesh: shape {self.shape} has {len(self.shape)} sizes for "
                f"{len(self.dims)} dimensions {self.dims}"
            )
        for d, size in zip(self.dims, self.shape, strict=True):
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"Mesh: size of dimension {d!r} must be an int >= 1, got {size!r}")
        for d in self.replicate:
            if d not in self.dims:
                raise ValueError(f"Mesh: replicate dimension {d!r} is not one of {self.dims}")
        if len(set(self.replicate)) != len(self.replicate):
            raise ValueError(f"Mesh: a replicate dimension is named twice in {self.replicate}")
        k = self.ranks_per_node
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"Mesh: ranks_per_node must be an int >= 1, got {k!r}")
        if self.world_size % k:
            raise ValueError(
                f"Mesh: ranks_per_node={k} does not divide the mesh's {self.world_size} ranks "
                f"(shape {self.shape})"
            )

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def topology(self) -> Topology:
        return Topology.uniform(self.nodes, self.ranks_per_node)

    def check_world_size(self, world_size: int) -> None:
        """Refuse a world whose size is not the mesh's."""
        if world_size != self.world_size:
            raise ValueError(
                f"Mesh: shape {self.shape} holds {self.world_size} ranks, "
                f"the world has {world_size!r}"
            )

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise ValueError(f"unknown rank {rank!r}: this mesh has ranks 0..{self.world_size - 1}")

    def coords(self, rank: int) -> tuple[int, ...]:
        """The rank's coordinate along each dimension (row-major: the last varies fastest)."""
        self._check_rank(rank)
        out = []
        for size in reversed(self.shape):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def state_of(self, rank: int) -> tuple[int, ...]:
        """What determines the rank's state: its coordinates along the dimensions that
        do not replicate (equal for two ranks iff they hold identical state)."""
        coords = self.coords(rank)
        return tuple(c for d, c in zip(self.dims, coords, strict=True) if d not in self.replicate)

    def replicas_of(self, rank: int) -> tuple[int, ...]:
        """The other ranks holding the same state as ``rank``, sorted."""
        state = self.state_of(rank)
        return tuple(r for r in range(self.world_size) if r != rank and self.state_of(r) == state)

    def replica_classes(self) -> tuple[tuple[int, ...], ...]:
        """The sets of two or more ranks holding one state, sorted."""
        by_state: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            by_state.setdefault(self.state_of(r), []).append(r)
        return tuple(sorted(tuple(rs) for rs in by_state.values() if len(rs) > 1))

    def parity_members(self, node: int) -> tuple[int, ...]:
        """The ranks of ``node``'s tier-1 parity group: the lowest rank of every state on
        the node, when the node holds two states or more, or one state held nowhere else
        (its mirror); () where the node needs no parity."""
        k = self.ranks_per_node
        if not isinstance(node, int) or isinstance(node, bool) or not 0 <= node < self.nodes:
            raise ValueError(f"unknown node {node!r}: this mesh has nodes 0..{self.nodes - 1}")
        first: dict[tuple[int, ...], int] = {}
        for r in range(node * k, (node + 1) * k):
            first.setdefault(self.state_of(r), r)
        reps = tuple(sorted(first.values()))
        if len(reps) >= 2 or not self.replicas_of(reps[0]):
            return reps
        return ()


def place_mesh(
    mesh: Mesh, *, tier2: bool = True, tier2_parity: int = 1, world_size: int | None = None
) -> Placement:
    """The placement that protects ``mesh`` (see the module docstring): replicas, one
    tier-1 parity group per node over its distinct states, rotated tier-2 stripes.
    ``world_size``, where given, must be the mesh's."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"place_mesh: mesh must be a Mesh, got {mesh!r}")
    if world_size is not None:
        mesh.check_world_size(world_size)
    check_tier2("place_mesh", mesh.nodes, tier2, tier2_parity)
    groups: list[Group] = []
    for n in range(mesh.nodes):
        members = mesh.parity_members(n)
        if members:
            groups.append(
                Group(
                    name=f"t1/n{n}",
                    tier=1,
                    members=tuple(DataBlock(r) for r in members),
                    parity=(Tier1Parity(n),),
                )
            )
    if tier2:
        groups.extend(tier2_stripes(mesh.nodes, tier2_parity))
    return Placement(
        topology=mesh.topology(),
        groups=tuple(groups),
        snapshots=tier2,
        replicas=mesh.replica_classes(),
    )
