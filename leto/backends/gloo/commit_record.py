"""Where the coordinator records each COMMIT and each fence, before anyone acts on it.

The protocol's DECIDE needs COMMIT(V) recorded where it survives any one trainer's
death, before any chunk moves. The coordinator decides (the core's ``CommitStep``),
records here, and only then sends ``commit(V)`` to the ranks; at each recovery it
records the new generation here before any agent is told to fence.

* :class:`Embedded` (``--rdzv-backend c10d``, the default): the record is the
  coordinator's own memory in node 0's agent; nothing to start.
* :class:`EtcdRecord` (``--rdzv-backend etcd``): the record is in the job's etcd
  cluster (:mod:`.etcdstore`), which survives the loss of node 0 and of any one etcd
  member of three. ``r/gen`` holds the generation and is moved by compare-and-swap
  on its revision; ``r/commit`` holds ``{step, gen}`` and is written in one
  transaction guarded by that revision, so a coordinator whose generation someone
  else moved on (fencing by generation) cannot record a commit. One transaction per
  step, whatever the number of ranks or chunks.

The model's inputs go there too, so that another coordinator can rebuild the model
(:meth:`EtcdRecord.take_over`, :func:`leto.spec.trace.rebuild`): every ``core_init``
and ``core`` record the coordinator writes to its event log is noted, and the records
noted since the last write are appended as one key ``r/log/<n>`` by the next
transaction, the commit's or the fence's (no extra round trip on the training path),
or by :meth:`EtcdRecord.flush`, which the agent calls before it sends any message
that follows from them: what a rank or an agent was told never depends on a model
input etcd does not hold. Every append is guarded by the revision of ``r/gen`` like
the commit, and a coordinator that takes over moves that revision first (it rewrites
``r/gen``) and only then reads the log: after that, the old coordinator can append
nothing more, so the log read is the whole of what it fed.

Every ``compact_every`` log keys (64) the coordinator compacts the log: ``r/base``
holds what rebuilds the model as it is then (its constants, its settings and its
state, :mod:`leto.spec.state_record`), written in one transaction with the deletion
of the log keys before it, so the log in etcd stays bounded, whatever the job's length.

A record that cannot be written (etcd unreachable for the store's patience, the
generation moved on, a record too large) is a :class:`RecordError`: the coordinator
stops the job with its line rather than let a commit that is not durable move a chunk.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .etcdstore import MAX_VALUE, EtcdStore, StoreError

__all__ = ["CommitRecord", "Embedded", "EtcdRecord", "RecordError", "TakenOver"]


@dataclass(frozen=True)
class TakenOver:
    """What a successor reads: the model's records, the last COMMIT, the kept keys."""

    records: list[dict[str, Any]]
    commit: dict[str, Any] | None
    kept: dict[str, dict[str, Any]]


class RecordError(RuntimeError):
    """The record could not be written: one line."""


class CommitRecord(Protocol):
    def commit(self, step: int, gen: int) -> None: ...

    def fence(self, gen: int) -> None: ...

    def note(self, record: dict[str, Any]) -> None: ...

    def keep(self, name: str, value: dict[str, Any]) -> bool: ...

    def flush(self) -> None: ...

    def compaction_due(self) -> bool: ...

    def compact(self, base: list[dict[str, Any]]) -> bool: ...

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

    def note(self, record: dict[str, Any]) -> None:
        pass  # the event log holds the model's inputs

    def keep(self, name: str, value: dict[str, Any]) -> bool:
        return True  # the coordinator holds it

    def flush(self) -> None:
        pass

    def compaction_due(self) -> bool:
        return False

    def compact(self, base: list[dict[str, Any]]) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return {"backend": "c10d"}


class EtcdRecord:
    """The record in etcd; see the module docstring. :meth:`start` first."""

    GEN = "r/gen"
    COMMIT = "r/commit"
    LOG = "r/log/"
    BASE = "r/base"

    def __init__(
        self,
        store: EtcdStore,
        clock: Callable[[], float] = time.perf_counter,
        compact_every: int = 64,
    ) -> None:
        self.store = store
        self.compact_every = compact_every  # log keys between two compactions
        self.base_seq = 0  # the first r/log/ key after r/base
        self.compactions = 0
        self.base_too_large = False
        self.clock = clock
        self.gen_revision = 0
        self.gen = 0
        self.writes = 0
        self.fences = 0
        self.seconds = 0.0
        self.slowest = 0.0
        self.pending: list[dict[str, Any]] = []  # model records not yet in etcd
        self.kept: dict[str, dict[str, Any]] = {}  # keys to overwrite with the next write
        self.seq = 0  # the next r/log/ key
        self.appends = 0  # r/log/ keys written
        self.flushes = 0  # appends that needed a transaction of their own
        self.log_bytes = 0

    def start(self, gen: int = 0) -> None:
        """The job's first generation record (the job's keys were cleared by its claim)."""
        self.gen = gen
        self.gen_revision = self._write({}, self.GEN, {"gen": gen}, "the generation record")

    def _write(
        self,
        guards: dict[str, int],
        name: str,
        value: dict[str, Any],
        what: str,
        drop: tuple[str, str] | None = None,
    ) -> int:
        puts = [(name, value)] if name else []
        puts += list(self.kept.items())
        log = None
        if self.pending:  # the model's inputs so far ride along
            log = (f"{self.LOG}{self.seq:012d}", {"records": self.pending})
            puts.append(log)
        t0 = self.clock()
        try:
            rev = self.store.write(guards, puts, drop=drop)
        except (StoreError, ValueError) as e:
            raise RecordError(f"cannot write {what} to etcd: {e}") from None
        took = self.clock() - t0
        self.seconds += took
        self.slowest = max(self.slowest, took)
        if rev is None:
            raise RecordError(
                f"cannot write {what} to etcd: the generation record moved past generation "
                f"{self.gen} (another coordinator fenced this one)"
            )
        for v in self.kept.values():
            self.log_bytes += len(json.dumps(v, separators=(",", ":")))
        self.kept = {}
        if log is not None:
            self.seq += 1
            self.appends += 1
            self.log_bytes += len(json.dumps(log[1], separators=(",", ":")))
            self.pending = []
        return rev

    def note(self, record: dict[str, Any]) -> None:
        """A model record (``core_init``, ``core``) the coordinator just wrote to its log."""
        self.pending.append(record)

    def keep(self, name: str, value: dict[str, Any]) -> bool:
        """Overwrite ``name`` with ``value`` at the next write (state a successor needs
        beside the log, replaced rather than appended); False if it is too large to."""
        if len(json.dumps(value, separators=(",", ":"))) > MAX_VALUE - 1024:
            return False
        self.kept[name] = value
        return True

    def flush(self) -> None:
        """The noted records into etcd now (before a message that follows from them)."""
        if self.pending or self.kept:
            self._write({self.GEN: self.gen_revision}, "", {}, "the model's inputs")
            self.flushes += 1

    def compaction_due(self) -> bool:
        """Enough log keys since the last compaction, and none pending."""
        return not self.pending and self.seq - self.base_seq >= self.compact_every

    def compact(self, base: list[dict[str, Any]]) -> bool:
        """Replace the log so far by ``base``: records that rebuild the model as the whole
        log would (its ``core_init``, settings and a ``core_state``), in one transaction
        with the deletion of the log keys it replaces. False (and the log kept) when the
        base is too large for one record."""
        if self.pending:
            raise RecordError("compacting the commit record with model records pending")
        value = {"records": base, "seq": self.seq}
        if len(json.dumps(value, separators=(",", ":"))) > MAX_VALUE - 1024:
            self.base_too_large = True
            return False
        drop = (f"{self.LOG}{0:012d}", f"{self.LOG}{self.seq:012d}")
        self._write({self.GEN: self.gen_revision}, self.BASE, value, "a compaction", drop)
        self.base_seq = self.seq
        self.compactions += 1
        return True

    def take_over(self) -> TakenOver:
        """Another coordinator's record, taken over: ``r/gen`` rewritten first (its
        revision moves, so the old coordinator can write nothing more), then the whole
        log read: its records in order, the last COMMIT and what it kept aside."""
        try:
            gen = self.store.get(self.GEN)
            if gen is None:
                raise RecordError(f"no generation record {self.store.key(self.GEN)} in etcd")
            self.gen = int(gen.value["gen"])
            rev = self.store.write({self.GEN: gen.mod_revision}, [(self.GEN, gen.value)])
            if rev is None:
                raise RecordError("the generation record moved while it was taken over")
            self.gen_revision = rev
            base = self.store.get(self.BASE)
            log = self.store.scan(self.LOG)
            commit = self.store.get(self.COMMIT)
            kept = {n: e.value for n, e in self.store.scan("k/")}
        except (StoreError, KeyError, TypeError, ValueError) as e:
            raise RecordError(f"cannot take the commit record over: {e}") from None
        records: list[dict[str, Any]] = []
        first = 0
        if base is not None:
            if not isinstance(base.value.get("records"), list) or not isinstance(
                base.value.get("seq"), int
            ):
                raise RecordError(f"the compacted log {self.store.key(self.BASE)} is not one")
            records += base.value["records"]
            first = base.value["seq"]
        for n, (name, entry) in enumerate(log, first):
            if name != f"{self.LOG}{n:012d}" or not isinstance(entry.value.get("records"), list):
                raise RecordError(f"the model's log in etcd is not whole at {name}")
            records += entry.value["records"]
        self.seq = self.base_seq = first + len(log)
        return TakenOver(records, None if commit is None else commit.value, kept)

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
        n = self.writes + self.fences + self.flushes + self.compactions  # every one timed
        return {
            "backend": "etcd",
            "commits": self.writes,
            "fences": self.fences,
            "transactions": n,
            "ms_mean": round(1000 * self.seconds / n, 3) if n else None,
            "ms_max": round(1000 * self.slowest, 3),
            "failovers": self.store.failovers,
            "log_appends": self.appends,
            "log_flushes": self.flushes,
            "log_bytes": self.log_bytes,
            "compactions": self.compactions,
        }
