"""The digest every data-parallel replica holds alike after a step
(:mod:`leto.core.agreement` compares them): its chunks' checksums (recorded when each
chunk was sealed, so no byte of state is read again), the optimizer's scalars and
hyper-parameters, and the LR scheduler's state."""

from __future__ import annotations

import json
from typing import Any

import xxhash

from .layout import RetainedLayout

__all__ = ["replica_digest"]


def replica_digest(lay: RetainedLayout, optimizer_state: Any, scheduler_state: Any) -> str:
    """One hex digest of ``lay``'s stored checksums, the optimizer's process state and
    the scheduler's (JSON, keys sorted: equal states give equal digests anywhere)."""
    h = xxhash.xxh3_128()
    h.update(b",".join(str(x).encode() for x in lay.records.stored_checksum_list()))
    h.update(json.dumps(optimizer_state, sort_keys=True).encode())
    h.update(json.dumps(scheduler_state, sort_keys=True).encode())
    return str(h.hexdigest())
