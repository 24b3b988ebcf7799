"""Tier 2 on the simulated ranks: every node's snapshot of its members' retained bytes,
with cross-node parity, so that the loss of up to ``tier2_parity`` whole nodes is
survived.

``m = 1``: a rotated sum (:func:`leto.retained.parity.encode_rotated`); ``m >= 2``:
striped Reed-Solomon (:mod:`leto.retained.rs`). When a snapshot is taken and when it is
restored are the core's decisions (Tier2Snapshot, a TIER2 reconcile).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from leto.backends.base import Snapshot
from leto.retained import recovery as rx
from leto.retained import rs
from leto.retained.parity import decode_rotated, encode_rotated
from leto.retained.recovery import IntegrityError

from .host import RanksHost
from .integrity import IntegrityHost, failure

__all__ = ["CaptureHost", "capture_clean", "restore", "take"]


class CaptureHost(RanksHost, IntegrityHost, Protocol):
    """The ranks whose bytes a snapshot captures, and where a chunk that fails its
    checksum then is reported."""


def capture_clean(host: CaptureHost) -> bool:
    """PROTOCOL.md, Tier2Snapshot: a snapshot captures verified bytes only.

    Bytes damaged after PREPARE's pass (a silent flip between the vote and the
    snapshot) would enter the snapshot under the chunk's good checksum and be found
    only when the snapshot is restored, with no tier left to repair them. A rank whose
    chunks fail here is an integrity failure (its memory is discarded and rebuilt
    from tier 1) and the snapshot is taken after that recovery.
    """
    if not host.options.verify:
        return True
    bad = {p.rank: p.layout.verify() for p in host.procs}
    bad = {r: cs for r, cs in bad.items() if cs}
    for r, cs in bad.items():
        failure(host, r, f"chunks {cs} fail their checksums at the tier-2 snapshot")
    return not bad


def take(ranks: RanksHost, step: int) -> None:
    """Every node's snapshot at ``step``: its members' packed bytes, their checksums
    and process states, and the node's share of the cross-node parity."""
    ranks.stats["snapshots_taken"] += 1
    N = ranks.backend.nodes
    rank_bytes = [rx.packed(p.layout) for p in ranks.procs]
    nb = rank_bytes[0].numel()
    width = max(ranks.backend.topology.node_sizes)
    checks = {
        p.rank: [p.layout.stored_checksum(c) for c in range(p.layout.n_chunks)] for p in ranks.procs
    }
    states = {p.rank: ranks.store(p.rank).process_states[p.rank][step] for p in ranks.procs}
    datas = []
    for n in range(N):
        d = torch.zeros(width * nb, dtype=torch.uint8)
        for j, r in enumerate(ranks.backend.ranks_of(n)):
            d[j * nb : (j + 1) * nb] = rank_bytes[r]
        datas.append(d)
    shares: list[Any] = [None] * N
    if N >= 2:

        def program(coll: Any) -> Any:
            m = ranks.options.tier2_parity
            if m == 1:
                return encode_rotated(coll, datas[coll.rank])
            share = torch.zeros(m * rs.striped_share_nbytes(width * nb, N, m), dtype=torch.uint8)
            rs.encode_striped(coll, datas[coll.rank], m, share)
            return share

        shares = ranks.backend.spmd(list(range(N)), program)
    for n in range(N):
        ranks.backend.node_store(n).snapshot = Snapshot(step, datas[n], checks, states, shares[n])


def restore(ranks: RanksHost, step: int) -> None:
    """Every rank restores its node's snapshot (a lost node's is decoded first)."""
    N = ranks.backend.nodes
    stores = [ranks.backend.node_store(n) for n in range(N)]
    snaps = [st.snapshot for st in stores]
    missing = [n for n, sn in enumerate(snaps) if sn is None or sn.step != step]
    m = ranks.options.tier2_parity
    if len(missing) > m:
        raise IntegrityError(f"tier-2 snapshots of nodes {missing} are gone: beyond tier 2")
    if missing:
        ref = next(s.snapshot for s in stores if s.snapshot is not None and s.snapshot.step == step)
        assert ref is not None and ref.share is not None
        datas = [
            torch.zeros_like(ref.data) if n in missing else stores[n].snapshot.data  # type: ignore[union-attr]
            for n in range(N)
        ]
        shares = [
            torch.zeros_like(ref.share) if n in missing else stores[n].snapshot.share  # type: ignore[union-attr]
            for n in range(N)
        ]

        def program(coll: Any) -> Any:
            if m == 1:
                return decode_rotated(coll, datas[coll.rank], missing[0], shares[coll.rank])
            rs.decode_striped(coll, datas[coll.rank], m, missing, shares[coll.rank])
            return shares[coll.rank]

        out = ranks.backend.spmd(list(range(N)), program)
        for lost in missing:
            stores[lost].snapshot = Snapshot(
                step, datas[lost], dict(ref.checksums), dict(ref.process_states), out[lost]
            )
    for n in range(N):
        snap = stores[n].snapshot
        assert snap is not None
        for j, r in enumerate(ranks.backend.ranks_of(n)):
            p = ranks.procs[r]
            lay = p.layout
            rx.free_undo(lay)
            nb = rx.packed(lay).numel()
            rx.unpack_into(lay, snap.data[j * nb : (j + 1) * nb])
            rx.seal_checked(lay, step, snap.checksums[r], "tier-2 snapshot", f"rank {r}")
            lay.clear_prepared()
            p.load_ps(snap.process_states[r])
