"""The recovery coordinator's phases.

Theory of operation: DETECT (a trainer exited, raised, or missed its heartbeat) ->
FENCE (bump the generation; the keepers refuse writes of older generations) ->
PROMOTE (a shadow takes each failed rank; survivors keep their processes) ->
RECONCILE (every chunk rolled forward to the committed step or back to the last one,
lost chunks rebuilt from tier-1 parity; beyond tier 1, every rank restores the tier-2
snapshot) -> REBUILD (communicator of the new generation) -> RESUME. Beyond both
tiers: FALLBACK to the disk checkpoint, never silent loss. A failure during recovery
restarts it at the next generation (Detect from any later phase). The recovery
deadline passing in any recovery phase ends the job (GiveUp -> FAILED, which accepts
no further event).
"""

from __future__ import annotations

import enum

from leto.core import events as ev
from leto.core.table import Table


class Phase(enum.Enum):
    RUNNING = "running"
    FENCING = "fencing"
    PROMOTING = "promoting"
    RECONCILING = "reconciling"
    FALLBACK = "fallback"
    REBUILDING = "rebuilding"
    RESUMING = "resuming"
    FAILED = "failed"  # the recovery deadline passed: the job stopped


class Kind(enum.Enum):
    """What the last reconcile did."""

    NONE = "none"
    INPLACE = "inplace"  # every chunk already at the committed step
    BACK = "back"  # an uncommitted step was dropped / undone
    FORWARD = "forward"  # a committed step was finished from undo + gradients
    TIER1 = "tier1"  # some chunk or gradient rebuilt from tier-1 parity
    TIER2 = "tier2"  # every rank restored the tier-2 snapshot
    CKPT = "ckpt"  # the disk checkpoint


P = Phase
RECOVERY: Table[Phase] = Table.build(
    "recovery",
    [
        # PROMOTING only for a hang (guarded in the cluster model): a dead rank there is
        # promoted without restarting, but a hung one must be fenced first.
        (
            (P.RUNNING, P.PROMOTING, P.RECONCILING, P.FALLBACK, P.REBUILDING, P.RESUMING),
            ev.Detect,
            P.FENCING,
        ),
        (P.FENCING, ev.Fence, P.PROMOTING),
        (P.PROMOTING, ev.Promote, None),
        (P.PROMOTING, ev.EndPromote, P.RECONCILING),
        (P.RECONCILING, ev.Reconcile, P.REBUILDING),
        (P.RECONCILING, ev.GoFallback, P.FALLBACK),
        (P.FALLBACK, ev.RestoreCheckpoint, P.REBUILDING),
        (P.REBUILDING, ev.Rebuild, P.RESUMING),
        (P.RESUMING, ev.Resume, P.RUNNING),
        (
            (P.FENCING, P.PROMOTING, P.RECONCILING, P.FALLBACK, P.REBUILDING, P.RESUMING),
            ev.GiveUp,
            P.FAILED,
        ),
        # Training-path decisions are taken only while running.
        (
            P.RUNNING,
            (ev.Decide, ev.Tier2Snapshot, ev.BeginCheckpoint, ev.WriteShard, ev.CheckpointDurable),
            None,
        ),
    ],
)

RECOVERY_PHASES = frozenset(p for p in Phase if p not in (Phase.RUNNING, Phase.FAILED))
