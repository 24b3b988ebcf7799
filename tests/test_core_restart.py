"""The core's rules for an elastic start (`--nnodes MIN:MAX`, :mod:`leto.core.elastic`)
and a whole-job restart (``leto launch --max-restarts``,
:mod:`leto.core.restart`): only a recovery that gave up restarts, at most N times, and
a job that asks for restarts needs a checkpoint to restart from."""

from __future__ import annotations

import pytest

from leto.core.elastic import world_at_close
from leto.core.restart import Ending, Restart, after, refusal


def test_a_recovery_that_gave_up_restarts_at_most_max_restarts_times() -> None:
    assert after(Ending.GAVE_UP, 0, 2) == Restart(1, 2)
    assert after(Ending.GAVE_UP, 1, 2) == Restart(2, 2)
    assert after(Ending.GAVE_UP, 2, 2) is None  # spent: the job stops
    assert after(Ending.GAVE_UP, 0, 0) is None  # the default: no restart


@pytest.mark.parametrize("ending", [Ending.SCRIPT_ERROR, Ending.FATAL])
def test_a_script_error_or_a_fatal_ending_never_restarts(ending: Ending) -> None:
    assert after(ending, 0, 1000) is None


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        after(Ending.GAVE_UP, -1, 2)
    with pytest.raises(ValueError, match=r"restart 3 of 2 is not in 1\.\.2"):
        Restart(3, 2)
    with pytest.raises(ValueError, match="are ints"):
        Restart(True, 2)  # type: ignore[arg-type]


def test_restarts_need_a_checkpoint_dir() -> None:
    why = refusal(2, checkpoint=False)
    assert why is not None and "--max-restarts 2" in why and "checkpoint_dir" in why
    assert "\n" not in why
    assert refusal(2, checkpoint=True) is None
    assert refusal(0, checkpoint=False) is None


def test_an_elastic_job_starts_with_max_nodes_or_at_the_timeout_with_at_least_min() -> None:
    assert world_at_close(2, 4, 4, timed_out=False) == 4
    assert world_at_close(2, 4, 6, timed_out=False) == 4  # the others: spares
    assert world_at_close(2, 4, 3, timed_out=False) is None  # waits for more
    assert world_at_close(2, 4, 3, timed_out=True) == 3
    assert world_at_close(2, 4, 1, timed_out=True) is None  # too few: cannot start
    assert world_at_close(3, 3, 3, timed_out=False) == 3  # a fixed size is MIN = MAX
    with pytest.raises(ValueError, match="need 1 <= lo <= hi"):
        world_at_close(3, 2, 3, timed_out=False)
