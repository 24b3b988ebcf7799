"""Adopting the retained state the trainers report: the model's picture of memory.

During RECONCILING every trainer reads its retained headers (each chunk's version,
torn or applied with an undo copy, checksum failures, sealed gradients, its node's
parity records) and the coordinator confirms its tier-2 snapshot. That report, not the
model's own record of the events it was fed, is what the reconcile plan is computed
from: a trainer that died between doing something and reporting it leaves the model one
event behind, the headers never are. The report is adopted only where the model could
have come to it (:func:`adoption_refusal`; ``spec/PROTOCOL.md``, "Adopting the
retained state"): a refusal is a :class:`~leto.core.errors.ProtocolError` and leaves
the state unchanged. Pure: values in, a state out.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs

from leto.core.chunk import LOST, NONE, TORN
from leto.core.cluster import ClusterModel, ClusterState
from leto.core.errors import ProtocolError
from leto.core.properties import INVARIANTS, grad_parity_ok
from leto.core.recovery import Phase
from leto.core.runs import (
    distinct,
    distinct_zip,
    records_from_runs,
    records_runs_json,
    row_from_runs,
    runs_json,
)
from leto.core.trainer import TrainerState

__all__ = ["Adopt", "Retained", "adopt", "adoption_refusal"]

Par = tuple[tuple[int, ...], ...] | None


@attrs.frozen
class Retained:
    """The retained state as the trainers found it, read during a recovery, and the
    tier-2 snapshot the coordinator holds confirmed. The model's data/undo/grad/par/gpar
    are its picture of memory; a trainer that died between doing something and
    reporting it leaves that picture one event behind, the retained headers never are."""

    data: tuple[tuple[int, ...], ...]
    undo: tuple[tuple[int, ...], ...]
    grad: tuple[int, ...]
    par: tuple[Par, ...]
    gpar: tuple[tuple[int, ...] | None, ...]
    t2: int
    t2lost: frozenset[int]

    def to_record(self) -> dict[str, Any]:
        """As JSON, every row as runs (``[[value, count], ...]``: O(runs), a row
        shared by many ranks encoded once)."""
        memo: dict[int, Any] = {}
        return {
            "data_runs": [runs_json(d, memo) for d in self.data],
            "undo_runs": [runs_json(u, memo) for u in self.undo],
            "grad": list(self.grad),
            "par_runs": [None if p is None else records_runs_json(p) for p in self.par],
            "gpar": [None if g is None else list(g) for g in self.gpar],
            "t2": self.t2,
            "t2lost": sorted(self.t2lost),
        }

    @classmethod
    def from_record(cls, rec: Any) -> Retained:
        """From :meth:`to_record`'s JSON (or the former one, every chunk's value
        listed); rows alike decode to one shared tuple."""
        if not isinstance(rec, dict):
            raise ValueError(f"adopt must be an object, got {rec!r}")
        try:
            if "data_runs" in rec:
                data = tuple(row_from_runs(x) for x in _list(rec["data_runs"]))
                undo = tuple(row_from_runs(x) for x in _list(rec["undo_runs"]))
                par = tuple(None if p is None else records_from_runs(p) for p in rec["par_runs"])
            else:
                data, undo = _ints2(rec["data"]), _ints2(rec["undo"])
                par = tuple(None if p is None else _ints2(p) for p in rec["par"])
            return cls(
                data=data,
                undo=undo,
                grad=_ints(rec["grad"]),
                par=par,
                gpar=tuple(None if g is None else _ints(g) for g in rec["gpar"]),
                t2=_int(rec["t2"]),
                t2lost=frozenset(_ints(rec["t2lost"])),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"adopt: malformed retained state ({type(e).__name__}: {e})") from None


def _list(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise TypeError(f"not a list: {v!r}"[:120])
    return v


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"not an int: {v!r}")
    return v


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise TypeError(f"not a list: {v!r}")
    return tuple(_int(x) for x in v)


def _ints2(v: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(v, list):
        raise TypeError(f"not a list: {v!r}")
    return tuple(_ints(x) for x in v)


@attrs.frozen
class Adopt:
    """The adoption, named in a refusal."""

    generation: int

    def __repr__(self) -> str:
        return f"Adopt(retained state of generation {self.generation})"


def adoption_refusal(model: ClusterModel, s: ClusterState, r: Retained) -> str | None:
    """Why ``r`` cannot replace ``s``'s picture of memory; None if it can.

    Only while reconciling (every trainer alive after EndPromote, before Reconcile:
    the plan is computed from it next); shapes of this topology; values a header can
    hold (a step, TORN, LOST; undo NONE or a step; gradients NONE, LOST or a step;
    parity versions NONE or a step); and nothing the model lost comes back (a chunk or
    gradient block LOST in the model is LOST in the report: memory a fault took is not
    found again; the reverse, a chunk failing its checksum, is what reports are for).
    """
    cfg = model.config
    R, C = cfg.ranks, cfg.chunks
    if s.phase is not Phase.RECONCILING:
        return "the retained state is adopted only while reconciling"
    for q, t in enumerate(s.trainer):
        if t is not TrainerState.ALIVE:
            return f"rank {q}'s trainer is {t.value}"
    if len(r.data) != R or len(r.undo) != R or len(r.grad) != R:
        return f"{R} ranks expected, got data {len(r.data)}, undo {len(r.undo)}, grad {len(r.grad)}"
    # each distinct (report, model) row once (few: the rows of a step are alike, and
    # shared by identity: only distinct objects are hashed)
    rows = distinct_zip(r.data, r.undo, s.data)
    rows_ok = all(len(d) == len(u) == C and _row_ok(d, u, m) for d, u, m in rows)
    for q in range(R):
        if len(r.data[q]) != C or len(r.undo[q]) != C:
            return (
                f"rank {q}: {C} chunks expected, got data {list(r.data[q])} undo {list(r.undo[q])}"
            )
        why = None if rows_ok else _row_refusal(q, r, s)
        if why is not None:
            return why
        g = r.grad[q]
        if g < 0 and g not in (NONE, LOST):
            return f"rank {q}: no gradient value {g}"
        if s.grad[q] == LOST and g != LOST:
            return f"rank {q}'s gradients are LOST in the model, reported {g}"
    groups = cfg.groups
    if len(r.par) != len(groups) or len(r.gpar) != len(groups):
        return f"{len(groups)} nodes expected, got par {len(r.par)}, gpar {len(r.gpar)}"
    for n, members in enumerate(groups):
        p, gp = r.par[n], r.gpar[n]
        records = distinct(p or ())  # a chunk's record per chunk: few distinct, shared
        if p is not None and (len(p) != C or {len(x) for x in records} - {len(members)}):
            return f"node {n}: parity of {C} chunks x {len(members)} members expected, got {p}"
        if gp is not None and len(gp) != len(members):
            return f"node {n}: gradient parity of {len(members)} members expected, got {gp}"
        versions = {*itertools.chain.from_iterable(records), *(gp or ())}
        if any(v < 0 and v != NONE for v in versions):
            return f"node {n}: no parity version in {p} / {gp}"
    if r.t2 < 0 or not r.t2lost <= set(range(len(groups))):
        return f"tier 2: snapshot step {r.t2}, lost blocks of nodes {sorted(r.t2lost)}"
    after = _adopted(model, s, r)
    if not _type_ok(model, after):
        return "the reported state breaks TypeOK"
    if not grad_parity_ok(model, after):
        return (
            "the reported state breaks ParityOK's gradient clause: a node's gradient "
            "parity names gradients a member does not hold"
        )
    return None


def _row_ok(data: tuple[int, ...], undo: tuple[int, ...], model: tuple[int, ...]) -> bool:
    """:func:`_row_refusal` finds nothing, read by distinct values (O(chunks) in C, not
    in Python): every value one a header can hold, and no chunk the model lost found."""
    return (
        all(d >= 0 or d in (TORN, LOST) for d in set(data))
        and all(u >= 0 or u == NONE for u in set(undo))
        and (
            LOST not in model
            or all(d == LOST for d, m in zip(data, model, strict=True) if m == LOST)
        )
    )


def _row_refusal(q: int, r: Retained, s: ClusterState) -> str | None:
    """The first chunk of rank ``q`` whose report cannot be adopted, and why."""
    for c, (d, u) in enumerate(zip(r.data[q], r.undo[q], strict=True)):
        if d < 0 and d not in (TORN, LOST):
            return f"rank {q} chunk {c}: no chunk value {d}"
        if u < 0 and u != NONE:
            return f"rank {q} chunk {c}: no undo value {u}"
        if s.data[q][c] == LOST and d != LOST:
            return f"rank {q} chunk {c} is LOST in the model, reported {d}"
    return None


# ParityOK's chunk clause is not asked of a report: a chunk whose bytes fail their
# checksum (silent corruption, outside the spec) is reported TORN or LOST while its
# node's parity still encodes the version it had; that is what reports are for.
_TYPE_OK = next(inv for inv in INVARIANTS if inv.name == "TypeOK")


def _type_ok(model: ClusterModel, s: ClusterState) -> bool:
    return _TYPE_OK.holds(model, s)


def _adopted(model: ClusterModel, s: ClusterState, r: Retained) -> ClusterState:
    par = r.par if model.config.tier1 else (None,) * len(r.par)
    gpar = r.gpar if model.config.tier1 else (None,) * len(r.gpar)
    return attrs.evolve(
        s, data=r.data, undo=r.undo, grad=r.grad, par=par, gpar=gpar, t2=r.t2, t2lost=r.t2lost
    )


def adopt(model: ClusterModel, s: ClusterState, r: Retained) -> ClusterState:
    """``s`` with the retained state ``r`` as its picture of memory (checked by
    :func:`adoption_refusal`; a refusal raises :class:`ProtocolError`, ``s`` unchanged)."""
    why = adoption_refusal(model, s, r)
    if why is not None:
        raise ProtocolError("cluster", s.phase, Adopt(s.gen), why)
    return _adopted(model, s, r)
