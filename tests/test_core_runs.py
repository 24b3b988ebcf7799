"""Rows of chunk values as runs (leto.core.runs): what a trainer's report and the
adoption's record carry. Round trips, shared rows, refusals, and the adoption from
runs equal to the adoption from every chunk listed."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leto.core.adopt import Retained
from leto.core.chunk import LOST, NONE, TORN, uniform_row
from leto.core.runs import (
    distinct,
    distinct_zip,
    from_runs,
    records_from_runs,
    records_runs_json,
    row_from_runs,
    runs_json,
    to_runs,
)

values = st.sampled_from([0, 1, 2, 7, TORN, LOST, NONE])
rows = st.lists(values, min_size=0, max_size=40)


@given(rows)
def test_runs_round_trip_and_are_maximal(row: list[int]) -> None:
    runs = to_runs(row)
    assert from_runs(runs, len(row)) == tuple(row)
    assert all(c >= 1 for _, c in runs) and sum(c for _, c in runs) == len(row)
    assert all(a[0] != b[0] for a, b in zip(runs, runs[1:], strict=False))  # no two alike
    assert row_from_runs(json.loads(json.dumps(runs_json(row)))) == tuple(row)


def test_rows_alike_decode_to_one_shared_tuple() -> None:
    a = row_from_runs([[3, 5], [TORN, 1], [2, 10]])
    b = row_from_runs([[3, 5], [TORN, 1], [2, 10]])
    assert a is b and a == (3,) * 5 + (TORN,) + (2,) * 10
    # one run: the row every model state shares for that value
    assert row_from_runs([[4, 4096]]) is uniform_row(4, 4096)


@pytest.mark.parametrize(
    ("runs", "n", "says"),
    [
        ([[1, 0]], None, "a count below 1"),
        ([[1, -2], [2, 4]], None, "a count below 1"),
        ([[1, 3]], 4, "cover 3 chunks, not 4"),
        ([[1, 2, 3]], None, "not runs"),
        ([[1, True]], None, "not runs"),
        ("1x4", None, "not runs"),
    ],
)
def test_malformed_runs_are_refused_naming_what_is_wrong(runs: object, n: int, says: str) -> None:
    with pytest.raises((TypeError, ValueError), match=says):
        row_from_runs(runs, n)


@given(st.lists(st.tuples(values, values), min_size=1, max_size=30))
def test_parity_records_round_trip_as_runs(records: list[tuple[int, int]]) -> None:
    text = json.dumps(records_runs_json(records))
    assert records_from_runs(json.loads(text)) == tuple(records)


def test_parity_records_of_the_wrong_shape_are_refused() -> None:
    with pytest.raises(TypeError, match="not runs of records"):
        records_from_runs([[1, 2]])
    with pytest.raises(ValueError, match="a count below 1"):
        records_from_runs([[[1, 1], 0]])


@given(st.lists(st.sampled_from(["a", "b"]), max_size=20), st.lists(rows, min_size=1, max_size=5))
def test_distinct_is_set_whatever_is_shared(picks: list[str], pool: list[list[int]]) -> None:
    objs = [tuple(r) for r in pool]
    seq = [
        objs[i % len(objs)] if p == "a" else tuple(objs[i % len(objs)]) for i, p in enumerate(picks)
    ]
    assert distinct(seq) == set(seq)
    assert distinct_zip(seq, seq[::-1]) == set(zip(seq, seq[::-1], strict=True))


def _retained(data: tuple[tuple[int, ...], ...]) -> Retained:
    return Retained(
        data=data,
        undo=tuple(uniform_row(NONE, len(d)) for d in data),
        grad=(1,) * len(data),
        par=(tuple((1, 1) for _ in data[0]),),
        gpar=((1, 1),),
        t2=0,
        t2lost=frozenset(),
    )


def test_the_adoption_record_is_runs_and_reads_back_the_same() -> None:
    r = _retained((uniform_row(3, 4096), (3,) * 4000 + (TORN,) * 96))
    rec = r.to_record()
    assert rec["data_runs"] == [[[3, 4096]], [[3, 4000], [TORN, 96]]]
    assert rec["par_runs"] == [[[[1, 1], 4096]]]
    assert len(json.dumps(rec)) < 300  # not 3 x 4096 values
    back = Retained.from_record(json.loads(json.dumps(rec)))
    assert back == r and back.data[0] is uniform_row(3, 4096)


def test_the_former_record_listing_every_chunk_still_reads() -> None:
    r = _retained(((1, 2), (2, 2)))
    listed = {
        **{k: v for k, v in r.to_record().items() if not k.endswith("_runs")},
        "data": [[1, 2], [2, 2]],
        "undo": [[NONE, NONE], [NONE, NONE]],
        "par": [[[1, 1], [1, 1]]],
    }
    assert Retained.from_record(listed) == r
    with pytest.raises(ValueError, match="malformed retained state"):
        Retained.from_record({**r.to_record(), "data_runs": [[[1, 0]]]})
