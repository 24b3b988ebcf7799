"""Where the coordinator records each COMMIT and each fence, before anyone acts on it.

The protocol's DECIDE needs COMMIT(V) recorded where it survives any one trainer's
death, before any chunk moves. The coordinator decides (the core's ``CommitStep``),
records here, and only then sends ``commit(V)`` to the ranks; at each recovery it
records the new generation here before any agent is told to fence.

* :class:`Embedded` (``--rdzv-backend c10d``, the default): the record is the
  coordinator's own memory in node 0's agent, as it always was; nothing to start.
* :class:`EtcdRecord` (``--rdzv-backend etcd``): the record is in the job's etcd
  cluster (:mod:`.etcdstore`), which survives the loss of node 0 and of any one etcd
  member of three. ``r/gen`` holds the generation and is moved by compare-and-swap
  on its revision; ``r/commit`` holds ``{step, gen}`` and is written in one
  transaction guarded by that revision, so a coordinator whose generation someone
  else moved on (fencing by generation) cannot record a commit. One transaction per
  step, whatever the number of ranks or chunks.

A record that cannot be written (etcd unreachable for the store's patience, or the
generation moved on) is a :class:`RecordError`: the coordinator stops the job with
its line rather than let a commit that is not durable move a chunk.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from .etcdstore import EtcdStore, StoreError

__all__ = ["CommitRecord", "Embedded", "EtcdRecord", "RecordError"]


class RecordError(RuntimeError):
    """The record could not be written: one line."""


class CommitRecord(Protocol):
    def commit(self, step: int, gen: int) -> None: ...

    def fence(self, gen: int) -> None: ...

    def stats(self) -> dict[str, Any]: ...


class Embedded:
    """The coordinator's memory is the record (one host, or node 0 trusted to live)."""

    def __init__(self) -> None:
        self.last: tuple[int, int] | None = None
        self.gen = 0

    def commit(self, step: int, gen: int) -> None:
        self.last = (step, gen)

    def fence(self, gen: int) -> None:
        self.gen = gen

    def stats(self) -> dict[str, Any]:
        return {"backend": "c10d"}


class EtcdRecord:
    """The record in etcd; see the module docstring. :meth:`start` first."""

    GEN = "r/gen"
    COMMIT = "r/commit"

    def __init__(self, store: EtcdStore, clock: Callable[[], float] = time.perf_counter) -> None:
        self.store = store
        self.clock = clock
        self.gen_revision = 0
        self.gen = 0
        self.writes = 0
        self.fences = 0
        self.seconds = 0.0
        self.slowest = 0.0

    def start(self, gen: int = 0) -> None:
        """The job's first generation record (the job's keys were cleared by its claim)."""
        self.gen = gen
        self.gen_revision = self._write({}, self.GEN, {"gen": gen}, "the generation record")

    def _write(self, guards: dict[str, int], name: str, value: dict[str, Any], what: str) -> int:
        t0 = self.clock()
        try:
            rev = self.store.write(guards, [(name, value)])
        except StoreError as e:
            raise RecordError(f"cannot write {what} to etcd: {e}") from None
        took = self.clock() - t0
        self.seconds += took
        self.slowest = max(self.slowest, took)
        if rev is None:
            raise RecordError(
                f"cannot write {what} to etcd: the generation record moved past generation "
                f"{self.gen} (another coordinator fenced this one)"
            )
        return rev

    def commit(self, step: int, gen: int) -> None:
        self._write({self.GEN: self.gen_revision}, self.COMMIT, {"step": step, "gen": gen},
                    f"COMMIT({step}) of generation {gen}")  # fmt: skip
        self.writes += 1

    def fence(self, gen: int) -> None:
        self.gen_revision = self._write(
            {self.GEN: self.gen_revision}, self.GEN, {"gen": gen}, f"the fence of generation {gen}"
        )
        self.gen = gen
        self.fences += 1

    def stats(self) -> dict[str, Any]:
        n = self.writes + self.fences
        return {
            "backend": "etcd",
            "commits": self.writes,
            "fences": self.fences,
            "ms_mean": round(1000 * self.seconds / n, 3) if n else None,
            "ms_max": round(1000 * self.slowest, 3),
            "failovers": self.store.failovers,
        }
