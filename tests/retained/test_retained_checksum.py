"""Checksums: agreement with a plain-integer reference, bit flips, swaps, salts."""

from __future__ import annotations

import pytest
import torch

from leto.retained.checksum import (
    DOMAIN_DATA,
    DOMAIN_GRAD,
    MODULUS,
    _mix,
    checksum,
    int32_words,
    unpack,
)


def reference(
    parts: list[torch.Tensor], index: int, version: int, domain: int = DOMAIN_DATA
) -> int:
    """The definition, with Python integers (no overflow anywhere)."""
    words = [w for p in parts for w in int32_words(p).tolist()]
    a = (sum(words) + index + 1) % MODULUS
    b = (sum((j + 1) * w for j, w in enumerate(words)) + _mix(domain, index, version)) % MODULUS
    value = a * MODULUS + b  # as unsigned 64 bits; the checksum is its int64 reading
    return value - (1 << 64) if value >= 1 << 63 else value


@pytest.mark.parametrize("sizes", [[8], [4096 * 3], [7, 7], [1, 5, 3], [12288, 12288]])
def test_matches_reference(sizes: list[int]) -> None:
    g = torch.Generator().manual_seed(sum(sizes))
    # full-range int32 words, including the extremes
    parts = [
        torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g) for n in sizes
    ]
    parts[0][0] = -(2**31)
    parts[-1][-1] = 2**31 - 1
    for index, version in [(0, 0), (5, 17), (1000, 2**40)]:
        assert checksum(parts, index=index, version=version).item() == reference(
            parts, index, version
        )


def test_float_views_and_single_tensor() -> None:
    t = torch.randn(3, 4)
    assert checksum(t, index=2, version=1).item() == reference([t], 2, 1)
    assert checksum([t], index=2, version=1).item() == checksum(t, index=2, version=1).item()


def test_every_single_bit_flip_is_detected() -> None:
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(8, generator=g), torch.randn(8, generator=g)]  # 64 bytes = 512 bits
    good = checksum(parts, index=3, version=9).item()
    for part in parts:
        b = part.view(torch.uint8)
        for byte in range(b.numel()):
            for bit in range(8):
                b[byte] ^= 1 << bit
                bad = checksum(parts, index=3, version=9).item()
                b[byte] ^= 1 << bit
                assert bad != good, (byte, bit)
    assert checksum(parts, index=3, version=9).item() == good


def test_swapped_chunks_are_detected() -> None:
    g = torch.Generator().manual_seed(1)
    chunks = [[torch.randn(16, generator=g), torch.randn(16, generator=g)] for _ in range(4)]
    stored = [checksum(c, index=i, version=5).item() for i, c in enumerate(chunks)]
    for i in range(4):
        for j in range(4):
            if i == j:
                continue
            # bytes of chunk j found at index i, header of i kept: contents differ
            assert checksum(chunks[j], index=i, version=5).item() != stored[i]
            # bytes and header of chunk j moved to index i: the index salt differs
            assert checksum(chunks[j], index=i, version=5).item() != stored[j]
    # the index salt alone separates identical contents (e.g. all-zero chunks)
    zeros = [torch.zeros(16)]
    values = {checksum(zeros, index=i, version=0).item() for i in range(100)}
    assert len(values) == 100


def test_word_transposition_and_salts() -> None:
    t = torch.arange(32, dtype=torch.int32)
    base = checksum(t, index=0, version=0).item()
    u = t.clone()
    u[[3, 20]] = u[[20, 3]]
    assert unpack(checksum(u, index=0, version=0).item())[0] == unpack(base)[0]  # A: order-blind
    assert checksum(u, index=0, version=0).item() != base  # B: position-weighted
    assert checksum(t, index=0, version=1).item() != base
    assert checksum(t, index=0, version=0, domain=DOMAIN_GRAD).item() != base
    # parts are read in order: swapping two parts is a reordering too
    x, y = torch.ones(4), torch.full((4,), 2.0)
    assert (
        checksum([x, y], index=0, version=0).item() != checksum([y, x], index=0, version=0).item()
    )


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        checksum(torch.zeros(3, dtype=torch.uint8), index=0, version=0)
    with pytest.raises(ValueError, match="contiguous"):
        checksum(torch.zeros(4, 4)[:, 0], index=0, version=0)
    with pytest.raises(ValueError, match="out of range"):
        checksum(torch.zeros(4), index=-1, version=0)
    with pytest.raises(ValueError, match="no tensors"):
        checksum([], index=0, version=0)
    # a misaligned byte view is copied, not rejected
    b = torch.arange(12, dtype=torch.uint8)
    assert (
        checksum(b[2:10], index=0, version=0).item()
        == checksum(b[2:10].clone(), index=0, version=0).item()
    )


@pytest.mark.parametrize("m,k", [(8, 1), (12, 3), (4096 * 2, 2), (6, 2)])
def test_batched_checksums_equal_single_ones(m: int, k: int) -> None:
    from leto.retained.checksum import checksum_chunks

    n = 5
    g = torch.Generator().manual_seed(m * k)
    bufs = [torch.randn(n * m, generator=g) for _ in range(k)]
    versions = [3, 0, 7, 2**33, 1]
    many = checksum_chunks(bufs, n, versions, domain=DOMAIN_GRAD).tolist()
    single = [
        checksum(
            [b[i * m : (i + 1) * m] for b in bufs], index=i, version=versions[i], domain=DOMAIN_GRAD
        ).item()
        for i in range(n)
    ]
    assert many == single
    with pytest.raises(ValueError):
        checksum_chunks(bufs, n, versions[:2])
