"""The explicit-state checker over the core: passes on the protocol, rejects mutants and
a model that cannot make progress, and prints shortest counterexamples."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import attrs
import pytest

from leto.core import events as ev
from leto.core.checker import check
from leto.core.chunk import NONE
from leto.core.cluster import ClusterConfig, ClusterModel, ClusterState, Mutant
from leto.core.erasure import Topology
from leto.core.errors import ProtocolError
from leto.core.properties import INVARIANTS
from leto.core.verify import CHECK_CONFIGS, MUTANTS, check_mutant

EXPECTED_CATCH = {
    Mutant.NO_UNDO: "Equivalence",
    Mutant.EARLY_COMMIT: "ParityOK",
    Mutant.NO_FENCING: "SingleWriter",
    Mutant.PARITY_FIRST: "ParityOK",
    Mutant.STALE_SHADOW: "Consistency",
    Mutant.EARLY_DURABLE: "Equivalence",
    Mutant.NO_TIMEOUT: "Bounded",
    Mutant.STALE_TAIL: "TailOK",
}


# The whole check of the protocol (every configuration of leto.core.verify.check_core:
# no violation, every configuration explored completely, every 'sometimes' property
# reached) runs once per test run, in the README's `leto spec check`, whose check in
# tests/test_readme.py asserts it (check_spec); here, the checker's own behaviour.


# EARLY_DURABLE's catch needs the largest configuration (two faults, 11 s): asserted,
# with every other mutant's, from the README's `leto spec check` (tests/test_readme.py)
@pytest.mark.parametrize(
    "mutant", [m for m in MUTANTS if m is not Mutant.EARLY_DURABLE], ids=lambda m: m.value
)
def test_checker_catches_mutant(mutant: Mutant) -> None:
    res = check_mutant(mutant)
    assert res.caught
    assert EXPECTED_CATCH[mutant] in res.caught_by
    assert res.counterexample.startswith("violation of ")


def test_counterexample_is_a_legal_shortest_trace() -> None:
    cfg = attrs.evolve(CHECK_CONFIGS["three-ranks"], mutant=Mutant.STALE_SHADOW)
    model = ClusterModel(cfg)
    res = check(model, stop_at_first=True)
    (v,) = res.violations
    assert v.trace[0] == (None, model.initial())
    state = model.initial()
    for event, expected in v.trace[1:]:
        assert event is not None
        state, _ = model.step(state, event)
        assert state == expected
    broken = {inv.name for inv in INVARIANTS if not inv.holds(model, state)}
    assert v.name in broken
    # BFS: no state on the way already broke it.
    for _, earlier in v.trace[:-1]:
        assert all(inv.holds(model, earlier) for inv in INVARIANTS if inv.name == v.name)


class _NoPromotion(ClusterModel):
    """A broken coordinator that never promotes a shadow: recovery cannot end."""

    def successors(self, s: ClusterState) -> Iterator[tuple[ev.Event, ClusterState]]:
        for e, nxt in super().successors(s):
            if not isinstance(e, ev.Promote):
                yield e, nxt


def test_checker_rejects_a_model_without_progress() -> None:
    cfg = ClusterConfig(topology=Topology((1, 1)), chunks=1, max_step=1, max_faults=1,
                        faults={"crash"}, reclaim=False)  # fmt: skip
    res = check(_NoPromotion(cfg))
    assert [v.name for v in res.violations] == ["Progress"]
    assert "Crash" in res.violations[0].describe()


def test_checker_reports_unreached_sometimes() -> None:
    cfg = ClusterConfig(topology=Topology((1, 1)), chunks=1, max_step=1, max_faults=0)
    res = check(ClusterModel(cfg))
    assert not res.violations
    assert "Fallback" in res.unreached and "RollForward" in res.unreached
    assert not res.ok


def test_illegal_events_raise_and_leave_state_unchanged() -> None:
    model = ClusterModel()
    s = model.initial()
    cases = [
        (ev.Finish(0), "txn", "IDLE"),
        (ev.Promote(1), "recovery", "RUNNING"),
        (ev.Decide(), "commit", "OPEN"),
        (ev.Compute(7), "cluster", "RUNNING"),
        (ev.StaleWrite(0, 0), "keeper", "RUNNING"),
    ]
    for event, machine, state_name in cases:
        with pytest.raises(ProtocolError) as info:
            model.step(s, event)
        assert info.value.machine == machine
        assert state_name in str(info.value) and repr(event) in str(info.value)
        assert s == model.initial()
    # A fenced (old-generation) writer is refused by the keeper.
    s1, _ = model.step(s, ev.Hang(0))
    s2, _ = model.step(s1, ev.Detect())
    s3, _ = model.step(s2, ev.Fence())
    with pytest.raises(ProtocolError, match="keeper|recovery"):
        model.step(s3, ev.Compute(1))


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="chunks"):
        ClusterConfig(chunks=0)
    with pytest.raises(ValueError, match="faults"):
        ClusterConfig(faults={"meteor"})
    with pytest.raises(ValueError, match="mutant|Mutant"):
        ClusterConfig(mutant="nonsense")


def test_import_core_does_not_import_torch() -> None:
    code = (
        "import sys, leto.core, leto.core.checker, leto.core.verify; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_recovery_schedule_reaches_running_from_every_state() -> None:
    from leto.core import schedule
    from leto.core.recovery import Phase

    # every configuration is checked with the schedule (check's default) by the README's
    # `leto spec check`; here, that the schedule is exercised, not vacuous: from a crash
    # mid-step it walks every phase
    model = ClusterModel(CHECK_CONFIGS["three-ranks"])
    s = model.initial()
    for e in (ev.Compute(0), ev.Crash(1)):
        s, _ = model.step(s, e)
    seen = []
    while schedule.in_recovery(s):
        e = schedule.next_event(model, s)
        assert e is not None and model.why_not(s, e) is None
        seen.append(type(e).__name__)
        s, _ = model.step(s, e)
    assert s.phase is Phase.RUNNING
    assert seen[:2] == ["Detect", "Fence"] and seen[-2:] == ["Rebuild", "Resume"]


def test_a_broken_schedule_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    import leto.core.checker as checker

    real = checker.next_event

    def skips_fencing(model: ClusterModel, s: ClusterState) -> ev.Event | None:
        e = real(model, s)
        return ev.EndPromote() if isinstance(e, ev.Fence) else e

    monkeypatch.setattr(checker, "next_event", skips_fencing)
    res = check(ClusterModel(CHECK_CONFIGS["reclaim"]), scheduled=True)
    bad = [v for v in res.violations if v.name == "Scheduled"]
    assert bad and "EndPromote" in bad[0].describe()


def test_tier1_off_is_configuration_of_the_model() -> None:
    from leto.core.recovery import Kind

    cfg = CHECK_CONFIGS["tier1-off"]
    model = ClusterModel(cfg)
    s = model.initial()
    assert s.par == (None, None) and s.gpar == (None, None)
    for e in (ev.Compute(0), ev.Compute(1), ev.Compute(2), ev.LoseMemory(1)):
        s, _ = model.step(s, e)
        assert s.par == (None, None)
    # with tier 1 on the same loss is rebuilt from parity; off, from the tier-2 snapshot
    on = ClusterModel(attrs.evolve(cfg, tier1=True))
    assert on.plan(attrs.evolve(s, par=on.initial().par, gpar=on.initial().gpar)).kind is Kind.TIER1
    assert model.plan(s).kind is Kind.TIER2


def test_tier2_parity_decides_whether_two_lost_nodes_fall_back() -> None:
    """Three nodes, two node losses: with one parity the recovery falls back to the
    checkpoint, which NEVER forbids the two-parity configuration; check_core reports
    that as a violation. (With two parities the snapshot is restored and Fallback is
    never reached: ``leto spec check`` asserts both, in tests/test_readme.py, since
    Tier2TwoNodesLost is reachable in tier2-m2 only.)"""
    from leto.core.verify import NEVER, check_core

    assert NEVER["tier2-m2"] == ("Fallback",)
    m1 = attrs.evolve(CHECK_CONFIGS["tier2-m2"], tier2_parity=1)
    report = check_core({"m1": m1}, never={"m1": NEVER["tier2-m2"]})
    (one,) = report.results.values()
    assert one.violations == () and "Tier2TwoNodesLost" not in one.reached
    assert "Fallback" in one.reached
    assert report.forbidden == ("m1: Fallback",) and report.violations == 1 and not report.ok


def test_a_resumed_job_starts_in_a_reachable_state() -> None:
    """``initial(step)``: where the failure-free run is when idle at ``step`` with its
    snapshot and its checkpoint taken there (the checkpoint only once every writer
    finished), but for the gradient blocks a new job does not have."""
    model = ClusterModel(ClusterConfig(topology=Topology((1, 1)), chunks=1, max_step=2))
    s = model.initial()
    for e in (
        *(ev.Compute(r) for r in (0, 1)),
        *(x for r in (0, 1) for x in (ev.Reduce(r), ev.Prepare(r))),
        ev.Decide(),
        *(
            x
            for r in (0, 1)
            for x in (ev.BeginChunk(r, 0), ev.EndChunk(r, 0), ev.ParityChunk(r, 0), ev.Finish(r))
        ),
        *(ev.Close(r) for r in (0, 1)),
        ev.Tier2Snapshot(),
        ev.BeginCheckpoint(),
        ev.WriteShard(1),
    ):
        s, _ = model.step(s, e)
    with pytest.raises(ProtocolError, match=r"writers \[0\] have not finished"):
        model.step(s, ev.CheckpointDurable())
    s, _ = model.step(s, ev.WriteShard(0))
    s, effects = model.step(s, ev.CheckpointDurable())
    assert s.ckpt == 1 and s.cpend == NONE
    # the same state, but that a new job holds no gradient blocks (no chunk needs them:
    # every chunk is at the step)
    assert model.initial(1) == attrs.evolve(s, grad=(NONE, NONE), gpar=model.initial().gpar)
    with pytest.raises(ValueError, match="initial step 3 is not in 0..2"):
        model.initial(3)


def test_give_up_ends_a_recovery_in_every_phase_and_nothing_follows() -> None:
    """The recovery deadline is the core's: scheduled when the backend reports it
    overdue, enabled in every recovery phase, and FAILED accepts nothing after it."""
    from leto.core import effects as fx
    from leto.core.recovery import Phase
    from leto.core.schedule import in_recovery, next_event, next_events

    m = ClusterModel(CHECK_CONFIGS["deadline"])
    s = m.initial()
    assert next_events(m, s, overdue=True) == ()  # nothing to give up while running
    s, _ = m.step(s, ev.Crash(0))
    # a failure seen while running is detected first, even when overdue
    assert next_event(m, s, overdue=True) == ev.Detect()
    seen = []
    while in_recovery(s):
        s, _ = m.step(s, next_event(m, s))
        if s.phase is not Phase.RUNNING:
            seen.append(s)
    assert {x.phase for x in seen} >= {Phase.FENCING, Phase.PROMOTING, Phase.REBUILDING}
    for mid in seen:
        assert next_event(m, mid, overdue=True) == ev.GiveUp()
        failed, effects = m.step(mid, ev.GiveUp())
        assert failed.phase is Phase.FAILED
        assert effects == (fx.JobFailed(mid.phase.value, mid.gen),)
        assert m.enabled(failed) == []
        assert next_events(m, failed, overdue=True) == ()
        with pytest.raises(ProtocolError, match="the job has failed"):
            m.step(failed, ev.Detect())
    with pytest.raises(ProtocolError):
        m.step(m.initial(), ev.GiveUp())  # no recovery to give up


def test_the_deadline_configuration_reaches_gave_up_and_keeps_progress() -> None:
    res = check(ClusterModel(CHECK_CONFIGS["deadline"]))
    assert res.complete and not res.violations
    assert "GaveUp" in res.reached


def test_the_loop_tail_lies_between_finish_and_the_next_compute() -> None:
    """Finish leaves the rank in its loop tail: the next step's Compute, a tier-2
    snapshot and a checkpoint wait for its Close, whose effect keeps the closed process
    state; a rank killed in its tail resumes with the process state of the target after
    the tail (the replay), and the mutant ``stale_tail`` resumes it a tail behind."""
    from leto.core import effects as fx
    from leto.core.schedule import in_recovery, next_event
    from leto.core.txn import TxnState

    def killed_in_the_tail(model: ClusterModel) -> ClusterState:
        s = model.initial()
        for e in (ev.CommitStep(1), ev.ApplyStep(1, (0, 1))):
            s, _ = model.step(s, e)
        assert s.pc == (TxnState.TAIL,) * 2 and s.step == (1, 1) and s.tail == (0, 0)
        for refused in (ev.Compute(0), ev.Tier2Snapshot(), ev.BeginCheckpoint()):
            with pytest.raises(ProtocolError):
                model.step(s, refused)
        s, effects = model.step(s, ev.Close(0))
        assert effects == (fx.KeepProcessState(0, 1),) and s.tail == (1, 0)
        assert model.why_not(s, ev.Compute(0)) is None
        s, _ = model.step(s, ev.Crash(1))  # rank 1 dies in its tail
        while in_recovery(s):
            s, _ = model.step(s, next_event(model, s))
        return s

    cfg = ClusterConfig(topology=Topology((1, 1)), chunks=1, max_step=2, max_faults=1, k=2)
    s = killed_in_the_tail(ClusterModel(cfg))
    assert (s.step, s.tail, s.pc) == ((1, 1), (1, 1), (TxnState.IDLE,) * 2)
    assert not [inv.name for inv in INVARIANTS if not inv.holds(ClusterModel(cfg), s)]
    broken = ClusterModel(attrs.evolve(cfg, mutant=Mutant.STALE_TAIL))
    s = killed_in_the_tail(broken)
    assert (s.step, s.tail) == ((1, 1), (1, 0))
    assert [inv.name for inv in INVARIANTS if not inv.holds(broken, s)] == ["TailOK"]
