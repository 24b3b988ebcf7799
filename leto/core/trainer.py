"""A rank's active trainer process, as the agent sees it."""

from __future__ import annotations

import enum

from leto.core import events as ev
from leto.core.table import Table


class TrainerState(enum.Enum):
    ALIVE = "alive"
    HUNG = "hung"  # alive but making no progress; detected by heartbeat timeout
    DEAD = "dead"


TRAINER: Table[TrainerState] = Table.build(
    "trainer",
    [
        (TrainerState.ALIVE, ev.Crash, TrainerState.DEAD),
        (TrainerState.ALIVE, ev.Hang, TrainerState.HUNG),
        (tuple(TrainerState), (ev.LoseMemory, ev.LoseNode), TrainerState.DEAD),
        # The fence turns a hung trainer into a stale process the keeper refuses.
        (TrainerState.HUNG, ev.Fence, TrainerState.DEAD),
        (TrainerState.DEAD, ev.Promote, TrainerState.ALIVE),
    ],
)
