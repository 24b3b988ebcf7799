"""The constants of one model instance (``MC*.cfg`` in TLA+), and the variants the checks
run on it: deliberately broken protocols (:class:`Mutant`) and the commit path's
aggregated events, correct or deliberately broken (:class:`Aggregation`)."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

import attrs

from leto.core.erasure import Topology


class Mutant(enum.Enum):
    """Deliberately broken variants of the protocol; the checks must catch each."""

    NONE = "none"
    NO_UNDO = "no_undo"  # recovery does not undo a torn chunk
    EARLY_COMMIT = "early_commit"  # COMMIT recorded before every rank prepared
    NO_FENCING = "no_fencing"  # the keeper accepts writes of an old generation
    PARITY_FIRST = "parity_first"  # parity updated before the data is complete
    STALE_SHADOW = "stale_shadow"  # a promoted shadow resumes at its own stale step
    EARLY_DURABLE = "early_durable"  # a checkpoint durable before every writer finished
    NO_TIMEOUT = "no_timeout"  # the recovery deadline does not cover PROMOTING
    # a rank that finished the target but did not close it resumes with the open state
    # it sent at its finish (before its loop tail), the tail not replayed
    STALE_TAIL = "stale_tail"


class Aggregation(enum.Enum):
    """Whether the checker tries the commit path's aggregated events
    (:class:`~leto.core.events.CommitStep`, :class:`~leto.core.events.ApplyStep`,
    :class:`~leto.core.events.CloseRanks`), and
    deliberately broken aggregations the refinement check must reject. ``step`` accepts
    aggregated events in every mode: this only says which ones ``candidates`` offers,
    how ``ApplyStep`` behaves and how the plan summarizes its repairs in runs."""

    OFF = "off"  # candidates are the chunk-level events only
    ON = "on"
    NO_PARITY_FOLD = "no_parity_fold"  # broken: ApplyStep leaves tier-1 parity behind
    UNCOMMITTED = "uncommitted"  # broken: ApplyStep does not wait for COMMIT
    OPEN_TAIL = "open_tail"  # broken: CloseRanks keeps no rank's closed state (tail)
    # broken: the plan reads each rank's roll forward from its first chunk, as if every
    # rank's chunks were alike (one run of all of them, or none)
    ROW_HEAD = "row_head"


FAULT_KINDS = frozenset({"crash", "hang", "lose_memory", "lose_node"})


def _check_fault_kinds(_inst: Any, _attr: Any, value: frozenset[str]) -> None:
    unknown = set(value) - FAULT_KINDS
    if unknown:
        raise ValueError(
            f"faults: unknown fault kind(s) {sorted(unknown)}; known: {sorted(FAULT_KINDS)}"
        )


def _fault_set(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


def _positive(_inst: Any, attr: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attr.name} must be >= 1, got {value}")


def _non_negative(_inst: Any, attr: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"{attr.name} must be >= 0, got {value}")


@attrs.frozen
class ClusterConfig:
    """The constants of one model instance (``MC*.cfg`` in TLA+)."""

    topology: Topology = attrs.field(factory=lambda: Topology((2, 1)))
    chunks: int = attrs.field(default=2, validator=_positive)
    max_step: int = attrs.field(default=2, validator=_positive)
    max_faults: int = attrs.field(default=2, validator=_non_negative)
    k: int = attrs.field(default=1, validator=_positive)
    faults: frozenset[str] = attrs.field(
        default=FAULT_KINDS, converter=_fault_set, validator=_check_fault_kinds
    )
    reclaim: bool = True  # shadows may go cold
    # tier 1 off: no node keeps parity, so every par/gpar is LOST (None) in every state
    # and a lost memory needs tier 2 (or the checkpoint)
    tier1: bool = True
    # tier 2's cross-node parities (``tier2_parity`` in a job's config): the snapshot
    # survives that many lost nodes, where some other node holds each lost share
    tier2_parity: int = attrs.field(default=1, validator=_positive)
    # the recovery deadline (``BoundedNext`` in TLA+): the checker also tries GiveUp in
    # every recovery phase (``step`` accepts it either way: a backend's deadline)
    deadline: bool = False
    mutant: Mutant = attrs.field(default=Mutant.NONE, converter=Mutant)

    @property
    def ranks(self) -> int:
        return self.topology.world_size

    @property
    def tier2_survives(self) -> int:
        """How many lost nodes the tier-2 snapshot survives: ``tier2_parity``, and
        never all of them (a lost node's share lives on another node)."""
        return min(self.tier2_parity, self.topology.nodes - 1)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self.topology.ranks_of(n)) for n in range(self.topology.nodes))
