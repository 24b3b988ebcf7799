"""What a node agent keeps in its own memory for its ranks, so that it outlives them:
each rank's process state after its last few steps (and the tier-2 snapshot's), its
prepare record (the pending process state of the step it voted for), the node's
named segments (tier-1 blocks that outlive a trainer) and which of the two tier-2
snapshot slots is current. Small JSON and descriptors; the bytes live in memfd
segments."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

from . import segments

__all__ = ["HostMemory", "MemoryHost"]


class MemoryHost(Protocol):
    """What a node's memory uses of its agent: the names its segments take (the job and
    the node, both known only once the agent joined the job)."""

    @property
    def job(self) -> str: ...

    @property
    def node(self) -> int: ...


class HostMemory:
    """A node's process states, prepare records, node segments and snapshot slots."""

    def __init__(self, agent: MemoryHost) -> None:
        self.agent = agent
        self.node_segments: dict[str, tuple[int, int]] = {}
        self.ps: dict[int, dict[int, str]] = {}
        self.pending: dict[int, str] = {}
        self.snap_active: int | None = None  # the node's current tier-2 snapshot slot
        self.snap_step: int | None = None  # and its step
        self.snap_writing: dict[int, int] = {}  # step -> slot being written for it

    def keep_ps(self, rank: int, step: int, ps: str) -> None:
        """Keep a rank's process state after ``step`` (the last few, and the snapshot's)."""
        hist = self.ps.setdefault(rank, {})
        hist[step] = ps
        for old in [s for s in hist if s < step - 3 and s != self.snap_step]:
            del hist[old]

    def renumber(self, new_rank: Callable[[int], int]) -> None:
        """This node's ranks renumbered (a node before it was lost): what is kept by rank
        follows each rank to its new number."""
        self.ps = {new_rank(r): h for r, h in self.ps.items()}
        self.pending = {new_rank(r): p for r, p in self.pending.items()}

    def state_of(self, rank: int) -> dict[str, Any]:
        """The reply to a rank's ``get_state``: its process states and prepare record."""
        return {
            "ok": True,
            "ps": {str(k): v for k, v in self.ps.get(rank, {}).items()},
            "pending": self.pending.get(rank),
        }

    def node_segment(self, name: str, nbytes: int) -> tuple[dict[str, Any], list[int]]:
        """The node's segment ``name`` of ``nbytes`` (created the first time): the reply
        to a ``node_segment`` request and the descriptor that goes with it."""
        have = self.node_segments.get(name)
        if have is None:
            fd = segments.create(f"leto-{self.agent.job}-node{self.agent.node}-{name}", nbytes)
            have = (fd, nbytes)
            self.node_segments[name] = have
        if have[1] != nbytes:
            return {"ok": False, "why": f"{name} has {have[1]} bytes"}, []
        return {"ok": True, "created": False}, [have[0]]

    def node_listing(self) -> dict[str, Any]:
        """The node's segments made so far: names and sizes, in name order."""
        names = sorted(self.node_segments)
        return {"ok": True, "names": names, "sizes": [self.node_segments[n][1] for n in names]}

    def snapshot_slot(self, step: int) -> dict[str, Any]:
        """The tier-2 slot to write the snapshot of ``step`` into (the one that is not
        current; the same for every rank of the node), and the current one."""
        slot = self.snap_writing.get(step)
        if slot is None:
            slot = 0 if self.snap_active is None else 1 - int(self.snap_active)
            if step >= 0:
                self.snap_writing[step] = slot
        return {
            "ok": True,
            "write": slot,
            "active": self.snap_active,
            "active_step": self.snap_step,
        }

    def snapshot_current(self, step: int) -> None:
        """The coordinator says the snapshot of ``step`` is complete: its slot is current."""
        if step in self.snap_writing:
            self.snap_active = self.snap_writing.pop(step)
            self.snap_step = step

    def close(self) -> None:
        for fd, _ in self.node_segments.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.node_segments.clear()
