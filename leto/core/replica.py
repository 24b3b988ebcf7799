"""Tier 1 as replicas: which member of a node a lost chunk is copied from, at which step.

Where a node's data-parallel ranks hold the same state (gloo's default, ``tier1_code =
"replica"``), tier 1 keeps no parity bytes: a lost chunk is copied from another member
of the node. The plan (:mod:`leto.core.reconcile`) names the chunk and the version the
node's tier-1 record holds for it (``Repair("tier1", rank, chunk, v)``); this module
picks the source, the same way on every member and in every backend, from what each
member offers (:class:`Offer`: the versions its bytes and its undo copy hold, each
``NONE`` when it cannot give them: lost, failing its checksum, or not asked for).

The rule (``spec/PROTOCOL.md``, "Tier 1 as replicas"), first match wins, members in
node order:

1. ``target`` from the bytes (not the undo copy) of a member that lost no chunk: it has
   settled at the target before the copies, so the copy needs no roll forward;
2. ``v``, the recorded version, from a member that can produce it (bytes or undo copy),
   as the parity would have decoded it;
3. ``target`` from any member that can produce it;
4. ``target - 1`` from any member that can produce it (the receiver then rolls it
   forward with its gradients of ``target``).

None when no member can give any of them: the recovery stops with an error naming
the chunk. Members that lost the chunk themselves are never sources.

Pure: no torch, no IO.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import attrs

from leto.core.chunk import NONE

__all__ = ["Offer", "Source", "replica_source"]


@attrs.frozen
class Offer:
    """What one member can give of one chunk: the version of its bytes and of its undo
    copy (``NONE``: it cannot give that one)."""

    data: int
    undo: int

    def versions(self) -> tuple[int, ...]:
        return tuple(v for v in (self.data, self.undo) if v != NONE and v >= 0)


@attrs.frozen
class Source:
    """Copy the chunk from local member ``member``'s bytes at ``version``."""

    member: int
    version: int


def replica_source(
    offers: Sequence[Offer],
    *,
    missing: Collection[int],
    lost_any: Collection[int],
    recorded: int,
    target: int,
) -> Source | None:
    """The source of one lost chunk (the module's rule).

    ``offers``: every member's offer of this chunk, by local rank; ``missing``: the
    members that lost this chunk (never a source); ``lost_any``: the members that lost
    any chunk (not settled at the target before the copies); ``recorded``: the version
    the tier-1 record holds for the receiver; ``target``: the plan's target.
    """
    if target < 0:
        raise ValueError(f"replica_source: target must be a step >= 0, got {target}")
    prefs = ((True, target), (False, recorded), (False, target), (False, target - 1))
    for whole_only, version in prefs:
        if version < 0:
            continue
        for m, offer in enumerate(offers):
            if m in missing:
                continue
            if whole_only:
                if m not in lost_any and offer.data == version:
                    return Source(m, version)
            elif version in offer.versions():
                return Source(m, version)
    return None
