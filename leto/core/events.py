"""Events of the protocol: one frozen, validated class per action of ``spec/Leto.tla``.

The class names are the TLA+ action names; ``spec/README.md`` maps each to the machine
that consumes it, and ``tests/test_spec_table.py`` keeps that table and this module in
sync.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs


def _non_negative(_inst: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


_index = attrs.field(validator=_non_negative)


class Event:
    """Base class of every protocol event."""

    __slots__ = ()


class Fault(Event):
    """An event injected by the environment, not by the protocol."""

    __slots__ = ()


# --- a rank's step transaction (txn) ---------------------------------------------------


@attrs.frozen
class Compute(Event):
    """Forward and backward done on ``rank`` (local gradients)."""

    rank: int = _index


@attrs.frozen
class Reduce(Event):
    """``rank`` received its reduced gradients for ``step+1`` into retained memory."""

    rank: int = _index


@attrs.frozen
class Prepare(Event):
    """``rank``'s reduced gradients are complete and tier-1 protected: its vote."""

    rank: int = _index


@attrs.frozen
class Decide(Event):
    """The coordinator records COMMIT(committed+1): every rank has prepared."""


@attrs.frozen
class BeginChunk(Event):
    """Keep ``chunk``'s old bytes as undo and start writing its new bytes."""

    rank: int = _index
    chunk: int = _index


@attrs.frozen
class EndChunk(Event):
    """``chunk``'s new bytes are completely written."""

    rank: int = _index
    chunk: int = _index


@attrs.frozen
class ParityChunk(Event):
    """``chunk``'s tier-1 parity now encodes its new bytes; the undo copy is released."""

    rank: int = _index
    chunk: int = _index


@attrs.frozen
class Finish(Event):
    """Every chunk of ``rank`` is at the new step: the step is done on this rank."""

    rank: int = _index


@attrs.frozen
class Close(Event):
    """``rank``'s loop tail after its step is over (the scheduler stepped, the scaler
    updated): at the next batch its process state of the step, after the tail, is kept by
    its node agent (the step's closed state)."""

    rank: int = _index


@attrs.frozen
class Tier2Snapshot(Event):
    """Every rank is idle at the same step: the cross-node snapshot catches up."""


# --- the disk checkpoint (tier 3) ---------------------------------------------------


@attrs.frozen
class BeginCheckpoint(Event):
    """Every rank is idle at one step past the durable checkpoint: the writers stage
    their state at that step and write it in the background."""


@attrs.frozen
class WriteShard(Event):
    """Writer ``rank`` finished writing its shard of the checkpoint in progress."""

    rank: int = _index


@attrs.frozen
class CheckpointDurable(Event):
    """Every writer finished: the checkpoint is durable and the fallback step moves."""


# --- shadows ------------------------------------------------------------------------


@attrs.frozen
class ShadowWarm(Event):
    """``rank``'s shadow is (re)warmed: torch imported, model skeleton built, mapped."""

    rank: int = _index


@attrs.frozen
class ShadowReclaim(Event):
    """``rank``'s shadow gives its memory back to the active trainer (goes cold)."""

    rank: int = _index


# --- faults -------------------------------------------------------------------------


@attrs.frozen
class Crash(Fault):
    """``rank``'s trainer process dies; its retained memory is intact."""

    rank: int = _index


@attrs.frozen
class Hang(Fault):
    """``rank``'s trainer stops making progress but its process lives on."""

    rank: int = _index


@attrs.frozen
class LoseMemory(Fault):
    """``rank``'s retained memory is lost (GPU reset, keeper crash); the trainer dies."""

    rank: int = _index


@attrs.frozen
class LoseNode(Fault):
    """A whole node is lost: its ranks' memory, its parity, its shadows."""

    node: int = _index


# --- keeper -------------------------------------------------------------------------


@attrs.frozen
class StaleWrite(Event):
    """A process of an old generation of ``rank`` tries to write ``chunk``."""

    rank: int = _index
    chunk: int = _index


# --- recovery coordinator -----------------------------------------------------------


@attrs.frozen
class Detect(Event):
    """A failed or hung trainer has been seen: recovery (re)starts."""


@attrs.frozen
class Fence(Event):
    """Bump the generation: no writer of an older one may touch retained state."""


@attrs.frozen
class Promote(Event):
    """``rank``'s shadow takes over the failed trainer."""

    rank: int = _index


@attrs.frozen
class EndPromote(Event):
    """Every rank has a live trainer of the new generation."""


@attrs.frozen
class Reconcile(Event):
    """Roll every chunk forward or back to one step, repairing from parity."""


@attrs.frozen
class GoFallback(Event):
    """The loss is beyond both tiers: fall back to the disk checkpoint."""


@attrs.frozen
class RestoreCheckpoint(Event):
    """Every rank reloads the last disk checkpoint."""


@attrs.frozen
class Rebuild(Event):
    """The communicator is rebuilt at the new generation."""


@attrs.frozen
class Resume(Event):
    """Every rank resumes training at the recovery's target step."""


@attrs.frozen
class GiveUp(Event):
    """The recovery deadline passed before the recovery resumed: the job stops (phase
    FAILED, which accepts no further event). Scheduled by
    :func:`leto.core.schedule.next_events` when the backend reports the deadline
    overdue; enabled in every recovery phase, so no recovery can outlive it."""


# --- aggregated events of the commit path ----------------------------------------------


def _ranks(_inst: Any, attribute: attrs.Attribute[tuple[int, ...]], value: tuple[int, ...]) -> None:
    if not value:
        raise ValueError(f"{attribute.name} must name at least one rank")
    for r in value:
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise ValueError(f"{attribute.name}: a rank is an int >= 0, got {r!r}")
    if list(value) != sorted(set(value)):
        raise ValueError(f"{attribute.name} must be sorted and distinct, got {list(value)}")


def _as_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


class Aggregated(Event):
    """An event that stands for a sequence of the protocol's own events (its
    expansion, :func:`leto.core.aggregate.expand`): the commit path's summary of many
    chunk-level transitions in one. Checked to refine them
    (:func:`leto.core.aggregate.check_refinement`): every transition it makes is the
    one its expansion makes, and it is accepted wherever its expansion is."""

    __slots__ = ()


@attrs.frozen
class CommitStep(Aggregated):
    """Every rank voted for ``step``: each rank's Compute, then each Reduce, then each
    Prepare, then Decide."""

    step: int = _index


@attrs.frozen
class ApplyStep(Aggregated):
    """Ranks ``ranks`` finished the committed ``step``: for each, in order, every chunk's
    BeginChunk, EndChunk, ParityChunk, in chunk order, then Finish."""

    step: int = attrs.field(validator=_non_negative)
    ranks: tuple[int, ...] = attrs.field(converter=_as_tuple, validator=_ranks)


@attrs.frozen
class CloseRanks(Aggregated):
    """Ranks ``ranks`` closed their loop tails (the coordinator's feed when a step's
    votes show them past it): each rank's ``Close``, in order."""

    ranks: tuple[int, ...] = attrs.field(converter=_as_tuple, validator=_ranks)


FAULTS: tuple[type[Fault], ...] = (Crash, Hang, LoseMemory, LoseNode)

AGGREGATED: tuple[type[Aggregated], ...] = (CommitStep, ApplyStep, CloseRanks)

ALL: tuple[type[Event], ...] = (
    Compute, Reduce, Prepare, Decide, BeginChunk, EndChunk, ParityChunk, Finish, Close,
    Tier2Snapshot, BeginCheckpoint, WriteShard, CheckpointDurable, ShadowWarm,
    ShadowReclaim, Crash, Hang, LoseMemory, LoseNode,
    StaleWrite, Detect, Fence, Promote, EndPromote, Reconcile, GoFallback,
    RestoreCheckpoint, Rebuild, Resume, GiveUp,
)  # fmt: skip
