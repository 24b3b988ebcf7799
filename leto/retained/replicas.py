"""The recovery executor's tier 1 as replicas: lost chunks and gradients copied from
another member of the node.

The source of each chunk is the core's rule (:func:`leto.core.replica.replica_source`);
these functions carry it out on one rank's retained memory, SPMD over the node's group
(every member calls them with its own ``ex``; its local rank is ``ex.rank``): each member
offers what it can give (:func:`offers`), the offers are gathered, every member picks
the same sources, the source sends and the receiver seals the bytes and checks them
against the source's checksum of them and, where the node's tier-1 record holds the
receiver at the same version, against the record's (the same on every replica).

Gradients: every member of a data-parallel node reduces the same gradients, so a lost
gradient block is copied from the first member that holds it intact, then sealed with
the receiver's prepare record and checked against its checksums.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

import torch

from leto.core.chunk import NONE
from leto.core.replica import Offer, replica_source
from leto.retained.layout import ChunkStatus, RetainedLayout
from leto.retained.parity import Collective
from leto.retained.recovery import IntegrityError, bytes_at, seal_rebuilt_grads

__all__ = ["Exchange", "copy_chunks", "copy_grads", "copy_grads_behind", "grads_intact", "offers"]

# Each member's offer of a chunk travels as 4 ints: data version, its checksum, undo
# version, its checksum (a version NONE: not offered; its checksum 0).
_FIELDS = 4


class Exchange(Collective, Protocol):
    """A node's group with what replica copies need beyond parity's collectives."""

    def gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every member's ``values`` (int64), by local rank."""
        ...

    def send(self, tensor: torch.Tensor, dst: int) -> None: ...

    def recv(self, tensor: torch.Tensor, src: int) -> None: ...


def offers(lay: RetainedLayout, *, missing: Collection[int], wanted: Collection[int]) -> list[int]:
    """This member's offer of every chunk, flat (:data:`_FIELDS` ints per chunk).

    ``missing``: this member's own lost chunks (it offers nothing of them); ``wanted``:
    the chunks some member lost (only their bytes are checked, and only for them is an
    undo copy offered: nothing else needs reading).
    """
    out: list[int] = []
    for c in range(lay.n_chunks):
        st = lay.chunk_status(c)
        dv = lay.chunk_version(c) if st is not ChunkStatus.TORN else NONE
        uv = lay.undo.version(c) if st is not ChunkStatus.CLEAN else NONE
        if c in missing:
            dv = uv = NONE
        else:
            if c in wanted and dv != NONE and not lay.records.verify_chunk(c):
                dv = NONE  # its bytes fail their checksum: not a source
            if uv != NONE and (c not in wanted or not lay.undo.verify(c)):
                uv = NONE
        out += [
            dv,
            lay.stored_checksum(c) if dv != NONE else 0,
            uv,
            lay.undo.checksum(c) if uv != NONE else 0,
        ]
    return out


def copy_chunks(
    ex: Exchange,
    lay: RetainedLayout,
    chunks: Sequence[tuple[int, int, int]],
    *,
    target: int,
    record: Callable[[int], tuple[int, int]],
    who: Callable[[int], str],
) -> int:
    """Every ``(member, chunk, recorded version)`` of the plan, copied from a replica.

    ``record(c)``: the node's tier-1 record of this member for chunk ``c`` (version,
    checksum); ``who(member)``: how errors name a member. Returns the chunks this member
    received.
    """
    me = ex.rank
    missing = {(m, c) for m, c, _ in chunks}
    lost_any = {m for m, _, _ in chunks}
    table = ex.gather_ints(
        offers(lay, missing={c for m, c in missing if m == me}, wanted={c for _, c, _ in chunks})
    )
    got = 0
    for m, c, v in chunks:
        rows = [t[_FIELDS * c : _FIELDS * c + _FIELDS] for t in table]
        src = replica_source(
            [Offer(t[0], t[2]) for t in rows],
            missing={i for i in range(len(rows)) if (i, c) in missing},
            lost_any=lost_any,
            recorded=v,
            target=target,
        )
        if src is None:
            raise IntegrityError(
                f"{who(m)} chunk {c}: no member of its node holds it at step "
                f"{target - 1}, {v} or {target}"
            )
        if me == src.member:
            for part in bytes_at(lay, c, src.version):
                ex.send(part, dst=m)
        elif me == m:
            for part in lay.chunk_data(c):
                ex.recv(part, src=src.member)
            lay.seal_chunk(c, src.version)
            t = rows[src.member]
            want = {t[1] if t[0] == src.version else t[3]}
            rec_version, rec_sum = record(c)
            if rec_version == src.version:
                want.add(rec_sum)
            if want != {lay.stored_checksum(c)}:
                raise IntegrityError(
                    f"{who(m)} chunk {c}: the bytes copied from {who(src.member)} fail the "
                    f"checksum of step {src.version}"
                )
            got += 1
    return got


def grads_intact(lay: RetainedLayout, step: int) -> bool:
    return lay.prepared_step == step and not lay.grads.verify(step)


def _send_grads(
    ex: Exchange,
    lay: RetainedLayout,
    src: int,
    dst: int,
    step: int,
    pending: Callable[[int], Mapping[str, Any] | None],
    who: Callable[[int], str],
) -> None:
    if ex.rank == src:
        ex.send(lay.grad_buffer, dst=dst)
    elif ex.rank == dst:
        ex.recv(lay.grad_buffer, src=src)
        seal_rebuilt_grads(lay, step, pending(src), f"copied from {who(src)}", who(dst))


def copy_grads(
    ex: Exchange,
    lay: RetainedLayout,
    lost: int,
    step: int,
    *,
    pending: Callable[[int], Mapping[str, Any] | None],
    who: Callable[[int], str],
) -> bool:
    """Member ``lost``'s gradients of ``step`` from the first member that holds them
    intact; False if none does. ``pending(src)``: the prepare record the copy from
    member ``src`` is checked against (the receiver's own, unless it diverged: then
    the source's)."""
    have = ex.rank != lost and grads_intact(lay, step)
    holders = ex.gather_ints([int(have)])
    src = next((i for i, h in enumerate(holders) if h[0]), None)
    if src is None:
        return False
    _send_grads(ex, lay, src, lost, step, pending, who)
    return True


def copy_grads_behind(
    ex: Exchange,
    lay: RetainedLayout,
    target: int,
    *,
    lost_any: bool,
    pending: Callable[[int], Mapping[str, Any] | None],
    who: Callable[[int], str],
) -> None:
    """After the copies: a member that lost chunks (``lost_any``) and still has some
    behind the target (a copy of ``target - 1``) without its gradients of ``target`` gets
    them from a member that holds them (one that has not settled yet); if none does,
    its settle says what is missing."""
    intact = grads_intact(lay, target)
    behind = lost_any and any(
        lay.chunk_status(c) is not ChunkStatus.CLEAN or lay.chunk_version(c) != target
        for c in range(lay.n_chunks)
    )
    rows = ex.gather_ints([int(behind and not intact), int(intact)])
    src = next((i for i, row in enumerate(rows) if row[1]), None)
    if src is None:
        return
    for m, row in enumerate(rows):
        if row[0]:
            _send_grads(ex, lay, src, m, target, pending, who)
