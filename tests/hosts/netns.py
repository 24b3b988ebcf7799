"""Test hosts: network namespaces joined by a bridge, each with an address of its own.

:class:`Hosts` makes ``n`` namespaces ``leto-PID-SEQ-hI`` (PID the creating process,
SEQ a counter of this process) and one more, ``leto-PID-SEQ-br``, holding the bridge
``br0``: nothing is made in the root namespace, so the machine's own network is never
touched. Host ``i`` has ``lo`` up and ``eth0`` (one end of a veth pair whose other end,
``vI``, is a port of the bridge) with the address ``10.231.0.{i+1}/24``; its own
``127.0.0.1`` is its own, so the root namespace's services are out of its reach, as
another machine's would be. :meth:`Hosts.popen` runs a command in a host (``ip netns
exec``: same filesystem and pids, its own network), :meth:`Hosts.cut` takes a host's
``eth0`` down (a cut cable: no FIN, no RST, packets dropped) and :meth:`Hosts.mend`
brings it back.

:meth:`Hosts.close` kills what runs inside and deletes every namespace. A SIGKILLed
test runs no finalizer, so :func:`sweep` (called before any namespace is made) removes
every ``leto-PID-...`` namespace whose PID is no longer alive, killing what still runs
inside it first. :func:`unavailable` says in one line why namespaces cannot be made
here (not root, no ``ip``, no veth or bridge support), or ``None``.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any

PREFIX = "leto-"
SUBNET = "10.231.0"
_NAME = re.compile(r"^leto-(\d+)-\d+-(?:h\d+|br)$")
_seq = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip() or res.returncode}")
    return res


def namespaces() -> list[str]:
    """The names of the network namespaces that ``ip netns`` knows."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pids_in(ns: str) -> list[int]:
    """The processes whose network namespace is ``ns``."""
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove(ns: str) -> None:
    """Kill what runs in ``ns``, then delete it (its veth ends go with it)."""
    for _ in range(50):
        left = pids_in(ns)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
    _ip("netns", "del", ns, check=False)


def sweep() -> list[str]:
    """Remove the namespaces of test hosts whose creating process is gone; their names."""
    gone = []
    for ns in namespaces():
        m = _NAME.match(ns)
        if m and not alive(int(m.group(1))):
            remove(ns)
            gone.append(ns)
    return gone


def unavailable() -> str | None:
    """Why test hosts cannot be made here, in one line; ``None`` when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (euid is not 0)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on PATH"
    try:
        with Hosts(1):
            pass
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return f"cannot make a network namespace with a veth pair and a bridge: {e}"
    return None


class Hosts:
    """``n`` test hosts on one bridge; a context manager that removes them on exit."""

    def __init__(self, n: int) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"test hosts: 1 to 200 hosts, not {n}")
        sweep()
        self.base = f"{PREFIX}{os.getpid()}-{next(_seq)}"
        self.bridge = f"{self.base}-br"
        self.names = [f"{self.base}-h{i}" for i in range(n)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self._made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        br = self.bridge
        _ip("netns", "add", br)
        self._made.append(br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addrs, strict=True)):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip(
                "-n",
                ns,
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                f"v{i}",
                "netns",
                br,
            )
            _ip("-n", br, "link", "set", f"v{i}", "master", "br0")
            _ip("-n", br, "link", "set", f"v{i}", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process in the hosts and delete every namespace made."""
        for ns in reversed(self._made):
            remove(ns)
        self._made.clear()

    def command(self, i: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run in host ``i``."""
        return ["ip", "netns", "exec", self.names[i], *cmd]

    def popen(self, i: int, cmd: Sequence[str], **kw: Any) -> subprocess.Popen[str]:
        """Start ``cmd`` in host ``i`` (``ip netns exec`` execs it: the pid is the command's)."""
        return subprocess.Popen(self.command(i, cmd), text=True, **kw)

    def run(
        self, i: int, cmd: Sequence[str], timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(i, cmd), capture_output=True, text=True, timeout=timeout)

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down on its side: its packets are dropped, nothing is closed."""
        _ip("-n", self.names[i], "link", "set", "eth0", "down")

    def mend(self, i: int) -> None:
        """Bring host ``i``'s link back up (its address is kept while it is down)."""
        _ip("-n", self.names[i], "link", "set", "eth0", "up")
