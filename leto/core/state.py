"""One global state of the model: every rank's machines and memory, the coordinator's
variables, the faults spent (``VARIABLES`` in TLA+)."""

from __future__ import annotations

import attrs

from leto.core.chunk import NONE
from leto.core.recovery import Kind, Phase
from leto.core.shadow import ShadowState
from leto.core.trainer import TrainerState
from leto.core.txn import CommitState, TxnState


@attrs.frozen(cache_hash=True)
class ClusterState:
    """One global state. Chunk values are steps, or TORN / LOST / GARBAGE."""

    trainer: tuple[TrainerState, ...]
    tgen: tuple[int, ...]
    pc: tuple[TxnState, ...]
    step: tuple[int, ...]
    # the step whose loop tail the rank's process state includes: its latest closed
    # state, which its node agent keeps (step - 1 in the tail, step once closed)
    tail: tuple[int, ...]
    data: tuple[tuple[int, ...], ...]
    undo: tuple[tuple[int, ...], ...]
    grad: tuple[int, ...]
    shadow: tuple[ShadowState, ...]
    stale: tuple[bool, ...]
    par: tuple[tuple[tuple[int, ...], ...] | None, ...]
    gpar: tuple[tuple[int, ...] | None, ...]
    gen: int = 0
    phase: Phase = Phase.RUNNING
    commit: CommitState = CommitState.OPEN
    committed: int = 0
    prepared: frozenset[int] = frozenset()
    faults: int = 0
    t2: int = 0
    t2lost: frozenset[int] = frozenset()
    target: int = NONE
    kind: Kind = Kind.NONE
    loss: int = 0
    mlost: frozenset[int] = frozenset()
    nlost: frozenset[int] = frozenset()
    promoted: frozenset[int] = frozenset()
    stale_writes: int = 0
    ckpt: int = 0  # step of the latest durable disk checkpoint: the fallback
    cpend: int = NONE  # step of the checkpoint being written, or NONE
    ckdone: frozenset[int] = frozenset()  # writers that finished their shard of cpend
    ckmiss: frozenset[int] = frozenset()  # writers whose shard the durable one lacks
