"""One chunk of a rank's retained state.

Theory of operation: a chunk moves from step v to v+1 in three writes. BeginChunk keeps
the old bytes as an undo copy and starts overwriting (the chunk is torn until EndChunk);
EndChunk completes the new bytes; ParityChunk folds the change into the node's tier-1
parity and only then releases the undo copy. So at every instant the chunk can produce
the version its parity encodes (the undo copy, or the new bytes), and a death anywhere
leaves nothing torn that cannot be undone. LOST is memory that vanished (a keeper crash,
a GPU reset, a node); CORRUPT is bytes that fail their checksum: neither is ever used,
both are repaired from parity or reported.
"""

from __future__ import annotations

import enum
import functools

from leto.core import events as ev
from leto.core.table import Table

# Values in the abstract model: a step number (>= 0), or one of these sentinels, each
# with its own value (as the TLA+ spec's model values are distinct): TORN, LOST and
# GARBAGE are what a chunk's data can be instead of a step; NONE is the absence of an
# undo copy, of gradients, of an encoded parity, of a recovery target.
TORN = -1
LOST = -2
GARBAGE = -3
NONE = -4
SENTINELS: frozenset[int] = frozenset((TORN, LOST, GARBAGE, NONE))


class ChunkState(enum.Enum):
    CLEAN = "clean"  # at a step, no undo copy
    WRITING = "writing"  # torn: new bytes being written, undo copy held
    WRITTEN = "written"  # new bytes complete, parity pending, undo copy held
    LOST = "lost"
    CORRUPT = "corrupt"  # fails its checksum (torn without undo, or a foreign write)


def classify(data: int, undo: int) -> ChunkState:
    """The machine state of a chunk from its model value and undo copy."""
    if data == LOST:
        return ChunkState.LOST
    if data == GARBAGE or (data == TORN and undo == NONE):
        return ChunkState.CORRUPT
    if data == TORN:
        return ChunkState.WRITING
    return ChunkState.CLEAN if undo == NONE else ChunkState.WRITTEN


@functools.lru_cache(maxsize=64)
def uniform_row(value: int, n: int) -> tuple[int, ...]:
    """``(value,) * n``, one shared object per ``(value, n)``: rows of a state that are all
    at one value share it, so a step of every rank copies no ranks x chunks tuples and
    :func:`is_uniform` answers by identity. A pure cache of immutable values."""
    return (value,) * n


@functools.lru_cache(maxsize=64)
def repeated(row: tuple[int, ...], n: int) -> tuple[tuple[int, ...], ...]:
    """``(row,) * n``, shared like :func:`uniform_row`: a node's parity when every chunk
    encodes the same versions."""
    return (row,) * n


def is_uniform(row: tuple[int, ...], value: int) -> bool:
    """Every entry of ``row`` is ``value`` (by identity with :func:`uniform_row` when it
    is that shared row, else by counting)."""
    return row is uniform_row(value, len(row)) or row.count(value) == len(row)


def producible(data: int, undo: int) -> frozenset[int]:
    """The versions this chunk can produce from its own memory."""
    state = classify(data, undo)
    if state is ChunkState.CLEAN:
        return frozenset((data,))
    if state is ChunkState.WRITTEN:
        return frozenset((data, undo))
    if state is ChunkState.WRITING:
        return frozenset((undo,))
    return frozenset()


_ANY = tuple(ChunkState)
_INTACT = (ChunkState.CLEAN, ChunkState.WRITING, ChunkState.WRITTEN)

CHUNK: Table[ChunkState] = Table.build(
    "chunk",
    [
        (ChunkState.CLEAN, ev.BeginChunk, ChunkState.WRITING),
        (ChunkState.WRITING, ev.EndChunk, ChunkState.WRITTEN),
        (ChunkState.WRITTEN, ev.ParityChunk, ChunkState.CLEAN),
        (_ANY, (ev.LoseMemory, ev.LoseNode), ChunkState.LOST),
        # Recovery rewrites every chunk at the target step.
        (_ANY, (ev.Reconcile, ev.RestoreCheckpoint), ChunkState.CLEAN),
        # Only a keeper without fencing lets an old generation write (a mutant).
        (_INTACT, ev.StaleWrite, ChunkState.CORRUPT),
    ],
)
