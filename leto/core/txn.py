"""A rank's step transaction and the step-level commit decision.

Theory of operation: a step is a transaction over the retained state. Each rank
computes (forward, backward), receives its reduced gradients into retained memory,
and PREPAREs once they are complete and protected by tier-1 parity (its vote). When
every rank has voted, the coordinator DECIDEs: COMMIT(v+1) is recorded in the agents'
replicated store, where no single death can erase it. Only then may any chunk move
v -> v+1 (APPLY). So at any instant either nothing of v+1 was applied anywhere (no
commit: roll back) or the commit exists and every rank can be rolled forward.

After FINISH the rank is in its *loop tail* (the user's code after
``optimizer.step()``: the scheduler's step, the scaler's update) until the next batch
CLOSEs the step: the process state after the tail is what its agent keeps for the
step, and the next step's compute starts from there.
"""

from __future__ import annotations

import enum

from leto.core import events as ev
from leto.core.table import Table


class TxnState(enum.Enum):
    IDLE = "idle"
    COMPUTED = "computed"
    REDUCED = "reduced"
    PREPARED = "prepared"
    APPLYING = "applying"
    TAIL = "tail"  # the step finished; the user's loop tail runs until the step is closed


class CommitState(enum.Enum):
    OPEN = "open"  # no vote yet for the next step
    VOTING = "voting"  # some ranks have voted


_ALL_TXN = tuple(TxnState)

TXN: Table[TxnState] = Table.build(
    "txn",
    [
        (TxnState.IDLE, ev.Compute, TxnState.COMPUTED),
        (TxnState.COMPUTED, ev.Reduce, TxnState.REDUCED),
        (TxnState.REDUCED, ev.Prepare, TxnState.PREPARED),
        (TxnState.PREPARED, ev.BeginChunk, TxnState.APPLYING),
        (TxnState.APPLYING, (ev.BeginChunk, ev.EndChunk, ev.ParityChunk), None),
        (TxnState.APPLYING, ev.Finish, TxnState.TAIL),
        # the loop tail is over: the process state after it is kept (the step closed)
        (TxnState.TAIL, ev.Close, TxnState.IDLE),
        # A promoted trainer or a resumed rank starts its next step from scratch.
        (_ALL_TXN, (ev.Promote, ev.Resume), TxnState.IDLE),
    ],
)

COMMIT: Table[CommitState] = Table.build(
    "commit",
    [
        ((CommitState.OPEN, CommitState.VOTING), ev.Prepare, CommitState.VOTING),
        (CommitState.VOTING, ev.Decide, CommitState.OPEN),
        # Votes of an old generation, or of a step that recovery dropped, are void.
        ((CommitState.OPEN, CommitState.VOTING), (ev.Fence, ev.Reconcile), CommitState.OPEN),
        ((CommitState.OPEN, CommitState.VOTING), ev.RestoreCheckpoint, CommitState.OPEN),
    ],
)
