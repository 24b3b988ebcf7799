"""Erasure groups: which blocks protect which, where they live, what a failure costs.

Theory of operation
-------------------
Every rank's retained state (parameters, optimizer state, gradients) is a
:class:`DataBlock` held on its node. Two tiers of redundancy protect it, and a disk
checkpoint sits behind both.

* **Tier 1, inside a node, every step.** One single-parity block per node
  (:class:`Tier1Parity`, XOR or a sum mod 2^w over the node's ranks' data) kept in the
  node's *host* memory. The common memory failures are per rank (a GPU reset, a keeper
  crash): host memory outlives them, and single parity rebuilds any one missing rank of
  the node at the current step, so nothing is lost. It costs one rank's worth of host
  memory per node and an intra-node reduction per step (no network). A node with one
  rank still gets its parity block: it is then a mirror in host memory. Tier 1 cannot
  survive a node loss (the parity dies with the node) nor two ranks of one node.
* **Tier 2, across nodes, lagging.** Every node keeps a snapshot of its ranks' data
  (:class:`SnapshotBlock`) taken every few steps, off the critical path, and the
  snapshots are erasure coded across nodes (:class:`Tier2Parity`) so that the loss of
  any ``tier2_parity`` whole nodes is survivable. Moving data between nodes every step
  would put the network on the training path, so tier 2 lags by up to K steps: using it
  rolls *every* rank back to the snapshot step (all ranks must resume at one step) and
  costs up to K steps of recompute. It also covers what tier 1 cannot inside a node
  (two ranks of one node losing memory: their snapshots are in host memory).
* **Tier 3.** Beyond both: the last disk checkpoint. Never silent corruption.

Tier-2 placement (rotated stripes)
----------------------------------
A parity block sitting on a node whose snapshot it protects is worth nothing against
the loss of that node (the node takes two blocks of the group with it). So with ``N``
nodes and ``p = tier2_parity`` (``1 <= p < N``) there are ``N`` tier-2 groups
("stripes") ``s = 0..N-1``: stripe ``s`` has its ``p`` parity blocks
``Tier2Parity(s, h)`` on the nodes ``h = s, s+1, .., s+p-1 (mod N)`` and, as members,
the snapshots of the other ``N - p`` nodes. Each snapshot is cut into ``N - p`` equal
stripes, one per group it belongs to (in the order of :attr:`Placement.groups`, see
:meth:`Placement.groups_of`). Every node holds exactly one block of every stripe (a
stripe of its snapshot, or one parity block), so losing any ``p`` nodes costs every
group exactly ``p`` blocks: all decodable (an MDS code per stripe). Each node stores
``p / (N - p)`` of a snapshot in parity, the optimum for this protection, and the load
is the same on every node. With 2 nodes and 1 parity this degenerates to each node
holding a copy of the other's snapshot; with ``p = N - 1`` it is full replication.
With ``p = 0`` the snapshots have no cross-node parity: they still cover memory losses
inside a node (including a single-node job), not a node loss.

Replicas
--------
Ranks that hold identical state (data parallel; on a device mesh, ranks that differ only
along a replicate dimension: :mod:`leto.core.mesh`) are listed in
:attr:`Placement.replicas`. A lost DataBlock with a live replica is copied from it at
the current step, from its own node or another one: a tier-1 repair whose ``group`` is
:data:`REPLICA`. :func:`place` lists none; :func:`leto.core.mesh.place_mesh` does.

Decoding
--------
A block belonging to several groups holds one *share* (stripe) in each; a group rebuilds
its missing shares when at most ``tolerance`` (= its number of parity blocks) of its
blocks are missing. Groups share no share, so peeling finishes in one pass per tier.
Tier 1 is tried first, copies from live replicas and tier-1 groups to a fixpoint (a
block one brings back can feed the other): if it brings back every lost
:class:`DataBlock`, the plan is tier 1 (no work lost). Otherwise the plan is a tier-2 rollback, which needs *every*
node's snapshot (present, or rebuilt from its stripes), since every rank restores its
snapshot, not only the ones that lost memory; failing that, tier 3. Tier 1 and tier 2
never feed each other: the snapshot holds an older step than the live data. A tier-2
plan drops the tier-1 repairs (their step is discarded by the rollback), restores the
lost DataBlocks from their snapshots and re-encodes lost tier-1 parity from them.
:func:`replay` executes a plan symbolically, share by share, and checks every repair's
sources are available when it runs: callers can assert a plan before carrying it out.

:func:`coverage` enumerates failure patterns (RankMemory of a rank, NodeLoss of a node)
and skips a RankMemory of a rank whose node is lost in the same pattern (subsumed);
different patterns that lose the same blocks are kept, since they are different
failures to inject.

Pure: no torch, no IO, no clock, no randomness; every output is deterministically
ordered.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, cast

import attrs
import networkx as nx

__all__ = [
    "Block",
    "CoverageReport",
    "DataBlock",
    "DecodePlan",
    "Failure",
    "Group",
    "NodeLoss",
    "PatternResult",
    "Placement",
    "RankMemory",
    "BlockRepair",
    "REPLICA",
    "Tier1Parity",
    "Tier2Parity",
    "SnapshotBlock",
    "Topology",
    "check_tier2",
    "coverage",
    "decode",
    "lost_blocks",
    "place",
    "placement_graph",
    "replay",
    "tier2_stripes",
]


def _check_index(inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(
            f"{type(inst).__name__}.{attribute.name} must be an int >= 0, got {value!r}"
        )


# --------------------------------------------------------------------------- topology


def _check_sizes(inst: Topology, attribute: attrs.Attribute[Any], value: tuple[int, ...]) -> None:
    if not value:
        raise ValueError("Topology.node_sizes must name at least one node, got ()")
    for node, size in enumerate(value):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(
                f"Topology.node_sizes[{node}] must be an int >= 1 (ranks on node {node}), "
                f"got {size!r}"
            )


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


@attrs.frozen
class Topology:
    """Ranks per node; ranks are numbered node-major: node 0 holds ranks 0..k-1, etc."""

    node_sizes: tuple[int, ...] = attrs.field(converter=_int_tuple, validator=_check_sizes)

    @classmethod
    def uniform(cls, nodes: int, ranks_per_node: int) -> Topology:
        for name, value in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Topology.uniform: {name} must be an int >= 1, got {value!r}")
        return cls((ranks_per_node,) * nodes)

    @functools.cached_property
    def world_size(self) -> int:  # read per event: summed once (attrs >= 23.2 caches it)
        return sum(self.node_sizes)

    @property
    def nodes(self) -> int:
        """The number of nodes."""
        return len(self.node_sizes)

    def _check_node(self, node: int) -> None:
        if not isinstance(node, int) or isinstance(node, bool) or not 0 <= node < self.nodes:
            raise ValueError(f"unknown node {node!r}: this topology has nodes 0..{self.nodes - 1}")

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"unknown rank {rank!r}: this topology has ranks 0..{self.world_size - 1}"
            )

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        first = 0
        for node, size in enumerate(self.node_sizes):
            if rank < first + size:
                return node
            first += size
        raise AssertionError("unreachable")  # pragma: no cover

    def ranks_of(self, node: int) -> tuple[int, ...]:
        self._check_node(node)
        first = sum(self.node_sizes[:node])
        return tuple(range(first, first + self.node_sizes[node]))


# ----------------------------------------------------------------------------- blocks


@functools.total_ordering
class _Ordered:
    """Total order across the block (or failure) classes: by kind, then by fields."""

    __slots__ = ()
    _FAMILY: ClassVar[str] = "block"
    _KIND: ClassVar[int]

    def sort_key(self) -> tuple[int, ...]:
        fields = attrs.fields(cast(Any, type(self)))
        return (self._KIND, *(getattr(self, f.name) for f in fields))

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, _Ordered) or other._FAMILY != self._FAMILY:
            return NotImplemented
        return self.sort_key() < other.sort_key()


@attrs.frozen(order=False)
class DataBlock(_Ordered):
    """A rank's retained state at the current step, held on the rank's node."""

    _KIND: ClassVar[int] = 0
    rank: int = attrs.field(validator=_check_index)


@attrs.frozen(order=False)
class Tier1Parity(_Ordered):
    """Single parity over the node's ranks' data, in that node's host memory."""

    _KIND: ClassVar[int] = 1
    node: int = attrs.field(validator=_check_index)


@attrs.frozen(order=False)
class SnapshotBlock(_Ordered):
    """The node's lagging snapshot of its ranks' data, held on that node."""

    _KIND: ClassVar[int] = 2
    node: int = attrs.field(validator=_check_index)


@attrs.frozen(order=False)
class Tier2Parity(_Ordered):
    """A parity block of tier-2 stripe ``index``, held on node ``holder``."""

    _KIND: ClassVar[int] = 3
    index: int = attrs.field(validator=_check_index)
    holder: int = attrs.field(validator=_check_index)


Block = DataBlock | Tier1Parity | SnapshotBlock | Tier2Parity
_BLOCK_TYPES = (DataBlock, Tier1Parity, SnapshotBlock, Tier2Parity)


def _block_tuple(value: Iterable[Block]) -> tuple[Block, ...]:
    return tuple(value)


@attrs.frozen(order=False)
class RankMemory(_Ordered):
    """A rank's retained memory is gone (GPU reset, keeper crash): loses its DataBlock."""

    _FAMILY: ClassVar[str] = "failure"
    _KIND: ClassVar[int] = 0
    rank: int = attrs.field(validator=_check_index)

    def __str__(self) -> str:
        return f"mem r{self.rank}"


@attrs.frozen(order=False)
class NodeLoss(_Ordered):
    """A whole node is gone: every block it holds is lost."""

    _FAMILY: ClassVar[str] = "failure"
    _KIND: ClassVar[int] = 1
    node: int = attrs.field(validator=_check_index)

    def __str__(self) -> str:
        return f"node n{self.node}"


Failure = RankMemory | NodeLoss


# ----------------------------------------------------------------------------- groups


def _check_tier(inst: Group, attribute: attrs.Attribute[int], value: int) -> None:
    if value not in (1, 2) or isinstance(value, bool):
        raise ValueError(f"Group.tier must be 1 or 2, got {value!r}")


@attrs.frozen
class Group:
    """An MDS erasure group: any ``tolerance`` missing blocks among members + parity
    can be rebuilt from the others (tier 1: single parity, XOR/sum)."""

    name: str
    tier: int = attrs.field(validator=_check_tier)
    members: tuple[Block, ...] = attrs.field(converter=_block_tuple)
    parity: tuple[Block, ...] = attrs.field(converter=_block_tuple)

    def __attrs_post_init__(self) -> None:
        if not self.members:
            raise ValueError(f"Group {self.name!r}: members must not be empty")
        if not self.parity:
            raise ValueError(f"Group {self.name!r}: parity must not be empty")
        member_type, parity_type = (
            (DataBlock, Tier1Parity) if self.tier == 1 else (SnapshotBlock, Tier2Parity)
        )
        for role, blocks, kind in (
            ("members", self.members, member_type),
            ("parity", self.parity, parity_type),
        ):
            for block in blocks:
                if not isinstance(block, kind):
                    raise ValueError(
                        f"Group {self.name!r} (tier {self.tier}): {role} must be "
                        f"{kind.__name__} blocks, got {block!r}"
                    )
        if len(set(self.blocks)) != len(self.blocks):
            raise ValueError(f"Group {self.name!r}: a block appears twice")

    @property
    def tolerance(self) -> int:
        return len(self.parity)

    @property
    def blocks(self) -> tuple[Block, ...]:
        return self.members + self.parity


# -------------------------------------------------------------------------- placement


def _group_tuple(value: Iterable[Group]) -> tuple[Group, ...]:
    return tuple(value)


def _classes(value: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(sorted(tuple(sorted(cls)) for cls in value))


# The ``group`` of a :class:`BlockRepair` that copies a DataBlock from a live replica.
REPLICA = "replica"


@attrs.frozen
class Placement:
    """Where every block lives and which groups protect it.

    ``snapshots`` says whether every node keeps a tier-2 snapshot (tier 2 on); the
    snapshots are then protected by the tier-2 groups, if any (``tier2_parity >= 1``).
    """

    topology: Topology
    groups: tuple[Group, ...] = attrs.field(converter=_group_tuple)
    snapshots: bool = False
    replicas: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_classes)

    def __attrs_post_init__(self) -> None:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"Placement: group names must be unique, got {names}")
        if REPLICA in names:
            raise ValueError(f"Placement: {REPLICA!r} names the copies from a replica, not a group")
        seen_ranks: set[int] = set()
        for cls in self.replicas:
            if len(cls) < 2:
                raise ValueError(f"Placement: a replica class needs two ranks or more, got {cls}")
            for rank in cls:
                self.topology._check_rank(rank)
                if rank in seen_ranks:
                    raise ValueError(f"Placement: rank {rank} is in two replica classes")
                seen_ranks.add(rank)
        parity_seen: set[Block] = set()
        tier1_seen: set[Block] = set()
        for group in self.groups:
            for block in group.blocks:
                self.holder(block)  # validates ranks and nodes against the topology
            for block in group.parity:
                if block in parity_seen:
                    raise ValueError(f"Placement: {block!r} is parity of two groups")
                parity_seen.add(block)
            if group.tier == 1:
                for block in group.members:
                    if block in tier1_seen:
                        raise ValueError(f"Placement: {block!r} is in two tier-1 groups")
                    tier1_seen.add(block)
            elif not self.snapshots:
                raise ValueError(f"Placement: tier-2 group {group.name!r} needs snapshots=True")

    def replicas_of(self, rank: int) -> tuple[int, ...]:
        """The other ranks that hold the same state as ``rank`` (sorted; () if none)."""
        self.topology._check_rank(rank)
        for cls in self.replicas:
            if rank in cls:
                return tuple(r for r in cls if r != rank)
        return ()

    def holder(self, block: Block) -> int:
        """The node whose memory holds ``block``."""
        topo = self.topology
        if isinstance(block, DataBlock):
            return topo.node_of(block.rank)
        if isinstance(block, Tier1Parity | SnapshotBlock):
            topo._check_node(block.node)
            return block.node
        if isinstance(block, Tier2Parity):
            topo._check_node(block.holder)
            return block.holder
        raise TypeError(f"not a block: {block!r}")

    def blocks(self) -> tuple[Block, ...]:
        """Every block of this placement, sorted."""
        out: set[Block] = {DataBlock(r) for r in range(self.topology.world_size)}
        if self.snapshots:
            out.update(SnapshotBlock(n) for n in range(self.topology.nodes))
        for group in self.groups:
            out.update(group.blocks)
        return tuple(sorted(out))

    def groups_of(self, block: Block) -> tuple[Group, ...]:
        """The groups ``block`` belongs to, in placement order. For a snapshot, its k-th
        group encodes its k-th stripe."""
        return tuple(g for g in self.groups if block in g.blocks)

    @property
    def tier1(self) -> bool:
        return any(g.tier == 1 for g in self.groups)


def place(
    topology: Topology, *, tier1: bool = True, tier2: bool = True, tier2_parity: int = 1
) -> Placement:
    """The standard placement: one tier-1 group per node, rotated tier-2 stripes.

    ``tier2_parity`` is how many whole nodes tier 2 survives; it must be smaller than the
    number of nodes when tier 2 is on (0 is allowed: snapshots without cross-node
    parity, which only cover memory losses inside a node).
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"place: topology must be a Topology, got {topology!r}")
    nodes = topology.nodes
    check_tier2("place", nodes, tier2, tier2_parity)
    groups: list[Group] = []
    if tier1:
        for n in range(nodes):
            groups.append(
                Group(
                    name=f"t1/n{n}",
                    tier=1,
                    members=tuple(DataBlock(r) for r in topology.ranks_of(n)),
                    parity=(Tier1Parity(n),),
                )
            )
    if tier2:
        groups.extend(tier2_stripes(nodes, tier2_parity))
    return Placement(topology=topology, groups=tuple(groups), snapshots=tier2)


def check_tier2(where: str, nodes: int, tier2: bool, tier2_parity: int) -> None:
    """Refuse a ``tier2_parity`` that is not an int >= 0, or that is not smaller than the
    number of nodes while tier 2 is on."""
    if not isinstance(tier2_parity, int) or isinstance(tier2_parity, bool) or tier2_parity < 0:
        raise ValueError(f"{where}: tier2_parity must be an int >= 0, got {tier2_parity!r}")
    if tier2 and tier2_parity >= nodes:
        raise ValueError(
            f"{where}: tier2_parity={tier2_parity} must be smaller than the number of nodes "
            f"({nodes}): a node cannot protect its own snapshot against its own loss "
            f"(use tier2_parity=0, or tier2=False)"
        )


def tier2_stripes(nodes: int, tier2_parity: int) -> list[Group]:
    """The rotated tier-2 stripes over ``nodes`` nodes' snapshots (none for parity 0)."""
    groups = []
    for s in range(nodes if tier2_parity > 0 else 0):
        holders = [(s + j) % nodes for j in range(tier2_parity)]
        groups.append(
            Group(
                name=f"t2/s{s}",
                tier=2,
                members=tuple(SnapshotBlock(n) for n in range(nodes) if n not in holders),
                parity=tuple(Tier2Parity(s, h) for h in holders),
            )
        )
    return groups


def placement_graph(placement: Placement) -> Any:
    """A bipartite ``networkx.Graph``: block nodes (``bipartite=0``, ``kind="block"``,
    ``holder`` = node) and group nodes keyed by group name (``bipartite=1``,
    ``kind="group"``, ``tier``, ``tolerance``); edges carry ``role`` ("member" or
    "parity"). Blocks in no group are isolated nodes."""
    graph = nx.Graph()
    for block in placement.blocks():
        graph.add_node(block, bipartite=0, kind="block", holder=placement.holder(block))
    for group in placement.groups:
        graph.add_node(
            group.name, bipartite=1, kind="group", tier=group.tier, tolerance=group.tolerance
        )
        for block in group.members:
            graph.add_edge(block, group.name, role="member")
        for block in group.parity:
            graph.add_edge(block, group.name, role="parity")
    return graph


# ----------------------------------------------------------------------------- decode


def lost_blocks(placement: Placement, failures: Iterable[Failure]) -> frozenset[Block]:
    """The blocks the given failures destroy."""
    lost: set[Block] = set()
    all_blocks: tuple[Block, ...] | None = None
    for failure in failures:
        if isinstance(failure, RankMemory):
            placement.topology._check_rank(failure.rank)
            lost.add(DataBlock(failure.rank))
        elif isinstance(failure, NodeLoss):
            placement.topology._check_node(failure.node)
            if all_blocks is None:
                all_blocks = placement.blocks()
            lost.update(b for b in all_blocks if placement.holder(b) == failure.node)
        else:
            raise TypeError(f"not a failure: {failure!r}")
    return frozenset(lost)


def _restore_group(node: int) -> str:
    return f"restore/n{node}"


@attrs.frozen
class BlockRepair:
    """Rebuild ``block`` (its share in ``group``) from ``sources`` (their shares in it).

    A tier-2 repair of a :class:`DataBlock` is a *restore*: ``group`` is
    ``"restore/n<node>"`` and the only source is the node's whole (rebuilt)
    :class:`SnapshotBlock`. A tier-1 repair with ``group`` :data:`REPLICA` is a *copy*:
    the only source is the DataBlock of a live replica (a rank holding the same state,
    :attr:`Placement.replicas`), on the block's node or another one.
    """

    block: Block
    tier: int
    group: str
    sources: tuple[Block, ...]

    @property
    def is_restore(self) -> bool:
        return isinstance(self.block, DataBlock) and self.tier == 2

    @property
    def is_copy(self) -> bool:
        return self.group == REPLICA


@attrs.frozen
class DecodePlan:
    """What a set of lost blocks costs, and how to rebuild what can be rebuilt.

    ``tier``: 0 nothing lost; 1 every lost DataBlock comes back at the current step
    (through tier-1 parity or a copy from a live replica; lost redundancy blocks are rebuilt where their groups allow,
    the rest is listed in ``unrecoverable`` for the caller to re-encode); 2 some lost
    DataBlock needs the tier-2 snapshot, and every node's snapshot is available, so every
    rank rolls back to the snapshot step (the caller does that; ``order`` restores the
    lost DataBlocks, then re-encodes lost tier-1 parity from them); 3 some DataBlock
    cannot be brought back at a common step: fall back to the disk checkpoint (``order``
    then lists what could still be rebuilt in place, for information).
    """

    recoverable: bool
    order: tuple[BlockRepair, ...]
    tier: int
    unrecoverable: frozenset[Block]


def _repair_groups(
    groups: Iterable[Group], lost: frozenset[Block], out: list[BlockRepair]
) -> set[Block]:
    """Repairs of every decodable group (members first, then parity re-encoded from the
    members). Returns the blocks left with a missing share."""
    broken: set[Block] = set()
    for group in groups:
        missing = [b for b in group.blocks if b in lost]
        if not missing:
            continue
        if len(missing) > group.tolerance:
            broken.update(missing)
            continue
        k = len(group.members)
        sources = tuple(b for b in group.blocks if b not in lost)[:k]
        for block in group.members:
            if block in lost:
                out.append(BlockRepair(block, group.tier, group.name, sources))
        for block in group.parity:
            if block in lost:
                out.append(BlockRepair(block, group.tier, group.name, group.members))
    return broken


def _tier1_repairs(
    placement: Placement, groups: list[Group], lost: frozenset[Block], out: list[BlockRepair]
) -> set[Block]:
    """Repairs at the current step, to a fixpoint: a lost DataBlock copied from a live
    replica (one on its own node first), then every decodable tier-1 group; a block one
    brings back can be the source of the other (two replicas of a node both lost: parity
    rebuilds the one in the group, the other copies it). Returns what is still missing."""
    missing = set(lost)
    progress = True
    while progress:
        progress = False
        for block in sorted(b for b in missing if isinstance(b, DataBlock)):
            node = placement.holder(block)
            live = [q for q in placement.replicas_of(block.rank) if DataBlock(q) not in missing]
            if live:
                source = min(live, key=lambda q: (placement.topology.node_of(q) != node, q))
                out.append(BlockRepair(block, 1, REPLICA, (DataBlock(source),)))
                missing.discard(block)
                progress = True
        before = len(out)
        _repair_groups(groups, frozenset(missing), out)
        for repair in out[before:]:
            missing.discard(repair.block)
            progress = True
    return missing


def decode(placement: Placement, lost: frozenset[Block]) -> DecodePlan:
    """Decide the tier a set of lost blocks costs and an executable repair order."""
    known = set(placement.blocks())
    for block in lost:
        if not isinstance(block, _BLOCK_TYPES):
            raise TypeError(f"decode: not a block: {block!r}")
        if block not in known:
            raise ValueError(f"decode: {block!r} is not part of this placement")
    lost = frozenset(lost)
    if not lost:
        return DecodePlan(recoverable=True, order=(), tier=0, unrecoverable=frozenset())

    tier1_groups = [g for g in placement.groups if g.tier == 1]
    tier2_groups = [g for g in placement.groups if g.tier == 2]

    order: list[BlockRepair] = []
    t1_missing = _tier1_repairs(placement, tier1_groups, lost, order)
    lost_data = sorted(b for b in lost if isinstance(b, DataBlock))
    need_tier2 = [b for b in lost_data if b in t1_missing]

    t2_order: list[BlockRepair] = []
    t2_broken = _repair_groups(tier2_groups, lost, t2_order)

    def snapshot_ok(node: int) -> bool:
        snap = SnapshotBlock(node)
        if snap not in lost:
            return True
        # A lost snapshot comes back only if it has stripes, and every stripe's group
        # rebuilt it.
        return bool(placement.groups_of(snap)) and snap not in t2_broken

    if not need_tier2:
        order.extend(t2_order)
        tier = 1
    elif placement.snapshots and all(snapshot_ok(n) for n in range(placement.topology.nodes)):
        # Rollback: tier-1 repairs rebuild the current step, which is about to be
        # discarded; drop them, restore from the snapshots, re-encode tier-1 parity.
        order = list(t2_order)
        for block in lost_data:
            node = placement.holder(block)
            order.append(BlockRepair(block, 2, _restore_group(node), (SnapshotBlock(node),)))
        for group in tier1_groups:
            for block in group.parity:
                if block in lost:
                    order.append(BlockRepair(block, 1, group.name, group.members))
        tier = 2
    else:
        order.extend(t2_order)
        tier = 3

    repaired = {r.block for r in order}
    # A block with several shares is back only when every share is.
    unrecoverable = frozenset(b for b in lost if b not in repaired or b in t2_broken)
    recoverable = not any(isinstance(b, DataBlock) for b in unrecoverable)
    assert recoverable == (tier <= 2)
    return DecodePlan(
        recoverable=recoverable, order=tuple(order), tier=tier, unrecoverable=unrecoverable
    )


def replay(
    placement: Placement, lost: Iterable[Block], order: Iterable[BlockRepair]
) -> frozenset[Block]:
    """Execute ``order`` symbolically after losing ``lost``; return the blocks whole at
    the end. Raises ``ValueError`` naming the first repair that cannot run: a source (its
    share in the repair's group) is not available, the target is not missing, the group
    is unknown or does not hold the block, or too few sources for the code.

    Bookkeeping is per share: a block has one share per group it belongs to (one share
    in all if it belongs to none) and is whole when every share is available. A restore
    from a snapshot needs the whole snapshot and makes the DataBlock whole.
    """
    by_name = {g.name: g for g in placement.groups}
    all_blocks = placement.blocks()
    shares = {b: [g.name for g in placement.groups_of(b)] or [""] for b in all_blocks}
    lost = frozenset(lost)
    available = {(b, s) for b in all_blocks if b not in lost for s in shares[b]}

    def whole(block: Block) -> bool:
        return all((block, s) in available for s in shares[block])

    for step, repair in enumerate(order):
        where = f"replay: repair #{step} {repair!r}"
        block = repair.block
        if block not in shares:
            raise ValueError(f"{where}: block is not part of this placement")
        if repair.is_copy:
            (source,) = repair.sources if len(repair.sources) == 1 else (None,)
            if not (
                isinstance(block, DataBlock)
                and isinstance(source, DataBlock)
                and repair.tier == 1
                and source.rank in placement.replicas_of(block.rank)
            ):
                raise ValueError(f"{where}: a copy reads one replica of the block's rank")
            if not whole(source):
                raise ValueError(f"{where}: source {source!r} is not available")
            if whole(block):
                raise ValueError(f"{where}: block is not missing")
            available.update((block, s) for s in shares[block])
            continue
        if repair.is_restore:
            node = placement.holder(block)
            if repair.group != _restore_group(node) or repair.sources != (SnapshotBlock(node),):
                raise ValueError(f"{where}: a restore reads its own node's snapshot")
            if not placement.snapshots or not whole(SnapshotBlock(node)):
                raise ValueError(f"{where}: snapshot of node {node} is not available")
            if whole(block):
                raise ValueError(f"{where}: block is not missing")
            available.update((block, s) for s in shares[block])
            continue
        group = by_name.get(repair.group)
        if group is None or block not in group.blocks or repair.tier != group.tier:
            raise ValueError(f"{where}: no tier-{repair.tier} group {repair.group!r} holds it")
        if (block, group.name) in available:
            raise ValueError(f"{where}: block is not missing")
        if len(set(repair.sources)) < len(group.members) or block in repair.sources:
            raise ValueError(f"{where}: needs {len(group.members)} other blocks of the group")
        for source in repair.sources:
            if source not in group.blocks or (source, group.name) not in available:
                raise ValueError(f"{where}: source {source!r} is not available")
        available.add((block, group.name))
    return frozenset(b for b in all_blocks if whole(b))


# --------------------------------------------------------------------------- coverage


@attrs.frozen
class PatternResult:
    failures: frozenset[Failure]
    lost: frozenset[Block]
    tier: int

    def label(self) -> str:
        return " + ".join(str(f) for f in sorted(self.failures))


def _elements(topology: Topology) -> list[Failure]:
    out: list[Failure] = [RankMemory(r) for r in range(topology.world_size)]
    out.extend(NodeLoss(n) for n in range(topology.nodes))
    return out


def _patterns(topology: Topology, max_failures: int) -> Iterator[tuple[Failure, ...]]:
    elements = _elements(topology)
    for size in range(1, max_failures + 1):
        for combo in itertools.combinations(elements, size):
            nodes_lost = {f.node for f in combo if isinstance(f, NodeLoss)}
            if any(
                isinstance(f, RankMemory) and topology.node_of(f.rank) in nodes_lost for f in combo
            ):
                continue  # subsumed: the node loss already takes that rank's memory
            yield combo


@attrs.frozen
class CoverageReport:
    placement: Placement
    max_failures: int
    patterns: tuple[PatternResult, ...]

    def survived(self, tier_max: int) -> tuple[PatternResult, ...]:
        """The patterns recovered at ``tier_max`` or below."""
        return tuple(p for p in self.patterns if p.tier <= tier_max)

    def by_tier(self) -> dict[int, int]:
        """Pattern count per tier: keys 1, 2, 3 always (0 too if any pattern lost nothing)."""
        counts = {1: 0, 2: 0, 3: 0}
        for p in self.patterns:
            counts[p.tier] = counts.get(p.tier, 0) + 1
        return dict(sorted(counts.items()))

    def summary(self) -> str:
        """A human table: pattern counts by number of failures and tier, then the
        patterns that fall back to the disk checkpoint."""
        pl = self.placement
        topo = pl.topology
        t2_groups = [g for g in pl.groups if g.tier == 2]
        t2 = (
            f"on ({t2_groups[0].tolerance} parity)"
            if t2_groups
            else ("on (no parity)" if pl.snapshots else "off")
        )
        sizes = "+".join(str(s) for s in topo.node_sizes)
        lines = [
            f"erasure coverage: {topo.nodes} node(s) ({sizes} ranks), "
            f"tier 1 {'on' if pl.tier1 else 'off'}, tier 2 {t2}, "
            + (f"{len(pl.replicas)} replica class(es), " if pl.replicas else "")
            + f"patterns of up to {self.max_failures} failure(s)",
            f"{'failures':>8}  {'patterns':>8}  {'tier 1':>6}  {'tier 2':>6}  {'tier 3':>6}",
        ]

        def row(label: str, pats: list[PatternResult]) -> str:
            c = [sum(1 for p in pats if p.tier == t) for t in (1, 2, 3)]
            return f"{label:>8}  {len(pats):>8}  {c[0]:>6}  {c[1]:>6}  {c[2]:>6}"

        for size in range(1, self.max_failures + 1):
            lines.append(row(str(size), [p for p in self.patterns if len(p.failures) == size]))
        lines.append(row("all", list(self.patterns)))
        fallback = [p for p in self.patterns if p.tier == 3]
        if fallback:
            lines.append("tier 3 (disk checkpoint):")
            lines.extend(f"  {p.label()}" for p in fallback)
        return "\n".join(lines)


def coverage(placement: Placement, max_failures: int = 2) -> CoverageReport:
    """Decode every pattern of 1..``max_failures`` failure elements (RankMemory of any
    rank, NodeLoss of any node). Patterns with a RankMemory of a rank whose node is lost
    in the same pattern are skipped (subsumed); distinct patterns that happen to lose the
    same blocks are kept (they are different failures to inject). Order: by number of
    failures, then lexicographically, RankMemory before NodeLoss."""
    if not isinstance(max_failures, int) or isinstance(max_failures, bool) or max_failures < 1:
        raise ValueError(f"coverage: max_failures must be an int >= 1, got {max_failures!r}")
    results = []
    for combo in _patterns(placement.topology, max_failures):
        lost = lost_blocks(placement, combo)
        results.append(
            PatternResult(failures=frozenset(combo), lost=lost, tier=decode(placement, lost).tier)
        )
    return CoverageReport(placement=placement, max_failures=max_failures, patterns=tuple(results))
