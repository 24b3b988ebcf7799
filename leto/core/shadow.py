"""A rank's shadow trainer.

Theory of operation: a shadow pays the start-up cost ahead of need (import torch, build
the model skeleton on the meta device, connect to the keeper) and waits WARM. When the
active trainer needs the memory, the shadow releases it and goes COLD; it re-warms
when memory is free again. Promotion works from either (from COLD only slower); the
promoted shadow becomes the trainer and a replacement starts SPAWNING in the
background. A lost node takes its shadows with it.
"""

from __future__ import annotations

import enum

from leto.core import events as ev
from leto.core.table import Table


class ShadowState(enum.Enum):
    SPAWNING = "spawning"  # none ready: a replacement is being started
    WARM = "warm"
    COLD = "cold"


SHADOW: Table[ShadowState] = Table.build(
    "shadow",
    [
        ((ShadowState.SPAWNING, ShadowState.COLD), ev.ShadowWarm, ShadowState.WARM),
        (ShadowState.WARM, ev.ShadowReclaim, ShadowState.COLD),
        ((ShadowState.WARM, ShadowState.COLD), ev.Promote, ShadowState.SPAWNING),
        (tuple(ShadowState), ev.LoseNode, ShadowState.SPAWNING),
    ],
)
