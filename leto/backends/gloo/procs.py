"""Process plumbing shared by the launcher, agents, keepers and trainers (no torch).

* :func:`die_with_parent`: ``PR_SET_PDEATHSIG(SIGKILL)``, so every leto process
  dies with the process that started it (a SIGKILLed launcher takes its keepers,
  zygote, trainers and shadows with it; their memfd memory is then freed);
  :func:`tie_to_parent` / :func:`die_with_starter`: the same for a ``leto launch``
  that another leto process started (``leto demo``, the harness, ``leto bench``),
  through the environment;
* :func:`pidfd`: a process handle (``pidfd_open``) that becomes readable the
  moment the process exits, for a selector loop;
* :func:`rss_bytes`: resident memory of a process (``/proc/PID/status``);
* :func:`free_port`: a TCP port the OS says is free on 127.0.0.1;
* :func:`listen_tcp`: a listening TCP socket bound to the address given, not to
  every interface (what torch's TCPStore would do on its own);
* :func:`describe_status`: "exit code 3" / "killed by SIGKILL";
* :func:`steady_heap`: glibc malloc's trim and mmap thresholds fixed for a training
  process, so that a step's freed activations are not handed back to the kernel and
  faulted in again by the next step;
* :class:`Backseat`: a thread's CPU priority lowered while other work of its process
  comes first, and given back after, where this process may give it back.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import signal
import socket
import sys
import threading
from typing import NamedTuple

__all__ = [
    "Backseat",
    "describe_status",
    "die_with_parent",
    "die_with_starter",
    "free_port",
    "listen_tcp",
    "parent_of",
    "pidfd",
    "port_in_use",
    "readable",
    "rss_bytes",
    "steady_heap",
    "tie_to_parent",
]

_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` when our parent dies; exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)  # the parent died before the request took effect


_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
_M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 1 << 30
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64 bits


def steady_heap() -> bool:
    """Fix glibc malloc's trim and mmap thresholds (True if it took; False without glibc).

    glibc moves both as a process frees memory, and a training step frees its
    activations every step: depending on what else the process allocates, the
    heuristic ends up returning them to the kernel at each step's end, and the next
    step faults every page in again. Measured in a benchmark job (4 ranks, batch 4096
    of the 1.06M-parameter MLP): 17,200 page faults per trainer and step, and 308 ms of
    CPU for forward and backward, against 75 faults and 281 ms with the thresholds
    fixed. Fixed, they take the heuristic out: up to 1 GiB freed at the top of the
    heap stays mapped, and blocks below 32 MiB come from the heap.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    mapped = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1)  # ctypes: untyped
    return mapped and ok


PARENT_ENV = "LETO_PARENT_PID"


class Backseat:
    """One thread's CPU priority (its Linux nice value) lowered to the lowest while other
    threads of the process come first, then given back; and, where the kernel lets it
    come back, its policy ``SCHED_IDLE`` meanwhile: it then runs only on a CPU no other
    thread wants, and any other thread that wakes takes its CPU at once (at nice 19 a
    thread still holds a CPU for a slice of its own against one that wakes).

    Giving it back lowers the nice value again, which needs ``CAP_SYS_NICE`` or an
    ``RLIMIT_NICE`` that allows it: where the process may not, :attr:`able` is False
    and nothing is ever lowered (a thread left at the lowest priority for good would
    be worse than none of this). Likewise :attr:`idle`: ``SCHED_IDLE`` is used only if
    the thread can leave it, and only for a thread under ``SCHED_OTHER`` (another
    policy, ``SCHED_BATCH`` say, is kept and the thread only reniced). Found out once,
    on a thread of its own that ends; the thread's own policy when it is lowered.

    A thread or process the lowered thread starts meanwhile is born at its priority
    (Linux copies a thread's policy and nice value into the threads and processes it
    starts: an intra-op pool or a data loader's workers created by the first step of a
    promoted rank, say). :meth:`restore` gives those back too: every thread of this
    process and of the processes started since that is still at the lowered priority.
    """

    LOWEST = 19

    def __init__(self) -> None:
        self.able, self.idle = _can_renice()
        self._lock = threading.Lock()
        self._held: dict[int, _Lowered] = {}  # native thread id -> how it was before

    def lower(self, tid: int) -> bool:
        """Thread ``tid`` to the lowest priority (until :meth:`restore`); True if it is."""
        if not self.able:
            return False
        with self._lock:
            if tid in self._held:
                return True
            try:
                nice = os.getpriority(os.PRIO_PROCESS, tid)
                policy = os.sched_getscheduler(tid)
                known = _tasks(os.getpid())  # these were not born lowered
                os.setpriority(os.PRIO_PROCESS, tid, self.LOWEST)
            except OSError:
                return False
            idle = self.idle and policy == os.SCHED_OTHER
            if idle:
                try:
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                except OSError:  # the thread has ended: nothing to keep idle
                    idle = False
            self._held[tid] = _Lowered(nice, idle, known)
            return True

    def restore(self, tid: int) -> None:
        """Thread ``tid``'s priority as it was before :meth:`lower` (if it was lowered),
        and that of every thread born at the lowered priority since."""
        with self._lock:
            was = self._held.pop(tid, None)
            if was is None:
                return
            for t in [tid, *_born(tid, was.known)]:
                if t != tid and not _looks_lowered(t, was.idle, self.LOWEST):
                    continue  # born to another thread, or changed since: not ours
                # each given back on its own: a failure of one leaves the other restored
                if was.idle:
                    try:
                        os.sched_setscheduler(t, os.SCHED_OTHER, os.sched_param(0))
                    except OSError:  # the thread has ended (or the limit changed)
                        pass
                try:
                    os.setpriority(os.PRIO_PROCESS, t, was.nice)
                except OSError:  # the thread has ended (or the limit changed)
                    pass


class _Lowered(NamedTuple):
    nice: int  # the thread's nice value before
    idle: bool  # made SCHED_IDLE (from SCHED_OTHER; any other policy is left as it was)
    known: frozenset[int]  # the threads of this process then


def _looks_lowered(tid: int, idle: bool, lowest: int) -> bool:
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) != lowest:
            return False
        return not idle or os.sched_getscheduler(tid) == os.SCHED_IDLE
    except OSError:  # it has ended
        return False


def _tasks(pid: int) -> frozenset[int]:
    """The thread ids of process ``pid`` (none if it has ended)."""
    try:
        return frozenset(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except (OSError, ValueError):
        return frozenset()


def _born(tid: int, known: frozenset[int]) -> list[int]:
    """The threads and processes that thread ``tid`` of this process may have started
    since ``known`` were its process's threads: the threads not in ``known``, the
    processes any of those or ``tid`` started (``/proc/PID/task/TID/children``), every
    thread of those, and so on. Not ``tid``."""
    me = os.getpid()
    new = sorted(_tasks(me) - known - {tid})
    out = list(new)
    todo = [(me, t) for t in [tid, *new]]
    while todo:
        pid, t = todo.pop()
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                children = [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
        for c in children:
            threads = sorted(_tasks(c))
            out += threads
            todo += [(c, x) for x in threads]
    return out


def _can_renice() -> tuple[bool, bool]:
    """Can a thread of this process lower its nice value back after raising it; and
    can it leave ``SCHED_IDLE`` for ``SCHED_OTHER`` again?"""
    result: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            now = os.getpriority(os.PRIO_PROCESS, tid)
            if now >= Backseat.LOWEST:
                result.append(False)
                return
            os.setpriority(os.PRIO_PROCESS, tid, now + 1)
            os.setpriority(os.PRIO_PROCESS, tid, now)
            result.append(True)
            if os.sched_getscheduler(tid) != os.SCHED_OTHER:  # e.g. SCHED_BATCH: left as is
                result.append(False)
                return
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            result.append(True)
        except (OSError, AttributeError):  # AttributeError: no SCHED_IDLE in this os
            result.append(False)

    t = threading.Thread(target=probe, name="leto-renice-probe")
    t.start()
    t.join()
    able = bool(result and result[0])
    return able, able and result[1:] == [True]


def tie_to_parent(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a child that must die with this process (see :func:`die_with_starter`)."""
    return {**env, PARENT_ENV: str(os.getpid())}


def die_with_starter() -> None:
    """Die with the process that started this one, if it asked to (``LETO_PARENT_PID``).

    Called first thing by ``leto launch``: an agent that ``leto demo`` started is then
    SIGKILLed with it, and its own processes die with the agent. The variable is taken
    out of the environment, so nothing this process starts inherits it.
    """
    value = os.environ.pop(PARENT_ENV, "")
    if not value.isdigit():
        return
    if os.getppid() != int(value):
        sys.stderr.write(
            f"leto: the process that started this one ({PARENT_ENV}={value}) is gone\n"
        )
        os._exit(1)
    die_with_parent(int(value))


def readable(fd: int) -> bool:
    """Is ``fd`` readable now (a pidfd: its process has exited)? ``poll``, not
    ``select``: descriptors past 1024 are fine."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


def pidfd(pid: int) -> int:
    """A pollable handle of process ``pid`` (readable once it has exited)."""
    return os.pidfd_open(pid)


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listen_tcp(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (its first address, IPv4 or IPv6)."""
    family, _, _, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return socket.create_server(addr, family=family, backlog=backlog)


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (``/proc/PID/stat``); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name, in parentheses, may hold any byte: the fields follow its last ')'
    try:
        return int(stat[stat.rindex(b")") + 2 :].split()[1])
    except (ValueError, IndexError):
        return None


def port_in_use(host: str, port: int) -> bool:
    """Whether ``host:port`` cannot be bound for another reason than the host (IPv4 or
    IPv6, its first address; a host that does not resolve is not a port in use)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError):
        return False
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind(addr)
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def describe_status(status: int | None) -> str:
    """Human words for a ``waitpid`` status or a Popen-style return code."""
    if status is None:
        return "exit status unknown"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit code {status}"


def waitstatus_to_code(status: int) -> int:
    """``os.waitpid`` status -> Popen-style code (negative: the signal)."""
    return os.waitstatus_to_exitcode(status)


def processes_with(tag: str) -> list[int]:
    """Pids (other than ours) whose command line contains ``tag``."""
    out = []
    me = os.getpid()
    needle = tag.encode()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if needle in cmd:
            out.append(int(d))
    return out


def memfd_holders(fragment: str) -> list[int]:
    """Pids holding a descriptor or a mapping of a memfd whose name contains ``fragment``.

    A memfd's memory is freed exactly when this list is empty.
    """
    out = []
    needle = "/memfd:" + fragment
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        held = False
        try:
            for fd in os.listdir(f"/proc/{d}/fd"):
                try:
                    if needle in os.readlink(f"/proc/{d}/fd/{fd}"):
                        held = True
                        break
                except OSError:
                    continue
            if not held:
                with open(f"/proc/{d}/maps", encoding="utf-8", errors="replace") as f:
                    held = any(needle in line for line in f)
        except OSError:
            continue
        if held:
            out.append(int(d))
    return out
