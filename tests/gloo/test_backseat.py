"""``procs.Backseat``: a thread's CPU priority lowered while a recovery runs beside its
compute, and given back after; never lowered where it could not be given back."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from leto.backends.gloo import procs
from leto.backends.gloo.procs import Backseat


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def _on_a_thread(work) -> None:  # type: ignore[no-untyped-def]
    """Run ``work(tid)`` on a fresh thread (its priority goes with it)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work(threading.get_native_id())
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def test_lowered_to_the_lowest_then_given_back() -> None:
    seat = Backseat()
    if not seat.able:
        pytest.skip("this process may not lower a nice value back (no CAP_SYS_NICE/RLIMIT_NICE)")

    def work(tid: int) -> None:
        before = _nice(tid)
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER
        assert seat.lower(tid) and _nice(tid) == Backseat.LOWEST
        lowered = os.SCHED_IDLE if seat.idle else os.SCHED_OTHER
        assert os.sched_getscheduler(tid) == lowered
        assert seat.lower(tid)  # twice: still the one value to give back
        seat.restore(tid)
        assert _nice(tid) == before and os.sched_getscheduler(tid) == os.SCHED_OTHER
        seat.restore(tid)  # nothing held: nothing changes
        assert _nice(tid) == before and os.sched_getscheduler(tid) == os.SCHED_OTHER

    _on_a_thread(work)


def test_another_thread_is_not_touched() -> None:
    seat = Backseat()
    if not seat.able:
        pytest.skip("this process may not lower a nice value back (no CAP_SYS_NICE/RLIMIT_NICE)")
    me = threading.get_native_id()
    mine = _nice(me)

    def work(tid: int) -> None:
        seat.lower(tid)
        assert _nice(me) == mine and _nice(tid) == Backseat.LOWEST
        seat.restore(tid)

    _on_a_thread(work)
    assert _nice(me) == mine


def test_never_lowered_where_it_could_not_be_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # a process without the right to lower a nice value: raising one succeeds, lowering
    # it again fails, as the kernel answers an unprivileged process
    def setpriority(which: int, who: int, value: int) -> None:
        if value < os.getpriority(which, who):
            raise PermissionError(1, "Operation not permitted")
        real(which, who, value)

    real = os.setpriority
    monkeypatch.setattr(procs.os, "setpriority", setpriority)
    seat = Backseat()
    assert not seat.able

    def work(tid: int) -> None:
        before = _nice(tid)
        assert not seat.lower(tid)
        assert _nice(tid) == before  # nothing lowered, nothing left lowered

    _on_a_thread(work)


def test_idle_only_where_the_thread_can_leave_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # a kernel (or a limit) that lets a thread become SCHED_IDLE but not leave it: the
    # seat still lowers the nice value, and never makes a thread idle
    def sched_setscheduler(pid: int, policy: int, param: os.sched_param) -> None:
        if policy == os.SCHED_OTHER and os.sched_getscheduler(pid) == os.SCHED_IDLE:
            raise PermissionError(1, "Operation not permitted")
        real(pid, policy, param)

    real = os.sched_setscheduler
    monkeypatch.setattr(procs.os, "sched_setscheduler", sched_setscheduler)
    seat = Backseat()
    assert not seat.idle
    if not seat.able:
        pytest.skip("this process may not lower a nice value back (no CAP_SYS_NICE/RLIMIT_NICE)")

    def work(tid: int) -> None:
        assert seat.lower(tid) and _nice(tid) == Backseat.LOWEST
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER
        seat.restore(tid)

    _on_a_thread(work)


def test_a_thread_under_another_policy_is_only_reniced() -> None:
    # started under SCHED_BATCH (a thread inherits its creator's policy): never made idle,
    # nor forced to SCHED_OTHER; its nice value is still lowered where it can come back
    def work(tid: int) -> None:
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        seat = Backseat()  # probed on a thread this one starts: SCHED_BATCH too
        assert not seat.idle
        if seat.able:
            assert seat.lower(tid) and os.sched_getscheduler(tid) == os.SCHED_BATCH
            seat.restore(tid)
            assert os.sched_getscheduler(tid) == os.SCHED_BATCH

    _on_a_thread(work)


def _able() -> Backseat:
    seat = Backseat()
    if not seat.able:
        pytest.skip("this process may not lower a nice value back (no CAP_SYS_NICE/RLIMIT_NICE)")
    return seat


def test_a_thread_switched_to_another_policy_after_the_probe_is_only_reniced() -> None:
    # the seat was probed under SCHED_OTHER (it may use SCHED_IDLE); the thread it lowers
    # runs under SCHED_BATCH now: kept so, reniced only, and given back as it was
    seat = _able()

    def work(tid: int) -> None:
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        before = _nice(tid)
        assert seat.lower(tid) and _nice(tid) == Backseat.LOWEST
        assert os.sched_getscheduler(tid) == os.SCHED_BATCH
        seat.restore(tid)
        assert os.sched_getscheduler(tid) == os.SCHED_BATCH and _nice(tid) == before

    _on_a_thread(work)


def test_threads_and_processes_started_while_lowered_are_given_back() -> None:
    # Linux copies a thread's policy and nice value into what it starts: a thread (an
    # intra-op pool) and a process (a data loader's worker) started by the lowered
    # thread are back at its priority after restore; a thread lowered on purpose before
    # is left alone
    seat = _able()
    stop = threading.Event()
    low = threading.Event()
    seen: dict[str, int] = {}

    def lowered_on_purpose() -> None:
        seen["own"] = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, seen["own"], Backseat.LOWEST)
        low.set()
        stop.wait(30)

    other = threading.Thread(target=lowered_on_purpose)
    other.start()
    low.wait(10)

    def work(tid: int) -> None:
        before = _nice(tid)
        assert seat.lower(tid)
        ready = threading.Event()

        def born() -> None:
            seen["thread"] = threading.get_native_id()
            ready.set()
            stop.wait(30)

        t = threading.Thread(target=born)
        t.start()
        ready.wait(10)
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            for who in (seen["thread"], proc.pid):  # born at the lowered priority
                assert _nice(who) == Backseat.LOWEST
                if seat.idle:
                    assert os.sched_getscheduler(who) == os.SCHED_IDLE
            seat.restore(tid)
            for who in (tid, seen["thread"], proc.pid):
                assert _nice(who) == before, who
                assert os.sched_getscheduler(who) == os.SCHED_OTHER, who
            assert _nice(seen["own"]) == Backseat.LOWEST  # not born of the lowered one
        finally:
            proc.kill()
            proc.wait()
            stop.set()
            t.join()

    try:
        _on_a_thread(work)
    finally:
        stop.set()
        other.join()
