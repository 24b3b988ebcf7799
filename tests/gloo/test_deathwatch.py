"""Deaths seen before the kernel's teardown of the dead process's memory (deathwatch)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from leto.backends.gloo import procs as P
from leto.backends.gloo import segments
from leto.backends.gloo.board import MUTEX_AT, SIZE
from leto.backends.gloo.deathwatch import DeathWatch, Undecided, quiesced

MiB = 1 << 20


# The child is a fresh interpreter, not a fork of pytest: a fork of a process with
# threads inherits whatever locks they held (the dynamic loader's, which pthread_exit's
# unwinding takes), as trainers forked from the single-threaded zygote do not.
_CHILD = """
import ctypes, mmap, os, sys, threading, time
from leto.backends.gloo.board import StatusBoard
how, anon = sys.argv[1], int(sys.argv[2])
board, fd = StatusBoard.create()
big = mmap.mmap(-1, anon)
big.write(b"\\1" * anon)
threading.Thread(target=time.sleep, args=(3.0,)).start()
sys.stdout.write(f"{fd}\\n")
sys.stdout.flush()
time.sleep(0.2)
if how == "exit":
    os._exit(3)
if how == "exit0":
    os._exit(0)
if how == "pthread_exit":  # the main thread ends, the process lives on
    ctypes.CDLL(None).pthread_exit(None)
time.sleep(60)
"""


@pytest.fixture
def watch() -> Iterator[DeathWatch]:
    dw = DeathWatch()
    yield dw
    dw.close()


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:  # whatever a failed test left
        p.kill()
        p.wait(10)


def _start(
    how: str, anon: int, dw: DeathWatch, procs: list[subprocess.Popen[bytes]]
) -> tuple[subprocess.Popen[bytes], int]:
    """A child holding its board's mutex, ``anon`` bytes of anonymous memory filled and a
    second thread that lives 3 s; it ends 0.2 s after it is ready, as ``how`` says."""
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, how, str(anon)], stdout=subprocess.PIPE)
    procs.append(proc)
    assert proc.stdout is not None
    child_fd = int(proc.stdout.readline())
    pidfd = os.pidfd_open(proc.pid)
    # the agent gets the board's descriptor with the hello; here through /proc
    fd = os.open(f"/proc/{proc.pid}/fd/{child_fd}", os.O_RDWR)
    try:
        dw.watch(fd, MUTEX_AT, SIZE, proc.pid)
    finally:
        os.close(fd)
    return proc, pidfd


def _until(pred: Callable[[], object], timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v is not None or time.monotonic() > deadline:
            return v
        time.sleep(0.0005)


@pytest.mark.parametrize(("how", "code"), [("kill", -signal.SIGKILL), ("exit", 3)])
def test_death_is_seen_before_the_teardown_with_its_exit_status(
    watch: DeathWatch, children: list[subprocess.Popen[bytes]], how: str, code: int
) -> None:
    proc, pidfd = _start(how, 512 * MiB, watch, children)
    try:
        if how == "kill":
            proc.kill()
        assert select.select([watch.fd], [], [], 10)[0], "the owner's death was not seen"
        assert watch.pids() == [proc.pid]
        got = _until(lambda: quiesced(proc.pid, pidfd), 1.0)
        # the status as waitpid reports it, read while the kernel still tears down the
        # 512 MiB (the pidfd not yet readable)
        torn_down = P.readable(pidfd)
        assert got == code
        assert not torn_down, "the pidfd was readable first: nothing gained"
    finally:
        os.close(pidfd)
    assert proc.wait(10) == code


def test_a_main_thread_that_exits_alone_is_not_a_death(
    watch: DeathWatch, children: list[subprocess.Popen[bytes]]
) -> None:
    """The mutex is released, but another thread can still write the process's memory:
    the gate refuses until that thread has ended too."""
    proc, pidfd = _start("pthread_exit", 4 * MiB, watch, children)
    try:
        assert select.select([watch.fd], [], [], 10)[0]
        assert watch.pids() == [proc.pid]
        time.sleep(0.1)
        assert quiesced(proc.pid, pidfd) is None  # the second thread lives (3 s)
        assert not P.readable(pidfd)
        assert select.select([pidfd], [], [], 10)[0]  # the process ends with that thread
    finally:
        os.close(pidfd)
    assert proc.wait(10) == 0


def test_a_reaped_process_is_left_to_its_pidfd(
    watch: DeathWatch, children: list[subprocess.Popen[bytes]]
) -> None:
    proc, pidfd = _start("kill", 4 * MiB, watch, children)
    proc.kill()
    proc.wait(10)
    try:
        with pytest.raises(Undecided, match=f"pid {proc.pid} is gone from /proc"):
            quiesced(proc.pid, pidfd)
    finally:
        os.close(pidfd)


def test_a_clean_exit_is_left_to_the_zygote(
    watch: DeathWatch, children: list[subprocess.Popen[bytes]]
) -> None:
    """Exit status 0 is also what /proc shows when it withholds the status: undecided."""
    proc, pidfd = _start("exit0", 4 * MiB, watch, children)
    try:
        assert select.select([watch.fd], [], [], 10)[0]
        with pytest.raises(Undecided, match="no exit status"):
            _until(lambda: quiesced(proc.pid, pidfd), 1.0)
    finally:
        os.close(pidfd)
    assert proc.wait(10) == 0


def test_a_live_process_is_not_quiesced_and_nothing_is_reported(
    watch: DeathWatch, children: list[subprocess.Popen[bytes]]
) -> None:
    proc, pidfd = _start("live", 4 * MiB, watch, children)
    try:
        time.sleep(0.3)
        assert quiesced(proc.pid, pidfd) is None
        assert watch.pids() == []
    finally:
        proc.kill()
        proc.wait(10)
        os.close(pidfd)


def test_a_board_never_held_is_not_watched_forever(watch: DeathWatch) -> None:
    """A segment whose mutex nobody holds: the watcher takes it at once, reports nothing."""
    fd = segments.create("unheld", SIZE)
    try:
        watch.watch(fd, MUTEX_AT, SIZE, 12345)
    finally:
        os.close(fd)
    time.sleep(0.2)
    assert watch.pids() == []
    names = [t.name for t in threading.enumerate()]
    assert "leto-deathwatch-12345" not in names


def test_a_thread_that_goes_while_its_stat_is_read_is_gone_not_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading an exiting thread's stat may fail with ESRCH (the thread was released after
    its file was opened): that thread is gone, not the process, whose own stat is then
    read (CI once called a clean exit's process "gone from /proc" this way). Here every
    thread's read fails so: the process's stat shows no exit status, as at a clean exit."""
    real_open = open

    def exiting(path: Any, *a: Any, **k: Any) -> Any:
        if "/task/" in str(path) and str(path).endswith("/stat"):
            raise ProcessLookupError(3, "No such process")
        return real_open(path, *a, **k)

    pidfd = os.pidfd_open(os.getpid())
    try:
        monkeypatch.setattr("builtins.open", exiting)
        with pytest.raises(Undecided, match="no exit status"):
            quiesced(os.getpid(), pidfd)
    finally:
        monkeypatch.undo()
        os.close(pidfd)
