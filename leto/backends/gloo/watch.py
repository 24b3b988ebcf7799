"""Seeing a job run: a progress line, Prometheus metrics, TensorBoard scalars.

Everything here reads the run's event log as node 0's coordinator writes it
(:class:`~leto.backends.gloo.eventlog.EventLog` listeners): the ``step`` records (one
per committed step, with its loss when the script gave one), ``failure``,
``recovery_end`` (its seconds and what the reconcile did), ``shadow`` and
``degraded``. So what is shown is what the log says, and a sink cannot change the
job: a listener that raises is dropped, with one line, and the job goes on.

* :class:`ProgressLine`: ``step 120  loss 0.4321  0.215 s/step  recoveries 2`` on the
  launcher's console, at most once per ``every_s`` (``leto launch --progress-every``;
  ``--no-progress`` or ``--quiet`` turns it off), when a recovery ends, and at the end.
* :class:`Metrics`: ``prometheus_client`` metrics in a registry of the job's own,
  served by ``leto launch --metrics HOST:PORT`` on the address given (off by default).
* :class:`TensorBoard`: scalars by step (``leto launch --tensorboard DIR``; needs the
  ``tensorboard`` package).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .eventlog import EventLog

__all__ = ["Metrics", "ProgressLine", "StepClock", "TensorBoard", "Watchers", "serve_metrics"]

Record = dict[str, Any]

# the metrics' names, for the docs and the tests
NAMES = (
    "leto_steps_total",
    "leto_step_seconds",
    "leto_loss",
    "leto_failures_total",
    "leto_recoveries_total",
    "leto_recovery_seconds",
    "leto_shadows",
    "leto_degraded_ranks",
)


class StepClock:
    """Step time from the ``step`` records' stamps: the mean over the steps since the
    previous call of :meth:`rate` (a recovery's long step counts where it fell)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.loss: float | None = None
        self._last: tuple[int, float] | None = None
        self._mark: tuple[int, float] | None = None

    def add(self, rec: Record) -> float | None:
        """Take a ``step`` record; the time since the previous one per step, if any."""
        step, t = int(rec["step"]), float(rec["t"])
        self.step = step
        if rec.get("loss") is not None:
            self.loss = float(rec["loss"])
        prev, self._last = self._last, (step, t)
        if self._mark is None:
            self._mark = (step, t)
        if prev is None or step <= prev[0]:
            return None
        return (t - prev[1]) / (step - prev[0])

    def rate(self) -> float | None:
        """Seconds per step since the previous call (None before two steps)."""
        if self._last is None or self._mark is None or self._last[0] <= self._mark[0]:
            return None
        (s0, t0), (s1, t1) = self._mark, self._last
        self._mark = self._last
        return (t1 - t0) / (s1 - s0)


class ProgressLine:
    """The console's progress line (see the module docstring)."""

    def __init__(
        self,
        say: Callable[[str], None],
        every_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.say, self.every_s, self.clock = say, every_s, clock
        self.steps = StepClock()
        self.recoveries = 0
        self._next = clock() + every_s

    def __call__(self, rec: Record) -> None:
        ev = rec.get("event")
        if ev == "step":
            self.steps.add(rec)
            if self.clock() >= self._next:
                self.show()
        elif ev == "recovery_end":
            self.recoveries += 1
            self.show()
        elif ev == "training_done":
            self.show()

    def show(self) -> None:
        if self.steps.step is None:
            return
        self._next = self.clock() + self.every_s
        parts = [f"step {self.steps.step}"]
        if self.steps.loss is not None:
            parts.append(f"loss {self.steps.loss:.4f}")
        rate = self.steps.rate()
        if rate is not None:
            parts.append(f"{rate:.3f} s/step")
        parts.append(f"recoveries {self.recoveries}")
        self.say("  ".join(parts))


class Metrics:
    """The job's metrics, in a registry of its own (not the process's global one)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.steps = Counter("leto_steps", "Committed training steps", registry=r)
        self.step_s = Gauge(
            "leto_step_seconds", "Wall time per step, over the last committed step", registry=r
        )
        self.loss = Gauge("leto_loss", "Loss of the last committed step (rank 0's)", registry=r)
        self.failures = Counter("leto_failures", "Failures detected, by kind", ["kind"], registry=r)
        self.recoveries = Counter(
            "leto_recoveries",
            "Recoveries ended, by what the reconcile did (inplace, forward, back, tier1, "
            "tier2, ckpt)",
            ["kind"],
            registry=r,
        )
        self.recovery_s = Histogram(
            "leto_recovery_seconds",
            "From the failure until training runs again",
            buckets=(0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0),
            registry=r,
        )
        self.shadows = Gauge("leto_shadows", "Shadows by state", ["state"], registry=r)
        self.degraded = Gauge("leto_degraded_ranks", "Ranks left without a warm shadow", registry=r)
        self._clock = StepClock()
        self._shadow: dict[int, str] = {}
        self._degraded: set[int] = set()

    def __call__(self, rec: Record) -> None:
        ev = rec.get("event")
        if ev == "step":
            self.steps.inc()
            per = self._clock.add(rec)
            if per is not None:
                self.step_s.set(per)
            if self._clock.loss is not None:
                self.loss.set(self._clock.loss)
        elif ev == "failure":
            self.failures.labels(kind=str(rec.get("kind", "unknown"))).inc()
        elif ev == "recovery_end":
            self.recoveries.labels(kind=str(rec.get("kind", "unknown"))).inc()
            self.recovery_s.observe(float(rec.get("seconds", 0.0)))
        elif ev == "shadow":
            self._shadow[int(rec["rank"])] = str(rec.get("state", "unknown"))
            states = set(self._shadow.values()) | {"warm", "cold"}
            for st in states:
                self.shadows.labels(state=st).set(sum(1 for v in self._shadow.values() if v == st))
        elif ev == "degraded":
            self._degraded.add(int(rec["rank"]))
            self.degraded.set(len(self._degraded))


def serve_metrics(metrics: Metrics, host: str, port: int) -> Any:
    """Serve ``metrics`` over HTTP on ``host:port`` (the address the user gave, nothing
    wider); the server, to ``shutdown()`` when the job ends."""
    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server


class TensorBoard:
    """Scalars by step in ``logdir`` (``torch.utils.tensorboard``): loss, step time,
    recoveries so far, and each recovery's seconds at the step it resumed."""

    def __init__(self, logdir: str) -> None:
        # an optional dependency (the tensorboard package): imported when asked for
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(log_dir=logdir)
        self._clock = StepClock()
        self.recoveries = 0

    def __call__(self, rec: Record) -> None:
        ev = rec.get("event")
        if ev == "step":
            step = int(rec["step"])
            per = self._clock.add(rec)
            if rec.get("loss") is not None:
                self.w.add_scalar("leto/loss", float(rec["loss"]), step)
            if per is not None:
                self.w.add_scalar("leto/step_seconds", per, step)
            self.w.add_scalar("leto/recoveries", self.recoveries, step)
        elif ev == "recovery_end":
            self.recoveries += 1
            at = int(rec.get("resumed_at", 0))
            self.w.add_scalar("leto/recovery_seconds", float(rec.get("seconds", 0.0)), at)

    def close(self) -> None:
        self.w.flush()
        self.w.close()


class Watchers:
    """What watches one job (node 0): the sinks its options ask for, listening to its
    event log, and what must be closed when it ends."""

    def __init__(
        self,
        log: EventLog,
        *,
        say: Callable[[str], None],
        progress_every: float | None,
        metrics: tuple[str, int] | None,
        tensorboard: str | None,
    ) -> None:
        self.server: Any = None
        self.tb: TensorBoard | None = None
        self.address: str | None = None
        if progress_every is not None:
            log.listeners.append(ProgressLine(say, progress_every))
        if metrics is not None:
            m = Metrics()
            self.server = serve_metrics(m, *metrics)
            host, port = self.server.server_address[:2]
            self.address = f"{host}:{port}"
            say(f"metrics at http://{self.address}/metrics")
            log.listeners.append(m)
        if tensorboard is not None:
            self.tb = TensorBoard(tensorboard)
            log.listeners.append(self.tb)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
