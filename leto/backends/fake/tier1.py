"""Tier 1 on the simulated ranks: each node's parity over its members' chunks and
gradients, kept in the node agent's memory.

A rank that loses its memory is rebuilt from its node's parity and the other members'
bytes (:func:`leto.retained.recovery.decode_chunk` / ``decode_grads``, run as one
collective program on every member of the node). Which chunks are rebuilt, at which
version, is the core's reconcile plan; this module only carries it out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from leto.core.chunk import NONE
from leto.retained import recovery as rx
from leto.retained.layout import RetainedLayout
from leto.retained.parity import as_bytes, encode, encode_local
from leto.retained.recovery import IntegrityError

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["decode_chunk", "decode_grads", "encode_all", "exact"]


def _run(eng: Engine, r: int, decode: Callable[..., None], **kw: Any) -> None:
    """``decode`` (a decoder of :mod:`leto.retained.recovery`, given ``kw``) on every
    member of rank ``r``'s node at once, each on its own layout: ``r`` is rebuilt."""
    members = eng.backend.ranks_of(eng.backend.node_of(r))
    lost, who = members.index(r), f"rank {r}"

    def program(coll: Any) -> None:
        decode(coll, eng.procs[members[coll.rank]].layout, lost=lost, who=who, **kw)

    eng.backend.spmd(members, program)


def decode_chunk(eng: Engine, r: int, c: int, version: int) -> None:
    """Rank ``r``'s chunk ``c`` at ``version`` from its node's parity."""
    store = eng._store(r)
    if store.parity is None:
        raise IntegrityError(f"rank {r} chunk {c}: its node's tier-1 parity is gone")
    vs, ck = list(store.parity_versions[c]), store.parity_checksums[c][eng._member(r)]
    _run(
        eng,
        r,
        rx.decode_chunk,
        c=c,
        version=version,
        versions=vs,
        checksum=ck,
        parity=store.parity[c],
    )


def decode_grads(eng: Engine, r: int, step: int) -> None:
    """Rank ``r``'s gradients of ``step`` from its node's gradient parity."""
    store = eng._store(r)
    if store.gparity is None:
        raise IntegrityError(f"rank {r}: its node's gradient parity is gone")
    vs, pend = list(store.gparity_versions), rx.load_pending(store.pending.get(r))
    _run(eng, r, rx.decode_grads, step=step, versions=vs, parity=store.gparity, pending=pend)


def encode_all(eng: Engine, step: int) -> None:
    """Every node's parity afresh over its members' chunks at ``step``, and an empty
    gradient parity (none of the node's gradients is retained yet)."""
    C = eng.procs[0].layout.n_chunks
    for n in range(eng.backend.nodes):
        store = eng.backend.node_store(n)
        members = eng.backend.ranks_of(n)
        if not eng.options.tier1:
            store.parity = None
            store.gparity = None
            continue
        lays = [eng.procs[q].layout for q in members]

        def program(coll: Any, lays: list[RetainedLayout] = lays) -> Any:
            return [encode(coll, lays[coll.rank].chunk_data(c), 0) for c in range(C)]

        out = eng.backend.spmd(members, program)
        store.parity = out[0]
        store.parity_versions = [[step] * len(members) for _ in range(C)]
        store.parity_checksums = [[lay.stored_checksum(c) for lay in lays] for c in range(C)]
        store.gparity = torch.zeros(as_bytes(lays[0].grad_buffer).numel(), dtype=torch.uint8)
        store.gparity_versions = [NONE] * len(members)


def exact(eng: Engine) -> list[str]:
    """Recompute every node's tier-1 parity from the members' bytes and compare."""
    out: list[str] = []
    if not eng.options.tier1:
        return out
    for n in range(eng.backend.nodes):
        store = eng.backend.node_store(n)
        if store.parity is None:
            continue
        members = eng.backend.ranks_of(n)
        for c in range(eng.n_chunks):
            datas = []
            for j, q in enumerate(members):
                if eng.backend.memory_lost(q) or eng.procs[q].ropt is None:
                    break
                datas.append(rx.bytes_at(eng.procs[q].layout, c, store.parity_versions[c][j]))
            else:
                if not torch.equal(encode_local(datas), store.parity[c]):
                    out.append(f"node {n} chunk {c}: parity bytes differ from the members' code")
    return out
