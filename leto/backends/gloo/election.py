"""Who runs a job's coordinator: an election among its agents, held in etcd.

The leader's key is ``job``, the rendezvous record (the coordinator's and the
TCPStore's addresses, the topology, the leader's lease): an agent becomes the leader
by creating it, which etcd does only if it does not exist, under a lease the leader
keeps alive (:meth:`Election.keep`). While the leader lives nobody else can; when its
lease ends (it died and stopped refreshing it, or it gave it back at the job's end,
or another agent deposed it) the key goes with it and the next campaign wins.

Deposing (:meth:`Election.depose`: revoking the lease the leader's record names) is
what an agent does when its link to the coordinator closes, rather than wait for the
lease to run out. It is safe even when the leader is alive behind a partition: a
successor takes the commit record over first (:meth:`.commit_record.EtcdRecord.
take_over` moves the revision of ``r/gen``), so the old leader can record no COMMIT,
no fence and no model input after that, and its next one stops its job.

Node 0's agent campaigns at the start (a job's first leader also clears what an
earlier job of the same id left); any other agent campaigns when its link to the
coordinator closes (:mod:`.control_plane`, ``docs/gloo.md``, "Failover").
"""

from __future__ import annotations

from typing import Any

from .etcdstore import NOT_FOUND, EtcdStore, Refused, StoreError

__all__ = ["Election"]

KEY = "job"


class Election:
    """One agent's part in the election of its job's coordinator (see the module)."""

    def __init__(self, store: EtcdStore, ttl: int) -> None:
        self.store = store
        self.ttl = ttl
        self.lease = 0  # this agent's, once it campaigned

    def campaign(self, info: dict[str, Any], *, first: bool = False) -> bool:
        """Try to lead with the rendezvous record ``info``: True if this agent is the
        leader now. ``first``: the job's start, which clears an earlier job's records."""
        for _ in range(2):
            if not self.lease:
                self.lease = self.store.grant(self.ttl)
            record = {**info, "lease": f"{self.lease:x}"}
            try:
                won = self.store.write(
                    {KEY: 0}, [(KEY, record)], lease=self.lease, clear="r/" if first else None
                )
            except Refused as e:
                if e.code != NOT_FOUND:
                    raise
                self.lease = 0  # it ran out while this agent waited: a new one
                continue
            return won is not None
        raise StoreError("etcd ended each lease it granted before it could be used")

    def leader(self) -> dict[str, Any] | None:
        """The leader's rendezvous record, checked; None while nobody leads."""
        entry = self.store.get(KEY)
        return None if entry is None else entry.value

    def renumbered(self, node: int) -> None:
        """The leader's node has a new number (a shrink in place lost a node before it):
        its record says so, for an agent that follows it or campaigns after it."""
        entry = self.store.get(KEY)
        if entry is not None and self.lease and entry.value.get("lease") == f"{self.lease:x}":
            self.store.put(KEY, {**entry.value, "node": node}, lease=self.lease)

    def keep(self) -> None:
        """Keep this agent's lease alive (StoreError once etcd let it expire). A keep that
        fails found the lease expired, or no member answering for the store's patience:
        :meth:`resign` then asks nothing, and the lease ends by its TTL if it has not (an
        agent cut off from etcd waited as long again for a revoke that could not come)."""
        try:
            self.store.refresh(self.lease)
        except StoreError:
            self.lease = 0
            raise

    def depose(self, leader: dict[str, Any]) -> bool:
        """End the lease of the leader whose record is ``leader`` (its link closed);
        False if it had ended already."""
        try:
            lease = int(str(leader.get("lease", "")), 16)
        except ValueError:
            raise StoreError(
                f"the leader's record names no lease: {leader.get('lease')!r}"
            ) from None
        return self.store.revoke(lease)

    def resign(self) -> None:
        """Give the role back (the job's end): the record goes with the lease."""
        if self.lease:
            self.store.revoke(self.lease)
            self.lease = 0
