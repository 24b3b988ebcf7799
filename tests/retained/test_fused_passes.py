"""The undo copy fused with the checksum that checks it (``copy_checksum``,
``UndoSlots.stage_checked``): the same bytes, the same values, the same undo contents
as the two passes apart, and a flipped bit still caught."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leto.retained import RetainedLayout
from leto.retained.checksum import ALGORITHMS, checksum, copy_checksum
from leto.retained.optim import to_retained


def _parts(sizes: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in sizes]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("block", [4, 12, 1000, 1 << 20])
def test_the_copy_and_its_checksum_are_the_passes_apart(algorithm: str, block: int) -> None:
    # blocks that divide the parts, that do not (12 bytes: 3 floats), and one larger
    # than every part: the value is the checksum of the copy, the copy the source
    src = _parts([1, 37, 1024, 5])
    dst = [torch.zeros_like(p) for p in src]
    got = copy_checksum(dst, src, index=3, version=9, algorithm=algorithm, block_bytes=block)
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    want = checksum(src, index=3, version=9, algorithm=algorithm)
    assert int(got) == int(want)
    assert int(got) != int(checksum(src, index=3, version=8, algorithm=algorithm))  # salted


def test_copy_checksum_refuses_parts_that_do_not_pair() -> None:
    src = _parts([8, 8])
    with pytest.raises(ValueError, match="as many destination parts"):
        copy_checksum([torch.zeros(8)], src, index=0, version=0)
    with pytest.raises(ValueError, match="a part of 32 bytes into 28"):
        copy_checksum([torch.zeros(8), torch.zeros(7)], src, index=0, version=0)


def _optimizer(seed: int = 0) -> tuple[RetainedLayout, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(9, 16), nn.Tanh(), nn.Linear(16, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    lay = RetainedLayout.create(model, chunk_numel=64, states=["exp_avg", "exp_avg_sq"])
    return lay, to_retained(opt, lay)


def _step(lay: RetainedLayout, ropt: torch.optim.Optimizer, V: int, fused: bool) -> list[list]:
    """One step as the gloo transaction runs it, the first chunk staged fused with its
    check or apart; the undo copy of every chunk, as saved."""
    g = torch.Generator().manual_seed(V)
    with torch.no_grad():
        lay.grad_buffer.copy_(torch.randn(lay.numel, generator=g))
    first = V % lay.n_chunks
    if fused:
        assert lay.undo.stage_checked(first) is True
        assert lay.verify(intact=[first]) == []
    else:
        assert lay.verify() == []
        assert lay.undo.stage(first)
    assert lay.undo.holds_staged(first)
    ropt.prepare(V)  # type: ignore[attr-defined]
    ropt.begin(V)  # type: ignore[attr-defined]
    undo = []
    for c in [(first + i) % lay.n_chunks for i in range(lay.n_chunks)]:
        ropt.save_undo(c, staged=c == first)  # type: ignore[attr-defined]
        undo.append([t.clone() for t in lay.undo_data(c)])
        ropt.apply_chunk(c)  # type: ignore[attr-defined]
        ropt.finish_chunk(c)  # type: ignore[attr-defined]
    ropt.end()  # type: ignore[attr-defined]
    return undo


def test_fused_steps_are_bitwise_the_passes_apart() -> None:
    a, oa = _optimizer()
    b, ob = _optimizer()
    assert a.n_chunks > 2
    for V in range(1, 6):
        ua, ub = _step(a, oa, V, fused=False), _step(b, ob, V, fused=True)
        for xa, xb in zip(ua, ub, strict=True):  # the same undo contents
            assert all(torch.equal(s, t) for s, t in zip(xa, xb, strict=True))
        assert torch.equal(a.records.stored_checksums(), b.records.stored_checksums())
        for i in range(a.n_chunks):
            assert all(
                torch.equal(s, t) for s, t in zip(a.chunk_data(i), b.chunk_data(i), strict=True)
            )
    assert a.records.versions() == b.records.versions() == [5] * a.n_chunks


@pytest.mark.parametrize("part", [0, 1, 2])
@pytest.mark.parametrize("where", [0, -1])
def test_a_flipped_bit_fails_the_staged_check(part: int, where: int) -> None:
    # in the parameters or either state, at the chunk's first or last byte: the check
    # fails, nothing stays staged, and a save copies the chunk afresh
    lay, _ = _optimizer()
    i = 1
    b = lay.chunk_data(i)[part].view(torch.uint8)
    b[where] ^= 0x01
    assert lay.undo.stage_checked(i) is False
    assert not lay.undo.holds_staged(i)
    assert lay.verify() == [i]  # the pass apart finds the same chunk
    lay.save_undo(i, staged=True)
    assert all(torch.equal(u, d) for u, d in zip(lay.undo_data(i), lay.chunk_data(i), strict=True))


def test_nothing_is_staged_without_a_free_slot_or_a_clean_chunk() -> None:
    lay, _ = _optimizer()
    lay.save_undo(0)  # the only slot taken, chunk 0 TORN
    assert lay.undo.stage_checked(1) is None and lay.undo.stage_checked(0) is None
    assert not lay.undo.holds_staged(1)
