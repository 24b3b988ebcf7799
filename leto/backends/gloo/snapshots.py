"""Tier 2 on a gloo rank: every K steps, its bytes into its node's slot plus a cross-node code.

A snapshot survives the loss of ``m`` whole nodes: each rank copies its retained bytes
into a slot of its node agent's snapshot segment and, with two nodes or more, stores
its share of the code across the ranks of the same local rank on every node (``m =
1``: the rotated sum; ``m >= 2``: :mod:`leto.retained.rs`, striped). With tier 1 as
replicas every rank holds the same bytes, so a rank's rotated share is a function of its
own (:func:`~leto.retained.parity.encode_rotated_alike`): nothing is encoded, sent or
stored at a snapshot, and a restore computes the survivors' shares from their bytes. A
recovery restores from the active slot (:mod:`.follow`).
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import torch

from leto.retained import rs
from leto.retained.layout import RetainedLayout
from leto.retained.parity import (
    as_bytes,
    encode_rotated,
    rotated_share_nbytes,
)
from leto.retained.recovery import IntegrityError

from . import messages as M
from . import segments
from .channel import AgentChannel
from .collective import coll as _coll
from .process_groups import ProcessGroups
from .rank_memory import RankMemory
from .rank_state import RankState

__all__ = ["SnapshotHost", "Tier2Snapshots"]


class SnapshotHost(Protocol):
    """What :class:`Tier2Snapshots` reads of its rank's session."""

    @property
    def cfg(self) -> Any: ...
    @property
    def ch(self) -> AgentChannel: ...
    @property
    def gen(self) -> int: ...
    @property
    def layout(self) -> RetainedLayout: ...
    @property
    def replica(self) -> bool: ...
    @property
    def rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def nproc(self) -> int: ...
    @property
    def nnodes(self) -> int: ...
    @property
    def memory(self) -> RankMemory: ...
    @property
    def groups(self) -> ProcessGroups: ...
    @property
    def ps(self) -> RankState: ...


class Tier2Snapshots:
    """One rank's tier-2 snapshots: the last one's step, and one sent but not yet confirmed."""

    def __init__(self, session: SnapshotHost, config: Any) -> None:
        self.session = session
        self.t2 = 0
        self.pending: int | None = None  # a snapshot sent, its "t2" not yet seen
        self.K = config.tier2_interval if config.tier2 else 10**12
        # m: lost nodes the snapshot survives (m >= 2: leto.retained.rs, striped)
        self.t2_parity = int(getattr(config, "tier2_parity", 1))
        # tier 1 as replicas: every rank holds the same bytes (data-parallel), so a rank's
        # share of the rotated code is a function of its own bytes (encode_rotated_alike):
        # it is computed when a restore needs it, not stored (nor sent) at each snapshot
        self.alike = self.t2_parity == 1 and session.replica
        self._mapped: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}  # slot -> mapping

    def maybe_take(self, V: int) -> None:
        """The tier-2 snapshot of step ``V`` if the last one is K steps back."""
        session = self.session
        if not session.cfg.tier2 or V - self.t2 < self.K:
            return
        if self.pending is not None:  # the previous snapshot is complete (long since)
            session.ch.wait_for("t2", self.pending, session.gen)
        bad = session.layout.verify() if session.cfg.verify_chunks else []
        if bad:  # PROTOCOL.md, Tier2Snapshot: a snapshot captures verified bytes only
            # the recovery this starts reads every chunk in its reports (as PREPARE's
            # failure does): else its report leaves the damaged chunk to the next
            # check, resumes in place, and the snapshot fails again the same way
            session.layout.mark_suspect()
            raise IntegrityError(
                f"chunks {bad} fail their checksums at the tier-2 snapshot of step {V}"
            )
        meta = _coll(self.take, V)
        session.ch.send(M.SnapshotDone(rank=session.rank, step=V, gen=session.gen, meta=meta))
        # No wait for the coordinator's "t2" here (it was a barrier of every rank each
        # K steps): step V+1 cannot commit before it anyway, since the coordinator
        # receives this rank's snapshot_done before its vote for V+1 (one FIFO path)
        # and feeds the model's Tier2Snapshot before that step's Compute events.
        self.pending = V
        self.t2 = V

    def layout(self) -> tuple[int, int]:
        """(snapshot bytes of this rank, parity bytes it stores for tier 2)."""
        session = self.session
        nb = sum(as_bytes(b).numel() for b in session.layout.data_buffers())
        m = self.t2_parity
        if session.nnodes < 2 or self.alike:
            return nb, 0
        if m == 1:
            return nb, rotated_share_nbytes(nb, session.nnodes)
        return nb, m * rs.striped_share_nbytes(nb, session.nnodes, m)

    def segment(self, slot: int) -> torch.Tensor:
        """The node's snapshot slot ``slot``, mapped (every local rank's bytes, then shares).

        The mapping is kept for the next snapshot into the same segment (the agent's, for
        its lifetime: the same inode): a fresh mapping would fault in every page of the
        copy again, which cost this copy five times its memory traffic."""
        nb, share = self.layout()
        total = self.session.nproc * (nb + share)
        # named for the world's node count too: a world changed in place (reshape)
        # encodes its snapshots over the nodes left, in segments of their own size
        fd = self.session.memory.segment(f"snap.{slot}.{self.session.nnodes}", total)
        try:
            key = (total, os.fstat(fd).st_ino)
            have = self._mapped.get(slot)
            if have is None or have[0] != key:
                have = (key, segments.as_tensor(fd, total))
                self._mapped[slot] = have
            return have[1]
        finally:
            os.close(fd)

    def take(self, step: int) -> dict[str, Any]:
        """Tier 2: this rank's bytes at ``step`` into its node's slot + the cross-node code."""
        session = self.session
        session.ch.mark("snapshot")
        reply, _ = session.ch.request(M.SnapshotSlot(step=step))
        seg = self.segment(int(reply["write"]))
        nb, share = self.layout()
        own = seg[session.local_rank * nb : (session.local_rank + 1) * nb]
        off = 0
        for b in session.layout.data_buffers():  # straight into the slot: no packed copy
            bb = as_bytes(b)
            own[off : off + bb.numel()].copy_(bb)
            off += bb.numel()
        if session.nnodes >= 2 and not self.alike:
            base = session.nproc * nb
            out = seg[base + session.local_rank * share : base + (session.local_rank + 1) * share]
            coll = session.groups.parity(session.groups.cross_group)
            if self.t2_parity == 1:
                encode_rotated(coll, own, out=out)
            else:
                rs.encode_striped(coll, own, self.t2_parity, out)
        lay = session.layout
        return {
            "step": step,
            "checksums": [lay.stored_checksum(c) for c in range(lay.n_chunks)],
            "ps": session.ps.to_json(step),
        }
