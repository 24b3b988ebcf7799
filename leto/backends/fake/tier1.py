"""Tier 1 on the simulated ranks: each node's parity over its members' chunks and
gradients, kept in the node agent's memory.

A rank that loses its memory is rebuilt from its node's parity and the other members'
bytes (:func:`leto.retained.recovery.decode_chunk` / ``decode_grads``, run as one
collective program on every member of the node). Which chunks are rebuilt, at which
version, is the core's reconcile plan; this module only carries it out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from leto.core.chunk import NONE
from leto.retained import recovery as rx
from leto.retained.layout import RetainedLayout
from leto.retained.parity import as_bytes, encode, encode_local
from leto.retained.recovery import IntegrityError

from .host import RanksHost

__all__ = ["decode_chunk", "decode_grads", "encode_all", "exact"]


def _run(ranks: RanksHost, r: int, decode: Callable[..., None], **kw: Any) -> None:
    """``decode`` (a decoder of :mod:`leto.retained.recovery`, given ``kw``) on every
    member of rank ``r``'s node at once, each on its own layout: ``r`` is rebuilt."""
    members = ranks.backend.ranks_of(ranks.backend.node_of(r))
    lost, who = members.index(r), f"rank {r}"

    def program(coll: Any) -> None:
        decode(coll, ranks.procs[members[coll.rank]].layout, lost=lost, who=who, **kw)

    ranks.backend.spmd(members, program)


def decode_chunk(ranks: RanksHost, r: int, c: int, version: int) -> None:
    """Rank ``r``'s chunk ``c`` at ``version`` from its node's parity."""
    store = ranks.store(r)
    if store.parity is None:
        raise IntegrityError(f"rank {r} chunk {c}: its node's tier-1 parity is gone")
    vs, ck = list(store.parity_versions[c]), store.parity_checksums[c][ranks.member(r)]
    _run(
        ranks,
        r,
        rx.decode_chunk,
        c=c,
        version=version,
        versions=vs,
        checksum=ck,
        parity=store.parity[c],
    )


def decode_grads(ranks: RanksHost, r: int, step: int) -> None:
    """Rank ``r``'s gradients of ``step`` from its node's gradient parity."""
    store = ranks.store(r)
    if store.gparity is None:
        raise IntegrityError(f"rank {r}: its node's gradient parity is gone")
    vs, pend = list(store.gparity_versions), rx.load_pending(store.pending.get(r))
    _run(ranks, r, rx.decode_grads, step=step, versions=vs, parity=store.gparity, pending=pend)


def encode_all(ranks: RanksHost, step: int) -> None:
    """Every node's parity afresh over its members' chunks at ``step``, and an empty
    gradient parity (none of the node's gradients is retained yet)."""
    C = ranks.procs[0].layout.n_chunks
    for n in range(ranks.backend.nodes):
        store = ranks.backend.node_store(n)
        members = ranks.backend.ranks_of(n)
        if not ranks.options.tier1:
            store.parity = None
            store.gparity = None
            continue
        lays = [ranks.procs[q].layout for q in members]

        def program(coll: Any, lays: list[RetainedLayout] = lays) -> Any:
            return [encode(coll, lays[coll.rank].chunk_data(c), 0) for c in range(C)]

        out = ranks.backend.spmd(members, program)
        store.parity = out[0]
        store.parity_versions = [[step] * len(members) for _ in range(C)]
        store.parity_checksums = [[lay.stored_checksum(c) for lay in lays] for c in range(C)]
        store.gparity = torch.zeros(as_bytes(lays[0].grad_buffer).numel(), dtype=torch.uint8)
        store.gparity_versions = [NONE] * len(members)


def exact(ranks: RanksHost, n_chunks: int) -> list[str]:
    """Recompute every node's tier-1 parity from the members' bytes and compare."""
    out: list[str] = []
    if not ranks.options.tier1:
        return out
    for n in range(ranks.backend.nodes):
        store = ranks.backend.node_store(n)
        if store.parity is None:
            continue
        members = ranks.backend.ranks_of(n)
        for c in range(n_chunks):
            datas = []
            for j, q in enumerate(members):
                if ranks.backend.memory_lost(q) or ranks.procs[q].ropt is None:
                    break
                datas.append(rx.bytes_at(ranks.procs[q].layout, c, store.parity_versions[c][j]))
            else:
                if not torch.equal(encode_local(datas), store.parity[c]):
                    out.append(f"node {n} chunk {c}: parity bytes differ from the members' code")
    return out
