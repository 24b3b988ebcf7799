"""The core's :class:`~leto.core.cluster.ClusterState` as a JSON record, and back.

What a coordinator that takes over needs is its predecessor's model state. The log of
everything fed (:mod:`leto.spec.trace`) rebuilds it, but grows with every step; a
state written down now and then lets the log before it go (``core_state`` records:
:func:`leto.spec.trace.rebuild` starts from the last one). The codec is one table,
field by field: a field added to the state and not to :data:`DECODE` is refused, not
silently dropped (``test_state_record``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import attrs

from leto.core.cluster import ClusterState
from leto.core.recovery import Kind, Phase
from leto.core.shadow import ShadowState
from leto.core.trainer import TrainerState
from leto.core.txn import CommitState, TxnState

__all__ = ["DECODE", "StateRecordError", "state_from_record", "state_to_record"]


class StateRecordError(ValueError):
    """A record that is not a state of the model: one line naming the field."""


def _enc(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, frozenset):
        return sorted(v)
    if isinstance(v, tuple):
        return [_enc(x) for x in v]
    return v


def _ints(v: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in v)


def _rows(v: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(_ints(r) for r in v)


def _of(kind: type[enum.Enum]) -> Callable[[Any], tuple[Any, ...]]:
    return lambda v: tuple(kind(x) for x in v)


DECODE: dict[str, Callable[[Any], Any]] = {
    "trainer": _of(TrainerState),
    "tgen": _ints,
    "pc": _of(TxnState),
    "step": _ints,
    "tail": _ints,
    "data": _rows,
    "undo": _rows,
    "grad": _ints,
    "shadow": _of(ShadowState),
    "stale": lambda v: tuple(bool(x) for x in v),
    "par": lambda v: tuple(None if p is None else _rows(p) for p in v),
    "gpar": lambda v: tuple(None if g is None else _ints(g) for g in v),
    "gen": int,
    "phase": Phase,
    "commit": CommitState,
    "committed": int,
    "prepared": frozenset,
    "faults": int,
    "t2": int,
    "t2lost": frozenset,
    "target": int,
    "kind": Kind,
    "loss": int,
    "mlost": frozenset,
    "nlost": frozenset,
    "promoted": frozenset,
    "stale_writes": int,
    "ckpt": int,
    "cpend": int,
    "ckdone": frozenset,
    "ckmiss": frozenset,
}


def state_to_record(state: ClusterState) -> dict[str, Any]:
    """Every field of ``state`` as JSON values (enums by value, sets sorted)."""
    return {f.name: _enc(getattr(state, f.name)) for f in attrs.fields(ClusterState)}


def state_from_record(record: Any) -> ClusterState:
    """The state :func:`state_to_record` wrote; :class:`StateRecordError` otherwise."""
    if not isinstance(record, dict):
        raise StateRecordError("a model state record is a JSON object")
    names = [f.name for f in attrs.fields(ClusterState)]
    missing = [n for n in names if n not in record]
    extra = sorted(set(record) - set(names))
    if missing or extra:
        raise StateRecordError(f"a model state record without {missing} or with {extra}")
    fields = {}
    for name in names:
        try:
            fields[name] = DECODE[name](record[name])
        except KeyError:
            raise StateRecordError(f"no decoder for the state's field {name!r}") from None
        except (TypeError, ValueError) as e:
            raise StateRecordError(f"the state's field {name!r}: {e}") from None
    return ClusterState(**fields)
