"""PREPARE's checksum pass marks the rank's layout suspect the moment it finds a chunk
failing, before anything may stop the step (a peer's death, an abort): the recovery
that follows then reads every chunk of the rank in its report."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from leto.backends.gloo.transaction import prepare_pass
from leto.retained import RetainedLayout
from leto.retained.recovery import deferrable


def _session(verify: bool) -> SimpleNamespace:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    lay = RetainedLayout.create(model, chunk_numel=16, states=["exp_avg"])
    return SimpleNamespace(layout=lay, cfg=SimpleNamespace(verify_chunks=verify))


def test_a_failing_chunk_marks_the_layout_suspect_at_once() -> None:
    s = _session(True)
    lay = s.layout
    assert prepare_pass(s) == [] and not lay.suspect  # nothing failing: nothing marked
    assert deferrable(lay)  # a report could leave clean chunks to the next PREPARE
    with torch.no_grad():
        lay.param_buffer[16] += 1  # chunk 1's bytes change, no header records it
    assert prepare_pass(s) == [1]
    assert lay.suspect  # before the caller raises, or is stopped first
    assert deferrable(lay) == []  # the recovery's report reads every chunk


def test_with_verify_chunks_off_the_pass_reads_nothing() -> None:
    s = _session(False)
    with torch.no_grad():
        s.layout.param_buffer[16] += 1
    assert prepare_pass(s) == [] and not s.layout.suspect


def test_the_pass_with_the_first_chunk_staged_finds_the_same_chunks() -> None:
    # the step's first chunk is read by its undo copy's check, the others by the pass:
    # a change in either is found before the vote, and the layout marked suspect
    for changed in (0, 1, 2):
        s = _session(True)
        lay = s.layout
        assert prepare_pass(s, first=1) == [] and lay.undo.holds_staged(1)
        staged = [t.clone() for t in lay.undo.copies[0]]
        assert torch.equal(staged[0], lay.chunk_data(1)[0])  # the chunk's bytes, copied
        with torch.no_grad():
            lay.param_buffer[16 * changed + 3] += 1
        assert prepare_pass(s, first=1) == [changed] == prepare_pass(s)
        assert lay.suspect
        # a check that failed keeps no copy; one that passed keeps it (in a free slot,
        # which a recovery ignores: the step raises before BeginChunk)
        assert lay.undo.holds_staged(1) == (changed != 1)


def test_a_fletcher_layout_keeps_the_passes_apart() -> None:
    # torch ops cannot share a pass: every chunk checked in one batch, nothing staged
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    lay = RetainedLayout.create(model, chunk_numel=16, states=[], checksum_algorithm="fletcher")
    s = SimpleNamespace(layout=lay, cfg=SimpleNamespace(verify_chunks=True))
    assert prepare_pass(s, first=1) == [] and not lay.undo.holds_staged(1)
    with torch.no_grad():
        lay.param_buffer[16] += 1
    assert prepare_pass(s, first=1) == [1] and lay.suspect
