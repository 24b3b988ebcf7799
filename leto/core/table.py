"""Transition tables as data: ``(state, event type) -> state``.

Every machine of the core is one such table (h11's ``_state.py`` is the model). The
table only says which events a state accepts and where they lead; the cross-machine
guards (is every rank prepared? is the writer of the current generation?) live in the
model's handlers (:mod:`leto.core.handlers`), next to the effects they gate.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Generic, TypeVar

import attrs

from leto.core.errors import ProtocolError

S = TypeVar("S", bound=enum.Enum)


@attrs.frozen
class Table(Generic[S]):
    """A named transition table."""

    machine: str
    transitions: Mapping[tuple[S, type], S]

    @classmethod
    def build(
        cls,
        machine: str,
        rows: Iterable[tuple[S | Iterable[S], type | Iterable[type], S | None]],
    ) -> Table[S]:
        """Rows are ``(from, event, to)``; ``from`` and ``event`` may be collections,
        and ``to=None`` means "stays in the same state"."""
        out: dict[tuple[S, type], S] = {}
        for src, ev, dst in rows:
            srcs: Iterable[S] = [src] if isinstance(src, enum.Enum) else src
            evs: Iterable[type] = [ev] if isinstance(ev, type) else ev
            for s in srcs:
                for e in evs:
                    key = (s, e)
                    if key in out:
                        raise ValueError(f"{machine}: duplicate row for {s.name} x {e.__name__}")
                    out[key] = s if dst is None else dst
        return cls(machine=machine, transitions=out)

    def accepts(self, state: S, event: object) -> bool:
        return (state, type(event)) in self.transitions

    def next(self, state: S, event: object) -> S:
        try:
            return self.transitions[(state, type(event))]
        except KeyError:
            raise ProtocolError(self.machine, state, event) from None

    def events(self) -> frozenset[type]:
        return frozenset(e for _, e in self.transitions)

    def states(self) -> frozenset[S]:
        return frozenset(s for s, _ in self.transitions) | frozenset(self.transitions.values())
