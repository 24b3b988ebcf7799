"""Planned faults for real processes: where a trainer SIGKILLs itself, hangs, raises.

A plan is a JSON list of objects (``leto launch --faults PLAN``, a file or inline
JSON)::

    [{"kind": "crash", "rank": 1, "step": 3, "phase": "backward"},
     {"kind": "crash", "rank": 2, "step": 5, "phase": "apply", "chunk": 1, "where": "mid_write"},
     {"kind": "hang", "rank": 0, "step": 7, "phase": "allreduce"},
     {"kind": "lose_memory", "rank": 3, "step": 9, "phase": "finish"},
     {"kind": "lose_node", "rank": 2, "step": 11, "phase": "prepare"},
     {"kind": "crash", "rank": 1, "step": 13, "phase": "recovery", "where": "Reconcile"}]

The phases are those of the fake backend's injector (``forward``, ``backward``,
``allreduce``, ``prepare``, ``decide``, ``apply``, ``parity``, ``finish``, and
``recovery`` with ``where`` naming the coordinator command being carried out).
What each kind does, *for real*, when rank ``rank`` reaches the point:

* ``crash``: the trainer sends itself SIGKILL (``apply``/``mid_write``: after
  writing half of the chunk's new bytes);
* ``hang``: the trainer sends itself SIGSTOP (a process that lives and makes no
  progress; found by the heartbeat timeout, then killed by the fence);
* ``exception``: the trainer raises ``RuntimeError`` (reported with its traceback);
* ``lose_memory``: the trainer SIGKILLs its keeper (the rank's retained memory is
  gone; the agent kills the trainer, the last holder of a mapping);
* ``lose_node``: the trainer SIGKILLs its node's agent (the node's keepers,
  trainers, shadows and host memory die with it);
* ``corrupt``: the trainer flips one bit of its retained chunk ``chunk`` (default
  0) and trains on, as after a memory error nothing reported: the next PREPARE's
  checksum pass (``verify_chunks``, on by default) stops the trainer
  (``IntegrityError``), and the recovery finds the chunk failing its checksum and
  rebuilds it from tier 1. Only between a chunk's tier-1 update and the next
  PREPARE (``forward``, ``backward``, ``allreduce``, ``parity``, ``finish``): a
  flip anywhere else would be sealed into the step or its parity, which no check
  of this design can see.

Each fault fires once per job, even across trainer incarnations and replacement
nodes: a trainer claims it with an atomic ``add`` on the job's TCPStore first. Before
it acts, the trainer appends the firing to ``RUN_DIR/faults.jsonl`` (the plan entry's
``id``, ``kind``, ``rank``, ``step``, ``phase``, ``chunk``, ``where``, the ``time``
on the event log's clock, its ``pid``): where a measurement of the recovery starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from leto.core import faultpoints as fp
from leto.core.faultpoints import FAULT_KINDS, PHASES

from . import messages as M

__all__ = ["CORRUPT_PHASES", "FAULT_KINDS", "PHASES", "FaultPlanError", "load_plan", "validate"]

# The fault points are leto's one vocabulary (leto.core.faultpoints). A trainer strikes
# the recovery's steps it carries out itself (Fence, Promote and EndPromote happen in
# the agents): before it reports its memory, and before each command of the coordinator.
RECOVERY_WHERE = ("Report", "Reconcile", "Rebuild", "Resume")
# the coordinator's command a trainer carries out -> the recovery point it is
COMMAND_POINT: dict[type[M.Message], str] = {
    M.CallReports: "Report",
    M.Reconcile: "Reconcile",
    M.Rebuild: "Rebuild",
    M.Resume: "Resume",
}
CORRUPT_PHASES = ("forward", "backward", "allreduce", "parity", "finish")


class FaultPlanError(ValueError):
    """A fault plan that cannot be carried out; the message names the entry and field."""


def validate(plan: Any, *, world_size: int | None = None) -> list[dict[str, Any]]:
    if not isinstance(plan, list):
        raise FaultPlanError(f"a fault plan is a JSON list, got {type(plan).__name__}")
    out = []
    for i, f in enumerate(plan):
        where = f"fault {i}"
        if not isinstance(f, dict):
            raise FaultPlanError(f"{where}: not an object")
        unknown = set(f) - {"kind", "rank", "step", "phase", "chunk", "where"}
        if unknown:
            raise FaultPlanError(f"{where}: unknown field(s) {sorted(unknown)}")
        kind = f.get("kind", "crash")
        if kind not in FAULT_KINDS:
            raise FaultPlanError(f"{where}: kind {kind!r} (known: {', '.join(FAULT_KINDS)})")
        rank, step, phase = f.get("rank"), f.get("step"), f.get("phase")
        if not isinstance(rank, int) or rank < 0 or (world_size is not None and rank >= world_size):
            raise FaultPlanError(f"{where}: rank {rank!r} is not a rank of the job")
        if not isinstance(step, int) or step < 1:
            raise FaultPlanError(f"{where}: step must be an int >= 1, got {step!r}")
        if phase not in PHASES:
            raise FaultPlanError(f"{where}: phase {phase!r} (known: {', '.join(PHASES)})")
        if kind == "corrupt" and phase not in CORRUPT_PHASES:
            raise FaultPlanError(
                f"{where}: a corrupt chunk at phase {phase!r} would be sealed unseen "
                f"(corrupt strikes at {', '.join(CORRUPT_PHASES)})"
            )
        chunk, at = f.get("chunk"), f.get("where")
        try:
            at = fp.check_point(
                phase, chunk, at, recovery=RECOVERY_WHERE, chunk_anywhere=kind == "corrupt"
            )
        except fp.FaultPointError as e:
            raise FaultPlanError(f"{where}: {e}") from None
        out.append(
            {
                "id": i,
                "kind": kind,
                "rank": rank,
                "step": step,
                "phase": phase,
                "chunk": chunk,
                "where": at,
            }
        )
    return out


def load_plan(text: str | None, *, world_size: int | None = None) -> list[dict[str, Any]]:
    """A plan from inline JSON or a file path (None or empty: no faults)."""
    if not text:
        return []
    raw = text.strip()
    if not raw.startswith("["):
        try:
            raw = Path(raw).read_text()
        except OSError as e:
            raise FaultPlanError(f"cannot read the fault plan {text!r}: {e.strerror}") from None
    try:
        plan = json.loads(raw)
    except json.JSONDecodeError as e:
        raise FaultPlanError(f"the fault plan is not valid JSON: {e}") from None
    return validate(plan, world_size=world_size)


def point(f: dict[str, Any]) -> str:
    """Where in a step a fault strikes: ``phase[chunk c]/where``."""
    at = str(f["phase"])
    if f.get("chunk") is not None:
        at += f"[chunk {f['chunk']}]"
    if f.get("where"):
        at += f"/{f['where']}"
    return at


def label(f: dict[str, Any]) -> str:
    return f"{f['kind']} rank {f['rank']} at step {f['step']} {point(f)}"
