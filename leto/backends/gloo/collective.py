"""What the training step and a recovery share on gloo: collectives whose failure is a
recovery, not a crash, and the retained buffers by name (the checkpoint's keys)."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from leto.retained.layout import ChecksumError, LayoutError
from leto.retained.recovery import IntegrityError

from .channel import Aborted

__all__ = [
    "ALL_GATHER",
    "CHECK_KEPT_PARITY",
    "CollectiveFailed",
    "REDUCE_SCATTER",
    "coll",
    "comm_error",
    "wait_or_abort",
]

# sharded state's collectives: torch 2.13 names them *_single (the *_tensor names warn)
REDUCE_SCATTER: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Interrupted(Exception):
    """The step was interrupted by a recovery (abort or a failed collective)."""


class CollectiveFailed(Exception):
    """A collective did not complete (a peer died or the group was torn down)."""


# test aid: verify a kept (not re-encoded) tier-1 parity byte for byte after a recovery
CHECK_KEPT_PARITY = os.environ.get("LETO_CHECK_KEPT_PARITY") == "1"


def coll(fn: Any, *args: Any, **kw: Any) -> Any:
    """Run a collective; its failure becomes :class:`CollectiveFailed`."""
    try:
        return fn(*args, **kw)
    except (IntegrityError, ChecksumError, LayoutError):
        raise
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError / DistError
        raise CollectiveFailed(
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e


ABORT_LOOK = timedelta(milliseconds=20)  # how often a waiting reduce looks for the abort


def wait_or_abort(work: Any, aborted: Callable[[], bool], what: str) -> None:
    """Wait for the async collective ``work``; if the recovery aborts this generation
    meanwhile (``aborted()``), leave it: :class:`~.channel.Aborted`.

    A peer that took the abort before it joined the collective goes to the recovery
    and never comes: gloo then waits for its buffer until the collective timeout (a
    peer's closed connection does not end a wait already posted), and the recovery
    waits for this rank as long. The abandoned collective still writes its buffers
    until it fails: the caller drops them (the next step allocates its own). The wait
    blocks as gloo's does, in slices of :data:`ABORT_LOOK` (a slice that ends first
    raises "timed out" and leaves the work running, which is waited for again)."""
    while True:
        try:
            work.wait(timeout=ABORT_LOOK)
            return
        except RuntimeError:
            if work.is_completed():
                coll(work.wait)  # it failed: its error, as a collective's
                return
        if aborted():
            raise Aborted(f"the recovery's abort came while {what}")


def comm_error(e: BaseException) -> bool:
    if isinstance(e, (CollectiveFailed, Aborted)):
        return True
    if isinstance(e, (IntegrityError, ChecksumError, LayoutError)):
        return False
    dist_error = getattr(dist, "DistError", ())
    if dist_error and isinstance(e, dist_error):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        k in text
        for k in ("gloo", "Gloo", "Connection closed", "Connection reset", "timed out", "Timed out")
    )
