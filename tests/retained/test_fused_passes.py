"""The undo copy fused with the checksum that checks it (``copy_checksum``,
``UndoSlots.stage_checked``), the gradients' mean fused with their seal's checksums
(``div_checksums``, ``GradBuffer.write_mean``): the same bytes, the same values, the
same undo contents as the passes apart, and a flipped bit still caught."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leto.retained import RetainedLayout
from leto.retained.checksum import (
    ALGORITHMS,
    DOMAIN_GRAD,
    checksum,
    checksum_chunks,
    copy_checksum,
    div_checksums,
)
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
    summed = torch.randn(lay.numel, generator=g)
    sums = None
    if fused:
        sums = lay.grads.write_mean(summed, 3, V)
    else:
        torch.div(summed, 3, out=lay.grad_buffer)
    first = V % lay.n_chunks
    if fused:
        assert lay.undo.stage_checked(first) is True
        assert lay.verify(intact=[first]) == []
    else:
        assert lay.verify() == []
        assert lay.undo.stage(first)
    assert lay.undo.holds_staged(first)
    lay.seal_grads(V, [True] * len(lay.params), sums)
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
        assert a.grads.checksums() == b.grads.checksums() and a.grads.verify(V) == []
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


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("flush", [False, True])
@pytest.mark.parametrize("block", [4, 20, 1 << 18])
def test_the_mean_and_its_checksums_are_torchs_division_and_the_pass(
    algorithm: str, flush: bool, block: int
) -> None:
    # subnormal sums and quotients among them, read as zero when the process flushes them
    g = torch.Generator().manual_seed(1)
    src = torch.randn(6 * 35, generator=g)
    src[::5] *= 1e-39
    dst, want = torch.empty_like(src), torch.empty_like(src)
    torch.set_flush_denormal(flush)
    try:
        got = div_checksums(
            dst, src, 7, 6, 11, domain=DOMAIN_GRAD, algorithm=algorithm, block_bytes=block
        )
        torch.div(src, 7, out=want)
    finally:
        torch.set_flush_denormal(False)  # the default, as every other test has it
    assert torch.equal(dst.view(torch.int32), want.view(torch.int32))
    assert (want == 0).any() == flush  # the mode was in force
    ref = checksum_chunks([want], 6, [11] * 6, domain=DOMAIN_GRAD, algorithm=algorithm)
    assert got.tolist() == ref.tolist()


def test_div_checksums_without_numpy_floats_and_bad_input() -> None:
    src = torch.randn(64).to(torch.bfloat16)
    dst = torch.empty_like(src)
    got = div_checksums(dst, src, 3, 4, 2, algorithm="xxh3")
    assert torch.equal(dst, torch.div(src, 3))
    assert got.tolist() == checksum_chunks([dst], 4, [2] * 4, algorithm="xxh3").tolist()
    with pytest.raises(ValueError, match="a multiple of n_chunks"):
        div_checksums(torch.empty(10), torch.empty(10), 3, 4, 0)
    with pytest.raises(ValueError, match="contiguous"):
        div_checksums(torch.empty(8), torch.empty(16)[::2], 3, 4, 0, algorithm="xxh3")
