"""Checksums, both algorithms: agreement with a reference, bit flips, swaps, salts."""

from __future__ import annotations

import pytest
import torch
import xxhash

from leto.retained.checksum import (
    ALGORITHMS,
    DOMAIN_DATA,
    DOMAIN_GRAD,
    MODULUS,
    _mix,
    checksum,
    checksum_chunks,
    default_algorithm,
    int32_words,
    unpack,
)


def _int64(value: int) -> int:
    """An unsigned 64-bit value read as int64."""
    return value - (1 << 64) if value >= 1 << 63 else value


def fletcher_reference(
    parts: list[torch.Tensor], index: int, version: int, domain: int = DOMAIN_DATA
) -> int:
    """The Fletcher definition, with Python integers (no overflow anywhere)."""
    words = [w for p in parts for w in int32_words(p).tolist()]
    a = (sum(words) + index + 1) % MODULUS
    b = (sum((j + 1) * w for j, w in enumerate(words)) + _mix(domain, index, version)) % MODULUS
    return _int64(a * MODULUS + b)


def xxh3_reference(
    parts: list[torch.Tensor], index: int, version: int, domain: int = DOMAIN_DATA
) -> int:
    """XXH3-64 of the concatenated bytes, seeded with the salt (one-shot, not streamed)."""
    data = b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)
    return _int64(xxhash.xxh3_64_intdigest(data, seed=_mix(domain, index, version)))


REFERENCES = {"fletcher": fletcher_reference, "xxh3": xxh3_reference}


def test_default_algorithm_follows_the_device() -> None:
    assert default_algorithm("cpu") == "xxh3"
    assert default_algorithm(torch.device("cuda", 0)) == "fletcher"
    t = torch.arange(8, dtype=torch.int32)
    assert checksum(t, index=1, version=2).item() == xxh3_reference([t], 1, 2)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("sizes", [[8], [4096 * 3], [7, 7], [1, 5, 3], [12288, 12288]])
def test_matches_reference(algorithm: str, sizes: list[int]) -> None:
    g = torch.Generator().manual_seed(sum(sizes))
    # full-range int32 words, including the extremes
    parts = [
        torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g) for n in sizes
    ]
    parts[0][0] = -(2**31)
    parts[-1][-1] = 2**31 - 1
    for index, version in [(0, 0), (5, 17), (1000, 2**40)]:
        got = checksum(parts, index=index, version=version, algorithm=algorithm).item()
        assert got == REFERENCES[algorithm](parts, index, version)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_float_views_and_single_tensor(algorithm: str) -> None:
    t = torch.randn(3, 4)
    one = checksum(t, index=2, version=1, algorithm=algorithm).item()
    assert one == REFERENCES[algorithm]([t], 2, 1)
    assert checksum([t], index=2, version=1, algorithm=algorithm).item() == one


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_single_bit_flip_is_detected(algorithm: str) -> None:
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(8, generator=g), torch.randn(8, generator=g)]  # 64 bytes = 512 bits

    def value() -> int:
        return int(checksum(parts, index=3, version=9, algorithm=algorithm).item())

    good = value()
    for part in parts:
        b = part.view(torch.uint8)
        for byte in range(b.numel()):
            for bit in range(8):
                b[byte] ^= 1 << bit
                bad = value()
                b[byte] ^= 1 << bit
                assert bad != good, (byte, bit)
    assert value() == good


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_swapped_chunks_are_detected(algorithm: str) -> None:
    g = torch.Generator().manual_seed(1)
    chunks = [[torch.randn(16, generator=g), torch.randn(16, generator=g)] for _ in range(4)]

    def value(c: list[torch.Tensor], i: int) -> int:
        return int(checksum(c, index=i, version=5, algorithm=algorithm).item())

    stored = [value(c, i) for i, c in enumerate(chunks)]
    for i in range(4):
        for j in range(4):
            if i == j:
                continue
            # bytes of chunk j found at index i, header of i kept: contents differ
            assert value(chunks[j], i) != stored[i]
            # bytes and header of chunk j moved to index i: the index salt differs
            assert value(chunks[j], i) != stored[j]
    # the index salt alone separates identical contents (e.g. all-zero chunks)
    zeros = [torch.zeros(16)]
    assert len({value(zeros, i) for i in range(100)}) == 100


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_word_transposition_and_salts(algorithm: str) -> None:
    def value(parts: list[torch.Tensor], version: int = 0, domain: int = DOMAIN_DATA) -> int:
        return int(
            checksum(parts, index=0, version=version, domain=domain, algorithm=algorithm).item()
        )

    t = torch.arange(32, dtype=torch.int32)
    base = value([t])
    u = t.clone()
    u[[3, 20]] = u[[20, 3]]
    assert value([u]) != base
    assert value([t], version=1) != base
    assert value([t], domain=DOMAIN_GRAD) != base
    # parts are read in order: swapping two parts is a reordering too
    x, y = torch.ones(4), torch.full((4,), 2.0)
    assert value([x, y]) != value([y, x])


def test_fletcher_halves() -> None:
    t = torch.arange(32, dtype=torch.int32)
    u = t.clone()
    u[[3, 20]] = u[[20, 3]]
    base = checksum(t, index=0, version=0, algorithm="fletcher").item()
    moved = checksum(u, index=0, version=0, algorithm="fletcher").item()
    assert unpack(moved)[0] == unpack(base)[0]  # A: order-blind
    assert unpack(moved)[1] != unpack(base)[1]  # B: position-weighted


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        checksum(torch.zeros(3, dtype=torch.uint8), index=0, version=0, algorithm="fletcher")
    for algorithm in ALGORITHMS:
        with pytest.raises(ValueError, match="contiguous"):
            checksum(torch.zeros(4, 4)[:, 0], index=0, version=0, algorithm=algorithm)
        with pytest.raises(ValueError, match="out of range"):
            checksum(torch.zeros(4), index=-1, version=0, algorithm=algorithm)
        with pytest.raises(ValueError, match="no tensors"):
            checksum([], index=0, version=0, algorithm=algorithm)
    with pytest.raises(ValueError, match="unknown checksum algorithm 'crc'"):
        checksum(torch.zeros(4), index=0, version=0, algorithm="crc")
    with pytest.raises(ValueError, match="reads host memory"):
        checksum(torch.zeros(4, device="meta"), index=0, version=0, algorithm="xxh3")
    # any byte view works for xxh3; a misaligned one is copied by Fletcher, not rejected
    b = torch.arange(12, dtype=torch.uint8)
    for algorithm in ALGORITHMS:
        assert (
            checksum(b[2:10], index=0, version=0, algorithm=algorithm).item()
            == checksum(b[2:10].clone(), index=0, version=0, algorithm=algorithm).item()
        )
    assert checksum(b[1:4], index=0, version=0).item() == xxh3_reference([b[1:4]], 0, 0)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("m,k", [(8, 1), (12, 3), (4096 * 2, 2), (6, 2)])
def test_batched_checksums_equal_single_ones(algorithm: str, m: int, k: int) -> None:
    n = 5
    g = torch.Generator().manual_seed(m * k)
    bufs = [torch.randn(n * m, generator=g) for _ in range(k)]
    versions = [3, 0, 7, 2**33, 1]
    many = checksum_chunks(bufs, n, versions, domain=DOMAIN_GRAD, algorithm=algorithm).tolist()
    single = [
        checksum(
            [b[i * m : (i + 1) * m] for b in bufs],
            index=i,
            version=versions[i],
            domain=DOMAIN_GRAD,
            algorithm=algorithm,
        ).item()
        for i in range(n)
    ]
    assert many == single
    with pytest.raises(ValueError):
        checksum_chunks(bufs, n, versions[:2], algorithm=algorithm)
    with pytest.raises(ValueError, match="equal sizes"):
        checksum_chunks([bufs[0], bufs[0][:-4]], n, versions, algorithm=algorithm)
