"""What a transition asks a backend to do: one frozen class per kind of effect.

:meth:`leto.core.cluster.ClusterModel.step` returns the next state and a tuple of
these; a backend carries each out (the fake engine's table
``leto.backends.fake.executors.EXECUTORS`` has one executor per class, gloo's
``leto.backends.gloo.commands.COMMANDS`` one command or the name of who does it, and
tests check that every class here has one). They are values: equal when their fields are, hashable,
validated on construction like the events.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from leto.core.reconcile import Repair, RepairKind, repair_kind

__all__ = [
    "AbortCheckpoint",
    "AbortCollectives",
    "AllReduceGradients",
    "ApplyChunk",
    "ChunkWritten",
    "Crash",
    "Detected",
    "Effect",
    "Fallback",
    "Fence",
    "ForwardBackward",
    "Hang",
    "JobFailed",
    "KeepProcessState",
    "KillStale",
    "LoadCheckpoint",
    "LoseMemory",
    "LoseNode",
    "Promote",
    "PublishCheckpoint",
    "RebuildCommunicator",
    "ReclaimShadow",
    "Reconciled",
    "RecordCommit",
    "RefuseStaleWrite",
    "ReleaseUndo",
    "RunRepair",
    "Resume",
    "SaveCheckpoint",
    "SaveUndo",
    "SpawnShadow",
    "StaleWriteAccepted",
    "StepDone",
    "TakeSnapshot",
    "UpdateParity",
    "Vote",
    "WarmShadow",
    "WriteGradientParity",
    "all_effect_types",
]


def _int(_inst: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be an int, got {type(value).__name__}")


def _ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


class Effect:
    """Base class of every effect."""

    __slots__ = ()


# --- a step ----------------------------------------------------------------------


@attrs.frozen
class ForwardBackward(Effect):
    """Rank ``rank`` computes its gradients of ``step`` and starts their all-reduce."""

    rank: int = attrs.field(validator=_int)
    step: int = attrs.field(validator=_int)


@attrs.frozen
class AllReduceGradients(Effect):
    """The reduced gradients of ``step`` land in rank ``rank``'s retained memory."""

    rank: int = attrs.field(validator=_int)
    step: int = attrs.field(validator=_int)


@attrs.frozen
class WriteGradientParity(Effect):
    """PREPARE: seal the gradients, fold them into the node's gradient parity, keep the
    prepare record (RNG, sampler, present mask, gradient checksums)."""

    rank: int = attrs.field(validator=_int)
    step: int = attrs.field(validator=_int)


@attrs.frozen
class Vote(Effect):
    rank: int = attrs.field(validator=_int)
    step: int = attrs.field(validator=_int)


@attrs.frozen
class RecordCommit(Effect):
    """COMMIT(step) is recorded where it survives any one trainer's death."""

    step: int = attrs.field(validator=_int)


@attrs.frozen
class SaveUndo(Effect):
    rank: int = attrs.field(validator=_int)
    chunk: int = attrs.field(validator=_int)
    step: int = attrs.field(validator=_int)  # the version the undo copy holds


@attrs.frozen
class ApplyChunk(Effect):
    rank: int = attrs.field(validator=_int)
    chunk: int = attrs.field(validator=_int)
    step: int = attrs.field(validator=_int)


@attrs.frozen
class ChunkWritten(Effect):
    """The chunk's new bytes are complete: seal them at ``step``."""

    rank: int = attrs.field(validator=_int)
    chunk: int = attrs.field(validator=_int)
    step: int = attrs.field(validator=_int)


@attrs.frozen
class UpdateParity(Effect):
    rank: int = attrs.field(validator=_int)
    chunk: int = attrs.field(validator=_int)
    step: int = attrs.field(validator=_int)


@attrs.frozen
class ReleaseUndo(Effect):
    rank: int = attrs.field(validator=_int)
    chunk: int = attrs.field(validator=_int)


@attrs.frozen
class StepDone(Effect):
    """FINISH: the optimizer moves on to ``step``; the rank's loop tail follows."""

    rank: int = attrs.field(validator=_int)
    step: int = attrs.field(validator=_int)


@attrs.frozen
class KeepProcessState(Effect):
    """CLOSE: the loop tail of ``step`` ran (the scheduler's step, the scaler's update);
    the rank's process state after it, the closed state of ``step``, is kept by its node
    agent. A recovery to ``step`` restores it, or, where it was not kept, the closed state
    of ``step - 1`` with the tail replayed."""

    rank: int = attrs.field(validator=_int)
    step: int = attrs.field(validator=_int)


@attrs.frozen
class TakeSnapshot(Effect):
    """Tier 2: every rank's state at ``step`` into the cross-node snapshot."""

    step: int = attrs.field(validator=_int)


# --- the disk checkpoint ---------------------------------------------------------


@attrs.frozen
class SaveCheckpoint(Effect):
    """Every writer stages its state at ``step`` and writes it in the background; each
    reports its shard done (``WriteShard``)."""

    step: int = attrs.field(validator=_int)


@attrs.frozen
class PublishCheckpoint(Effect):
    """Every writer finished: the checkpoint at ``step`` is the fallback from now on
    (older ones may be removed)."""

    step: int = attrs.field(validator=_int)


@attrs.frozen
class AbortCheckpoint(Effect):
    """A recovery fenced the writers of the checkpoint at ``step``: it never becomes
    durable; its partial files are removed."""

    step: int = attrs.field(validator=_int)


# --- shadows ---------------------------------------------------------------------


@attrs.frozen
class WarmShadow(Effect):
    rank: int = attrs.field(validator=_int)


@attrs.frozen
class ReclaimShadow(Effect):
    rank: int = attrs.field(validator=_int)


@attrs.frozen
class SpawnShadow(Effect):
    """A replacement shadow starts spawning (it is warm at ``ShadowWarm``)."""

    rank: int = attrs.field(validator=_int)


# --- faults (simulated backends carry them out; real ones observe them) ----------


@attrs.frozen
class Crash(Effect):
    rank: int = attrs.field(validator=_int)


@attrs.frozen
class Hang(Effect):
    rank: int = attrs.field(validator=_int)


@attrs.frozen
class LoseMemory(Effect):
    rank: int = attrs.field(validator=_int)


@attrs.frozen
class LoseNode(Effect):
    node: int = attrs.field(validator=_int)


@attrs.frozen
class StaleWriteAccepted(Effect):
    """Only the ``no_fencing`` mutant produces it: a fenced writer got through."""

    rank: int = attrs.field(validator=_int)
    chunk: int = attrs.field(validator=_int)


@attrs.frozen
class RefuseStaleWrite(Effect):
    rank: int = attrs.field(validator=_int)
    chunk: int = attrs.field(validator=_int)


@attrs.frozen
class KillStale(Effect):
    rank: int = attrs.field(validator=_int)


# --- recovery --------------------------------------------------------------------


@attrs.frozen
class Detected(Effect):
    ranks: tuple[int, ...] = attrs.field(converter=_ints)
    during_recovery: bool = False


@attrs.frozen
class Fence(Effect):
    """Bump the generation: no writer of an older one may touch retained state."""

    generation: int = attrs.field(validator=_int)


@attrs.frozen
class AbortCollectives(Effect):
    """Abort every collective of ``generation`` and older (none may hang)."""

    generation: int = attrs.field(validator=_int)


@attrs.frozen
class Promote(Effect):
    rank: int = attrs.field(validator=_int)
    warm: bool = attrs.field()
    generation: int = attrs.field(validator=_int)


def _count(_inst: Any, attribute: attrs.Attribute[int], value: int) -> None:
    _int(_inst, attribute, value)
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


@attrs.frozen
class RunRepair(Effect):
    """One repair of the reconcile plan (:class:`leto.core.reconcile.Repair`):
    ``what`` is a :class:`~leto.core.reconcile.RepairKind` (its name accepted);
    with ``count > 1`` the same repair of chunks ``chunk .. chunk + count - 1``, in
    order (:meth:`expand`)."""

    what: RepairKind = attrs.field(converter=repair_kind)
    rank: int = attrs.field(validator=_int)
    chunk: int = attrs.field(validator=_int)  # -1: the rank's gradients, or the whole rank
    version: int = attrs.field(validator=_int)
    count: int = attrs.field(default=1, validator=_count)

    def expand(self) -> tuple[RunRepair, ...]:
        """The chunk-level repairs this run stands for, in order."""
        if self.count == 1:
            return (self,)
        return tuple(
            RunRepair(self.what, self.rank, c, self.version)
            for c in range(self.chunk, self.chunk + self.count)
        )

    def repair(self) -> Repair:
        """The plan's repair this effect carries."""
        return Repair(self.what, self.rank, self.chunk, self.version, self.count)


@attrs.frozen
class Reconciled(Effect):
    target: int = attrs.field(validator=_int)
    kind: str
    reason: str


@attrs.frozen
class Fallback(Effect):
    """Beyond both tiers: the disk checkpoint (or, without one, a clear stop)."""

    reason: str


@attrs.frozen
class LoadCheckpoint(Effect):
    step: int = attrs.field(validator=_int)


@attrs.frozen
class RebuildCommunicator(Effect):
    generation: int = attrs.field(validator=_int)


@attrs.frozen
class Resume(Effect):
    step: int = attrs.field(validator=_int)
    generation: int = attrs.field(validator=_int)


@attrs.frozen
class JobFailed(Effect):
    """The recovery deadline passed in ``phase``: stop the job, exit 1, one line naming
    what the recovery still waited for (the backend's observation)."""

    phase: str
    generation: int = attrs.field(validator=_int)


def all_effect_types() -> tuple[type[Effect], ...]:
    """Every concrete effect class, in the order of this module."""
    return tuple(
        obj
        for obj in globals().values()
        if isinstance(obj, type) and issubclass(obj, Effect) and obj is not Effect
    )
