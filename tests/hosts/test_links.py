"""A TCP link between leto's agents (node to coordinator) whose cable is cut closes on
both ends within the seconds asked (``wire.keep_alive``): without it nothing is ever
sent back, and a node cut off would look alive for ever (the job then waited for it
until --recovery-timeout, and the cut-off node ran on, orphaned)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

from netns import Hosts

END = r"""
import select, socket, sys, time
from leto.backends.gloo.wire import Conn, keep_alive
role, addr, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
if role == "server":
    srv = socket.create_server((addr, 5555))
    print("listening", flush=True)
    sock, _ = srv.accept()
else:
    sock = socket.create_connection((addr, 5555))
if seconds:
    keep_alive(sock, seconds)
conn = Conn(sock)
print("connected", flush=True)
sys.stdin.readline()  # the link is cut
t = time.monotonic()
while time.monotonic() - t < 3 * max(seconds, 1.0):
    readable, _, _ = select.select([conn], [], [], 0.1)
    if readable and not conn.feed():
        print(f"closed {time.monotonic() - t:.2f}", flush=True)
        break
else:
    print("open", flush=True)
"""


def _ends(hosts: Hosts, seconds: float) -> list[str]:
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
    server = hosts.popen(0, [sys.executable, "-c", END, "server", "0.0.0.0", str(seconds)], **pipes)
    assert server.stdout is not None and server.stdin is not None
    assert server.stdout.readline().strip() == "listening"
    client = hosts.popen(
        1, [sys.executable, "-c", END, "client", hosts.addrs[0], str(seconds)], **pipes
    )
    assert client.stdout is not None and client.stdin is not None
    try:
        assert client.stdout.readline().strip() == "connected"
        assert server.stdout.readline().strip() == "connected"
        time.sleep(0.3)  # idle, as a node's link is between two steps' messages
        hosts.cut(1)
        for p in (server, client):
            p.stdin.write("cut\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        return [server.stdout.readline().strip(), client.stdout.readline().strip()]
    finally:
        for p in (server, client):
            p.kill()
            p.wait()


def test_a_cut_link_closes_on_both_ends_within_its_seconds(
    make_hosts: Callable[[int], Hosts],
) -> None:
    ends = _ends(make_hosts(2), 1.0)
    for end in ends:
        what, _, took = end.partition(" ")
        assert what == "closed" and float(took) <= 2.5, ends


def test_without_keepalive_a_cut_link_looks_open(make_hosts: Callable[[int], Hosts]) -> None:
    """The case the keepalive is for: nothing tells either end (so the test above can fail)."""
    assert _ends(make_hosts(2), 0.0) == ["open", "open"]
