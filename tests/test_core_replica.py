"""The core's rule for tier 1 as replicas (leto.core.replica): which member a lost chunk
is copied from, and at which step."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leto.core.chunk import NONE
from leto.core.replica import Offer, Source, replica_source


def test_prefers_the_target_from_a_member_that_lost_nothing() -> None:
    offers = [Offer(4, NONE), Offer(5, 4), Offer(5, NONE)]
    # member 1 lost another chunk: not settled, so member 2's bytes at the target win
    got = replica_source(offers, missing={0}, lost_any={0, 1}, recorded=4, target=5)
    assert got == Source(2, 5)


def test_then_the_recorded_version_as_the_parity_would_decode_it() -> None:
    offers = [Offer(NONE, NONE), Offer(6, 5), Offer(NONE, NONE)]
    got = replica_source(offers, missing={0}, lost_any={0, 1}, recorded=5, target=6)
    assert got == Source(1, 5)  # its undo copy, though its bytes are at the target


def test_then_the_target_then_the_step_before_it() -> None:
    offers = [Offer(NONE, NONE), Offer(NONE, 7), Offer(NONE, NONE)]
    assert replica_source(offers, missing={0}, lost_any={0, 1}, recorded=3, target=7) == Source(
        1, 7
    )
    offers = [Offer(NONE, NONE), Offer(6, NONE)]
    assert replica_source(offers, missing={0}, lost_any={0, 1}, recorded=3, target=7) == Source(
        1, 6
    )


def test_a_member_missing_the_chunk_is_never_a_source() -> None:
    offers = [Offer(5, NONE), Offer(5, NONE)]
    assert replica_source(offers, missing={0, 1}, lost_any={0, 1}, recorded=5, target=5) is None


def test_nothing_older_than_the_step_before_the_target() -> None:
    offers = [Offer(NONE, NONE), Offer(3, NONE)]
    assert replica_source(offers, missing={0}, lost_any={0}, recorded=5, target=5) is None


def test_a_negative_target_is_refused() -> None:
    with pytest.raises(ValueError, match="target must be a step >= 0, got -4"):
        replica_source([Offer(0, NONE)], missing=set(), lost_any=set(), recorded=0, target=NONE)


_version = st.one_of(st.just(NONE), st.integers(0, 6))


@given(
    st.lists(st.tuples(_version, _version), min_size=1, max_size=5),
    st.sets(st.integers(0, 4)),
    st.sets(st.integers(0, 4)),
    st.integers(0, 6),
    st.integers(0, 6),
)
def test_the_rule_against_its_statement(
    raw: list[tuple[int, int]], missing: set[int], lost: set[int], recorded: int, target: int
) -> None:
    offers = [Offer(d, u) for d, u in raw]
    lost_any = lost | missing  # a member missing this chunk lost a chunk
    got = replica_source(
        offers, missing=missing, lost_any=lost_any, recorded=recorded, target=target
    )

    def can(m: int, v: int) -> bool:
        return m not in missing and v >= 0 and v in (offers[m].data, offers[m].undo)

    members = range(len(offers))
    settled = [m for m in members if m not in lost_any and offers[m].data == target]
    if settled:
        assert got == Source(settled[0], target)
        return
    for v in (recorded, target, target - 1):
        holders = [m for m in members if can(m, v)]
        if holders:
            assert got == Source(holders[0], v)
            return
    assert got is None


def test_the_models_sentinels_are_distinct_and_never_a_step() -> None:
    from leto.core.chunk import GARBAGE, LOST, SENTINELS, TORN

    assert len({TORN, LOST, GARBAGE, NONE}) == 4 == len(SENTINELS)
    assert all(v < 0 for v in SENTINELS)
