"""How many nodes an elastic job starts with (``leto launch --nnodes MIN:MAX``).

torchrun's elastic form: the job starts once ``MAX`` nodes have joined, or once at
least ``MIN`` have and the rendezvous timeout has passed (fewer than ``MIN`` then: the
job cannot start). The world it starts with changes only as :mod:`leto.core.world`
decides (a shrink when a lost node has no replacement within the spare timeout, a
grow-back when a spare joins a world below ``MAX``); agents that join a world at ``MAX``
wait in the spare pool. Pure: no IO, no clock (whether the
timeout passed comes in as an argument).
"""

from __future__ import annotations

__all__ = ["world_at_close"]


def world_at_close(lo: int, hi: int, joined: int, timed_out: bool) -> int | None:
    """The number of nodes the job starts with, node 0 and ``joined - 1`` others having
    joined, for ``--nnodes lo:hi``; None: the rendezvous stays open (a timed-out one
    with fewer than ``lo`` nodes cannot start: the caller says so)."""
    if not 1 <= lo <= hi or joined < 1:
        raise ValueError(f"nodes {lo}:{hi} with {joined} joined: need 1 <= lo <= hi, joined >= 1")
    if joined >= hi:
        return hi
    if timed_out and joined >= lo:
        return joined
    return None
