"""The protocol's invariants and "sometimes" properties, over :class:`ClusterState`.

Each invariant is the Python form of the TLA+ invariant of the same name in
``spec/Leto.tla`` (plain words in ``spec/README.md``). "Sometimes" properties name the
interesting states a check must actually reach, so that it cannot pass vacuously.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from leto.core import events as ev
from leto.core.chunk import GARBAGE, LOST, NONE, TORN, ChunkState, classify, producible
from leto.core.cluster import ClusterModel, ClusterState
from leto.core.recovery import Kind, Phase
from leto.core.runs import distinct
from leto.core.shadow import ShadowState
from leto.core.trainer import TrainerState
from leto.core.txn import TxnState

StatePredicate = Callable[[ClusterModel, ClusterState], bool]
EdgePredicate = Callable[[ClusterModel, ClusterState, ev.Event, ClusterState], bool]


@attrs.frozen
class Invariant:
    name: str
    holds: StatePredicate
    doc: str


@attrs.frozen
class Sometimes:
    """Reached when some state (or some transition, for ``edge``) satisfies it."""

    name: str
    state: StatePredicate | None = None
    edge: EdgePredicate | None = None
    doc: str = ""


def _type_ok(m: ClusterModel, s: ClusterState) -> bool:
    cfg = m.config
    R, C = cfg.ranks, cfg.chunks
    if not (len(s.data) == len(s.undo) == len(s.step) == len(s.tail) == len(s.pc) == R):
        return False
    if any(not 0 <= x <= cfg.max_step for x in s.tail):
        return False
    if any(len(row) != C for row in s.data) or any(len(row) != C for row in s.undo):
        return False
    # each distinct row once, read by its distinct values: O(ranks x chunks) in C (the
    # hashes and sets), in Python only per distinct row and value
    values_ok = all(
        all(d in (TORN, LOST, GARBAGE) or 0 <= d <= cfg.max_step for d in set(dr))
        for dr in distinct(s.data)
    ) and all(all(u == NONE or 0 <= u <= cfg.max_step for u in set(ur)) for ur in distinct(s.undo))
    ckpt_ok = 0 <= s.ckpt <= cfg.max_step and (s.cpend == NONE or s.ckpt < s.cpend <= cfg.max_step)
    return values_ok and ckpt_ok and 0 <= s.committed <= cfg.max_step and s.faults <= cfg.max_faults


def _consistency(m: ClusterModel, s: ClusterState) -> bool:
    if s.phase in (Phase.REBUILDING, Phase.RESUMING):
        return all(
            d == s.target or (d == LOST and s.trainer[r] is TrainerState.DEAD)
            for r, row in enumerate(s.data)
            for d in row
        )
    if s.phase is Phase.RUNNING:
        for r in range(m.config.ranks):
            if s.trainer[r] is not TrainerState.ALIVE or s.tgen[r] != s.gen:
                continue  # a failed rank is recovery's business
            st = s.step[r]
            if st not in (s.committed, s.committed - 1):
                return False
            allowed = (st, st + 1, TORN) if s.pc[r] is TxnState.APPLYING else (st,)
            if any(d not in allowed for d in s.data[r]):
                return False
    return True


def _equivalence(m: ClusterModel, s: ClusterState) -> bool:
    return all(
        d != GARBAGE and (d != TORN or u != NONE)
        for dr, ur in zip(s.data, s.undo, strict=True)
        for d, u in zip(dr, ur, strict=True)
    )


def _tier1_rebuilds(m: ClusterModel) -> int:
    """How many lost members per node tier 1 rebuilds: one (single parity), or none
    when the config switches tier 1 off."""
    return 1 if m.config.tier1 else 0


def tier1_covered(m: ClusterModel, s: ClusterState) -> bool:
    """Every loss since the last resume is one that tier-1 parity rebuilds."""
    return all(
        n not in s.nlost and len(s.mlost & set(members)) <= _tier1_rebuilds(m)
        for n, members in enumerate(m.config.groups)
    )


def tier2_covered(m: ClusterModel, s: ClusterState) -> bool:
    """At most ``tier2_parity`` nodes lost more than their tier-1 parity rebuilds."""
    beyond = [
        n
        for n, members in enumerate(m.config.groups)
        if n in s.nlost or len(s.mlost & set(members)) > _tier1_rebuilds(m)
    ]
    # A lost node's snapshot share lives on another node: a one-node job has none.
    return len(beyond) <= m.config.tier2_parity and len(s.nlost) <= m.config.tier2_survives


def _durability(m: ClusterModel, s: ClusterState) -> bool:
    # Judged while the recovery that set ``kind`` is still in force (Resume clears the
    # record of what was lost).
    if s.phase not in (Phase.REBUILDING, Phase.RESUMING):
        return True
    if s.kind in (Kind.INPLACE, Kind.FORWARD, Kind.BACK, Kind.TIER1):
        return s.loss == 0
    if s.kind is Kind.TIER2:
        return s.loss <= m.config.k and not tier1_covered(m, s)
    if s.kind is Kind.CKPT:
        # the latest durable checkpoint, given up only beyond both tiers
        return not tier2_covered(m, s) and s.target == s.ckpt
    return True


def _parity_ok(m: ClusterModel, s: ClusterState) -> bool:
    for n, members in enumerate(m.config.groups):
        par = s.par[n]
        if par is not None:
            for c in range(m.config.chunks):
                for i, r in enumerate(members):
                    d = s.data[r][c]
                    if d != LOST and par[c][i] not in producible(d, s.undo[r][c]):
                        return False
    return grad_parity_ok(m, s)


def grad_parity_ok(m: ClusterModel, s: ClusterState) -> bool:
    """ParityOK's gradient clause: each node's gradient parity records, for every member,
    the gradients it holds (unless they are LOST, or reduced for the next step and not
    yet voted for)."""
    for n, members in enumerate(m.config.groups):
        gp = s.gpar[n]
        if gp is not None:
            for i, r in enumerate(members):
                g = s.grad[r]
                if g == LOST or (g == s.committed + 1 and r not in s.prepared):
                    continue
                if gp[i] != g:
                    return False
    return True


def _single_writer(m: ClusterModel, s: ClusterState) -> bool:
    return s.stale_writes == 0 and all(g <= s.gen for g in s.tgen)


def _tail_ok(m: ClusterModel, s: ClusterState) -> bool:
    if s.phase is not Phase.RUNNING:
        return True
    for r in range(m.config.ranks):
        if s.trainer[r] is not TrainerState.ALIVE or s.tgen[r] != s.gen:
            continue  # a failed rank's process state is restored by its recovery
        closed = s.step[r] - 1 if s.pc[r] is TxnState.TAIL else s.step[r]
        if s.tail[r] != closed:
            return False
    return True


def _integrity(m: ClusterModel, s: ClusterState) -> bool:
    if s.phase not in (Phase.REBUILDING, Phase.RESUMING):
        return True
    for r in range(m.config.ranks):
        for d, u in zip(s.data[r], s.undo[r], strict=True):
            state = classify(d, u)
            if state in (ChunkState.WRITING, ChunkState.CORRUPT):
                return False
            if state is ChunkState.LOST and s.trainer[r] is not TrainerState.DEAD:
                return False
    return True


INVARIANTS: tuple[Invariant, ...] = (
    Invariant("TypeOK", _type_ok, "every variable holds a value of its type"),
    Invariant(
        "Consistency",
        _consistency,
        "recovery puts every chunk of every rank at one step; a running rank is at the "
        "committed step (or the one before it) and its chunks match its step",
    ),
    Invariant(
        "Equivalence",
        _equivalence,
        "every retained value is a value of the failure-free run; nothing torn lacks its undo",
    ),
    Invariant(
        "Durability",
        _durability,
        "committed work is given up only beyond tier 1 (at most K steps) or beyond tier 2 "
        "(back to the latest durable checkpoint)",
    ),
    Invariant("ParityOK", _parity_ok, "parity encodes a version each member can produce"),
    Invariant("SingleWriter", _single_writer, "no write of an old generation is accepted"),
    Invariant("Integrity", _integrity, "recovery never hands on a torn, corrupt or lost chunk"),
    Invariant(
        "TailOK",
        _tail_ok,
        "a running rank's process state includes the loop tail of every step it finished "
        "but the one it is in the tail of: no replica resumes a scheduler step behind",
    ),
)


def _mid_chunk_death(m: ClusterModel, s: ClusterState) -> bool:
    return any(
        s.trainer[r] is not TrainerState.ALIVE and any(d == TORN for d in s.data[r])
        for r in range(m.config.ranks)
    )


def _tail_death(m: ClusterModel, s: ClusterState) -> bool:
    return any(
        s.trainer[r] is not TrainerState.ALIVE and s.pc[r] is TxnState.TAIL
        for r in range(m.config.ranks)
    )


def _tail_replayed(m: ClusterModel, pre: ClusterState, e: ev.Event, post: ClusterState) -> bool:
    """A rank resumed that had finished the target but not closed it (the state where
    the mutant ``stale_tail`` restores the open process state)."""
    return isinstance(e, ev.Resume) and any(
        x < pre.target <= st for x, st in zip(pre.tail, pre.step, strict=True)
    )


def _fault_in_recovery(m: ClusterModel, pre: ClusterState, e: ev.Event, post: ClusterState) -> bool:
    return isinstance(e, ev.Fault) and pre.phase is not Phase.RUNNING


def _cold_promotion(m: ClusterModel, pre: ClusterState, e: ev.Event, post: ClusterState) -> bool:
    return isinstance(e, ev.Promote) and pre.shadow[e.rank] is ShadowState.COLD


def _kind(kind: Kind) -> StatePredicate:
    return lambda m, s: s.kind is kind and s.phase is Phase.REBUILDING


SOMETIMES: tuple[Sometimes, ...] = (
    Sometimes("MidChunkDeath", state=_mid_chunk_death, doc="a trainer died with a torn chunk"),
    Sometimes(
        "TailDeath", state=_tail_death, doc="a trainer died in its loop tail (step not closed)"
    ),
    Sometimes(
        "TailReplayed",
        edge=_tail_replayed,
        doc="a rank that finished the target but had not closed it resumed: its tail replayed",
    ),
    Sometimes("RollForward", state=_kind(Kind.FORWARD), doc="a committed step rolled forward"),
    Sometimes("RollBack", state=_kind(Kind.BACK), doc="an uncommitted step was dropped"),
    Sometimes("Tier1Repair", state=_kind(Kind.TIER1), doc="lost chunks rebuilt from tier 1"),
    Sometimes("Tier2Repair", state=_kind(Kind.TIER2), doc="the tier-2 snapshot restored"),
    Sometimes(
        "Tier2TwoNodesLost",
        edge=lambda m, pre, e, post: (
            isinstance(e, ev.Reconcile) and post.kind is Kind.TIER2 and len(pre.t2lost) >= 2
        ),
        doc="the tier-2 snapshot restored after two lost nodes (tier2_parity >= 2)",
    ),
    Sometimes("Fallback", state=lambda m, s: s.phase is Phase.FALLBACK, doc="disk checkpoint"),
    Sometimes(
        "CheckpointMadeDurable",
        edge=lambda m, pre, e, post: isinstance(e, ev.CheckpointDurable) and post.ckpt > 0,
        doc="a periodic checkpoint became durable: the fallback step moved forward",
    ),
    Sometimes(
        "FallbackToLaterCheckpoint",
        edge=lambda m, pre, e, post: isinstance(e, ev.RestoreCheckpoint) and post.target > 0,
        doc="the fallback restored a periodic checkpoint, not step 0",
    ),
    Sometimes(
        "CheckpointAborted",
        edge=lambda m, pre, e, post: isinstance(e, ev.Fence) and pre.cpend != NONE,
        doc="a recovery aborted a checkpoint in progress",
    ),
    Sometimes(
        "GaveUp",
        edge=lambda m, pre, e, post: isinstance(e, ev.GiveUp) and pre.phase is Phase.PROMOTING,
        doc="the recovery deadline ended a recovery waiting for a promotion",
    ),
    Sometimes("FailureDuringRecovery", edge=_fault_in_recovery, doc="a fault while recovering"),
    Sometimes("ColdPromotion", edge=_cold_promotion, doc="a cold shadow was promoted"),
    Sometimes(
        "StaleWriteRefused",
        edge=lambda m, pre, e, post: isinstance(e, ev.StaleWrite),
        doc="an old generation tried to write",
    ),
    Sometimes(
        "TrainingDone",
        state=lambda m, s: s.phase is Phase.RUNNING and all(x == m.config.max_step for x in s.step),
        doc="training reached its last step",
    ),
)


def violated(m: ClusterModel, s: ClusterState) -> list[str]:
    """Names of the invariants ``s`` breaks."""
    return [inv.name for inv in INVARIANTS if not inv.holds(m, s)]
