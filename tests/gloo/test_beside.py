"""A recovery beside the compute (transaction.StepTransaction): one recovery is followed,
never two, whichever thread sees the abort first; a compute under an exception is never
kept."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from torch import nn

from leto.backends.gloo.collective import Interrupted
from leto.backends.gloo.stops import StopPoints
from leto.backends.gloo.transaction import Recovered, StepTransaction
from leto.core.reconcile import Plan
from leto.core.recovery import Kind


class _Follower:
    def __init__(self, release: threading.Event) -> None:
        self.calls: list[str] = []
        self.plans: list[Plan] = []
        self.release = release
        self.world_changed = False  # a recovery that reshaped the world keeps no compute

    def _follow(self, before_writes: Any = None, *, beside: bool = False) -> None:
        self.calls.append("beside" if beside else "here")
        self.release.wait(10)
        self.plans = [Plan(4, Kind.INPLACE, (), "")]  # resumed where the compute began


def _txn() -> tuple[StepTransaction, Any]:
    release = threading.Event()
    model = nn.Linear(2, 2)
    ch = SimpleNamespace(mark=lambda *a: None, send=lambda m: None)
    s = SimpleNamespace(
        model=model,
        rank=0,
        flush_denormal=False,
        gen=1,
        full=None,
        ch=ch,
        groups=SimpleNamespace(destroy=lambda: None),
        follower=_Follower(release),
        cursor=SimpleNamespace(restore=lambda st: None, batch=lambda v: None),
        sampler_state={},
        stats={"computes_kept": 0},
        snapshots=SimpleNamespace(maybe_take=lambda v: None),
        ropt=SimpleNamespace(version=4),
        _log=lambda *a, **k: None,
    )
    s.stops = StopPoints(model, lambda: False, Interrupted)
    txn = StepTransaction(s)  # type: ignore[arg-type]
    txn.in_progress = 5
    return txn, s


def test_a_safe_point_that_claims_the_recovery_starts_none_beside() -> None:
    txn, s = _txn()
    with txn._compute():
        assert txn.claims_recovery()  # the main thread follows it
        txn._abort_seen()  # the reader offers it a moment later: nothing starts
        assert not txn.beside()
    assert s.follower.calls == []


def test_an_abort_inside_the_compute_is_followed_beside_it_and_kept() -> None:
    txn, s = _txn()
    with txn._compute():
        txn._abort_seen()
        assert txn.beside() and not txn.claims_recovery()  # a safe point does not follow it
        s.follower.release.set()
    assert s.follower.calls == ["beside"] and s.stats["computes_kept"] == 1
    assert not txn.beside()


def test_a_compute_that_raises_a_recovery_is_void_after_the_one_beside_it() -> None:
    txn, s = _txn()
    with pytest.raises(Recovered), txn._compute():
        txn._abort_seen()
        s.follower.release.set()
        raise Interrupted("a safe point saw the abort first")
    assert s.follower.calls == ["beside"]  # one recovery, not two
    assert s.stats["computes_kept"] == 0


def test_another_error_in_the_compute_stays_itself() -> None:
    txn, s = _txn()
    with pytest.raises(ZeroDivisionError), txn._compute():
        txn._abort_seen()
        s.follower.release.set()
        raise ZeroDivisionError
    assert s.follower.calls == ["beside"]


def test_a_recovery_thread_that_cannot_start_leaves_it_to_a_safe_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # no thread to be had ("can't start new thread"): nothing is left beside the compute
    # to wait for, the compute's priority is given back, and its safe point follows the
    # recovery (its plan kept the compute)
    txn, s = _txn()
    lowered: list[int] = []
    restored: list[int] = []
    monkeypatch.setattr(txn._backseat, "lower", lowered.append)
    monkeypatch.setattr(txn._backseat, "restore", restored.append)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with txn._compute():
        txn._abort_seen()
        assert not txn.beside() and lowered == restored == [txn._compute_tid]
        monkeypatch.undo()
        s.follower.release.set()
        txn.paused()  # the safe point: followed here, on the compute's thread
    assert s.follower.calls == ["here"] and s.stats["computes_kept"] == 1
