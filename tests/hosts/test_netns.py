"""The test hosts themselves: an address each, reachable from the others and not from
the root namespace's loopback; a stale host of a dead process swept, a live one's kept."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from netns import Hosts, namespaces, pids_in, sweep

PROBE = (
    "import socket,sys\n"
    "s=socket.socket(); s.settimeout(2)\n"
    "try:\n"
    "    s.connect((sys.argv[1], int(sys.argv[2]))); print(s.recv(16).decode())\n"
    "except OSError as e:\n"
    "    print('refused', type(e).__name__)\n"
)
SERVE = (
    "import socket,sys\n"
    "s=socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)\n"
    "c,_=s.accept(); c.sendall(b'hello'); c.close()\n"
)


def test_hosts_reach_each_other_by_address_and_not_the_root_loopback(
    make_hosts: Callable[[int], Hosts],
) -> None:
    hosts = make_hosts(2)
    assert hosts.addrs == ["10.231.0.1", "10.231.0.2"]
    assert all(ns in namespaces() for ns in [hosts.bridge, *hosts.names])
    show = hosts.run(1, ["ip", "-4", "-o", "addr", "show", "eth0"])
    assert "10.231.0.2/24" in show.stdout, show
    server = hosts.popen(0, [sys.executable, "-c", SERVE, hosts.addrs[0]], stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        got = hosts.run(1, [sys.executable, "-c", PROBE, hosts.addrs[0], port])
        assert got.stdout.strip() == "hello", got
    finally:
        server.kill()
        server.wait()
    with socket.create_server(("127.0.0.1", 0)) as root:  # a service of the root namespace
        port = str(root.getsockname()[1])
        got = hosts.run(1, [sys.executable, "-c", PROBE, "127.0.0.1", port])
        assert got.stdout.startswith("refused"), got


def test_a_cut_link_drops_packets_and_mends(make_hosts: Callable[[int], Hosts]) -> None:
    hosts = make_hosts(2)
    server = hosts.popen(0, [sys.executable, "-c", SERVE, "0.0.0.0"], stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        hosts.cut(1)
        got = hosts.run(1, [sys.executable, "-c", PROBE, hosts.addrs[0], port])
        assert got.stdout.startswith("refused"), got
        hosts.mend(1)
        got = hosts.run(1, [sys.executable, "-c", PROBE, hosts.addrs[0], port])
        assert got.stdout.strip() == "hello", got
    finally:
        server.kill()
        server.wait()


def test_sweep_removes_a_dead_process_s_hosts_and_keeps_a_live_one_s(
    make_hosts: Callable[[int], Hosts],
) -> None:
    mine = make_hosts(1)  # this process is alive: its hosts stay
    code = (
        "import subprocess,sys,time\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from netns import Hosts\n"
        "h = Hosts(1)\n"
        "p = subprocess.Popen(h.command(0, ['sleep', '300']))\n"
        "print(h.names[0], h.bridge, p.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    here = str(Path(__file__).resolve().parent)
    maker = subprocess.Popen([sys.executable, "-c", code, here], stdout=subprocess.PIPE, text=True)
    assert maker.stdout is not None
    ns, br, sleeper = maker.stdout.readline().split()
    assert ns.startswith(f"leto-{maker.pid}-") and ns in namespaces()
    # `ip netns exec` joins the namespace, then execs: under load that takes a while
    deadline = time.monotonic() + 20
    while int(sleeper) not in pids_in(ns) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert int(sleeper) in pids_in(ns)
    maker.kill()  # SIGKILL: no finalizer runs, its namespaces and the sleep stay
    maker.wait()
    assert ns in namespaces() and br in namespaces()
    gone = sweep()
    assert sorted(gone) == sorted([ns, br]), gone
    assert ns not in namespaces() and br not in namespaces()
    assert all(n in namespaces() for n in [mine.bridge, *mine.names])
    assert not running(int(sleeper)), "the process left in the stale namespace was not killed"


def running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a killed orphan waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
