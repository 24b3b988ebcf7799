"""The coordinator's pool of spare agents (node membership: the agents', not a protocol
event): spares that proved the job's secret wait here, with torch imported and their
zygote forked, until a lost node's rank is given to one (docs/gloo.md, "Spares")."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from .eventlog import EventLog

__all__ = ["SparePool"]


class SparePool:
    """The pooled spares' ids, lowest first; ``active()``: the job still runs."""

    def __init__(
        self,
        log: EventLog,
        active: Callable[[], bool],
        usable: Callable[[str], bool] = lambda _peer: True,
    ) -> None:
        self.log = log
        self.active = active
        self.usable = usable  # a spare from this peer may take a place (its host not excluded)
        self.ids: list[int] = []  # ids only grow: the pool stays sorted
        self.peers: dict[int, str] = {}
        self.passed: set[int] = set()  # spares passed over, each said once
        self.joined_count = 0  # ids are given in the order the spares joined

    def joined(self, peer: str) -> int:
        """A spare agent proved the job's secret: it waits in the pool; its id."""
        sid = self.joined_count
        self.joined_count += 1
        self.ids.append(sid)
        self.peers[sid] = peer
        self.log.write("spare_joined", spare=sid, peer=peer, pool=len(self.ids))
        return sid

    def left(self, sid: int) -> None:
        """A pooled spare's link closed (it died, or the job ended)."""
        if sid in self.ids:
            self.ids.remove(sid)
            if self.active():
                self.log.write("spare_left", spare=sid, pool=len(self.ids))

    def assign(self, lost_at: Mapping[int, float], up: Collection[int]) -> list[tuple[int, int]]:
        """Which pooled spare takes which lost node, decided here only: each lost node
        still awaiting its replacement (``lost_at``: when each was lost; ``up``: the
        nodes whose agent is linked), the one lost first first (then the lowest node
        rank), takes the lowest spare id in the pool whose host is not excluded
        (:mod:`.exclusion`; a spare passed over is logged once and stays). ``(spare id, node)`` pairs; the
        agent tells each spare, and the spare joins as that node
        (:meth:`.Coordinator.node_up`). A node lost while the pool is empty waits
        ``spare_timeout`` for a replacement started by hand, or for a spare that joins
        the pool meanwhile."""
        if not self.active():
            return []
        out = []
        for node in sorted(lost_at, key=lambda n: (lost_at[n], n)):
            if node in up:
                continue
            for s in self.ids:
                if not self.usable(self.peers[s]) and s not in self.passed:
                    self.passed.add(s)
                    self.log.write("spare_passed_over", spare=s, peer=self.peers[s])
            usable = [s for s in self.ids if self.usable(self.peers[s])]
            if not usable:
                break
            sid = usable[0]
            self.ids.remove(sid)
            self.log.write("spare_assigned", spare=sid, node=node, pool=len(self.ids))
            out.append((sid, node))
        return out
