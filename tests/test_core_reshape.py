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
