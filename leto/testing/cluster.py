"""The cluster state machine for Hypothesis, and the plain model it is checked against.

The plain model knows nothing of chunks, undo copies or parity versions. It keeps the
COMMIT record, the tier-2 snapshot step and the failures since the last reconcile, and
predicts each recovery's outcome from the erasure decoder's verdict on those failures
alone (:func:`leto.core.erasure.decode`): within tier 1 the run resumes at the
committed step, within tier 2 at the snapshot, beyond both at the latest disk
checkpoint every writer finished (it counts the writers' reports itself). The
core's reconcile reaches its answer by a different road (versions and undo copies), so
agreement between the two is evidence, not tautology.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import attrs
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from leto.core import events as ev
from leto.core import schedule
from leto.core.chunk import NONE, TORN
from leto.core.cluster import ClusterConfig, ClusterModel, ClusterState, Effect
from leto.core.erasure import Failure, NodeLoss, RankMemory, decode, lost_blocks, place
from leto.core.errors import ProtocolError
from leto.core.faultpoints import PHASES
from leto.core.properties import violated
from leto.core.recovery import Phase
from leto.core.trainer import TrainerState
from leto.core.txn import TxnState


@attrs.define
class PlainModel:
    """What a user expects of the run, from the events alone."""

    config: ClusterConfig
    committed: int = 0
    snapshot: int = 0
    failures: list[Failure] = attrs.Factory(list)
    resumed_at: list[int] = attrs.Factory(list)
    checkpoint: int = 0  # the latest checkpoint every writer finished
    pending: int | None = None  # the checkpoint being written
    written: set[int] = attrs.Factory(set)  # writers that reported it done

    def expected_tier(self) -> int:
        placement = place(self.config.topology, tier2_parity=1)
        return decode(placement, lost_blocks(placement, self.failures)).tier

    def expected_target(self) -> int:
        tier = self.expected_tier()
        if tier <= 1:
            return self.committed
        if tier == 2:
            return self.snapshot
        return self.checkpoint

    def apply(self, e: ev.Event, before: ClusterState, after: ClusterState) -> None:
        if isinstance(e, ev.Decide):
            self.committed += 1
        elif isinstance(e, ev.Tier2Snapshot):
            self.snapshot = before.step[0]
        elif isinstance(e, ev.BeginCheckpoint):
            self.pending, self.written = before.step[0], set()
        elif isinstance(e, ev.WriteShard):
            self.written.add(e.rank)
        elif isinstance(e, ev.CheckpointDurable):
            if self.pending is not None and len(self.written) == self.config.ranks:
                self.checkpoint = self.pending
            self.pending = None
        elif isinstance(e, ev.Fence):
            self.pending = None
        elif isinstance(e, ev.LoseMemory):
            self.failures.append(RankMemory(e.rank))
        elif isinstance(e, ev.LoseNode):
            self.failures.append(NodeLoss(e.node))
        elif isinstance(e, (ev.Reconcile, ev.RestoreCheckpoint)):
            self.committed = self.snapshot = after.target
            self.failures.clear()
        elif isinstance(e, ev.Resume):
            self.resumed_at.append(before.target)


def _key(e: ev.Event) -> str:
    return repr(e)


_TRAINING_EVENTS = (
    ev.Compute, ev.Reduce, ev.Prepare, ev.Decide, ev.BeginChunk, ev.EndChunk,
    ev.ParityChunk, ev.Finish, ev.Close, ev.Tier2Snapshot,
)  # fmt: skip

# Points of a step at which fault_at_phase strikes a rank, named in leto's one
# vocabulary (leto.core.faultpoints: "phase" or "phase/where"), each by the model
# state a rank is in there.
_POINTS: dict[str, Callable[[ClusterState, int], bool]] = {
    "backward": lambda s, r: s.pc[r] is TxnState.COMPUTED,
    "allreduce": lambda s, r: s.pc[r] is TxnState.REDUCED,
    "decide/before": lambda s, r: s.pc[r] is TxnState.PREPARED and s.committed == s.step[r],
    "decide/after": lambda s, r: s.pc[r] is TxnState.PREPARED and s.committed == s.step[r] + 1,
    "apply/mid_write": lambda s, r: TORN in s.data[r],
    "apply/written": lambda s, r: any(
        d == s.step[r] + 1 and u != NONE for d, u in zip(s.data[r], s.undo[r], strict=True)
    ),
    "parity": lambda s, r: (
        s.pc[r] is TxnState.APPLYING and TORN not in s.data[r] and all(u == NONE for u in s.undo[r])
    ),
    "forward": lambda s, r: s.pc[r] is TxnState.IDLE and s.step[r] > 0,
    "tail": lambda s, r: s.pc[r] is TxnState.TAIL,
}
assert all(p.split("/")[0] in PHASES for p in _POINTS)

_RECOVERY_EVENTS = (
    ev.Detect, ev.Fence, ev.Promote, ev.EndPromote, ev.Reconcile, ev.GoFallback,
    ev.RestoreCheckpoint, ev.Rebuild, ev.Resume, ev.ShadowWarm,
)  # fmt: skip


class ClusterMachine(RuleBasedStateMachine):
    """Random steps and faults against the plain model. Subclass and set ``config``;
    override :meth:`execute` to run each step's effects on a real backend."""

    config: ClassVar[ClusterConfig] = ClusterConfig(max_step=3, max_faults=3, reclaim=True)

    def __init__(self) -> None:
        super().__init__()
        self.model = ClusterModel(self.config)
        self.state = self.model.initial()
        self.plain = PlainModel(self.config)
        self.expected: int | None = None  # the target the plain model predicted

    # --- hooks for backends ----------------------------------------------------------

    def execute(self, event: ev.Event, effects: tuple[Effect, ...], state: ClusterState) -> None:
        """Carry out ``effects`` on a real backend; ``state`` is the core's new state."""

    # --- driving ---------------------------------------------------------------------

    def _do(self, e: ev.Event) -> None:
        before = self.state
        after, effects = self.model.step(before, e)
        note(f"{e!r} -> {after.phase.name} committed={after.committed}")
        if isinstance(e, (ev.Reconcile, ev.GoFallback)):
            self.expected = self.plain.expected_target()
            tier = self.plain.expected_tier()
            assert isinstance(e, ev.GoFallback) == (tier == 3), (
                f"{type(e).__name__} but the decoder says tier {tier} for {self.plain.failures}"
            )
        self.plain.apply(e, before, after)
        self.state = after
        self.execute(e, effects, after)

    def _enabled(self, faults: bool) -> list[ev.Event]:
        return sorted(
            (e for e in self.model.enabled(self.state) if isinstance(e, ev.Fault) == faults),
            key=_key,
        )

    @precondition(lambda self: bool(self._enabled(faults=False)))
    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        self._do(data.draw(st.sampled_from(self._enabled(faults=False)), label="event"))

    @precondition(lambda self: bool(self._enabled(faults=True)))
    @rule(data=st.data())
    def inject(self, data: st.DataObject) -> None:
        self._do(data.draw(st.sampled_from(self._enabled(faults=True)), label="fault"))

    @precondition(lambda self: self.state.phase is Phase.RUNNING)
    @rule(
        rank=st.integers(0, 63),
        point=st.sampled_from(sorted(_POINTS)),
        fault=st.sampled_from(["crash", "hang", "lose_memory", "lose_node"]),
    )
    def fault_at_phase(self, rank: int, point: str, fault: str) -> None:
        """Train (no faults) until ``rank`` reaches ``point`` of its step, then fail it."""
        r = rank % self.config.ranks
        reached = _POINTS[point]
        for _ in range(8 * (self.config.chunks + 8) * self.config.ranks):
            if reached(self.state, r):
                break
            training = [
                e for e in self.model.enabled(self.state) if isinstance(e, _TRAINING_EVENTS)
            ]
            if not training:
                return
            mine = [e for e in training if getattr(e, "rank", r) == r]
            self._do(sorted(mine or training, key=_key)[0])
        else:
            return
        node = self.model.node_of[r]
        event = {
            "crash": ev.Crash(r),
            "hang": ev.Hang(r),
            "lose_memory": ev.LoseMemory(r),
            "lose_node": ev.LoseNode(node),
        }[fault]
        if self.model.why_not(self.state, event) is None:
            note(f"fault at {point} of rank {r}")
            self._do(event)

    @rule(data=st.data())
    def illegal_event_is_refused(self, data: st.DataObject) -> None:
        enabled = set(self.model.enabled(self.state))
        refused = sorted(
            (e for e in self.model.candidates(self.state) if e not in enabled), key=_key
        )
        if not refused:
            return
        e = data.draw(st.sampled_from(refused), label="illegal")
        before = self.state
        try:
            self.model.step(before, e)
        except ProtocolError as err:
            assert err.event == e and err.machine
        else:
            raise AssertionError(f"{e!r} was accepted in {before.phase.name}")
        assert self.state is before

    def _recovering(self) -> bool:
        s = self.state
        return s.phase is not Phase.RUNNING or any(t is not TrainerState.ALIVE for t in s.trainer)

    @precondition(_recovering)
    @rule()
    def finish_recovery(self) -> None:
        """Detect and drive the coordinator until training runs again (no new faults)."""
        for _ in range(64):
            if not self._recovering():
                return
            options = sorted(
                (e for e in self.model.enabled(self.state) if isinstance(e, _RECOVERY_EVENTS)),
                key=_key,
            )
            assert options, f"recovery is stuck in {self.state.phase.name}"
            self._do(options[0])
        raise AssertionError("recovery did not end within 64 steps")

    # --- checks after every rule -------------------------------------------------------

    @invariant()
    def core_invariants_hold(self) -> None:
        broken = violated(self.model, self.state)
        assert not broken, f"invariants {broken} broken in {self.state}"

    @invariant()
    def the_deadline_can_end_every_recovery(self) -> None:
        """In every phase of a recovery, the deadline's scheduled ``GiveUp`` is enabled
        (the checker's "Bounded"; TLA+'s ``Liveness`` on ``BoundedSpec``)."""
        s = self.state
        if s.phase in (Phase.RUNNING, Phase.FAILED):
            return
        give = schedule.next_event(self.model, s, overdue=True)
        assert give == ev.GiveUp(), f"the deadline schedules {give!r} in {s.phase.name}"
        err = self.model.why_not(s, give)
        assert err is None, f"the deadline cannot end a recovery in {s.phase.name}: {err}"

    @invariant()
    def recovery_matches_plain_model(self) -> None:
        s = self.state
        if s.phase in (Phase.REBUILDING, Phase.RESUMING) and self.expected is not None:
            assert s.target == self.expected, (
                f"resuming at {s.target}, the plain model expects {self.expected}"
            )
        assert s.ckpt == self.plain.checkpoint, (
            f"the fallback step is {s.ckpt}; every writer finished only {self.plain.checkpoint}"
        )
        if s.phase is Phase.RUNNING:
            for r in range(self.config.ranks):
                if s.trainer[r] is TrainerState.ALIVE and s.tgen[r] == s.gen:
                    assert s.step[r] in (self.plain.committed, self.plain.committed - 1)

    def teardown(self) -> None:
        if self.plain.resumed_at:
            note(f"resumed at {self.plain.resumed_at}")


def machine_for(config: ClusterConfig, base: type[ClusterMachine] = ClusterMachine) -> Any:
    """A subclass of ``base`` running ``config`` (pytest collects its ``TestCase``)."""
    return type(f"{base.__name__}_{config.mutant.value}", (base,), {"config": config})
