"""torchft as a system of ``leto bench recovery``: its job, and its recoveries broken down.

The job runs as torchft runs one: a ``LighthouseServer`` (started here, with the
settings of torchft's README: ``min_replicas`` 1, ``quorum_tick_ms`` 100,
``join_timeout_ms`` 10000, its default 5 s heartbeat timeout), and one replica
group per rank (:mod:`leto.bench.ftworker`, why one rank per group), each group
with its own ``TCPStore`` hosted here, under the benchmark's agent
(:class:`leto.bench.agent.Job`), which restarts a dead group's process and leaves
the other groups alone. They train on without it: the failed step's all-reduce
fails and is not committed, the lighthouse forms a quorum of the survivors once
the dead group's heartbeat has timed out, and the restarted group joins a later
quorum and heals from a live peer's state.

A recovery's phases, on the restarted group's critical path
(:func:`torchft_breakdown`; the same names as :mod:`leto.bench.timeline`):

=================  ========================================================================
detection          the agent sees the dead process exit (pidfd)
process_state      start the group's new process: python, import torch, model, optimizer
communicator       the quorum: torchft's manager up, the lighthouse's quorum with the new
                   group in it, the gloo process group configured across the groups
model_state        heal: the state of a live peer received over that group and applied
lost_work          the healing step's commit (its own gradients were zeros: nothing is
                   computed again; the survivors dropped the failed step meanwhile)
=================  ========================================================================

``total`` runs from the failure until the restarted group has committed a step.
Meanwhile the survivors keep training: ``detail["survivors"]`` has the steps they
committed during the recovery and their throughput against the steady one before it.
"""

from __future__ import annotations

import importlib.metadata
import os
import statistics
from typing import Any

from .agent import Job
from .interval import failure_schedule, without_checkpoints
from .workload import BenchError, Workload

__all__ = ["missing", "measure_torchft", "torchft_breakdown", "version"]

LIGHTHOUSE = {"min_replicas": 1, "quorum_tick_ms": 100, "join_timeout_ms": 10000}
_TIMEOUT_S = 300.0
_STEADY_STEPS = 10


def missing() -> str | None:
    """Why torchft cannot run here (None: it can).

    Its native module sets up its log on import, from ``RUST_LOG`` (default: info,
    a line per quorum request): the benchmark's own process imports it with
    warnings only, unless the user set ``RUST_LOG``.
    """
    had = "RUST_LOG" in os.environ
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft  # noqa: F401
    except Exception as e:  # an ImportError, or a broken native extension
        first = (str(e).splitlines() or [""])[0]
        return (
            f"torchft is not importable ({type(e).__name__}: {first}); pip install torchft==0.2.0"
        )
    finally:
        if not had:
            del os.environ["RUST_LOG"]
    return None


def version() -> str:
    return importlib.metadata.version("torchft")


def _first(events: list[dict[str, Any]], ev: str) -> dict[str, Any]:
    for e in events:
        if e["ev"] == ev:
            return e
    raise ValueError(f"the restarted group never reported {ev!r}")


def _step_times(events: list[dict[str, Any]], ranks: set[int]) -> dict[int, tuple[float, int]]:
    """Each step committed by one of ``ranks``: the first report's time, its participants."""
    out: dict[int, tuple[float, int]] = {}
    for e in events:
        if e["ev"] == "step" and e["rank"] in ranks and e["step"] not in out:
            out[e["step"]] = (e["t"], e["participants"])
    return out


def torchft_breakdown(
    events: list[dict[str, Any]], failure: dict[str, Any], world: int, batch: int
) -> dict[str, Any]:
    """One torchft recovery (see the module docstring): the restarted group's phases,
    and what the other groups trained meanwhile."""
    rank = failure["rank"]
    fe = next(
        (e for e in events if e["ev"] == "fail" and e["pid"] == failure["pid"]),
        None,
    )
    if fe is None:
        raise ValueError(f"no failure report of rank {rank} (pid {failure['pid']})")
    new = [e for e in events if e["gen"] == failure["new_gen"] and e["rank"] == rank]
    t_fail, t_detect = fe["t"], failure["t_detect"]
    t_model = _first(new, "model")["t"]
    t_pg = _first(new, "pg")["t"]
    t_heal = _first(new, "heal_start")["t"]
    t_recv = _first(new, "heal_recv")["t"]
    loaded = _first(new, "loaded")
    back = _first(new, "step")
    t_done = back["t"]
    out: dict[str, Any] = {
        "detection": t_detect - t_fail,
        "process_state": t_model - t_detect,
        "communicator": t_heal - t_model,
        "model_state": loaded["t"] - t_heal,
        "lost_work": t_done - loaded["t"],
        "total": t_done - t_fail,
    }
    others = set(range(world)) - {rank}
    steps = _step_times(events, others)
    during = sorted(s for s, (t, _) in steps.items() if t_fail < t <= t_done)
    before = sorted(s for s, (t, _) in steps.items() if t <= t_fail)[-_STEADY_STEPS:]
    steady_s = steps[before[-1]][0] - steps[before[0]][0] if len(before) > 1 else 0.0
    steady = (len(before) - 1) / steady_s if steady_s > 0 else float("nan")
    rate = len(during) / out["total"]
    rows = sum(steps[s][1] for s in during) * batch / out["total"]
    resumed = [steps[s][0] for s in during]
    out["detail"] = {
        "failed_step": fe["step"],
        "healed_to": loaded["step"],
        "rejoined_at": back["step"],
        "python_start": _first(new, "main")["t"] - failure["t_respawn"],
        "import_torch": _first(new, "torch")["t"] - _first(new, "main")["t"],
        "manager_up": t_pg - t_model,
        "quorum_wait": t_heal - t_pg,
        "transfer": t_recv - t_heal,
        "apply": loaded["t"] - t_recv,
        "survivors": {
            "steps": len(during),
            "first_commit_after": (resumed[0] - t_fail) if resumed else None,
            "steps_per_s": rate,
            "rows_per_s": rows,
            "steady_steps_per_s": steady,
            "steady_rows_per_s": steady * world * batch,
            "fraction_of_steady": rate / steady if steady == steady and steady > 0 else None,
        },
    }
    return out


def _full_steps(job: Job) -> int:
    """The fewest steps any current group has committed with every group in the quorum
    (a group that comes up first trains alone: ``min_replicas`` is 1)."""
    return min(
        sum(
            1
            for e in job.events
            if e["ev"] == "step" and e["pid"] == p.pid and e["participants"] == job.wl.world
        )
        for p in job.trainers.values()
    )


def _steady_step_s(events: list[dict[str, Any]], world: int) -> float:
    """The median time between consecutive steps committed by every group."""
    steps = _step_times(events, set(range(world)))
    ts = [t for s, (t, n) in sorted(steps.items()) if n == world]
    gaps = [b - a for a, b in zip(ts, ts[1:], strict=False)]
    if not gaps:
        raise BenchError("torchft: no steps to time in its calibration")
    return float(statistics.median(gaps))


class _Lighthouse:
    """torchft's lighthouse and one ``TCPStore`` per replica group, for one job."""

    def __init__(self, world: int) -> None:
        import torch.distributed as dist
        from torchft.coordination import LighthouseServer

        self.server = LighthouseServer(bind="[::]:0", **LIGHTHOUSE)
        self.stores = [
            dist.TCPStore(  # type: ignore[attr-defined] # (torch's stubs: c10d)
                "127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True
            )
            for _ in range(world)
        ]

    def spec(self) -> dict[str, Any]:
        return {"lighthouse": self.server.address(), "group_stores": [s.port for s in self.stores]}

    def close(self) -> None:
        self.server.shutdown()
        self.stores.clear()


def _job(wl: Workload, schedule: list[dict[str, Any]], lh: _Lighthouse) -> Job:
    return Job(
        "torchft",
        wl,
        plan_for=lambda gen: {"schedule": schedule},
        max_failures=len(schedule) + 1,
        extra_spec=lh.spec(),
    )


def measure_torchft(
    wl: Workload,
    *,
    repeats: int,
    schedule: list[dict[str, Any]] | None,
    gap_s: float,
    cal_steps: int,
    progress: Any = None,
    fail_at: str = "forward",
) -> dict[str, Any]:
    """torchft through the same failures (or its own schedule, from its step time,
    when no system before it set one); failure ``j + 1`` is armed once recovery ``j``
    is over (:mod:`leto.bench.ftworker`)."""
    reason = missing()
    if reason is not None:
        raise BenchError(reason)
    if schedule is None:
        lh = _Lighthouse(wl.world)
        try:
            with _job(wl, [], lh) as cal:
                cal.start()
                cal.pump(lambda: _full_steps(cal) >= cal_steps + 5, _TIMEOUT_S, "calibration")
                step_s = _steady_step_s(cal.events, wl.world)
        finally:
            lh.close()
        schedule = failure_schedule(
            repeats, 1, step_s=step_s, world=wl.world, after_step=cal_steps, gap_s=gap_s, at=fail_at
        )
    lh = _Lighthouse(wl.world)
    runs: list[dict[str, Any]] = []
    try:
        with _job(wl, schedule, lh) as job:
            job.start()
            job.pump(lambda: _full_steps(job) >= 2, _TIMEOUT_S, "every group in the quorum")
            job.store.set("armed/0", "1")
            for j in range(len(schedule)):

                def back(j: int = j) -> bool:
                    if len(job.failures) <= j:
                        return False
                    p = job.trainers[job.failures[j]["rank"]]
                    return p.gen == job.failures[j]["new_gen"] and "step" in p.seen

                job.pump(back, _TIMEOUT_S, f"recovery {j + 1}")
                try:
                    run = torchft_breakdown(job.events, job.failures[j], wl.world, wl.batch)
                except ValueError as e:
                    raise BenchError(f"torchft: recovery {j + 1}: {e}") from None
                # the other groups trained on, so the death may come at a later step
                run["detail"]["scheduled_step"] = schedule[j]["step"]
                runs.append(run)
                job.store.set(f"armed/{j + 1}", "1")
                if progress is not None:
                    progress.advance(f"torchft recovery {j + 1}")
            step_s = _steady_step_s(job.events, wl.world)
    finally:
        lh.close()
    surv = [r["detail"]["survivors"] for r in runs]
    frac = [s["fraction_of_steady"] for s in surv if s["fraction_of_steady"] is not None]
    backend = f"torchft {version()}, gloo, {wl.world} replica groups x 1 rank"
    return {
        **without_checkpoints(step_s, runs, schedule, backend),
        "version": version(),
        "lighthouse": LIGHTHOUSE,
        "survivor_throughput": {
            "steps_per_s": statistics.median(s["steps_per_s"] for s in surv),
            "rows_per_s": statistics.median(s["rows_per_s"] for s in surv),
            "fraction_of_steady": statistics.median(frac) if frac else None,
        },
    }
