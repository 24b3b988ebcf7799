"""The whole protocol as one model: every rank's machines, the coordinator, the faults.

This is the Python twin of ``spec/Leto.tla`` (``spec/PROTOCOL.md`` is the contract):
one handler per TLA+ action, each a guard followed by an update. The machines'
transition tables (:mod:`leto.core.txn`, :mod:`~leto.core.chunk`,
:mod:`~leto.core.shadow`, :mod:`~leto.core.trainer`, :mod:`~leto.core.recovery`) decide
which events each machine accepts; the guards here add what crosses machines (is every
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
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from leto.core import effects as fx
from leto.core import events as ev
from leto.core.chunk import (
    CHUNK,
    GARBAGE,
    LOST,
    NONE,
    TORN,
    ChunkState,
    classify,
    is_uniform,
    repeated,
    uniform_row,
)
from leto.core.config import FAULT_KINDS, Aggregation, ClusterConfig, Mutant
from leto.core.errors import ProtocolError
from leto.core.reconcile import Plan, Repair, Survivors, empty_grad_parity, plan, reencoded_parity
from leto.core.recovery import RECOVERY, Kind, Phase
from leto.core.shadow import SHADOW, ShadowState
from leto.core.state import ClusterState
from leto.core.table import Table
from leto.core.trainer import TRAINER, TrainerState
from leto.core.txn import COMMIT, TXN, CommitState, TxnState

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


def _set(t: tuple[Any, ...], i: int, v: Any) -> tuple[Any, ...]:
    return t[:i] + (v,) + t[i + 1 :]


def _set2(t: tuple[tuple[Any, ...], ...], i: int, j: int, v: Any) -> tuple[tuple[Any, ...], ...]:
    return _set(t, i, _set(t[i], j, v))


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
            heads = [x.rank for x in p.repairs if x.what == "forward" and x.chunk == 0]
            p = attrs.evolve(
                p,
                repairs=(
                    *(x for x in p.repairs if x.what != "forward"),
                    *(Repair("forward", r, 0, p.target, self.config.chunks) for r in heads),
                ),
            )
        return p

    def active(self, s: ClusterState, r: int) -> bool:
        return (
            s.phase is Phase.RUNNING and s.trainer[r] is TrainerState.ALIVE and s.tgen[r] == s.gen
        )


# --- guards and updates, one pair per event type --------------------------------------

Guard = Callable[[ClusterModel, ClusterState, Any], ProtocolError | None]
Update = Callable[[ClusterModel, ClusterState, Any], tuple[ClusterState, tuple[Effect, ...]]]
_HANDLERS: dict[type, tuple[Guard, Update]] = {}


def _handler(event_type: type) -> Callable[[Guard], Callable[[Update], Update]]:
    def register_guard(guard: Guard) -> Callable[[Update], Update]:
        def register_update(update: Update) -> Update:
            _HANDLERS[event_type] = (guard, update)
            return update

        return register_update

    return register_guard


def _err(machine: str, state: Any, e: Any, why: str) -> ProtocolError:
    return ProtocolError(machine, state, e, why)


def _rank_ok(m: ClusterModel, s: ClusterState, e: Any) -> ProtocolError | None:
    if e.rank >= m.config.ranks:
        return _err("cluster", s.phase, e, f"rank {e.rank} out of range 0..{m.config.ranks - 1}")
    if hasattr(e, "chunk") and e.chunk >= m.config.chunks:
        return _err("cluster", s.phase, e, f"chunk {e.chunk} out of range 0..{m.config.chunks - 1}")
    return None


def _trainer_guard(m: ClusterModel, s: ClusterState, e: Any) -> ProtocolError | None:
    """Rank index valid, the cluster running, and the writer of the current generation."""
    err = _rank_ok(m, s, e)
    if err:
        return err
    r = e.rank
    if s.phase is not Phase.RUNNING:
        return _err("recovery", s.phase, e, "training is paused during recovery")
    if s.trainer[r] is not TrainerState.ALIVE:
        return _err("trainer", s.trainer[r], e, f"rank {r}'s trainer is not alive")
    if s.tgen[r] != s.gen:
        return _err("keeper", s.phase, e, f"generation {s.tgen[r]} is fenced (current {s.gen})")
    if not TXN.accepts(s.pc[r], e):
        return _err("txn", s.pc[r], e, "")
    return None


# Compute -------------------------------------------------------------------------


def _g_compute(m: ClusterModel, s: ClusterState, e: ev.Compute) -> ProtocolError | None:
    err = _trainer_guard(m, s, e)
    if err:
        return err
    if s.step[e.rank] >= m.config.max_step:
        return _err("txn", s.pc[e.rank], e, f"training is done at step {m.config.max_step}")
    if s.step[e.rank] - s.t2 >= m.config.k:
        return _err("txn", s.pc[e.rank], e, "tier 2 lags K steps: waiting for the snapshot")
    return None


@_handler(ev.Compute)(_g_compute)
def _u_compute(
    m: ClusterModel, s: ClusterState, e: ev.Compute
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r = e.rank
    return attrs.evolve(s, pc=_set(s.pc, r, TxnState.COMPUTED)), (
        fx.ForwardBackward(r, s.step[r] + 1),
    )


# Reduce --------------------------------------------------------------------------


def _g_reduce(m: ClusterModel, s: ClusterState, e: ev.Reduce) -> ProtocolError | None:
    err = _trainer_guard(m, s, e)
    if err:
        return err
    st = s.step[e.rank]
    in_collective = (TxnState.COMPUTED, TxnState.REDUCED, TxnState.PREPARED)
    for q in range(m.config.ranks):
        if not (
            s.trainer[q] is TrainerState.ALIVE
            and s.tgen[q] == s.gen
            and s.step[q] == st
            and s.pc[q] in in_collective
        ):
            return _err("txn", s.pc[e.rank], e, f"rank {q} is not in the gradient collective")
    return None


@_handler(ev.Reduce)(_g_reduce)
def _u_reduce(
    m: ClusterModel, s: ClusterState, e: ev.Reduce
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r = e.rank
    nxt = s.step[r] + 1
    return attrs.evolve(s, pc=_set(s.pc, r, TxnState.REDUCED), grad=_set(s.grad, r, nxt)), (
        fx.AllReduceGradients(r, nxt),
    )


# Prepare -------------------------------------------------------------------------


@_handler(ev.Prepare)(_trainer_guard)
def _u_prepare(
    m: ClusterModel, s: ClusterState, e: ev.Prepare
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r = e.rank
    n = m.node_of[r]
    gp = s.gpar[n]
    gpar = s.gpar if gp is None else _set(s.gpar, n, _set(gp, m.member[r], s.grad[r]))
    return attrs.evolve(
        s,
        pc=_set(s.pc, r, TxnState.PREPARED),
        gpar=gpar,
        prepared=s.prepared | {r},
        commit=COMMIT.next(s.commit, e),
    ), (
        fx.WriteGradientParity(r, s.grad[r]),
        fx.Vote(r, s.grad[r]),
    )


# Decide --------------------------------------------------------------------------


def _g_decide(m: ClusterModel, s: ClusterState, e: ev.Decide) -> ProtocolError | None:
    if not RECOVERY.accepts(s.phase, e):
        return _err("recovery", s.phase, e, "")
    if not COMMIT.accepts(s.commit, e):
        return _err("commit", s.commit, e, "no vote yet")
    need = 1 if m.config.mutant is Mutant.EARLY_COMMIT else m.config.ranks
    if len(s.prepared) < need:
        missing = sorted(set(range(m.config.ranks)) - s.prepared)
        return _err("commit", s.commit, e, f"ranks {missing} have not prepared")
    if any(s.grad[r] != s.committed + 1 for r in s.prepared):
        return _err("commit", s.commit, e, "a vote is not for the next step")
    return None


@_handler(ev.Decide)(_g_decide)
def _u_decide(
    m: ClusterModel, s: ClusterState, e: ev.Decide
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return attrs.evolve(
        s, committed=s.committed + 1, prepared=frozenset(), commit=COMMIT.next(s.commit, e)
    ), (fx.RecordCommit(s.committed + 1),)


# BeginChunk / EndChunk / ParityChunk / Finish -----------------------------------------


def _g_begin(m: ClusterModel, s: ClusterState, e: ev.BeginChunk) -> ProtocolError | None:
    err = _trainer_guard(m, s, e)
    if err:
        return err
    r, c = e.rank, e.chunk
    st = s.step[r]
    if s.committed != st + 1:
        return _err("commit", s.commit, e, f"step {st + 1} is not committed")
    state = classify(s.data[r][c], s.undo[r][c])
    if not m.chunk_table.accepts(state, e) or s.data[r][c] != st:
        return _err("chunk", state, e, f"chunk is not clean at step {st}")
    for lower in range(c):
        if s.data[r][lower] != st + 1 or s.undo[r][lower] != NONE:
            return _err("chunk", state, e, f"chunk {lower} is not done yet (chunks apply in order)")
    return None


@_handler(ev.BeginChunk)(_g_begin)
def _u_begin(
    m: ClusterModel, s: ClusterState, e: ev.BeginChunk
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r, c = e.rank, e.chunk
    return attrs.evolve(
        s,
        undo=_set2(s.undo, r, c, s.data[r][c]),
        data=_set2(s.data, r, c, TORN),
        pc=_set(s.pc, r, TXN.next(s.pc[r], e)),
    ), (
        fx.SaveUndo(r, c, s.data[r][c]),
        fx.ApplyChunk(r, c, s.step[r] + 1),
    )


def _g_end(m: ClusterModel, s: ClusterState, e: ev.EndChunk) -> ProtocolError | None:
    err = _trainer_guard(m, s, e)
    if err:
        return err
    state = classify(s.data[e.rank][e.chunk], s.undo[e.rank][e.chunk])
    if not m.chunk_table.accepts(state, e):
        return _err("chunk", state, e, "")
    return None


@_handler(ev.EndChunk)(_g_end)
def _u_end(
    m: ClusterModel, s: ClusterState, e: ev.EndChunk
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r, c = e.rank, e.chunk
    return attrs.evolve(s, data=_set2(s.data, r, c, s.step[r] + 1)), (
        fx.ChunkWritten(r, c, s.step[r] + 1),
    )


def _g_parity(m: ClusterModel, s: ClusterState, e: ev.ParityChunk) -> ProtocolError | None:
    err = _trainer_guard(m, s, e)
    if err:
        return err
    r, c = e.rank, e.chunk
    state = classify(s.data[r][c], s.undo[r][c])
    if not m.chunk_table.accepts(state, e):
        return _err("chunk", state, e, "")
    if state is ChunkState.WRITING:  # the parity-first mutant: once per chunk
        par = s.par[m.node_of[r]]
        if par is not None and par[c][m.member[r]] == s.step[r] + 1:
            return _err("chunk", state, e, "parity already written")
    return None


@_handler(ev.ParityChunk)(_g_parity)
def _u_parity(
    m: ClusterModel, s: ClusterState, e: ev.ParityChunk
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r, c = e.rank, e.chunk
    n = m.node_of[r]
    new = s.step[r] + 1
    p = s.par[n]
    par = s.par if p is None else _set(s.par, n, _set2(p, c, m.member[r], new))
    torn = s.data[r][c] == TORN
    undo = s.undo if torn else _set2(s.undo, r, c, NONE)
    effects: tuple[Effect, ...] = (fx.UpdateParity(r, c, new),)
    if not torn:
        effects += (fx.ReleaseUndo(r, c),)
    return attrs.evolve(s, par=par, undo=undo), effects


def _g_finish(m: ClusterModel, s: ClusterState, e: ev.Finish) -> ProtocolError | None:
    err = _trainer_guard(m, s, e)
    if err:
        return err
    r = e.rank
    new = s.step[r] + 1
    if any(d != new for d in s.data[r]) or any(u != NONE for u in s.undo[r]):
        return _err("txn", s.pc[r], e, "not every chunk is done")
    return None


@_handler(ev.Finish)(_g_finish)
def _u_finish(
    m: ClusterModel, s: ClusterState, e: ev.Finish
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r = e.rank
    return attrs.evolve(
        s, step=_set(s.step, r, s.step[r] + 1), pc=_set(s.pc, r, TXN.next(s.pc[r], e))
    ), (fx.StepDone(r, s.step[r] + 1),)


# CommitStep / ApplyStep: the commit path, aggregated -----------------------------------
#
# Each stands for a sequence of the events above (leto.core.aggregate.expand) and must
# leave the state that sequence leaves, accepted exactly where the sequence runs
# (leto.core.aggregate.check_refinement). They cost O(ranks + nodes) per step, not
# O(ranks x chunks): every rank's guard reads its rows by identity (uniform_row), and
# the rows they write are the shared ones.


def _g_commit_step(m: ClusterModel, s: ClusterState, e: ev.CommitStep) -> ProtocolError | None:
    cfg = m.config
    R = cfg.ranks
    if s.phase is not Phase.RUNNING:
        return _err("recovery", s.phase, e, "training is paused during recovery")
    if e.step != s.committed + 1:
        return _err("commit", s.commit, e, f"the model's next step is {s.committed + 1}")
    v = s.committed
    if s.trainer.count(TrainerState.ALIVE) != R:
        r = next(q for q in range(R) if s.trainer[q] is not TrainerState.ALIVE)
        return _err("trainer", s.trainer[r], e, f"rank {r}'s trainer is not alive")
    if s.tgen.count(s.gen) != R:
        r = next(q for q in range(R) if s.tgen[q] != s.gen)
        return _err("keeper", s.phase, e, f"generation {s.tgen[r]} is fenced (current {s.gen})")
    if s.pc.count(TxnState.IDLE) != R:
        r = next(q for q in range(R) if s.pc[q] is not TxnState.IDLE)
        return _err("txn", s.pc[r], e, f"rank {r} is not idle")
    if s.step.count(v) != R:
        r = next(q for q in range(R) if s.step[q] != v)
        return _err("txn", s.pc[r], e, f"rank {r} is at step {s.step[r]}, not {v}")
    if v >= cfg.max_step:
        return _err("txn", TxnState.IDLE, e, f"training is done at step {cfg.max_step}")
    if v - s.t2 >= cfg.k:
        return _err("txn", TxnState.IDLE, e, "tier 2 lags K steps: waiting for the snapshot")
    return None


@_handler(ev.CommitStep)(_g_commit_step)
def _u_commit_step(
    m: ClusterModel, s: ClusterState, e: ev.CommitStep
) -> tuple[ClusterState, tuple[Effect, ...]]:
    R, new = m.config.ranks, e.step
    gpar = tuple(None if gp is None else uniform_row(new, len(gp)) for gp in s.gpar)
    return attrs.evolve(
        s,
        pc=(TxnState.PREPARED,) * R,
        grad=uniform_row(new, R),
        gpar=gpar,
        committed=new,
        prepared=frozenset(),
        commit=CommitState.OPEN,
    ), (fx.RecordCommit(new),)


def _g_apply_step(m: ClusterModel, s: ClusterState, e: ev.ApplyStep) -> ProtocolError | None:
    cfg = m.config
    if s.phase is not Phase.RUNNING:
        return _err("recovery", s.phase, e, "training is paused during recovery")
    if e.ranks[-1] >= cfg.ranks:
        return _err("cluster", s.phase, e, f"rank {e.ranks[-1]} out of range 0..{cfg.ranks - 1}")
    old = e.step - 1
    if len(e.ranks) == cfg.ranks and _all_ready(m, s, old):
        return _committed(m, s, e)
    for r in e.ranks:
        if s.trainer[r] is not TrainerState.ALIVE:
            return _err("trainer", s.trainer[r], e, f"rank {r}'s trainer is not alive")
        if s.tgen[r] != s.gen:
            return _err("keeper", s.phase, e, f"generation {s.tgen[r]} is fenced (current {s.gen})")
        if s.step[r] != old:
            why = f"rank {r} is at step {s.step[r]}: it can finish step {s.step[r] + 1} only"
            return _err("txn", s.pc[r], e, why)
        if s.pc[r] is not TxnState.PREPARED:
            return _err("txn", s.pc[r], e, f"rank {r} has not prepared (or began applying)")
        if not is_uniform(s.data[r], old) or not is_uniform(s.undo[r], NONE):
            return _err("chunk", s.pc[r], e, f"rank {r}'s chunks are not all clean at step {old}")
    return _committed(m, s, e)


def _all_ready(m: ClusterModel, s: ClusterState, old: int) -> bool:
    """Every rank ready to apply the step after ``old`` (the per-rank checks of
    ``ApplyStep``'s guard, counted over the whole tuples at once)."""
    R, C = m.config.ranks, m.config.chunks
    return (
        s.trainer.count(TrainerState.ALIVE) == R
        and s.tgen.count(s.gen) == R
        and s.step.count(old) == R
        and s.pc.count(TxnState.PREPARED) == R
        and s.data.count(uniform_row(old, C)) == R
        and s.undo.count(uniform_row(NONE, C)) == R
    )


def _committed(m: ClusterModel, s: ClusterState, e: ev.ApplyStep) -> ProtocolError | None:
    if m.aggregation is not Aggregation.UNCOMMITTED and s.committed != e.step:
        return _err("commit", s.commit, e, f"step {e.step} is not committed")
    return None


def _fold(
    p: tuple[tuple[int, ...], ...], members: list[int], new: int
) -> tuple[tuple[int, ...], ...]:
    """Node parity ``p`` with the columns of ``members`` at ``new`` in every chunk."""

    def row(x: tuple[int, ...]) -> tuple[int, ...]:
        out = list(x)
        for i in members:
            out[i] = new
        return uniform_row(new, len(out)) if out.count(new) == len(out) else tuple(out)

    if p and (p is repeated(p[0], len(p)) or p.count(p[0]) == len(p)):
        return repeated(row(p[0]), len(p))  # every chunk's row alike: fold once
    return tuple(row(x) for x in p)


@_handler(ev.ApplyStep)(_g_apply_step)
def _u_apply_step(
    m: ClusterModel, s: ClusterState, e: ev.ApplyStep
) -> tuple[ClusterState, tuple[Effect, ...]]:
    cfg = m.config
    new = e.step
    row = uniform_row(new, cfg.chunks)
    ranks = set(e.ranks)
    if len(ranks) == cfg.ranks:
        data = (row,) * cfg.ranks
        step = uniform_row(new, cfg.ranks)
        pc = (TxnState.TAIL,) * cfg.ranks
    else:
        data = tuple(row if r in ranks else d for r, d in enumerate(s.data))
        step = tuple(new if r in ranks else x for r, x in enumerate(s.step))
        pc = tuple(TxnState.TAIL if r in ranks else p for r, p in enumerate(s.pc))
    par = s.par
    if m.aggregation is not Aggregation.NO_PARITY_FOLD:
        touched: dict[int, list[int]] = {}
        for r in e.ranks:
            touched.setdefault(m.node_of[r], []).append(m.member[r])
        par = tuple(
            p if p is None or n not in touched else _fold(p, touched[n], new)
            for n, p in enumerate(s.par)
        )
    # no effect: the ranks did the work before the coordinator heard of it
    return attrs.evolve(s, data=data, step=step, pc=pc, par=par), ()


# Close -----------------------------------------------------------------------------


@_handler(ev.Close)(_trainer_guard)
def _u_close(
    m: ClusterModel, s: ClusterState, e: ev.Close
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r = e.rank
    return attrs.evolve(
        s, pc=_set(s.pc, r, TXN.next(s.pc[r], e)), tail=_set(s.tail, r, s.step[r])
    ), (fx.KeepProcessState(r, s.step[r]),)


# Tier2Snapshot ---------------------------------------------------------------------


def _g_t2(m: ClusterModel, s: ClusterState, e: ev.Tier2Snapshot) -> ProtocolError | None:
    if not RECOVERY.accepts(s.phase, e):
        return _err("recovery", s.phase, e, "")
    st = s.step[0]
    if st <= s.t2:
        return _err("recovery", s.phase, e, "the snapshot is current")
    for r in range(m.config.ranks):
        if s.pc[r] is not TxnState.IDLE or s.step[r] != st or not is_uniform(s.data[r], st):
            return _err("txn", s.pc[r], e, f"rank {r} is not idle at step {st}")
    return None


@_handler(ev.Tier2Snapshot)(_g_t2)
def _u_t2(
    m: ClusterModel, s: ClusterState, e: ev.Tier2Snapshot
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return attrs.evolve(s, t2=s.step[0], t2lost=frozenset()), (fx.TakeSnapshot(s.step[0]),)


# BeginCheckpoint / WriteShard / CheckpointDurable ----------------------------------


def _g_begin_ckpt(m: ClusterModel, s: ClusterState, e: ev.BeginCheckpoint) -> ProtocolError | None:
    if not RECOVERY.accepts(s.phase, e):
        return _err("recovery", s.phase, e, "")
    if s.cpend != NONE:
        return _err("checkpoint", s.phase, e, f"the checkpoint at step {s.cpend} is in progress")
    st = s.step[0]
    if st <= s.ckpt:
        return _err("checkpoint", s.phase, e, f"step {st} is not past the durable {s.ckpt}")
    for r in range(m.config.ranks):
        if s.pc[r] is not TxnState.IDLE or s.step[r] != st or not is_uniform(s.data[r], st):
            return _err("txn", s.pc[r], e, f"rank {r} is not idle at step {st}")
    return None


@_handler(ev.BeginCheckpoint)(_g_begin_ckpt)
def _u_begin_ckpt(
    m: ClusterModel, s: ClusterState, e: ev.BeginCheckpoint
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return attrs.evolve(s, cpend=s.step[0], ckdone=frozenset()), (fx.SaveCheckpoint(s.step[0]),)


def _g_shard(m: ClusterModel, s: ClusterState, e: ev.WriteShard) -> ProtocolError | None:
    err = _rank_ok(m, s, e)
    if err:
        return err
    r = e.rank
    if not m.active(s, r):
        return _err("keeper", s.phase, e, f"rank {r} is not a writer of generation {s.gen}")
    if s.cpend == NONE:
        return _err("checkpoint", s.phase, e, "no checkpoint in progress")
    if r in s.ckdone:
        return _err("checkpoint", s.phase, e, f"rank {r}'s shard is written already")
    return None


@_handler(ev.WriteShard)(_g_shard)
def _u_shard(
    m: ClusterModel, s: ClusterState, e: ev.WriteShard
) -> tuple[ClusterState, tuple[Effect, ...]]:
    # no effect: the writer did the work before the coordinator heard of it
    return attrs.evolve(s, ckdone=s.ckdone | {e.rank}), ()


def _g_durable(m: ClusterModel, s: ClusterState, e: ev.CheckpointDurable) -> ProtocolError | None:
    if not RECOVERY.accepts(s.phase, e):
        return _err("recovery", s.phase, e, "")
    if s.cpend == NONE:
        return _err("checkpoint", s.phase, e, "no checkpoint in progress")
    need = 1 if m.config.mutant is Mutant.EARLY_DURABLE else m.config.ranks
    if len(s.ckdone) < need:
        missing = sorted(set(range(m.config.ranks)) - s.ckdone)
        return _err("checkpoint", s.phase, e, f"writers {missing} have not finished")
    return None


@_handler(ev.CheckpointDurable)(_g_durable)
def _u_durable(
    m: ClusterModel, s: ClusterState, e: ev.CheckpointDurable
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return attrs.evolve(
        s,
        ckpt=s.cpend,
        ckmiss=frozenset(range(m.config.ranks)) - s.ckdone,
        cpend=NONE,
        ckdone=frozenset(),
    ), (fx.PublishCheckpoint(s.cpend),)


# Shadows ---------------------------------------------------------------------------


def _shadow_guard(m: ClusterModel, s: ClusterState, e: Any) -> ProtocolError | None:
    err = _rank_ok(m, s, e)
    if err:
        return err
    if isinstance(e, ev.ShadowReclaim) and not m.config.reclaim:
        return _err("shadow", s.shadow[e.rank], e, "memory reclaim is off")
    if not SHADOW.accepts(s.shadow[e.rank], e):
        return _err("shadow", s.shadow[e.rank], e, "")
    return None


def _u_shadow(m: ClusterModel, s: ClusterState, e: Any) -> tuple[ClusterState, tuple[Effect, ...]]:
    r = e.rank
    new = SHADOW.next(s.shadow[r], e)
    effect = fx.WarmShadow(r) if new is ShadowState.WARM else fx.ReclaimShadow(r)
    return attrs.evolve(s, shadow=_set(s.shadow, r, new)), (effect,)


_handler(ev.ShadowWarm)(_shadow_guard)(_u_shadow)
_handler(ev.ShadowReclaim)(_shadow_guard)(_u_shadow)


# Faults ----------------------------------------------------------------------------


def _fault_budget(m: ClusterModel, s: ClusterState, e: Any, kind: str) -> ProtocolError | None:
    if kind not in m.config.faults:
        return _err("fault", s.phase, e, f"{kind} faults are not in this model")
    if s.faults >= m.config.max_faults:
        return _err("fault", s.phase, e, f"fault budget {m.config.max_faults} spent")
    return None


def _g_trainer_fault(m: ClusterModel, s: ClusterState, e: Any) -> ProtocolError | None:
    err = _rank_ok(m, s, e) or _fault_budget(
        m, s, e, "crash" if isinstance(e, ev.Crash) else "hang"
    )
    if err:
        return err
    if not TRAINER.accepts(s.trainer[e.rank], e):
        return _err("trainer", s.trainer[e.rank], e, "")
    return None


def _u_trainer_fault(
    m: ClusterModel, s: ClusterState, e: Any
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r = e.rank
    return attrs.evolve(
        s, trainer=_set(s.trainer, r, TRAINER.next(s.trainer[r], e)), faults=s.faults + 1
    ), (fx.Crash(r) if isinstance(e, ev.Crash) else fx.Hang(r),)


_handler(ev.Crash)(_g_trainer_fault)(_u_trainer_fault)
_handler(ev.Hang)(_g_trainer_fault)(_u_trainer_fault)


def _lose_rank_memory(s: ClusterState, r: int, e: Any) -> dict[str, Any]:
    C = len(s.data[r])
    return {
        "data": _set(s.data, r, (LOST,) * C),
        "undo": _set(s.undo, r, (NONE,) * C),
        "grad": _set(s.grad, r, LOST),
        "trainer": _set(s.trainer, r, TRAINER.next(s.trainer[r], e)),
        "mlost": s.mlost | {r},
    }


def _g_lose_memory(m: ClusterModel, s: ClusterState, e: ev.LoseMemory) -> ProtocolError | None:
    err = _rank_ok(m, s, e) or _fault_budget(m, s, e, "lose_memory")
    if err:
        return err
    if all(d == LOST for d in s.data[e.rank]):
        return _err("chunk", ChunkState.LOST, e, "already lost")
    return None


@_handler(ev.LoseMemory)(_g_lose_memory)
def _u_lose_memory(
    m: ClusterModel, s: ClusterState, e: ev.LoseMemory
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return attrs.evolve(s, faults=s.faults + 1, **_lose_rank_memory(s, e.rank, e)), (
        fx.LoseMemory(e.rank),
    )


def _g_lose_node(m: ClusterModel, s: ClusterState, e: ev.LoseNode) -> ProtocolError | None:
    if e.node >= m.config.topology.nodes:
        return _err("cluster", s.phase, e, f"node {e.node} out of range")
    err = _fault_budget(m, s, e, "lose_node")
    if err:
        return err
    if e.node in s.nlost:
        return _err("fault", s.phase, e, "node already lost in this recovery")
    return None


@_handler(ev.LoseNode)(_g_lose_node)
def _u_lose_node(
    m: ClusterModel, s: ClusterState, e: ev.LoseNode
) -> tuple[ClusterState, tuple[Effect, ...]]:
    n = e.node
    for r in m.config.groups[n]:
        s = attrs.evolve(
            s,
            shadow=_set(s.shadow, r, SHADOW.next(s.shadow[r], e)),
            stale=_set(s.stale, r, False),
            **_lose_rank_memory(s, r, e),
        )
    return attrs.evolve(
        s,
        par=_set(s.par, n, None),
        gpar=_set(s.gpar, n, None),
        t2lost=s.t2lost | {n},
        nlost=s.nlost | {n},
        faults=s.faults + 1,
    ), (fx.LoseNode(n),)


# Keeper fencing --------------------------------------------------------------------


def _g_stale(m: ClusterModel, s: ClusterState, e: ev.StaleWrite) -> ProtocolError | None:
    err = _rank_ok(m, s, e)
    if err:
        return err
    if not s.stale[e.rank]:
        return _err("keeper", s.phase, e, f"rank {e.rank} has no process of an old generation")
    return None


@_handler(ev.StaleWrite)(_g_stale)
def _u_stale(
    m: ClusterModel, s: ClusterState, e: ev.StaleWrite
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r, c = e.rank, e.chunk
    stale = _set(s.stale, r, False)
    state = classify(s.data[r][c], s.undo[r][c])
    if m.config.mutant is Mutant.NO_FENCING and CHUNK.accepts(state, e):
        return attrs.evolve(
            s,
            stale=stale,
            data=_set2(s.data, r, c, GARBAGE),
            undo=_set2(s.undo, r, c, NONE),
            stale_writes=s.stale_writes + 1,
        ), (fx.StaleWriteAccepted(r, c),)
    return attrs.evolve(s, stale=stale), (
        fx.RefuseStaleWrite(r, c),
        fx.KillStale(r),
    )


# Recovery coordinator --------------------------------------------------------------


def _phase_guard(m: ClusterModel, s: ClusterState, e: Any) -> ProtocolError | None:
    if not RECOVERY.accepts(s.phase, e):
        return _err("recovery", s.phase, e, "")
    return None


def _all_alive(m: ClusterModel, s: ClusterState, e: Any) -> ProtocolError | None:
    err = _phase_guard(m, s, e)
    if err:
        return err
    for r, t in enumerate(s.trainer):
        if t is not TrainerState.ALIVE:
            return _err("recovery", s.phase, e, f"rank {r}'s trainer is {t.name}")
    return None


def _g_detect(m: ClusterModel, s: ClusterState, e: ev.Detect) -> ProtocolError | None:
    err = _phase_guard(m, s, e)
    if err:
        return err
    if all(t is TrainerState.ALIVE for t in s.trainer):
        return _err("recovery", s.phase, e, "no failed trainer")
    if s.phase is Phase.PROMOTING and TrainerState.HUNG not in s.trainer:
        return _err("recovery", s.phase, e, "failed ranks are being promoted")
    return None


@_handler(ev.Detect)(_g_detect)
def _u_detect(
    m: ClusterModel, s: ClusterState, e: ev.Detect
) -> tuple[ClusterState, tuple[Effect, ...]]:
    failed = [r for r, t in enumerate(s.trainer) if t is not TrainerState.ALIVE]
    return attrs.evolve(s, phase=RECOVERY.next(s.phase, e)), (
        fx.Detected(failed, s.phase is not Phase.RUNNING),
    )


@_handler(ev.Fence)(_phase_guard)
def _u_fence(
    m: ClusterModel, s: ClusterState, e: ev.Fence
) -> tuple[ClusterState, tuple[Effect, ...]]:
    trainer = list(s.trainer)
    stale = list(s.stale)
    for r, t in enumerate(s.trainer):
        if TRAINER.accepts(t, e):  # a hung trainer becomes a stale process
            trainer[r] = TRAINER.next(t, e)
            stale[r] = True
    gen = s.gen + 1
    # a checkpoint in progress is aborted: its writers are fenced
    abort: tuple[Effect, ...] = () if s.cpend == NONE else (fx.AbortCheckpoint(s.cpend),)
    return attrs.evolve(
        s,
        gen=gen,
        trainer=tuple(trainer),
        stale=tuple(stale),
        prepared=frozenset(),
        commit=COMMIT.next(s.commit, e),
        phase=RECOVERY.next(s.phase, e),
        cpend=NONE,
        ckdone=frozenset(),
    ), (fx.Fence(gen), fx.AbortCollectives(gen - 1), *abort)


def _g_give_up(m: ClusterModel, s: ClusterState, e: ev.GiveUp) -> ProtocolError | None:
    err = _phase_guard(m, s, e)
    if err:
        return err
    if m.config.mutant is Mutant.NO_TIMEOUT and s.phase is Phase.PROMOTING:
        return _err("recovery", s.phase, e, "mutant no_timeout: no deadline while promoting")
    return None


@_handler(ev.GiveUp)(_g_give_up)
def _u_give_up(
    m: ClusterModel, s: ClusterState, e: ev.GiveUp
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return attrs.evolve(s, phase=RECOVERY.next(s.phase, e)), (fx.JobFailed(s.phase.value, s.gen),)


def _g_promote(m: ClusterModel, s: ClusterState, e: ev.Promote) -> ProtocolError | None:
    err = _rank_ok(m, s, e) or _phase_guard(m, s, e)
    if err:
        return err
    r = e.rank
    if not TRAINER.accepts(s.trainer[r], e):
        return _err("trainer", s.trainer[r], e, "")
    if not SHADOW.accepts(s.shadow[r], e):
        return _err("shadow", s.shadow[r], e, "no shadow ready")
    return None


@_handler(ev.Promote)(_g_promote)
def _u_promote(
    m: ClusterModel, s: ClusterState, e: ev.Promote
) -> tuple[ClusterState, tuple[Effect, ...]]:
    r = e.rank
    warm = s.shadow[r] is ShadowState.WARM
    return attrs.evolve(
        s,
        trainer=_set(s.trainer, r, TRAINER.next(s.trainer[r], e)),
        tgen=_set(s.tgen, r, s.gen),
        pc=_set(s.pc, r, TXN.next(s.pc[r], e)),
        shadow=_set(s.shadow, r, SHADOW.next(s.shadow[r], e)),
        promoted=s.promoted | {r},
    ), (fx.Promote(r, warm, s.gen), fx.SpawnShadow(r))


_handler(ev.EndPromote)(_all_alive)(
    lambda m, s, e: (attrs.evolve(s, phase=RECOVERY.next(s.phase, e)), ())
)


def _g_reconcile(m: ClusterModel, s: ClusterState, e: Any) -> ProtocolError | None:
    err = _phase_guard(m, s, e)
    if err:
        return err
    fallback = m.plan(s).fallback
    if isinstance(e, ev.Reconcile) and fallback:
        return _err("recovery", s.phase, e, "the loss is beyond both tiers: fall back")
    if isinstance(e, ev.GoFallback) and not fallback:
        return _err("recovery", s.phase, e, "recoverable in place: no fallback")
    return None


def _recovered(m: ClusterModel, s: ClusterState, e: Any, target: int, kind: Kind) -> ClusterState:
    cfg = m.config
    if cfg.mutant is Mutant.NO_UNDO and isinstance(e, ev.Reconcile):
        data = tuple(tuple(GARBAGE if d == TORN else target for d in row) for row in s.data)
    elif isinstance(e, ev.RestoreCheckpoint) and s.ckmiss:
        # a writer's missing shard (only the early_durable mutant leaves one) loads
        # bytes of no step
        data = tuple(
            uniform_row(GARBAGE if r in s.ckmiss else target, cfg.chunks) for r in range(cfg.ranks)
        )
    else:
        data = (uniform_row(target, cfg.chunks),) * cfg.ranks
    return attrs.evolve(
        s,
        data=data,
        undo=(uniform_row(NONE, cfg.chunks),) * cfg.ranks,
        grad=(NONE,) * cfg.ranks,
        par=reencoded_parity(cfg.groups, cfg.chunks, target),
        gpar=empty_grad_parity(cfg.groups),
        # an intact snapshot (no block lost) is kept: it is at most K steps back and
        # still covers a node loss; one that lost blocks is retaken at the target
        t2=s.t2 if isinstance(e, ev.Reconcile) and not s.t2lost else target,
        t2lost=frozenset(),
        committed=target,
        prepared=frozenset(),
        commit=COMMIT.next(s.commit, e),
        target=target,
        kind=kind,
        loss=s.committed - target,
        phase=RECOVERY.next(s.phase, e),
    )


@_handler(ev.Reconcile)(_g_reconcile)
def _u_reconcile(
    m: ClusterModel, s: ClusterState, e: ev.Reconcile
) -> tuple[ClusterState, tuple[Effect, ...]]:
    p = m.plan(s)
    assert p.target is not None
    effects: tuple[Effect, ...] = tuple(
        fx.RunRepair(x.what, x.rank, x.chunk, x.version, x.count) for x in p.repairs
    ) + (fx.Reconciled(p.target, p.kind.value, p.reason),)
    return _recovered(m, s, e, p.target, p.kind), effects


@_handler(ev.GoFallback)(_g_reconcile)
def _u_fallback(
    m: ClusterModel, s: ClusterState, e: ev.GoFallback
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return attrs.evolve(s, phase=RECOVERY.next(s.phase, e)), (fx.Fallback(m.plan(s).reason),)


@_handler(ev.RestoreCheckpoint)(_phase_guard)
def _u_restore(
    m: ClusterModel, s: ClusterState, e: ev.RestoreCheckpoint
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return _recovered(m, s, e, s.ckpt, Kind.CKPT), (fx.LoadCheckpoint(s.ckpt),)


@_handler(ev.Rebuild)(_all_alive)
def _u_rebuild(
    m: ClusterModel, s: ClusterState, e: ev.Rebuild
) -> tuple[ClusterState, tuple[Effect, ...]]:
    return attrs.evolve(s, tgen=(s.gen,) * m.config.ranks, phase=RECOVERY.next(s.phase, e)), (
        fx.RebuildCommunicator(s.gen),
    )


@_handler(ev.Resume)(_all_alive)
def _u_resume(
    m: ClusterModel, s: ClusterState, e: ev.Resume
) -> tuple[ClusterState, tuple[Effect, ...]]:
    R, target = m.config.ranks, s.target
    stale_shadow = m.config.mutant is Mutant.STALE_SHADOW
    step = tuple(0 if stale_shadow and r in s.promoted else target for r in range(R))
    # every rank resumes with the process state of the target after its loop tail: the
    # closed state its agent kept (or the snapshot's, the checkpoint's), else the closed
    # state of target - 1 with the tail replayed; the mutant restores the open state a
    # rank that finished the target sent (before its tail), not replayed
    stale_tail = m.config.mutant is Mutant.STALE_TAIL
    tail = tuple(
        step[r] if stale_shadow and r in s.promoted  # the shadow's own state, all of it
        else target - 1 if stale_tail and s.tail[r] < target <= s.step[r]
        else target
        for r in range(R)
    )  # fmt: skip
    return attrs.evolve(
        s,
        step=step,
        tail=tail,
        pc=tuple(TXN.next(p, e) for p in s.pc),
        target=NONE,
        promoted=frozenset(),
        mlost=frozenset(),
        nlost=frozenset(),
        phase=RECOVERY.next(s.phase, e),
    ), (fx.Resume(s.target, s.gen),)
