"""The node's gradient parity is written afresh only once every member has released its
gradients (PROTOCOL.md, "Gradient parity during a reconcile").

Under a plan that writes no chunk (INPLACE) no collective of the node follows the
settles, so the node's first rank ends its reconcile while another rank may still hold
its sealed gradients. Had it written the record afresh (every member NONE) there, that
rank killed before its release would leave a record naming none of the gradients its
next report holds: ParityOK's gradient clause, and the job stopped with "the protocol
model refused the retained state the trainers reported" (two SIGKILLs 15-25 ms apart,
tests/gloo/random_instants.py). Here the first rank carries out such a reconcile while
the other is held before its release, deterministically, and the next generation's
report is judged by the core's adoption.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from leto.backends.gloo import follow
from leto.backends.gloo import messages as M
from leto.backends.gloo.parity_block import ParityBlock, block_bytes
from leto.backends.gloo.segments import create
from leto.core.adopt import Retained, adopt, adoption_refusal
from leto.core.chunk import NONE
from leto.retained import recovery as rx
from leto.spec.trace import CoreSetup, decode, run

STEP = 2  # both ranks voted and applied it; rank 0 is killed after, rank 1 in the recovery


@pytest.fixture
def blocks() -> Iterator[list[ParityBlock]]:
    """The node's tier-1 records of a 2-member node: chunk 0's, then the gradients'."""
    fds = [create(f"test-gpar-{i}", block_bytes(2, 8)) for i in range(2)]
    try:
        yield [ParityBlock(fd, 2, 8) for fd in fds]
    finally:
        for fd in fds:
            os.close(fd)


class _Records:
    def stored_checksum_list(self) -> list[int]:
        return [7]


class _Layout:
    """Rank 0's retained memory, as far as an INPLACE reconcile reads it."""

    n_chunks = 1
    prepared_step = STEP  # its gradients of STEP, sealed
    records = _Records()
    device = torch.device("cpu")

    def clear_prepared(self) -> None:
        self.prepared_step = -1

    def derive_params(self) -> None:
        pass


def _first_rank(blocks: list[ParityBlock], sent: list[Any]) -> follow.Follower:
    nothing = lambda *a, **k: None  # noqa: E731
    s = SimpleNamespace(
        rank=0,
        local_rank=0,
        node=0,
        nproc=2,
        gen=1,
        cfg=SimpleNamespace(tier1=True, tier2=False, tier1_code="replicas"),
        replica=True,
        parity=blocks[:1],
        gparity=blocks[1],
        layout=_Layout(),
        ropt=None,
        groups=SimpleNamespace(init=nothing, node_group=None, parity=lambda group: None),
        ch=SimpleNamespace(mark=nothing, send=sent.append),
        ps=SimpleNamespace(prefetch=nothing, send=nothing),
        memory=SimpleNamespace(status_lost=nothing, gather_params=nothing),
        stats=Counter(),
    )
    return follow.Follower(s)  # type: ignore[arg-type]


def _model_after_second_kill() -> tuple[Any, Any]:
    """The core's model of the run: STEP applied, rank 0 killed, generation 1's INPLACE
    reconcile, rank 1 killed in it, generation 2 reconciling (its reports next)."""
    setup = CoreSetup(nodes=(2,), chunks=1, k=None)
    model = setup.model()
    s = setup.initial(model)
    closes = [["Close", 0], ["Close", 1]]
    steps = [["CommitStep", STEP - 1], ["ApplyStep", STEP - 1, [0, 1]], *closes]
    steps += [
        ["CommitStep", STEP],
        ["ApplyStep", STEP, [0, 1]],
        ["Crash", 0],
        ["Detect"],
        ["Fence"],
    ]
    s, _ = run(model, s, [decode(x) for x in [*steps, ["Promote", 0], ["EndPromote"]]])
    held = Retained(
        data=((STEP,), (STEP,)),
        undo=((NONE,), (NONE,)),
        grad=(STEP, STEP),
        par=(((STEP, STEP),),),
        gpar=((STEP, STEP),),
        t2=0,
        t2lost=frozenset(),
    )
    assert adoption_refusal(model, s, held) is None

    s = adopt(model, s, held)
    items = [["Reconcile"], ["Crash", 1], ["Detect"], ["Fence"], ["Promote", 1], ["EndPromote"]]
    s, _ = run(model, s, [decode(x) for x in items])
    return model, s


def test_the_gradient_parity_waits_for_every_release(
    blocks: list[ParityBlock], monkeypatch: pytest.MonkeyPatch
) -> None:
    par, gpar = blocks
    par.write_full(None, [STEP, STEP], [7, 7])
    gpar.write_full(None, [STEP, STEP], [0, 0])  # both ranks' gradients of STEP
    sent: list[Any] = []
    f = _first_rank(blocks, sent)
    # the node's collectives: rank 1 passed the gather of checksums, then is held (and
    # killed) before its settle releases its gradients
    monkeypatch.setattr(f, "_node_checksums", lambda: [[7, 7]])
    monkeypatch.setattr(rx, "check_resumable", lambda *a, **k: None)
    lay = f.session.layout

    def settle(target: int) -> tuple[int, int]:
        assert target == STEP
        lay.clear_prepared()  # nothing behind: the gradients released
        return 0, 0

    monkeypatch.setattr(f, "_settle", settle)
    f._reconcile(M.Reconcile(gen=1, kind="inplace", target=STEP, retake_t2=False))
    assert [type(m) for m in sent] == [M.Pending, M.Reconciled]
    assert lay.prepared_step == -1

    # generation 2's reports: rank 0 released its gradients, rank 1's are still sealed
    model, s = _model_after_second_kill()
    report = Retained(
        data=((STEP,), (STEP,)),
        undo=((NONE,), (NONE,)),
        grad=(NONE, STEP),
        par=(((STEP, STEP),),),
        gpar=(gpar.versions() if gpar.valid else None,),  # as Follower._report reads it
        t2=0,
        t2lost=frozenset(),
    )
    assert adoption_refusal(model, s, report) is None, gpar.versions()

    # had rank 1 released, the coordinator's Rebuild (every rank reconciled) renews it
    f._rebuild(1)
    assert gpar.state() == [NONE, NONE]
    assert isinstance(sent[-1], M.Rebuilt)


def test_a_rebuild_without_this_ranks_reconcile_writes_nothing(
    blocks: list[ParityBlock],
) -> None:
    gpar = blocks[1]
    sent: list[Any] = []
    f = _first_rank(blocks, sent)
    f._rebuild(3)
    assert not gpar.valid and isinstance(sent[-1], M.Rebuilt)
