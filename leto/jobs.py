"""The jobs of a run directory: which records of its event log are one job's.

A run directory may be used again (``leto launch --run-dir runs/gpt`` run a second
time, as one runs the same ``torchrun`` command again): each job's coordinator appends
to the same ``events.jsonl``. Every record names its job (``"job"``, the id node 0
draws at the job's start and every agent, spare and restart of that job shares), so a
reader takes one job's records: the latest job's unless told which (``leto report
--job ID``, ``leto spec trace --job ID``), by its id or a prefix of it that names one
job (a process title shows the first 8 characters). A log written before records named
their job holds one job, whose id is ``""``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

__all__ = ["Choice", "NoSuchJob", "choose", "job_of"]


class NoSuchJob(ValueError):
    """``--job`` names no job of the log, or more than one (a one-line reason)."""


def job_of(rec: Mapping[str, Any]) -> str:
    """The id of the job a record belongs to (``""``: a record that names none)."""
    job = rec.get("job")
    return job if isinstance(job, str) else ""


@attrs.frozen
class Choice:
    """The job a reader shows (:attr:`job`) among the jobs of a log (:attr:`jobs`, in
    the order they started); :attr:`latest`: no job was asked for."""

    job: str
    jobs: tuple[str, ...]
    latest: bool

    def holds(self, rec: Mapping[str, Any]) -> bool:
        return job_of(rec) == self.job

    def note(self, where: object) -> str | None:
        """One line saying which of several jobs is shown; None for a log of one job."""
        if len(self.jobs) < 2:
            return None
        which = f"job {_shown(self.job)}"
        if self.latest:
            others = ", ".join(_shown(j) for j in self.jobs if j != self.job)
            return (
                f"{where} holds {len(self.jobs)} jobs; this is the latest, {which} "
                f"(--job ID for another: {others})"
            )
        n = self.jobs.index(self.job) + 1
        return f"{where} holds {len(self.jobs)} jobs; this is {which}, the {_nth(n)} to start"


def choose(records: Iterable[Mapping[str, Any]], wanted: str | None = None) -> Choice:
    """The job ``wanted`` names (its id, or a prefix of exactly one job's id), or the
    latest job (the last to start) when ``wanted`` is None. :class:`NoSuchJob` if it
    names none, or several."""
    jobs = tuple(dict.fromkeys(job_of(r) for r in records))
    if wanted is None:
        return Choice(jobs[-1] if jobs else "", jobs, latest=True)
    if wanted in jobs:
        return Choice(wanted, jobs, latest=False)
    hits = [j for j in jobs if wanted and j.startswith(wanted)]
    if len(hits) == 1:
        return Choice(hits[0], jobs, latest=False)
    known = ", ".join(_shown(j) for j in jobs) or "none"
    if hits:
        raise NoSuchJob(
            f"--job {wanted}: names {len(hits)} jobs ({', '.join(hits)}): give more of it"
        )
    raise NoSuchJob(f"--job {wanted}: no such job in the log (its jobs: {known})")


def _shown(job: str) -> str:
    return job or "(unnamed)"


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
