"""The fake backend: N simulated ranks in one process, deterministic, with a fault injector.

Everything a real backend keeps in other processes lives here in plain objects:

* each rank's **keeper** is a dict of named uint8 tensors (:class:`FakeKeeper`);
  losing the memory fills every segment with garbage (``0xA5``) and marks it
  lost, so a view still held by a dead trainer sees garbage, an ``attach``
  fails (bad magic), and re-creating the layout re-uses the same tensors;
* each node's **agent memory** is a :class:`~leto.backends.base.NodeStore`;
  losing the node replaces it with an empty one (a spare node);
* the gradient **all-reduce** is split-phase, like ``torch.distributed`` with
  ``async_op=True``: a rank deposits its tensor when its backward ends and
  ``wait()`` returns the sum over every rank, added in rank order (so the result
  is the same whatever order the ranks run in); waiting before every rank has
  deposited is a :class:`~leto.backends.base.CollectiveError` (a deadlock in a real
  job), so is waiting on an aborted generation;
* parity programs run on :func:`leto.retained.parity.run_spmd` (one thread per
  member, exact and deterministic sums);
* **shadows** are objects built by a factory (a deep copy of the model skeleton).

Nothing here reads a clock or a random source. :class:`FaultInjector` schedules
faults at named points of a step (see :data:`PHASES`); each fault fires once and
keeps counters, so a test can assert that every fault it planned fired and was
recovered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from leto.backends.base import (
    Backend,
    CollectiveError,
    FencedError,
    NodeStore,
    ProcState,
    T,
)
from leto.core import faultpoints as fp
from leto.core.erasure import Topology
from leto.core.faultpoints import APPLY_WHERE, DECIDE_WHERE, PHASES
from leto.retained.layout import LayoutError
from leto.retained.parity import Collective, InProcessGroup, run_on_threads

__all__ = [
    "APPLY_WHERE",
    "DECIDE_WHERE",
    "FAULT_KINDS",
    "FakeBackend",
    "FakeKeeper",
    "Fault",
    "FaultInjector",
    "PHASES",
    "RECOVERY_WHERE",
]

GARBAGE_BYTE = 0xA5

# The fault points are leto's one vocabulary (leto.core.faultpoints); the fake backend
# strikes every one but "Report" (its ranks report nothing: the engine reads their
# memory) and every kind but "exception" (a simulated rank raises nothing).
RECOVERY_WHERE = tuple(w for w in fp.RECOVERY_WHERE if w != "Report")
FAULT_KINDS = tuple(k for k in fp.FAULT_KINDS if k != "exception")


@dataclass
class Fault:
    """One planned fault; ``fired``/``recovered``/``detected`` are its counters."""

    kind: str
    rank: int  # the rank whose progress reaches the point (and that fails, but lose_node)
    step: int
    phase: str
    chunk: int | None = None
    where: str | None = None
    node: int | None = None  # lose_node
    bit: int = 0  # corrupt: which bit of the chunk's first parameter byte to flip
    target_chunk: int | None = None  # corrupt: the chunk whose bytes are flipped
    fired: int = 0
    recovered: int = 0
    detected: int = 0  # corrupt: caught by a checksum

    def matches(
        self, rank: int, step: int, phase: str, chunk: int | None, where: str | None
    ) -> bool:
        return (
            self.fired == 0
            and self.rank == rank
            and self.step == step
            and self.phase == phase
            and (self.chunk is None or self.chunk == chunk)
            and (self.where is None or self.where == where)
        )

    @property
    def label(self) -> str:
        at = self.phase
        if self.chunk is not None:
            at += f"[chunk {self.chunk}]"
        if self.where:
            at += f"/{self.where}"
        who = f"node {self.node}" if self.kind == "lose_node" else f"rank {self.rank}"
        return f"{self.kind} {who} at step {self.step} {at}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "rank": self.rank,
            "node": self.node,
            "step": self.step,
            "phase": self.phase,
            "chunk": self.chunk,
            "where": self.where,
            "fired": self.fired,
            "recovered": self.recovered,
            "detected": self.detected,
        }


class FaultInjector:
    """A fluent plan of faults, consulted by the engine at every point of a step.

    ::

        inj.fail_at(rank=1, step=3, phase="forward") \\
           .fail_at(rank=0, step=5, phase="apply", chunk=2, where="mid_write") \\
           .lose_memory(rank=2, step=7, phase="parity", chunk=0) \\
           .lose_node(node=1, step=9, phase="prepare") \\
           .corrupt(rank=3, step=11, chunk=1)

    Steps count from 1 (the step being computed). Each fault fires once, the
    first time its point is reached; :meth:`unfired` lists the ones that never
    did and :meth:`counters` sums them up.
    """

    def __init__(self, topology: Topology, n_chunks: int | None = None) -> None:
        self.topology = topology
        self.n_chunks = n_chunks
        self.faults: list[Fault] = []

    # --- planning ------------------------------------------------------------------

    def _check(
        self, rank: int, step: int, phase: str, chunk: int | None, where: str | None
    ) -> str | None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"step: must be an int >= 1 (the step being computed), got {step!r}")
        if (
            isinstance(rank, bool)
            or not isinstance(rank, int)
            or not 0 <= rank < self.topology.world_size
        ):
            raise ValueError(f"rank: {rank!r} is not a rank of 0..{self.topology.world_size - 1}")
        return fp.check_point(phase, chunk, where, n_chunks=self.n_chunks, recovery=RECOVERY_WHERE)

    def _add(self, fault: Fault) -> FaultInjector:
        self.faults.append(fault)
        return self

    def fail_at(
        self,
        *,
        rank: int,
        step: int,
        phase: str,
        chunk: int | None = None,
        where: str | None = None,
        kind: str = "crash",
    ) -> FaultInjector:
        """``rank``'s trainer fails (``kind``: crash or hang) at that point of ``step``."""
        if kind not in ("crash", "hang"):
            raise ValueError(f"kind: fail_at takes 'crash' or 'hang', got {kind!r}")
        where = self._check(rank, step, phase, chunk, where)
        return self._add(Fault(kind, rank, step, phase, chunk, where))

    def lose_memory(
        self,
        *,
        rank: int,
        step: int,
        phase: str = "finish",
        chunk: int | None = None,
        where: str | None = None,
    ) -> FaultInjector:
        """``rank``'s retained memory is lost (a GPU reset or keeper crash); its trainer dies."""
        where = self._check(rank, step, phase, chunk, where)
        return self._add(Fault("lose_memory", rank, step, phase, chunk, where))

    def lose_node(
        self,
        *,
        node: int,
        step: int,
        phase: str = "finish",
        chunk: int | None = None,
        where: str | None = None,
        rank: int | None = None,
    ) -> FaultInjector:
        """A whole node is lost (memory, parity, snapshot, shadows) when ``rank``
        (default: the node's first rank) reaches the point."""
        if self.topology.nodes < 2:
            raise ValueError("node: losing the only node of a job loses everything; use 2+ nodes")
        if (
            isinstance(node, bool)
            or not isinstance(node, int)
            or not 0 <= node < self.topology.nodes
        ):
            raise ValueError(f"node: {node!r} is not a node of 0..{self.topology.nodes - 1}")
        trigger = self.topology.ranks_of(node)[0] if rank is None else rank
        where = self._check(trigger, step, phase, chunk, where)
        return self._add(Fault("lose_node", trigger, step, phase, chunk, where, node=node))

    def corrupt(
        self, *, rank: int, step: int, chunk: int, bit: int = 0, phase: str = "finish"
    ) -> FaultInjector:
        """Flip one bit of ``rank``'s chunk ``chunk`` in retained memory at that point of
        ``step`` (the trainer lives on): the chunk's checksum must catch it."""
        if not 0 <= bit < 8:
            raise ValueError(f"bit: must be in 0..7, got {bit}")
        if self.n_chunks is not None and not 0 <= chunk < self.n_chunks:
            raise ValueError(f"chunk: {chunk} is not a chunk of 0..{self.n_chunks - 1}")
        if phase not in ("allreduce", "decide", "finish"):
            raise ValueError(
                f"phase: corrupt strikes between events (allreduce, decide, finish), not at {phase!r}"
            )
        where = self._check(rank, step, phase, None, None)
        return self._add(
            Fault("corrupt", rank, step, phase, None, where, bit=bit, target_chunk=chunk)
        )

    # --- firing --------------------------------------------------------------------

    def take(
        self, rank: int, step: int, phase: str, chunk: int | None = None, where: str | None = None
    ) -> list[Fault]:
        """The faults planned for this point (each fires once: marked fired here)."""
        hits = [f for f in self.faults if f.matches(rank, step, phase, chunk, where)]
        for f in hits:
            f.fired += 1
        return hits

    def pending_at(
        self, rank: int, step: int, phase: str, chunk: int | None, where: str | None
    ) -> bool:
        return any(f.matches(rank, step, phase, chunk, where) for f in self.faults)

    def unfired(self) -> list[Fault]:
        return [f for f in self.faults if f.fired == 0]

    def unrecovered(self) -> list[Fault]:
        return [f for f in self.faults if f.fired and not f.recovered]

    @property
    def all_fired(self) -> bool:
        return not self.unfired()

    def counters(self) -> dict[str, Any]:
        by_phase: dict[str, int] = {}
        by_kind: dict[str, int] = {}
        for f in self.faults:
            if f.fired:
                by_phase[f.phase] = by_phase.get(f.phase, 0) + 1
                by_kind[f.kind] = by_kind.get(f.kind, 0) + 1
        return {
            "planned": len(self.faults),
            "fired": sum(1 for f in self.faults if f.fired),
            "recovered": sum(1 for f in self.faults if f.recovered),
            "detected": sum(f.detected for f in self.faults),
            "by_phase": dict(sorted(by_phase.items())),
            "by_kind": dict(sorted(by_kind.items())),
        }


# ----------------------------------------------------------------------------- memory


class FakeKeeper:
    """One rank's retained segments (create-or-attach by name, like a keeper process)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.segments: dict[str, torch.Tensor] = {}
        self.lost = False

    def __call__(self, name: str, nbytes: int) -> torch.Tensor:
        seg = self.segments.get(name)
        if seg is None:
            seg = torch.zeros(nbytes, dtype=torch.uint8)
            self.segments[name] = seg
        elif seg.numel() != nbytes:
            raise LayoutError(
                f"rank {self.rank}: segment {name!r} has {seg.numel()} bytes, {nbytes} requested"
            )
        return seg

    def lose(self) -> None:
        for seg in self.segments.values():
            seg.fill_(GARBAGE_BYTE)
        self.lost = True

    def nbytes(self) -> int:
        return sum(s.numel() for s in self.segments.values())


class _ByteGroup(InProcessGroup):
    """:class:`InProcessGroup` with uint8 sums added natively (torch's uint8 addition
    wraps mod 256, the parity code's arithmetic): the same bytes, without the int64
    round trip, which made tier-2 snapshots of a small model take 100+ ms."""

    def _sum(self) -> torch.Tensor:
        ts = [t for t in self._slots if t is not None]
        if len(ts) == self.size and ts[0].dtype == torch.uint8:
            if any(t.shape != ts[0].shape or t.dtype != torch.uint8 for t in ts):
                raise ValueError("ranks disagree on tensor shape/dtype")
            acc = ts[0].clone()
            for t in ts[1:]:
                acc.add_(t)
            return acc
        return super()._sum()


class _FakeWork:
    def __init__(self, backend: FakeBackend, key: Any) -> None:
        self._backend = backend
        self._key = key

    def wait(self) -> torch.Tensor:
        return self._backend._complete(self._key)


class FakeBackend(Backend):
    """N simulated ranks in one process (see the module docstring)."""

    name = "fake"

    def __init__(self, topology: Topology, *, n_chunks: int | None = None) -> None:
        super().__init__(topology)
        R = topology.world_size
        self.keepers = [FakeKeeper(r) for r in range(R)]
        self.stores = [NodeStore() for _ in range(topology.nodes)]
        self.procs = [ProcState.ALIVE] * R
        self.writer_gen = [0] * R  # the generation whose process may write each rank
        self.shadows: list[Any] = [None] * R  # a warm shadow's objects
        self.shadow_factories: list[Callable[[], Any] | None] = [None] * R
        self.faults = FaultInjector(topology, n_chunks)
        self.stats = {"collectives": 0, "aborted": 0, "refused_writes": 0, "spmd_calls": 0}
        self._deposits: dict[Any, dict[int, torch.Tensor]] = {}
        self._results: dict[Any, torch.Tensor] = {}
        self._waits: dict[Any, int] = {}
        self._aborted: set[int] = set()

    # --- memory -----------------------------------------------------------------------

    def allocator(self, rank: int) -> FakeKeeper:
        return self.keepers[rank]

    def unmap(self, rank: int) -> None:
        pass  # nothing to do in one process: the views simply go out of use

    def memory_lost(self, rank: int) -> bool:
        return self.keepers[rank].lost

    def reset_memory(self, rank: int) -> None:
        self.keepers[rank].lost = False

    def lose_memory(self, rank: int) -> None:
        """Fault: ``rank``'s keeper loses its memory; its trainer dies with it."""
        self.keepers[rank].lose()
        self.procs[rank] = ProcState.DEAD

    def lose_node(self, node: int) -> None:
        """Fault: every rank of ``node`` loses memory, trainer and shadow; the agent's
        memory is gone (a spare node with empty memory replaces it)."""
        for r in self.ranks_of(node):
            self.lose_memory(r)
            self.shadows[r] = None
        self.stores[node] = NodeStore()

    def node_store(self, node: int) -> NodeStore:
        return self.stores[node]

    def retained_bytes(self) -> dict[tuple[int, str], bytes]:
        """Every keeper segment's bytes (tests compare them before and after)."""
        return {
            (k.rank, name): bytes(seg.numpy().tobytes())
            for k in self.keepers
            for name, seg in sorted(k.segments.items())
        }

    # --- fencing ------------------------------------------------------------------------

    def fence(self, generation: int) -> None:
        self.generation = generation

    def admit(self, rank: int, generation: int) -> None:
        """``rank``'s trainer of ``generation`` may write from now on."""
        self.writer_gen[rank] = generation

    def check_writer(self, rank: int, generation: int) -> None:
        if generation != self.generation or self.writer_gen[rank] != generation:
            self.stats["refused_writes"] += 1
            raise FencedError(
                f"rank {rank}: a write from generation {generation} was refused (the keeper is "
                f"at generation {self.generation}, rank {rank} admitted at {self.writer_gen[rank]})"
            )

    # --- collectives --------------------------------------------------------------------

    def all_reduce(self, rank: int, tensor: torch.Tensor, *, tag: Any) -> _FakeWork:
        gen = tag[1] if isinstance(tag, tuple) and len(tag) > 1 else self.generation
        if gen in self._aborted:
            raise CollectiveError(f"all_reduce {tag!r}: generation {gen} was aborted")
        self._deposits.setdefault(tag, {})[rank] = tensor.detach().clone()
        return _FakeWork(self, tag)

    def _complete(self, tag: Any) -> torch.Tensor:
        gen = tag[1] if isinstance(tag, tuple) and len(tag) > 1 else self.generation
        if gen in self._aborted:
            raise CollectiveError(f"all_reduce {tag!r}: generation {gen} was aborted")
        result = self._results.get(tag)
        if result is None:
            deposits = self._deposits.get(tag, {})
            missing = [r for r in range(self.world_size) if r not in deposits]
            if missing:
                raise CollectiveError(
                    f"all_reduce {tag!r}: ranks {missing} never joined (a real job would hang here)"
                )
            result = deposits[0].clone()
            for r in range(1, self.world_size):
                result.add_(deposits[r])
            self._results[tag] = result
            self._waits[tag] = 0
            del self._deposits[tag]
            self.stats["collectives"] += 1
        self._waits[tag] += 1
        if self._waits[tag] == self.world_size:  # every member has its result
            del self._results[tag], self._waits[tag]
            return result
        return result.clone()

    def spmd(self, members: Sequence[int], fn: Callable[[Collective], T]) -> list[T]:
        """One thread per member over an in-process group (exact, deterministic sums)."""
        self.stats["spmd_calls"] += 1
        size = len(members)
        return run_on_threads(_ByteGroup(size), size, fn)

    def barrier(self, generation: int) -> None:
        missing = [r for r, p in enumerate(self.procs) if p is not ProcState.ALIVE]
        if missing:
            raise CollectiveError(
                f"barrier of generation {generation}: ranks {missing} are not alive"
            )

    def abort(self, generation: int) -> None:
        self._aborted.add(generation)
        for key in [k for k in self._deposits if isinstance(k, tuple) and k[1] <= generation]:
            del self._deposits[key]
            self.stats["aborted"] += 1
        for key in [k for k in self._results if isinstance(k, tuple) and k[1] <= generation]:
            del self._results[key], self._waits[key]

    def rebuild(self, generation: int) -> None:
        self.generation = generation
        for r in range(self.world_size):
            if self.procs[r] is ProcState.ALIVE:
                self.writer_gen[r] = generation

    # --- processes --------------------------------------------------------------------

    def crash(self, rank: int) -> None:
        self.procs[rank] = ProcState.DEAD

    def hang(self, rank: int) -> None:
        self.procs[rank] = ProcState.HUNG

    def spawn_shadow(self, rank: int, factory: Callable[[], Any]) -> None:
        self.shadow_factories[rank] = factory
        self.shadows[rank] = factory()

    def reclaim_shadow(self, rank: int) -> None:
        self.shadows[rank] = None  # cold: its memory is given back; rebuilt on promotion

    def promote_shadow(self, rank: int, generation: int) -> Any:
        obj = self.shadows[rank]
        if obj is None:  # cold: pay the start-up cost now
            factory = self.shadow_factories[rank]
            if factory is None:
                raise CollectiveError(f"rank {rank} has no shadow to promote")
            obj = factory()
        self.shadows[rank] = None
        self.procs[rank] = ProcState.ALIVE
        self.writer_gen[rank] = generation
        return obj

    def kill(self, rank: int) -> None:
        pass  # a stale process of an old generation: it simply stops existing

    def alive(self, rank: int) -> ProcState:
        return self.procs[rank]
