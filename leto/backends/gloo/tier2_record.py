"""The tier-2 snapshot as the coordinator knows it: its step and each rank's record of
it (checksums, process state), kept in the commit record so that a coordinator taking
over can restore tier 2 (:meth:`.coordinator.Coordinator.take_over`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .eventlog import EventLog

__all__ = ["T2_KEY", "Tier2Record"]

T2_KEY = "k/tier2"  # the tier-2 snapshot's metadata, kept in the commit record


class Tier2Record:
    """The current tier-2 snapshot: ``step`` and ``meta`` (rank -> its checksums and
    process state of it). ``keep(key, value)`` writes a value of the commit record (False:
    too large to keep); ``log`` takes the warning that a successor could not restore it."""

    def __init__(self, keep: Callable[[str, dict[str, Any]], bool], log: EventLog) -> None:
        self._keep = keep
        self._log = log
        self.step = 0
        self.meta: dict[int, Any] = {}
        self._not_kept = False  # the commit record could not keep it (too large): said once

    def set(self, step: int, meta: Mapping[int, Any]) -> None:
        """The tier-2 snapshot of ``step`` is current: kept here, and noted for a successor
        (before the ranks hear)."""
        self.step = step
        self.meta = dict(meta)
        kept = {"step": step, "meta": {str(r): m for r, m in meta.items()}}
        if not self._keep(T2_KEY, kept) and not self._not_kept:
            self._not_kept = True
            self._log.write(
                "warning",
                what="the tier-2 snapshot's metadata is too large for the commit record: "
                "a coordinator that takes over cannot restore tier 2",
            )

    def take_over(self, kept: Mapping[str, dict[str, Any]]) -> None:
        """A successor: the snapshot its predecessor kept in the commit record, if any."""
        t2 = kept.get(T2_KEY)
        if t2 is not None:
            self.step = int(t2["step"])
            self.meta = {int(r): m for r, m in t2["meta"].items()}
