"""One checkpoint/restart recovery's breakdown, read from a job's events.

Every phase is the gap between two instants of the critical path (the last rank
to get there), so the phases of a recovery add up to its total exactly:

=================  ========================================================================
detection          the agent sees the dead process exit (pidfd)
process_state      stop the survivors, start new processes: python, import torch, build
                   model and optimizer
communicator       ``init_process_group`` on gloo, DDP's broadcast
model_state        load the checkpoint (from disk, or from host memory)
lost_work          recompute the steps since the checkpoint, and the step in flight
=================  ========================================================================

``total`` runs from the failure (the dying process's last stamp) until every rank
has completed the step that was in flight. leto's recoveries are broken down into
the same phases by :func:`leto.bench.gloojob.leto_breakdown`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PHASES", "restart_breakdown"]

PHASES = ("detection", "process_state", "model_state", "communicator", "lost_work")


def _fail_event(events: list[dict[str, Any]], failure: dict[str, Any]) -> dict[str, Any]:
    for e in events:
        if e["ev"] == "fail" and e["rank"] == failure["rank"] and e["pid"] == failure["pid"]:
            return e
    raise ValueError(f"no failure report of rank {failure['rank']} (pid {failure['pid']})")


def _last(events: list[dict[str, Any]], ev: str, world: int, **match: Any) -> float:
    """The time the last rank reported ``ev`` (first report per rank, filtered)."""
    first: dict[int, float] = {}
    for e in events:
        if e["ev"] == ev and all(e.get(k) == v for k, v in match.items()):
            first.setdefault(e["rank"], e["t"])
    if len(first) < world:
        raise ValueError(f"only ranks {sorted(first)} reported {ev!r} {match or ''}")
    return max(first.values())


def restart_breakdown(
    events: list[dict[str, Any]], failure: dict[str, Any], world: int
) -> dict[str, Any]:
    """A checkpoint/restart recovery: the generation started after ``failure``."""
    fe = _fail_event(events, failure)
    f, gen = fe["step"], failure["new_gen"]
    new = [e for e in events if e["gen"] == gen]
    t_model = _last(new, "model", world)
    t_pg = _last(new, "pg", world)
    t_loaded = _last(new, "loaded", world)
    t_done = _last(new, "step", world, step=f)
    loaded = {e["step"] for e in new if e["ev"] == "loaded"}
    out: dict[str, Any] = {
        "detection": failure["t_detect"] - fe["t"],
        "process_state": t_model - failure["t_detect"],
        "communicator": t_pg - t_model,
        "model_state": t_loaded - t_pg,
        "lost_work": t_done - t_loaded,
        "total": t_done - fe["t"],
    }
    out["detail"] = {
        "failed_step": f,
        "resumed_from": min(loaded),
        "steps_recomputed": f - min(loaded),
        "stop_workers": failure["t_respawn"] - failure["t_detect"],
        "python_start": _last(new, "main", world) - failure["t_respawn"],
        "import_torch": _last(new, "torch", world) - _last(new, "main", world),
    }
    return out
