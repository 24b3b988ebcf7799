"""A process's death, seen before the kernel has torn its memory down.

A pidfd becomes readable when the process has exited entirely, which includes the
kernel's teardown of its address space: on the reference machine about 0.18 s per GiB
of anonymous memory (a trainer holds its gradients, its all-reduce buffer and its
activations there), so detection grew with the model. The kernel releases a dying
thread's robust futexes earlier, as the thread starts its exit and before the
teardown (``exit_mm_release``, then ``mmput``). A process's main thread therefore
holds a process-shared robust mutex (glibc's ``pthread_mutex_t``, in the status board
it shares with its agent, :func:`hold`) for its whole life, and the agent keeps a
thread blocked on it (:class:`DeathWatch`): the lock returns ``EOWNERDEAD`` the moment
the owner dies.

That a thread has died does not make the process harmless: a recovery must not read or
write the dead rank's retained memory while any of its threads can still write it.
:func:`quiesced` is the gate. A thread can write user memory only while it has an
address space, and the kernel clears a dying thread's (``current->mm = NULL``) before
it drops its reference and the last one tears the space down; ``/proc`` shows a thread
without one as ``vsize`` 0. ``quiesced`` gives the exit status only when every thread
of the process shows 0 (or is gone), and the pidfd still names the process afterwards
(the pid was not reaped and reused while it read). A process whose main thread exits
while others run (``pthread_exit``) is not dead: its other threads have an address
space, ``quiesced`` stays None, and the pidfd decides as before.

What the gate covers is what the gloo backend's retained memory is written by: the
process's own threads, on the CPU. Writes that do not go through a thread of the
process are not covered (asynchronous I/O, a device's DMA into pinned pages, a
``vfork`` child sharing the address space); memory written that way needs the pidfd.
The agent takes the mutex with glibc's code on memory the trainer (and anything it
forks) can write: a corrupted mutex can at worst mislead the watcher thread, which
exits right after; the gate, not the mutex, decides a death.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import signal
import struct
import threading

__all__ = ["MUTEX_BYTES", "DeathWatch", "Undecided", "hold", "quiesced"]

#: bytes reserved for the mutex: more than glibc's ``pthread_mutex_t`` (40 on x86-64,
#: 48 on aarch64)
MUTEX_BYTES = 64
_SHARED = 1  # PTHREAD_PROCESS_SHARED
_ROBUST = 1  # PTHREAD_MUTEX_ROBUST
_libc = ctypes.CDLL(None, use_errno=True)  # glibc >= 2.34 has pthread in libc
# resolved at import (in the zygote, before it forks): a lookup takes the dynamic
# loader's lock, which a fork of a process with threads may inherit held
_fn = {
    name: getattr(_libc, f"pthread_{name}")
    for name in (
        "mutexattr_init",
        "mutexattr_setpshared",
        "mutexattr_setrobust",
        "mutexattr_destroy",
        "mutex_init",
        "mutex_lock",
        "mutex_consistent",
        "mutex_unlock",
    )
}
_PID = struct.Struct("<q")
# /proc/PID/stat fields after the command's closing parenthesis: field 3 is index 0
_VSIZE = 23 - 3
_EXIT_CODE = 52 - 3


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(rc, f"{what}: {os.strerror(rc)}")


def hold(buf: mmap.mmap, offset: int) -> ctypes.Array[ctypes.c_char]:
    """Initialise a process-shared robust mutex at ``buf[offset:]`` and lock it from the
    calling thread, for the rest of the process's life (never unlocked: its release by
    the kernel is the news). The returned view pins the mapping: keep it."""
    m = (ctypes.c_char * MUTEX_BYTES).from_buffer(buf, offset)
    attr = ctypes.create_string_buffer(64)  # pthread_mutexattr_t: 4 bytes on glibc
    _check(_fn["mutexattr_init"](attr), "pthread_mutexattr_init")
    try:
        _check(_fn["mutexattr_setpshared"](attr, _SHARED), "pthread_mutexattr_setpshared")
        _check(_fn["mutexattr_setrobust"](attr, _ROBUST), "pthread_mutexattr_setrobust")
        _check(_fn["mutex_init"](m, attr), "pthread_mutex_init")
    finally:
        _fn["mutexattr_destroy"](attr)
    _check(_fn["mutex_lock"](m), "pthread_mutex_lock")
    return m


class DeathWatch:
    """The agent's side: a thread per watched process, blocked on its mutex; the pid of
    each whose owner died is written to a pipe (:attr:`fd`, for the agent's selector)."""

    def __init__(self) -> None:
        self.fd, self._wfd = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self.fd, False)
        self._lock = threading.Lock()
        self._closed = False

    def watch(self, fd: int, offset: int, size: int, pid: int) -> None:
        """Watch the mutex at ``offset`` of segment ``fd`` (``size`` bytes), held by
        process ``pid``. The descriptor may be closed once this returns."""
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        threading.Thread(
            target=self._wait, args=(mm, offset, pid), name=f"leto-deathwatch-{pid}", daemon=True
        ).start()

    def _wait(self, mm: mmap.mmap, offset: int, pid: int) -> None:
        m = (ctypes.c_char * MUTEX_BYTES).from_buffer(mm, offset)
        rc = _fn["mutex_lock"](m)  # ctypes lets go of the GIL here
        if rc in (0, errno.EOWNERDEAD):  # 0: the mutex was never held (nothing to watch)
            if rc == errno.EOWNERDEAD:
                _fn["mutex_consistent"](m)
            # unlocked before the mapping goes: glibc keeps a thread's robust mutexes
            # in a list through their own memory
            _fn["mutex_unlock"](m)
        del m
        mm.close()
        if rc == errno.EOWNERDEAD:
            with self._lock:
                if not self._closed:
                    os.write(self._wfd, _PID.pack(pid))

    def pids(self) -> list[int]:
        """The pids whose owner died since the last call."""
        out: list[int] = []
        while True:
            try:
                data = os.read(self.fd, _PID.size * 64)
            except BlockingIOError:
                return out
            if not data:
                return out
            out += [v for (v,) in _PID.iter_unpack(data)]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._wfd)
            os.close(self.fd)


class Undecided(Exception):
    """The early path cannot decide this death (the process was reaped, or ``/proc``
    shows no exit status): its pidfd and the zygote's ``waitpid`` decide."""


def _field(stat: bytes, i: int) -> int:
    return int(stat.rsplit(b")", 1)[1].split()[i])


def quiesced(pid: int, pidfd: int) -> int | None:
    """Process ``pid``'s exit code (Popen style: negative, the signal) once none of its
    threads has an address space left (see the module docstring); None while one has.
    Raises :class:`Undecided` if the process is gone (reaped: the pid may name another
    process by now) or ``/proc`` shows no exit status (0: a clean exit, or a status
    ``/proc`` withholds), which the zygote's ``waitpid`` then gives."""
    task = f"/proc/{pid}/task"
    try:
        tids = set(os.listdir(task))
        for tid in tids:
            try:
                with open(f"{task}/{tid}/stat", "rb") as f:
                    if _field(f.read(), _VSIZE) != 0:
                        return None
            except (FileNotFoundError, ProcessLookupError):
                continue  # that thread is gone (ESRCH: it went while its stat was read)
        # the same threads after the scan: none cloned one the scan did not see (only
        # possible while the process is not exiting as a whole; then it has one still)
        if set(os.listdir(task)) - tids:
            return None
        with open(f"/proc/{pid}/stat", "rb") as f:
            status = _field(f.read(), _EXIT_CODE)
    except OSError:
        raise Undecided(f"pid {pid} is gone from /proc") from None
    try:
        signal.pidfd_send_signal(pidfd, 0)  # still the process we read (not reaped)
    except ProcessLookupError:
        raise Undecided(f"pid {pid} was reaped") from None
    if status == 0:
        raise Undecided(f"pid {pid}: no exit status in /proc")
    try:
        return os.waitstatus_to_exitcode(status)
    except ValueError:
        raise Undecided(f"pid {pid}: exit status {status:#x} is not one") from None
