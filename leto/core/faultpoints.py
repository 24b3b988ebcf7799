"""One vocabulary of fault points for every backend and every test.

A fault strikes a rank at a *phase* of a step (and, for some phases, at a point
*where* inside it), or during a recovery before the rank carries out one of the
recovery's steps, named as the core's events are. The fake backend, the gloo fault
plans, the demos and ``leto.testing`` all use these names; each backend says which of
them it can strike (:func:`check_point` with its own ``recovery`` points and kinds).
"""

from __future__ import annotations

__all__ = [
    "APPLY_WHERE",
    "DECIDE_WHERE",
    "DEFAULT_WHERE",
    "FAULT_KINDS",
    "PHASES",
    "RECOVERY_WHERE",
    "FaultPointError",
    "check_point",
]

PHASES = (
    "forward",  # during the forward pass (before backward)
    "backward",  # after backward, before the gradients enter the all-reduce
    "allreduce",  # inside the gradient all-reduce (this rank's part sent, the sum not in)
    "prepare",  # gradients sealed in retained memory, gradient parity and vote not written
    "decide",  # where="before": voted, COMMIT not recorded; "after": recorded, no chunk applied
    "apply",  # chunk ``chunk``: where = "undo_saved" | "mid_write" | "written"
    "parity",  # chunk ``chunk``: tier-1 parity updated, undo copy not yet released
    "finish",  # every chunk applied, the step not yet finished on this rank
    "tail",  # the user's loop after optimizer.step(): the step not yet closed at the next batch
    "recovery",  # during a recovery, before the rank carries out the step named by ``where``
)
APPLY_WHERE = ("undo_saved", "mid_write", "written")
DECIDE_WHERE = ("before", "after")
# the recovery's steps, by the core event a rank carries out ("Report": a rank reports
# its retained memory, the input of Reconcile)
RECOVERY_WHERE = ("Fence", "Promote", "EndPromote", "Report", "Reconcile", "Rebuild", "Resume")
FAULT_KINDS = ("crash", "hang", "exception", "lose_memory", "lose_node", "corrupt")
DEFAULT_WHERE = {"apply": "mid_write", "decide": "before", "recovery": "Reconcile"}


class FaultPointError(ValueError):
    """A fault point that is not one of the vocabulary (or not one a backend strikes)."""


def check_point(
    phase: object,
    chunk: object,
    where: object,
    *,
    n_chunks: int | None = None,
    recovery: tuple[str, ...] = RECOVERY_WHERE,
    chunk_anywhere: bool = False,
) -> str | None:
    """Validate a point; return its ``where`` (the phase's default when None).

    ``recovery``: the recovery points this backend strikes; ``chunk_anywhere``: a
    chunk is allowed at every phase (a corruption names the chunk it flips).
    """
    if phase not in PHASES:
        raise FaultPointError(f"phase: {phase!r} is not a phase (known: {', '.join(PHASES)})")
    if phase in ("apply", "parity"):
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
            raise FaultPointError(f"chunk: phase {phase!r} needs a chunk index, got {chunk!r}")
    elif chunk is not None and not chunk_anywhere:
        raise FaultPointError(f"chunk: phase {phase!r} takes no chunk")
    elif chunk is not None and (not isinstance(chunk, int) or chunk < 0):
        raise FaultPointError(f"chunk: {chunk!r} is not a chunk index")
    if isinstance(chunk, int) and n_chunks is not None and not 0 <= chunk < n_chunks:
        raise FaultPointError(f"chunk: {chunk} is not a chunk of 0..{n_chunks - 1}")
    allowed = {"apply": APPLY_WHERE, "decide": DECIDE_WHERE, "recovery": recovery}
    if phase not in allowed:
        if where is not None:
            raise FaultPointError(f"where: phase {phase!r} has no sub-points")
        return None
    at = DEFAULT_WHERE[str(phase)] if where is None else where
    if at not in allowed[str(phase)]:
        raise FaultPointError(
            f"where: {at!r} is not a point of {phase!r} here (known: {', '.join(allowed[str(phase)])})"
        )
    return str(at)
