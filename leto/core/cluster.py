"""The whole protocol as one model: every rank's machines, the coordinator, the faults.

This is the Python twin of ``spec/Leto.tla`` (``spec/PROTOCOL.md`` is the contract):
one handler per TLA+ action, each a guard followed by an update (the ``*_handlers``
modules, by area; :mod:`leto.core.handlers` says how they are entered). The machines'
transition tables (:mod:`leto.core.txn`, :mod:`~leto.core.chunk`,
:mod:`~leto.core.shadow`, :mod:`~leto.core.trainer`, :mod:`~leto.core.recovery`) decide
which events each machine accepts; the guards add what crosses machines (is every
rank prepared? does the writer hold the current generation?). ``step`` never mutates:
it returns a new state and the effects a backend must carry out, or raises
:class:`~leto.core.errors.ProtocolError` and the caller keeps the old state.

The model's constants are :class:`~leto.core.config.ClusterConfig`, its states
:class:`~leto.core.state.ClusterState`; both are importable from here too.

The explicit-state checker (:mod:`leto.core.checker`), the Hypothesis machines
(:mod:`leto.testing`) and, later, the backends' coordinators all drive this model.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import attrs

from leto.core import (
    aggregated_handlers,
    checkpoint_handlers,
    commit_handlers,
    fault_handlers,
    recovery_handlers,
)
from leto.core import effects as fx
from leto.core import events as ev
from leto.core.chunk import CHUNK, NONE, ChunkState, uniform_row
from leto.core.config import FAULT_KINDS, Aggregation, ClusterConfig, Mutant
from leto.core.errors import ProtocolError
from leto.core.handlers import Handlers
from leto.core.reconcile import (
    Plan,
    Repair,
    RepairKind,
    Survivors,
    empty_grad_parity,
    plan,
    reencoded_parity,
)
from leto.core.recovery import Phase
from leto.core.shadow import ShadowState
from leto.core.state import ClusterState
from leto.core.table import Table
from leto.core.trainer import TrainerState
from leto.core.txn import TxnState

__all__ = [
    "FAULT_KINDS",
    "Aggregation",
    "ClusterConfig",
    "ClusterModel",
    "ClusterState",
    "Effect",
    "Mutant",
]

# The parity-first mutant's chunk table: parity may be written while the chunk is torn.
_CHUNK_PARITY_FIRST: Table[ChunkState] = Table(
    machine="chunk",
    transitions={
        **CHUNK.transitions,
        (ChunkState.WRITING, ev.ParityChunk): ChunkState.WRITING,
    },
)


Effect = fx.Effect

# one guard and one update per event type, from every area's module
_HANDLERS: Handlers = {
    **commit_handlers.HANDLERS,
    **aggregated_handlers.HANDLERS,
    **checkpoint_handlers.HANDLERS,
    **fault_handlers.HANDLERS,
    **recovery_handlers.HANDLERS,
}


@attrs.frozen
class ClusterModel:
    """Initial state, enabled events, and the step function of the whole protocol."""

    config: ClusterConfig = attrs.field(factory=ClusterConfig)
    aggregation: Aggregation = attrs.field(default=Aggregation.OFF, converter=Aggregation)
    node_of: tuple[int, ...] = attrs.field(init=False)
    member: tuple[int, ...] = attrs.field(init=False)
    chunk_table: Table[ChunkState] = attrs.field(init=False)

    @node_of.default
    def _node_of(self) -> tuple[int, ...]:
        return tuple(self.config.topology.node_of(r) for r in range(self.config.ranks))

    @member.default
    def _member(self) -> tuple[int, ...]:
        return tuple(self.config.groups[self.node_of[r]].index(r) for r in range(self.config.ranks))

    @chunk_table.default
    def _chunk_table(self) -> Table[ChunkState]:
        return _CHUNK_PARITY_FIRST if self.config.mutant is Mutant.PARITY_FIRST else CHUNK

    # --- states -------------------------------------------------------------------

    def initial(self, step: int = 0) -> ClusterState:
        """The initial state; ``step > 0``: a job resumed from the durable checkpoint of
        ``step`` after a full outage starts where the failure-free run is when every rank
        is idle at ``step`` with its snapshot and its checkpoint taken there, but holding
        no gradient blocks (a new job has none; no chunk needs them, every chunk is at
        ``step``): the reachable state tests/test_core_checker.py compares it with."""
        cfg = self.config
        R, C = cfg.ranks, cfg.chunks
        if not 0 <= step <= cfg.max_step:
            raise ValueError(f"initial step {step} is not in 0..{cfg.max_step}")
        return self._tier1(
            ClusterState(
                trainer=(TrainerState.ALIVE,) * R,
                tgen=(0,) * R,
                pc=(TxnState.IDLE,) * R,
                step=(step,) * R,
                tail=(step,) * R,
                data=(uniform_row(step, C),) * R,
                undo=(uniform_row(NONE, C),) * R,
                grad=(NONE,) * R,
                shadow=(ShadowState.WARM,) * R,
                stale=(False,) * R,
                par=reencoded_parity(cfg.groups, C, step),
                gpar=empty_grad_parity(cfg.groups),
                committed=step,
                t2=step,
                ckpt=step,
            )
        )

    def _tier1(self, s: ClusterState) -> ClusterState:
        """Tier 1 switched off in the config: no parity survives any transition."""
        if self.config.tier1 or all(p is None for p in s.par):
            return s
        n = len(s.par)
        return attrs.evolve(s, par=(None,) * n, gpar=(None,) * n)

    def candidates(self, s: ClusterState) -> Iterator[ev.Event]:
        """Every event worth trying in ``s`` (a superset of the enabled ones)."""
        cfg = self.config
        R = range(cfg.ranks)
        if s.phase is Phase.FAILED:
            return
        if s.phase is Phase.RUNNING:
            for r in R:
                if s.trainer[r] is not TrainerState.ALIVE or s.tgen[r] != s.gen:
                    continue
                pc = s.pc[r]
                if pc is TxnState.IDLE:
                    yield ev.Compute(r)
                elif pc is TxnState.COMPUTED:
                    yield ev.Reduce(r)
                elif pc is TxnState.REDUCED:
                    yield ev.Prepare(r)
                if pc in (TxnState.PREPARED, TxnState.APPLYING):
                    for c in range(cfg.chunks):
                        yield ev.BeginChunk(r, c)
                        yield ev.EndChunk(r, c)
                        yield ev.ParityChunk(r, c)
                    yield ev.Finish(r)
                elif pc is TxnState.TAIL:
                    yield ev.Close(r)
            yield ev.Decide()
            yield ev.Tier2Snapshot()
            yield ev.BeginCheckpoint()
            for r in R:
                yield ev.WriteShard(r)
            yield ev.CheckpointDurable()
            if self.aggregation is not Aggregation.OFF:
                yield from self._aggregated_candidates(s)
        for r in R:
            yield ev.ShadowWarm(r)
            if cfg.reclaim:
                yield ev.ShadowReclaim(r)
            if s.stale[r]:
                for c in range(cfg.chunks):
                    yield ev.StaleWrite(r, c)
        if s.faults < cfg.max_faults:
            for r in R:
                if "crash" in cfg.faults:
                    yield ev.Crash(r)
                if "hang" in cfg.faults:
                    yield ev.Hang(r)
                if "lose_memory" in cfg.faults:
                    yield ev.LoseMemory(r)
            if "lose_node" in cfg.faults:
                for n in range(cfg.topology.nodes):
                    yield ev.LoseNode(n)
        if s.phase is not Phase.RUNNING:
            yield ev.Detect()
            yield ev.Fence()
            for r in R:
                yield ev.Promote(r)
            yield ev.EndPromote()
            yield ev.Reconcile()
            yield ev.GoFallback()
            yield ev.RestoreCheckpoint()
            yield ev.Rebuild()
            yield ev.Resume()
            if cfg.deadline:
                yield ev.GiveUp()
        else:
            yield ev.Detect()

    def _aggregated_candidates(self, s: ClusterState) -> Iterator[ev.Event]:
        yield ev.CommitStep(s.committed + 1)
        tail = [r for r in range(self.config.ranks) if s.pc[r] is TxnState.TAIL]
        for n in range(1, len(tail) + 1):
            for subset in itertools.combinations(tail, n):
                yield ev.CloseRanks(subset)
        by_step: dict[int, list[int]] = {}
        for r in range(self.config.ranks):
            if s.pc[r] is TxnState.PREPARED:
                by_step.setdefault(s.step[r] + 1, []).append(r)
        for st, ranks in sorted(by_step.items()):
            for n in range(1, len(ranks) + 1):
                for subset in itertools.combinations(ranks, n):
                    yield ev.ApplyStep(st, subset)

    def why_not(self, s: ClusterState, e: ev.Event) -> ProtocolError | None:
        """``None`` if ``e`` is enabled in ``s``, else the error ``step`` would raise."""
        handler = _HANDLERS.get(type(e))
        if handler is None:
            return ProtocolError("cluster", s.phase, e, "not an event of this protocol")
        if s.phase is Phase.FAILED:
            return ProtocolError("cluster", s.phase, e, "the job has failed")
        guard, _ = handler
        return guard(self, s, e)

    def enabled(self, s: ClusterState) -> list[ev.Event]:
        return [e for e in self.candidates(s) if self.why_not(s, e) is None]

    def step(self, s: ClusterState, e: ev.Event) -> tuple[ClusterState, tuple[Effect, ...]]:
        err = self.why_not(s, e)
        if err is not None:
            raise err
        _, update = _HANDLERS[type(e)]
        after, effects = update(self, s, e)
        return self._tier1(after), effects

    def successors(self, s: ClusterState) -> Iterator[tuple[ev.Event, ClusterState]]:
        for e in self.enabled(s):
            _, update = _HANDLERS[type(e)]
            yield e, self._tier1(update(self, s, e)[0])

    # --- helpers ------------------------------------------------------------------

    def survivors(self, s: ClusterState) -> Survivors:
        return Survivors(
            groups=self.config.groups,
            data=s.data,
            undo=s.undo,
            grad=s.grad,
            par=s.par,
            gpar=s.gpar,
            committed=s.committed,
            t2=s.t2,
            t2_intact=len(s.t2lost) <= self.config.tier2_survives,
        )

    def plan(self, s: ClusterState) -> Plan:
        """The reconcile plan of ``s``, its repairs in runs (:class:`Repair` ``count``)."""
        p = plan(self.survivors(s))
        if self.aggregation is Aggregation.ROW_HEAD and p.target is not None:
            heads = [x.rank for x in p.repairs if x.what is RepairKind.FORWARD and x.chunk == 0]
            p = attrs.evolve(
                p,
                repairs=(
                    *(x for x in p.repairs if x.what is not RepairKind.FORWARD),
                    *(
                        Repair(RepairKind.FORWARD, r, 0, p.target, self.config.chunks)
                        for r in heads
                    ),
                ),
            )
        return p

    def active(self, s: ClusterState, r: int) -> bool:
        return (
            s.phase is Phase.RUNNING and s.trainer[r] is TrainerState.ALIVE and s.tgen[r] == s.gen
        )
