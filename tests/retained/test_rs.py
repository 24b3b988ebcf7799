"""leto.retained.rs: the Cauchy Reed-Solomon code of tier 2 with m >= 2 parities,
checked against reedsolo's GF(2^8) (the same field: primitive polynomial 0x11d)."""

from __future__ import annotations

import itertools

import pytest
import reedsolo
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leto.retained import rs

reedsolo.init_tables(rs.PRIM)


def test_field_arithmetic_is_reedsolos() -> None:
    for a in range(256):
        for b in range(256):
            assert rs.gf_mul(a, b) == reedsolo.gf_mul(a, b)
        if a:
            assert rs.gf_inv(a) == reedsolo.gf_inverse(a)
    with pytest.raises(ZeroDivisionError, match="0 has no inverse"):
        rs.gf_inv(0)


def test_vectorised_multiply_matches_the_scalar_one() -> None:
    data = torch.arange(256, dtype=torch.uint8)
    for coef in (0, 1, 2, 0x53, 255):
        out = torch.zeros(256, dtype=torch.uint8)
        rs.mul_into(out, coef, data)
        assert out.tolist() == [reedsolo.gf_mul(coef, x) for x in range(256)]


def _reference_parity(data: list[list[int]], m: int) -> list[list[int]]:
    """Scalar encode with reedsolo's multiply: P_j[b] = XOR_i C[j][i] * D_i[b]."""
    c = [[reedsolo.gf_inverse(j ^ (m + i)) for i in range(len(data))] for j in range(m)]
    out = []
    for j in range(m):
        row = []
        for b in range(len(data[0])):
            v = 0
            for i, d in enumerate(data):
                v ^= reedsolo.gf_mul(c[j][i], d[b])
            row.append(v)
        out.append(row)
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 3),
    st.integers(1, 64),
    st.randoms(use_true_random=False),
)
def test_any_m_lost_blocks_are_rebuilt_bitwise(k: int, m: int, n: int, rnd) -> None:  # type: ignore[no-untyped-def]
    data = [
        torch.tensor([rnd.randrange(256) for _ in range(n)], dtype=torch.uint8) for _ in range(k)
    ]
    parity = rs.encode(data, m)
    assert [p.tolist() for p in parity] == _reference_parity([d.tolist() for d in data], m)
    blocks = list(range(k + m))
    for lost in itertools.combinations(blocks, min(m, k + m - 1)):
        present = {i: data[i] for i in range(k) if i not in lost}
        surviving = {j: parity[j] for j in range(m) if k + j not in lost}
        got = rs.decode(k, m, present, surviving)
        assert sorted(got) == [i for i in range(k) if i in lost]
        for i, d in got.items():
            assert torch.equal(d, data[i]), (k, m, lost, i)


def test_more_losses_than_parities_is_refused() -> None:
    data = [torch.full((8,), i, dtype=torch.uint8) for i in range(4)]
    parity = rs.encode(data, 2)
    with pytest.raises(ValueError, match=r"3 data blocks missing \(\[0, 1, 2\]\), only 2"):
        rs.decode(4, 2, {3: data[3]}, {0: parity[0], 1: parity[1]})


def test_bad_blocks_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="flat uint8 tensors of one length"):
        rs.encode([torch.zeros(4, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8)], 1)
    with pytest.raises(ValueError, match="m \\+ k <= 256"):
        rs.cauchy(200, 100)


def test_a_singular_matrix_is_refused() -> None:
    with pytest.raises(ValueError, match="singular"):
        rs.invert([[1, 2], [1, 2]])


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 6), st.integers(1, 3), st.integers(1, 40), st.randoms(use_true_random=False))
def test_striped_across_a_group_any_m_lost_members_rebuilt_bitwise(
    size: int,
    m: int,
    n: int,
    rnd,  # type: ignore[no-untyped-def]
) -> None:
    from leto.retained.parity import run_spmd

    m = min(m, size - 1)
    blk = rs.striped_share_nbytes(n, size, m)
    data = [
        torch.tensor([rnd.randrange(256) for _ in range(n)], dtype=torch.uint8) for _ in range(size)
    ]
    shares = [torch.zeros(m * blk, dtype=torch.uint8) for _ in range(size)]
    run_spmd(size, lambda c: rs.encode_striped(c, data[c.rank], m, shares[c.rank]))
    # every parity share is the Cauchy combination of its stripe's members' blocks
    c = rs.cauchy(m, size - m)
    for h in range(size):
        for j in range(m):
            s = (h - j) % size
            members = [(s + m + i) % size for i in range(size - m)]
            want = torch.zeros(blk, dtype=torch.uint8)
            for i, x in enumerate(members):
                padded = torch.zeros((size - m) * blk, dtype=torch.uint8)
                padded[:n] = data[x]
                rs.mul_into(want, c[j][i], padded.view(size - m, blk)[i])
            assert torch.equal(shares[h][j * blk : (j + 1) * blk], want)
    for lost in itertools.combinations(range(size), m):
        d2 = [
            torch.zeros(n, dtype=torch.uint8) if r in lost else data[r].clone() for r in range(size)
        ]
        s2 = [
            torch.zeros(m * blk, dtype=torch.uint8) if r in lost else shares[r].clone()
            for r in range(size)
        ]
        run_spmd(
            size,
            lambda c, d2=d2, s2=s2, lost=lost: rs.decode_striped(
                c, d2[c.rank], m, lost, s2[c.rank]
            ),
        )
        for r in range(size):
            assert torch.equal(d2[r], data[r]), (size, m, lost, r)
            assert torch.equal(s2[r], shares[r]), (size, m, lost, r)


def test_striped_refuses_more_lost_members_than_parities() -> None:
    from leto.retained.parity import run_spmd

    d = [torch.zeros(6, dtype=torch.uint8) for _ in range(4)]
    sh = [torch.zeros(2 * 3, dtype=torch.uint8) for _ in range(4)]
    with pytest.raises(
        ValueError, match=r"cannot rebuild members \[0, 1, 2\] of 4 with 2 parities"
    ):
        run_spmd(4, lambda c: rs.decode_striped(c, d[c.rank], 2, [0, 1, 2], sh[c.rank]))
