"""The run's event log: one JSON object per line in ``RUN_DIR/events.jsonl``.

Every record has ``t`` (Unix time), ``t_rel`` (seconds since the job started),
``event`` and ``job`` (the job's id: a run directory used again holds several jobs,
:mod:`leto.jobs`); what else it carries depends on the event (see ``docs/gloo.md``).
Lines are flushed as they are written, so a job killed half way leaves a
readable log, and ``leto report`` reads it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

__all__ = ["EventLog", "job_started", "read_events"]


class EventLog:
    def __init__(
        self, path: str | os.PathLike[str] | None, *, t0: float | None = None, job: str = ""
    ) -> None:
        self.t0 = time.time() if t0 is None else t0
        self.job = {"job": job} if job else {}
        self.path = Path(path) if path is not None else None
        self._f: TextIO | None = None
        # an in-memory log (no path: tests, probes) keeps its records; a file log does
        # not, so a long job's log does not grow the agent's memory
        self.records: list[dict[str, Any]] = []
        # who watches the job (leto.backends.gloo.watch): called with every record
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        now = time.time()
        rec = {
            "t": round(now, 6),
            "t_rel": round(now - self.t0, 6),
            "event": event,
            **self.job,
            **fields,
        }
        if self._f is None:
            self.records.append(rec)
        else:
            self._f.write(json.dumps(rec, separators=(",", ":"), default=str) + "\n")
            self._f.flush()
        for listen in list(self.listeners):
            try:
                listen(rec)
            except Exception as e:  # noqa: BLE001 - a watcher never stops the job
                self.listeners.remove(listen)
                print(
                    f"leto: {type(listen).__name__} stopped watching the job: "
                    f"{type(e).__name__}: {e}",
                    file=sys.stderr,
                    flush=True,
                )
        return rec

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def job_started(path: str | os.PathLike[str], job: str) -> float | None:
    """When ``job`` started its records in the log at ``path`` (the ``t`` of its first):
    a restart of the job, or a coordinator that takes it over, continues its clock.
    None: the log holds none of its records."""
    needle = json.dumps({"job": job}, separators=(",", ":"))[1:-1]
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if needle not in line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(rec, dict) or rec.get("job") != job:
                    continue
                t = rec.get("t")
                return float(t) if isinstance(t, (int, float)) else None
    except OSError:
        return None
    return None


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of an event log (a truncated last line is skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out
