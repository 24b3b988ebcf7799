"""The guards and updates of the model's events: what they share, and how they are entered.

Each event type has one pair: a guard that returns ``None`` where the event is enabled
(else the :class:`~leto.core.errors.ProtocolError` to raise) and an update that returns
the next state and the effects a backend must carry out. Each area's module
(:mod:`~leto.core.commit_handlers`, :mod:`~leto.core.aggregated_handlers`,
:mod:`~leto.core.checkpoint_handlers`, :mod:`~leto.core.fault_handlers`,
:mod:`~leto.core.recovery_handlers`) enters its pairs in its own ``HANDLERS`` table;
:class:`~leto.core.cluster.ClusterModel` dispatches on their union. The handlers see the
model as a :class:`ModelView`, so they need not import the module that dispatches to
them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from leto.core.chunk import ChunkState
from leto.core.config import Aggregation, ClusterConfig
from leto.core.effects import Effect
from leto.core.errors import ProtocolError
from leto.core.reconcile import Plan
from leto.core.state import ClusterState
from leto.core.table import Table


class ModelView(Protocol):
    """What a guard or an update reads of :class:`~leto.core.cluster.ClusterModel`."""

    @property
    def config(self) -> ClusterConfig: ...

    @property
    def aggregation(self) -> Aggregation: ...

    @property
    def node_of(self) -> tuple[int, ...]: ...

    @property
    def member(self) -> tuple[int, ...]: ...

    @property
    def chunk_table(self) -> Table[ChunkState]: ...

    def plan(self, s: ClusterState) -> Plan: ...

    def active(self, s: ClusterState, r: int) -> bool: ...


Guard = Callable[[ModelView, ClusterState, Any], ProtocolError | None]
Update = Callable[[ModelView, ClusterState, Any], tuple[ClusterState, tuple[Effect, ...]]]
Handlers = dict[type, tuple[Guard, Update]]


def registrar(table: Handlers) -> Callable[[type], Callable[[Guard], Callable[[Update], Update]]]:
    """The decorator ``_handler(event_type)(guard)`` that enters an update in ``table``."""

    def _handler(event_type: type) -> Callable[[Guard], Callable[[Update], Update]]:
        def register_guard(guard: Guard) -> Callable[[Update], Update]:
            def register_update(update: Update) -> Update:
                table[event_type] = (guard, update)
                return update

            return register_update

        return register_guard

    return _handler


def _set(t: tuple[Any, ...], i: int, v: Any) -> tuple[Any, ...]:
    return t[:i] + (v,) + t[i + 1 :]


def _set2(t: tuple[tuple[Any, ...], ...], i: int, j: int, v: Any) -> tuple[tuple[Any, ...], ...]:
    return _set(t, i, _set(t[i], j, v))


def _err(machine: str, state: Any, e: Any, why: str) -> ProtocolError:
    return ProtocolError(machine, state, e, why)


def _rank_ok(m: ModelView, s: ClusterState, e: Any) -> ProtocolError | None:
    if e.rank >= m.config.ranks:
        return _err("cluster", s.phase, e, f"rank {e.rank} out of range 0..{m.config.ranks - 1}")
    if hasattr(e, "chunk") and e.chunk >= m.config.chunks:
        return _err("cluster", s.phase, e, f"chunk {e.chunk} out of range 0..{m.config.chunks - 1}")
    return None
