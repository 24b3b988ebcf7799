"""leto.core.reshape: the survivors' ranks of a world changed in place, and the new
world's protocol state (its generation, its committed step, the old disk checkpoint)."""

from __future__ import annotations

import pytest

from leto.core import reshape
from leto.core.recovery import Phase
from leto.spec.trace import CoreSetup, TraceError


def test_survivors_keep_their_order_and_are_renumbered_densely() -> None:
    assert reshape.survivors(3, 2, frozenset({1})) == (0, 1, 4, 5)
    assert reshape.survivors(3, 1, frozenset({0})) == (1, 2)
    assert reshape.survivors(3, 1, frozenset({2})) == (0, 1)
    assert reshape.survivors(2, 2, frozenset()) == (0, 1, 2, 3)
    for args, why in [
        ((0, 1, frozenset()), "has no ranks"),
        ((2, 1, frozenset({2})), "not all among nodes 0..1"),
        ((2, 1, frozenset({0, 1})), "every node is lost"),
    ]:
        with pytest.raises(ValueError, match=why) as e:
            reshape.survivors(*args)
        assert "\n" not in str(e.value)


def test_a_surviving_node_and_its_ranks_are_renumbered_as_survivors_orders_them() -> None:
    for nodes, per, lost in [(3, 1, {1}), (3, 2, {1}), (4, 2, {0, 2}), (3, 1, {2}), (3, 1, {0})]:
        kept = reshape.survivors(nodes, per, frozenset(lost))
        new = [reshape.renumbered_rank(r, per, frozenset(lost)) for r in kept]
        assert new == list(range(len(kept))), (nodes, per, lost, new)
    assert [reshape.renumbered(n, frozenset({1})) for n in (0, 2, 3)] == [0, 1, 2]
    assert reshape.renumbered(3, frozenset({0, 2})) == 1
    for args, why in [((1, frozenset({1})), "not a surviving node"), ((-1, frozenset()), "not a")]:
        with pytest.raises(ValueError, match=why) as e:
            reshape.renumbered(*args)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="is not a rank"):
        reshape.renumbered_rank(2, 0, frozenset())


def test_the_new_world_starts_idle_at_the_committed_step_in_the_change_s_generation() -> None:
    setup = CoreSetup(nodes=(1, 1), chunks=3, k=2, start=6, gen=4, ckpt=5)
    model = setup.model()
    s = setup.initial(model)
    assert (s.phase, s.gen, s.committed, s.t2, s.ckpt) == (Phase.RUNNING, 4, 6, 6, 5)
    assert s.step == (6, 6) and s.tgen == (4, 4)
    assert s.data == ((6, 6, 6), (6, 6, 6))
    fresh = CoreSetup(nodes=(1, 1), chunks=3, k=2, start=6).initial(model)
    assert (fresh.gen, fresh.ckpt) == (0, 6)  # a job resumed from its checkpoint at start
    back = CoreSetup.from_record(setup.to_record())
    assert back == setup and "gen" not in CoreSetup(nodes=(1,), chunks=1, k=None).to_record()
    with pytest.raises(ValueError, match="not in 0..6"):
        reshape.in_place(model, 6, 4, 7)
    with pytest.raises(TraceError, match="ckpt <= start"):
        CoreSetup.from_record({**setup.to_record(), "ckpt": 7})


def test_a_new_shard_is_the_old_shards_slices_of_its_part_of_the_flat_space() -> None:
    cases = [
        (10, (2, 8), (1, 16)),
        (10, (2, 8), (3, 4)),
        (259, (8, 64), (3, 128)),
        (5, (1, 8), (4, 2)),
    ]
    cases += [
        (u, (ow, os_), (nw, ns))
        for u in (1, 7, 12)
        for ow, os_ in ((2, 6), (3, 4))
        for nw, ns in ((1, 12), (2, 6), (4, 3), (3, 8))
    ]
    for used, old, new in cases:
        got = []  # (flat position, old rank, its offset) of every element copied
        for rank in range(new[0]):
            for s in reshape.shard_slices(used, old, new, rank):
                assert 0 <= s.start < s.stop <= old[1] and 0 <= s.at < new[1], (used, old, new, s)
                assert s.at + s.stop - s.start <= new[1]
                got += [
                    (rank * new[1] + s.at + i, s.old, s.start + i) for i in range(s.stop - s.start)
                ]
        # every real element exactly once, in order, from the old rank that held it
        assert got == [(e, e // old[1], e % old[1]) for e in range(used)], (used, old, new)
    assert reshape.shard_slices(10, (2, 8), (1, 16), 0) == (
        reshape.Slice(0, 0, 8, 0),
        reshape.Slice(1, 0, 2, 8),
    )
    assert reshape.shard_slices(4, (2, 8), (3, 4), 2) == ()  # padding only: from no one
    for args, why in [
        ((10, (2, 8), (0, 16), 0), "positive worlds"),
        ((17, (2, 8), (1, 16), 0), "do not fit"),
        ((10, (2, 8), (2, 4), 0), "do not fit"),
        ((10, (2, 8), (1, 16), 1), "not a rank of the new world of 1"),
    ]:
        with pytest.raises(ValueError, match=why) as e:
            reshape.shard_slices(*args)  # type: ignore[arg-type]
        assert "\n" not in str(e.value)
