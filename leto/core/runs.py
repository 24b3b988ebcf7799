"""Rows of chunk values as runs: how a report or a record carries ranks x chunks state in
the size of its runs, not of its chunks.

A rank's row of chunk versions (or undo copies, or a node's parity records) is, between
two faults, one value repeated, or a few: ``[(value, count), ...]`` in chunk order says
it in O(runs). Decoding gives one shared tuple per distinct list of runs (a pure cache
of immutable values, as :func:`leto.core.chunk.uniform_row`), so the rows a thousand
ranks report alike are one object: adoption and TypeOK read each distinct row once
(:func:`distinct`), by identity first, and hash only those. Pure: values in, values out.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, TypeVar

from leto.core.chunk import uniform_row

__all__ = [
    "distinct",
    "distinct_zip",
    "from_runs",
    "records_from_runs",
    "records_runs_json",
    "row_from_runs",
    "runs_json",
    "to_runs",
]

T = TypeVar("T", bound=Hashable)


def to_runs(row: Sequence[T]) -> list[tuple[T, int]]:
    """``row`` as runs ``[(value, count), ...]`` in order (a uniform row in C time)."""
    if not row:
        return []
    if row.count(row[0]) == len(row):
        return [(row[0], len(row))]
    return [(v, len(list(g))) for v, g in itertools.groupby(row)]


@functools.lru_cache(maxsize=256)
def _row(runs: tuple[tuple[Any, int], ...]) -> tuple[Any, ...]:
    if len(runs) == 1 and type(runs[0][0]) is int:
        return uniform_row(runs[0][0], runs[0][1])
    return tuple(itertools.chain.from_iterable(itertools.repeat(v, n) for v, n in runs))


def from_runs(runs: Iterable[tuple[T, int]], n: int | None = None) -> tuple[T, ...]:
    """The row of ``n`` values (None: as many as the counts add to) ``runs`` describe,
    one shared tuple per distinct runs. ValueError names what is wrong: a count below
    1, or counts that do not add to ``n``."""
    key = tuple((v, c) for v, c in runs)
    if any(type(c) is not int or c < 1 for _, c in key):
        raise ValueError(f"runs {_show(key)}: a count below 1")
    total = sum(c for _, c in key)
    if n is not None and total != n:
        raise ValueError(f"runs {_show(key)} cover {total} chunks, not {n}")
    return _row(key)


def row_from_runs(runs: Any, n: int | None = None) -> tuple[int, ...]:
    """A row of ints from its JSON form ``[[value, count], ...]`` (TypeError or ValueError
    name what is wrong)."""
    if not isinstance(runs, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p) for p in runs
    ):
        raise TypeError(f"not runs [[value, count], ...]: {_show(runs)}")
    return from_runs(((v, c) for v, c in runs), n)


def runs_json(row: Sequence[int], memo: dict[int, Any] | None = None) -> list[list[int]]:
    """``row`` as JSON runs ``[[value, count], ...]``; ``memo`` (by identity) encodes a
    row shared by many ranks once."""
    if memo is not None and id(row) in memo:
        return memo[id(row)]  # type: ignore[no-any-return]
    out = [[v, c] for v, c in to_runs(row)]
    if memo is not None:
        memo[id(row)] = out
    return out


def records_runs_json(records: Sequence[Sequence[int]]) -> list[list[Any]]:
    """A node's parity records (per chunk, a tuple of its members' versions) as JSON
    runs ``[[[version, ...], count], ...]``."""
    return [[list(v), c] for v, c in to_runs([tuple(r) for r in records])]


def records_from_runs(runs: Any) -> tuple[tuple[int, ...], ...]:
    """The parity records :func:`records_runs_json` describes (TypeError or ValueError
    name what is wrong)."""
    if not isinstance(runs, list) or not all(
        isinstance(p, list)
        and len(p) == 2
        and isinstance(p[0], list)
        and all(type(x) is int for x in p[0])
        and type(p[1]) is int
        for p in runs
    ):
        raise TypeError(f"not runs of records [[[version, ...], count], ...]: {_show(runs)}")
    return from_runs((tuple(v), c) for v, c in runs)


def distinct(rows: Iterable[T]) -> set[T]:
    """The distinct values of ``rows`` (objects that stay alive meanwhile, as a state's
    rows do): each object is hashed once however often it recurs (rows shared by
    identity cost one hash, not one per rank)."""
    seq = rows if isinstance(rows, tuple | list) else tuple(rows)
    if seq and seq.count(seq[0]) == len(seq):  # one value (by identity first): in C
        return {seq[0]}
    return set({id(r): r for r in seq}.values())


def distinct_zip(*columns: Sequence[T]) -> set[tuple[T, ...]]:
    """The distinct tuples of ``zip(*columns)``, keyed by the identities of their items
    first: a tuple of shared rows is hashed once, not once per rank."""
    return set({tuple(map(id, t)): t for t in zip(*columns, strict=True)}.values())


def _show(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."
