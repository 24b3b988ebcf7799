"""Deaths seen before the kernel's teardown of the dead process's memory (deathwatch)."""

from __future__ import annotations

import ctypes
import mmap
import os
import select
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from leto.backends.gloo import segments
from leto.backends.gloo.board import MUTEX_AT, SIZE, StatusBoard
from leto.backends.gloo.deathwatch import DeathWatch, quiesced

MiB = 1 << 20


def _child(how: str, anon: int, ready: int) -> None:
    """The forked child: holds a board's mutex, fills ``anon`` bytes of anonymous memory,
    starts a second thread that lives 3 s, says ready, then ends as ``how`` says."""
    try:
        board, fd = StatusBoard.create()
        os.write(ready, fd.to_bytes(4, "little"))
        big = mmap.mmap(-1, anon)
        big.write(b"\1" * anon)
        threading.Thread(target=time.sleep, args=(3.0,)).start()
        os.write(ready, b"x")
        time.sleep(0.2)
        if how == "exit":
            os._exit(3)
        if how == "pthread_exit":  # the main thread ends, the process lives on
            ctypes.CDLL(None).pthread_exit(None)
        time.sleep(60)
    finally:
        os._exit(99)


@pytest.fixture
def watch() -> Iterator[DeathWatch]:
    dw = DeathWatch()
    yield dw
    dw.close()


def _start(how: str, anon: int, dw: DeathWatch) -> tuple[int, int]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        _child(how, anon, w)
    os.close(w)
    child_fd = int.from_bytes(os.read(r, 4), "little")
    assert os.read(r, 1) == b"x"
    os.close(r)
    pidfd = os.pidfd_open(pid)
    # the agent gets the board's descriptor with the hello; here through /proc
    fd = os.open(f"/proc/{pid}/fd/{child_fd}", os.O_RDWR)
    try:
        dw.watch(fd, MUTEX_AT, SIZE, pid)
    finally:
        os.close(fd)
    return pid, pidfd


def _until(pred: object, timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()  # type: ignore[operator]
        if v is not None or time.monotonic() > deadline:
            return v
        time.sleep(0.0005)


@pytest.mark.parametrize(("how", "code"), [("kill", -signal.SIGKILL), ("exit", 3)])
def test_death_is_seen_before_the_teardown_with_its_exit_status(
    watch: DeathWatch, how: str, code: int
) -> None:
    pid, pidfd = _start(how, 512 * MiB, watch)
    try:
        if how == "kill":
            os.kill(pid, signal.SIGKILL)
        assert select.select([watch.fd], [], [], 10)[0], "the owner's death was not seen"
        assert watch.pids() == [pid]
        got = _until(lambda: quiesced(pid, pidfd), 1.0)
        # the status as the zygote's waitpid reports it, read while the kernel still
        # tears down the 512 MiB (the pidfd not yet readable)
        torn_down = bool(select.select([pidfd], [], [], 0)[0])
        assert got == code
        assert not torn_down, "the pidfd was readable first: nothing gained"
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(pidfd)
    assert os.waitstatus_to_exitcode(status) == code


def test_a_main_thread_that_exits_alone_is_not_a_death(watch: DeathWatch) -> None:
    """The mutex is released, but another thread can still write the process's memory:
    the gate refuses until that thread has ended too."""
    pid, pidfd = _start("pthread_exit", 4 * MiB, watch)
    try:
        assert select.select([watch.fd], [], [], 10)[0]
        assert watch.pids() == [pid]
        time.sleep(0.1)
        assert quiesced(pid, pidfd) is None  # the second thread lives (3 s)
        assert not select.select([pidfd], [], [], 0)[0]
        assert select.select([pidfd], [], [], 10)[0]  # the process ends with that thread
    finally:
        os.waitpid(pid, 0)
        os.close(pidfd)


def test_a_reaped_process_is_left_to_its_pidfd(watch: DeathWatch) -> None:
    pid, pidfd = _start("kill", 4 * MiB, watch)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    try:
        assert quiesced(pid, pidfd) is None  # gone from /proc, and the pidfd says so
    finally:
        os.close(pidfd)


def test_a_live_process_is_not_quiesced_and_nothing_is_reported(watch: DeathWatch) -> None:
    pid, pidfd = _start("live", 4 * MiB, watch)
    try:
        time.sleep(0.3)
        assert quiesced(pid, pidfd) is None
        assert watch.pids() == []
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
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
