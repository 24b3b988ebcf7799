"""The fake backend's pieces: the fault injector and its counters, the keeper, the
split-phase all-reduce, fencing, in-process parity programs."""

from __future__ import annotations

import pytest
import torch
from fakejob import make_engine

from leto.backends.base import CollectiveError, FencedError
from leto.backends.fake import FakeBackend, FaultInjector
from leto.core.erasure import Topology
from leto.retained.layout import LayoutError, RetainedLayout
from leto.retained.parity import decode, encode

TOPO = Topology((2, 2))


# ---------------------------------------------------------------------- injector


def test_injector_is_fluent_and_validates_every_argument() -> None:
    inj = FaultInjector(TOPO, n_chunks=3)
    assert inj.fail_at(rank=0, step=1, phase="forward").lose_node(node=1, step=2) is inj
    bad = [
        (dict(rank=0, step=1, phase="fly"), "phase: 'fly' is not a phase"),
        (dict(rank=4, step=1, phase="forward"), "rank: 4 is not a rank of 0..3"),
        (dict(rank=0, step=0, phase="forward"), "step: must be an int >= 1"),
        (dict(rank=0, step=1, phase="apply"), "chunk: phase 'apply' needs a chunk"),
        (dict(rank=0, step=1, phase="apply", chunk=3), "chunk: 3 is not a chunk of 0..2"),
        (dict(rank=0, step=1, phase="apply", chunk=0, where="late"), "where: 'late'"),
        (dict(rank=0, step=1, phase="forward", chunk=0), "chunk: phase 'forward' takes no chunk"),
        (dict(rank=0, step=1, phase="forward", where="x"), "where: phase 'forward' has no"),
        (dict(rank=0, step=1, phase="forward", kind="explode"), "kind: fail_at takes"),
        # the one vocabulary's "Report" is a gloo point: simulated ranks report nothing
        (dict(rank=0, step=1, phase="recovery", where="Report"), "where: 'Report' is not"),
    ]
    for kwargs, msg in bad:
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            inj.fail_at(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="node: 2 is not a node"):
        inj.lose_node(node=2, step=1)
    with pytest.raises(ValueError, match="losing the only node"):
        FaultInjector(Topology((2,))).lose_node(node=0, step=1)
    with pytest.raises(ValueError, match="corrupt strikes between events"):
        inj.corrupt(rank=0, step=1, chunk=0, phase="forward")
    assert len(inj.faults) == 2  # nothing was added by the refused calls


def test_defaults_for_where() -> None:
    inj = FaultInjector(TOPO)
    inj.fail_at(rank=0, step=1, phase="apply", chunk=0)
    inj.fail_at(rank=0, step=1, phase="decide")
    inj.fail_at(rank=0, step=1, phase="recovery")
    assert [f.where for f in inj.faults] == ["mid_write", "before", "Reconcile"]


def test_every_fault_fires_once_and_is_counted() -> None:
    eng = make_engine()
    inj = eng.injector
    inj.fail_at(rank=1, step=2, phase="forward")
    inj.fail_at(rank=2, step=2, phase="apply", chunk=1, where="written")  # same step, later point
    inj.lose_memory(rank=3, step=3, phase="parity", chunk=0)
    inj.fail_at(rank=0, step=50, phase="finish")  # never reached
    eng.train(4)
    c = inj.counters()
    assert c["planned"] == 4 and c["fired"] == 3 and c["recovered"] == 3
    assert c["by_phase"] == {"apply": 1, "forward": 1, "parity": 1}
    assert c["by_kind"] == {"crash": 2, "lose_memory": 1}
    assert [f.label for f in inj.unfired()] == ["crash rank 0 at step 50 finish"]
    assert not inj.all_fired and inj.unrecovered() == []
    assert [f.fired for f in inj.faults] == [1, 1, 1, 0]
    assert eng.stats["failures_injected"] == 3 and eng.stats["recoveries"] == 3


# ------------------------------------------------------------------------ memory


def test_a_lost_keeper_holds_garbage_and_cannot_be_attached() -> None:
    eng = make_engine()
    backend = eng.backend
    model = eng.procs[1].replica.model
    backend.lose_memory(1)
    assert backend.memory_lost(1)
    assert bool((backend.keepers[1].segments["leto.param"] == 0xA5).all())
    with pytest.raises(LayoutError, match="bad magic"):
        RetainedLayout.attach(model, alloc=backend.allocator(1))


def test_keeper_refuses_a_segment_of_another_size() -> None:
    b = FakeBackend(TOPO)
    b.allocator(0)("x", 8)
    with pytest.raises(LayoutError, match="has 8 bytes, 16 requested"):
        b.allocator(0)("x", 16)


# ------------------------------------------------------------------- collectives


def test_all_reduce_sums_in_rank_order_whatever_the_call_order() -> None:
    b = FakeBackend(TOPO)
    vals = [torch.tensor([0.1]), torch.tensor([0.2]), torch.tensor([0.3]), torch.tensor([1e8])]
    works = {r: b.all_reduce(r, vals[r], tag=("g", 0, 1)) for r in (3, 1, 0, 2)}
    expect = ((vals[0] + vals[1]) + vals[2]) + vals[3]
    for r in (2, 0, 3, 1):
        assert torch.equal(works[r].wait(), expect)
    assert b._results == {} and b.stats["collectives"] == 1  # released once all have it


def test_waiting_before_everyone_joined_or_after_an_abort_fails() -> None:
    b = FakeBackend(TOPO)
    w = b.all_reduce(0, torch.ones(2), tag=("g", 0, 1))
    with pytest.raises(CollectiveError, match=r"ranks \[1, 2, 3\] never joined"):
        w.wait()
    b.abort(0)
    with pytest.raises(CollectiveError, match="aborted"):
        b.all_reduce(1, torch.ones(2), tag=("g", 0, 1))


def test_fencing_refuses_writers_of_an_old_generation() -> None:
    b = FakeBackend(TOPO)
    b.check_writer(0, 0)
    b.fence(1)
    with pytest.raises(FencedError, match="generation 0 was refused"):
        b.check_writer(0, 0)
    b.spawn_shadow(0, lambda: "skeleton")
    assert b.promote_shadow(0, 1) == "skeleton"
    b.check_writer(0, 1)  # the promoted trainer writes at the new generation
    with pytest.raises(FencedError):
        b.check_writer(1, 1)  # a survivor not yet re-admitted (before rebuild)
    b.rebuild(1)
    b.check_writer(1, 1)
    assert b.stats["refused_writes"] == 2


def test_spmd_parity_program_is_exact_with_wraparound() -> None:
    b = FakeBackend(TOPO)
    data = [torch.tensor([200, 1, 255], dtype=torch.uint8) for _ in range(3)]
    data[1] = torch.tensor([100, 2, 255], dtype=torch.uint8)

    def program(c):  # type: ignore[no-untyped-def]
        return encode(c, data[c.rank], 0)

    parity = b.spmd([0, 1, 2], program)[0]
    assert parity.tolist() == [(200 + 100 + 200) % 256, 4, (255 * 3) % 256]
    lost = torch.zeros(3, dtype=torch.uint8)
    datas = [data[0], lost, data[2]]
    b.spmd([0, 1, 2], lambda c: decode(c, datas[c.rank], 1, 0, parity if c.rank == 0 else None))
    assert torch.equal(lost, data[1])
    with pytest.raises(ZeroDivisionError):
        b.spmd([0, 1], lambda c: 1 // 0)


def test_the_backend_interface_and_the_core_do_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, leto, leto.core, leto.backends, leto.backends.base; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_effect_of_the_core_has_one_executor() -> None:
    from leto.backends.fake.executors import EXECUTORS, RECONCILE_EFFECTS
    from leto.core.effects import all_effect_types

    kinds = set(all_effect_types())
    assert len(kinds) >= 30
    assert set(EXECUTORS) | set(RECONCILE_EFFECTS) == kinds
    assert not set(EXECUTORS) & set(RECONCILE_EFFECTS)


def test_effects_are_typed_values_that_validate() -> None:
    import pytest

    from leto.core import effects as fx

    assert fx.SaveUndo(1, 2, 3) == fx.SaveUndo(rank=1, chunk=2, step=3)
    assert hash(fx.Detected([0, 2], True)) == hash(fx.Detected((0, 2), True))
    with pytest.raises(TypeError, match="rank must be an int"):
        fx.ReleaseUndo("1", 0)  # type: ignore[arg-type]
