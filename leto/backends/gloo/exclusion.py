"""Hosts that failed too often are not taken back (``--exclude-after K --exclude-window
S``): a host whose nodes failed K times within S seconds (a lost node, or a failure of
one of its ranks: a crash, a hang, an exception, lost memory) is excluded for the rest
of the job. A node's replacement started there is refused, and a spare waiting in the
pool from there is passed over for one from another host; each in one line. A host is
the address its agent's link to the coordinator comes from: agents on the loopback
address (every node on one machine) cannot be told apart and are never excluded.
Membership only, no protocol event: the coordinator's, beside its spare pool."""

from __future__ import annotations

import ipaddress

from .eventlog import EventLog

__all__ = ["Exclusions", "host_of"]


def host_of(peer: str) -> str:
    """The address of a link's peer ``HOST:PORT`` (``[V6]:PORT`` too)."""
    host = peer.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Exclusions:
    """Each node's host, each host's failures in the window, and the hosts excluded.
    ``after`` 0: nothing is ever excluded."""

    def __init__(self, log: EventLog, after: int, window: float) -> None:
        self.log = log
        self.after = after
        self.window = window
        self.hosts: dict[int, str] = {}  # node -> the host its agent joined from
        self.failures: dict[str, list[float]] = {}
        self.excluded: dict[str, str] = {}  # host -> why, in one line

    def joined(self, node: int, peer: str) -> None:
        """Node ``node``'s agent (or the spare taking its place) joined from ``peer``."""
        self.hosts[node] = host_of(peer)

    def failed(self, node: int, now: float) -> None:
        """A failure of ``node`` (lost, or one of its ranks) at ``now``: its host is
        excluded once it failed ``after`` times within ``window`` seconds."""
        host = self.hosts.get(node)
        if not self.after or host is None or _loopback(host) or host in self.excluded:
            return
        times = [t for t in self.failures.get(host, []) if now - t <= self.window] + [now]
        self.failures[host] = times
        if len(times) >= self.after:
            why = (
                f"host {host} failed {len(times)} time(s) within {self.window:g} s "
                f"(--exclude-after {self.after}, --exclude-window {self.window:g}): it is not "
                "taken back, a spare from another host takes its place"
            )
            self.excluded[host] = why
            self.log.write("host_excluded", host=host, node=node, failures=len(times), why=why)

    def refusal(self, peer: str) -> str | None:
        """Why an agent joining from ``peer`` is not taken (None: it is)."""
        return self.excluded.get(host_of(peer))
