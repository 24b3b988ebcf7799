"""How often the checkpointing baselines checkpoint, and when the failures strike.

Checkpoint interval: Daly's optimum (Young's first-order ``sqrt(2 C M)``, refined;
:mod:`leto.sim.theory`) of the compute time between checkpoints, for the save cost
``C`` measured in the job (the time training is blocked) and the MTBF ``M`` given
on the command line. An asynchronous save blocks only while it stages the state;
its background write must end before the next one starts, so its interval is at
least the write time. In steps: rounded, at least one.

Failure schedule (``leto bench recovery``): ``n`` failures, each at a step a
fraction ``(j + 1/2)/n`` of the way into a checkpoint interval of the synchronous
disk baseline, so the steps lost to it are spread evenly over the interval (their
median is half of it, the expected loss under failures uniform in time). Every
system gets the same steps and the same failing ranks (rotating, so a rank's
shadow has time to warm again), spaced at least ``gap_s`` of training apart.

Where in its step a rank dies (``at``, the same for every system): ``forward`` (the
default), after its forward pass, before its backward, so the step was never voted on
and every system computes it again; or ``update``, after the step's gradients are
reduced and, for leto, after the step was voted on and committed (the rank has the
COMMIT and has applied nothing), which leto rolls forward, while a baseline dies
before its ``optimizer.step()`` and computes the step again after its restart.
"""

from __future__ import annotations

import math
from typing import Any

from leto.sim.theory import daly_interval, young_interval

from .workload import BenchError

__all__ = [
    "without_checkpoints",
    "FAIL_AT",
    "check_fail_at",
    "checkpoint_interval_steps",
    "failure_schedule",
    "young_interval",
    "daly_interval",
]

#: where in its step a rank dies (see the module docstring)
FAIL_AT = ("forward", "update")


def check_fail_at(at: str) -> None:
    """Refuse a failure point that is not one of :data:`FAIL_AT`."""
    if at not in FAIL_AT:
        raise BenchError(f"a failure strikes at one of {', '.join(FAIL_AT)}, not {at!r}")


def checkpoint_interval_steps(
    save_s: float, mtbf_s: float, step_s: float, write_s: float = 0.0
) -> int:
    """Steps between checkpoints (see the module docstring)."""
    if mtbf_s <= 0:
        raise BenchError(f"MTBF must be positive, got {mtbf_s}")
    if step_s <= 0:
        raise BenchError(f"step time must be positive, got {step_s}")
    compute_s = max(daly_interval(max(save_s, 0.0), mtbf_s), write_s)
    steps = max(1, round(compute_s / step_s))
    if write_s > 0:
        steps = max(steps, math.ceil(write_s / step_s))
    return steps


def failure_schedule(
    n: int,
    interval: int,
    *,
    step_s: float,
    world: int,
    after_step: int,
    gap_s: float,
    at: str = "forward",
) -> list[dict[str, Any]]:
    """``n`` failures ``{"rank", "step"}``, with ``"at"`` where it is not ``forward``
    (see the module docstring)."""
    if n < 1 or interval < 1:
        raise BenchError("a failure schedule needs n >= 1 failures and an interval >= 1 step")
    check_fail_at(at)
    gap_steps = max(1, math.ceil(gap_s / max(step_s, 1e-9)))
    spacing = interval * max(1, math.ceil(gap_steps / interval))
    base = interval * (after_step // interval + 1)
    out = []
    for j in range(n):
        offset = 1 + int((j + 0.5) * interval / n)  # 1..interval
        f: dict[str, Any] = {"rank": (j + 1) % world, "step": base + j * spacing + offset}
        if at != "forward":
            f["at"] = at
        out.append(f)
    return out


def without_checkpoints(
    step_s: float, runs: list[dict[str, Any]], schedule: list[dict[str, Any]], backend: str
) -> dict[str, Any]:
    """A system's result that writes no checkpoint (leto, torchft, nvre): its steady step
    time, no save or interval, its recoveries and the failure schedule they followed."""
    return {
        "calibration": {"step_s": step_s, "save_s": 0.0, "write_s": 0.0},
        "interval_steps": None,
        "interval_s": None,
        "runs": runs,
        "schedule": schedule,
        "backend": backend,
    }
