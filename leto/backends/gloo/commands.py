"""How gloo carries out the core's effects: one entry per effect class.

``COMMANDS`` maps every effect of :mod:`leto.core.effects` to how the gloo job carries
it out: a :class:`Send` builds the coordinator's command (a message of :mod:`.messages`)
from the effect, the states before and after the events that returned it, and the few
things the coordinator keeps that the model does not (:class:`Narrow`); a
:class:`Done` names who does it instead and why the coordinator sends nothing (the
trainers did it before the model heard of it, the world did it to them, another
effect's command carries it). ``tests/gloo`` checks that every effect has exactly one
entry, as ``tests/fake`` does for the fake engine's ``EXECUTORS``.

The coordinator decides only *when* (after COMMIT or the fence is durable, once a wait
is over); *what* it sends comes from here (:func:`commands`). Each command sent is
logged as a ``command`` record, which ``leto spec trace`` checks against the effects of
the events fed just before it (:mod:`leto.spec.trace`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from leto.core import effects as fx
from leto.core.cluster import Effect
from leto.core.recovery import Kind

from . import messages as M
from .model_feed import Fed

__all__ = ["COMMANDS", "Done", "Narrow", "Send", "commands", "logged"]

Out = tuple[int | None, M.Message]  # (node, or None for every node; the message)


@attrs.frozen
class Narrow:
    """What of the coordinator a command needs beyond the model's states."""

    node_of: Callable[[int], int]
    t2_step: int  # the tier-2 snapshot that is current
    t2_meta: dict[int, Any]  # each rank's checksums and process state of it
    diverged: tuple[int, ...]  # ranks discarded for a replica check this recovery


@attrs.frozen
class Send:
    """The coordinator sends what ``build`` makes of the effect."""

    build: Callable[[Any, Fed, Narrow], Out]


@attrs.frozen
class Done:
    """No command: ``by`` does it, for the reason ``why``."""

    by: str
    why: str


def _commit(e: fx.RecordCommit, fed: Fed, n: Narrow) -> Out:
    return None, M.Commit(step=e.step, gen=fed.after.gen)


def _abort(e: fx.Detected, fed: Fed, n: Narrow) -> Out:
    return None, M.Abort(gen=fed.after.gen)


def _fence(e: fx.Fence, fed: Fed, n: Narrow) -> Out:
    # the hung trainers the fence made stale processes: the agents kill them
    b, a = fed.before, fed.after
    kill = [r for r in range(len(a.trainer)) if b.trainer[r] is not a.trainer[r]]
    return None, M.Fence(gen=e.generation, kill=kill)


def _promote(e: fx.Promote, fed: Fed, n: Narrow) -> Out:
    return n.node_of(e.rank), M.PromoteRank(rank=e.rank, gen=e.generation, warm=e.warm)


def _reconcile(
    kind: Kind, target: int, repairs: list[dict[str, Any]], retake: bool, fed: Fed, n: Narrow
) -> Out:
    snapshot = None
    if kind is Kind.TIER2:
        snapshot = {"step": n.t2_step, "meta": {str(r): m for r, m in n.t2_meta.items()}}
    return None, M.Reconcile(
        gen=fed.after.gen,
        kind=kind.value,
        target=target,
        repairs=repairs,
        retake_t2=retake,
        snapshot=snapshot,
        diverged=sorted(n.diverged),
    )


def _reconciled(e: fx.Reconciled, fed: Fed, n: Narrow) -> Out:
    # runs of chunks (count), expanded by each node (leto.core.reconcile.Repair.expand)
    repairs = [x.repair().wire() for x in fed.effects if isinstance(x, fx.RunRepair)]
    # the tier-2 snapshot is retaken only if it lost blocks (the model's rule)
    retake = bool(fed.before.t2lost)
    return _reconcile(Kind(e.kind), e.target, repairs, retake, fed, n)


def _load_checkpoint(e: fx.LoadCheckpoint, fed: Fed, n: Narrow) -> Out:
    return _reconcile(Kind.CKPT, e.step, [], True, fed, n)


def _rebuild(e: fx.RebuildCommunicator, fed: Fed, n: Narrow) -> Out:
    return None, M.Rebuild(gen=e.generation)


def _resume(e: fx.Resume, fed: Fed, n: Narrow) -> Out:
    return None, M.Resume(gen=e.generation, step=e.step, t2=n.t2_step)


def _tier2(e: fx.TakeSnapshot, fed: Fed, n: Narrow) -> Out:
    return None, M.Tier2(step=e.step, gen=fed.after.gen)


_STEP = "the trainers did it before they reported it: the model is fed what they did"
_WORLD = "a fault of the world: the agents observe it and report it, the model is fed it"
_CKPT = "each trainer writes its part of the checkpoint on its own schedule"
_SHADOW = "each node's agent keeps its shadows and reports their state"

COMMANDS: dict[type[Effect], Send | Done] = {
    fx.ForwardBackward: Done("trainers", _STEP),
    fx.AllReduceGradients: Done("trainers", _STEP),
    fx.WriteGradientParity: Done("trainers", _STEP),
    fx.Vote: Done("trainers", _STEP),
    fx.RecordCommit: Send(_commit),
    fx.SaveUndo: Done("trainers", _STEP),
    fx.ApplyChunk: Done("trainers", _STEP),
    fx.ChunkWritten: Done("trainers", _STEP),
    fx.UpdateParity: Done("trainers", _STEP),
    fx.ReleaseUndo: Done("trainers", _STEP),
    fx.StepDone: Done("trainers", _STEP),
    fx.KeepProcessState: Done("agents", "each agent keeps its ranks' closed state itself"),
    fx.TakeSnapshot: Send(_tier2),
    fx.SaveCheckpoint: Done("trainers", _CKPT),
    fx.PublishCheckpoint: Done("trainers", _CKPT + "; the newest complete one is the fallback"),
    fx.AbortCheckpoint: Done("trainers", "the fence's generation stops the checkpoint's writers"),
    fx.WarmShadow: Done("agents", _SHADOW),
    fx.ReclaimShadow: Done("agents", _SHADOW),
    fx.SpawnShadow: Done("agents", "the agent of a promoted rank starts its next shadow"),
    fx.Crash: Done("world", _WORLD),
    fx.Hang: Done("world", _WORLD),
    fx.LoseMemory: Done("world", _WORLD),
    fx.LoseNode: Done("world", _WORLD),
    fx.StaleWriteAccepted: Done("keepers", "only a mutant's: gloo's keepers refuse it"),
    fx.RefuseStaleWrite: Done("keepers", "the keeper's fence refuses an old generation"),
    fx.KillStale: Done("agents", "killed by the fence (its kill list), fed once acknowledged"),
    fx.Detected: Send(_abort),
    fx.Fence: Send(_fence),
    fx.AbortCollectives: Done("agents", "the abort and the fence end the old communicator"),
    fx.Promote: Send(_promote),
    fx.RunRepair: Done("coordinator", "sent in the Reconcile command of its Reconciled"),
    fx.Reconciled: Send(_reconciled),
    fx.Fallback: Done("coordinator", "RestoreCheckpoint follows: its LoadCheckpoint is sent"),
    fx.LoadCheckpoint: Send(_load_checkpoint),
    fx.RebuildCommunicator: Send(_rebuild),
    fx.Resume: Send(_resume),
    fx.JobFailed: Done("coordinator", "Coordinator.fail stops the job, naming the wait"),
}


def commands(fed: Fed, narrow: Narrow) -> list[Out]:
    """The commands that carry out ``fed``'s effects, in their order."""
    out = []
    for e in fed.effects:
        how = COMMANDS[type(e)]
        if isinstance(how, Send):
            out.append(how.build(e, fed, narrow))
    return out


def logged(node: int | None, msg: M.Message) -> dict[str, Any]:
    """A command as its ``command`` record holds it (:mod:`leto.spec.trace`): the message
    on the wire, less the tier-2 snapshot's metadata (O(ranks x chunks))."""
    wire = msg.to_wire()
    wire.pop("snapshot", None)
    return {"to": node, "message": wire}
