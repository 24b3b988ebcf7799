"""The step rule of the core (leto.core.steps): where every rank ends an interrupted
retained step, the reports it refuses, and that leto.retained.regroup re-exports it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leto.core.errors import StepAgreementError
from leto.core.steps import StepReport, agree_step


def R(v: int, p: int) -> StepReport:
    return StepReport(version=v, prepared=p)


def test_the_rule_on_hand_checked_reports() -> None:
    assert agree_step([R(0, -1)] * 2) == 0  # nothing sealed yet
    assert agree_step([R(2, 3), R(2, 3)]) == 3
    assert agree_step([R(2, 3), R(2, 2)]) == 2
    assert agree_step([R(2, 3), R(3, 3), R(3, 4)]) == 3


@pytest.mark.parametrize(
    ("reports", "why"),
    [
        ([], "no rank reported its step"),
        ([R(1, 1), R(2, 2)], r"ranks at steps \[1, 2\] cannot agree"),
        ([R(1, 2), R(3, 3)], r"ranks at steps \[1, 3\] cannot agree"),
    ],
)
def test_refused_reports_name_the_steps(reports: list[StepReport], why: str) -> None:
    with pytest.raises(StepAgreementError, match=why) as exc:
        agree_step(reports)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize(("v", "p"), [(-1, 0), (0, -2), (True, 0), (1, 1.5)])
def test_a_malformed_report_is_refused(v: object, p: object) -> None:
    with pytest.raises(StepAgreementError, match="StepReport"):
        StepReport(v, p)  # type: ignore[arg-type]


@given(
    top=st.integers(1, 50),
    behind=st.lists(st.booleans(), min_size=1, max_size=8),
    sealed_next=st.lists(st.booleans(), min_size=1, max_size=8),
)
def test_every_rank_ends_at_one_step_it_can_reach(
    top: int, behind: list[bool], sealed_next: list[bool]
) -> None:
    # Reports the protocol can produce: a rank behind has the top step sealed.
    reports = [
        R(top - 1, top) if b else R(top, top + 1 if s else top)
        for b, s in zip(behind, sealed_next * len(behind), strict=False)
    ]
    target = agree_step(reports)
    for r in reports:
        # a rank reaches its committed step (roll back) or the one it sealed (forward)
        assert target in (r.version, r.prepared)
    assert target == (top + 1 if all(r == R(top, top + 1) for r in reports) else top)


def test_regroup_reexports_the_core_rule() -> None:
    regroup = pytest.importorskip("leto.retained.regroup")
    assert regroup.agree_step is agree_step and regroup.StepReport is StepReport
