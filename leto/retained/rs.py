"""A systematic Cauchy Reed-Solomon code over GF(2^8): ``k`` data blocks, ``m`` parities,
any ``m`` of the ``k + m`` blocks lost are rebuilt from the others (MDS).

Tier 2 with ``tier2_parity = m >= 2`` (:mod:`leto.core.erasure`: a stripe of ``N - m``
nodes' snapshot shares and ``m`` parity blocks on ``m`` other nodes) needs a code whose
parities are independent: the sum mod 256 that tier 1 and ``m = 1`` use
(:mod:`leto.retained.parity`) is one equation, enough for one lost block only.

Field: GF(2^8) with the primitive polynomial 0x11d and generator 2, the field of
``reedsolo`` (the property tests check this module's arithmetic against it), where
addition is XOR. Parity ``j`` is ``P_j = XOR_i C[j][i] * D_i`` with the Cauchy matrix
``C[j][i] = 1 / (x_j ^ y_i)``, ``x_j = j``, ``y_i = m + i``: every square submatrix of a
Cauchy matrix is invertible, so any ``e <= m`` lost data blocks are rebuilt from any
``e`` surviving parities (a ``e x e`` system, solved once per erasure pattern, not per
byte). Byte-wise multiplication by a constant is one lookup in a 256-entry row of the
multiplication table, vectorised in torch over the whole block; the SPMD encode sums
the members' products with a bitwise-XOR reduction (``torch.distributed`` ``BXOR``,
which gloo runs on CPU tensors).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from leto.retained.parity import Collective

__all__ = [
    "PRIM",
    "XorCollective",
    "cauchy",
    "decode",
    "decode_striped",
    "encode",
    "encode_striped",
    "gf_inv",
    "gf_mul",
    "invert",
    "mul_into",
    "striped_share_nbytes",
]

PRIM = 0x11D
_STEP = 1 << 20  # bytes per lookup (bounds the int64 index copy)


def _tables() -> tuple[list[int], list[int]]:
    exp = [0] * 512
    log = [0] * 256
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= PRIM
    for i in range(255, 512):
        exp[i] = exp[i - 255]
    return exp, log


_EXP, _LOG = _tables()


def gf_mul(a: int, b: int) -> int:
    if a == 0 or b == 0:
        return 0
    return _EXP[_LOG[a] + _LOG[b]]


def gf_inv(a: int) -> int:
    if not 0 < a < 256:
        raise ZeroDivisionError(f"gf_inv: {a} has no inverse in GF(2^8)")
    return _EXP[255 - _LOG[a]]


def _mul_table() -> torch.Tensor:
    log = torch.tensor(_LOG, dtype=torch.int64)
    exp = torch.tensor(_EXP, dtype=torch.int64)
    t = exp[(log[:, None] + log[None, :])].to(torch.uint8)
    t[0, :] = 0
    t[:, 0] = 0
    return t


_MUL = _mul_table()  # _MUL[a][b] = a * b


def cauchy(m: int, k: int) -> list[list[int]]:
    """The ``m x k`` Cauchy matrix of the code (rows: parities, columns: data blocks)."""
    if m < 1 or k < 1 or m + k > 256:
        raise ValueError(f"cauchy: need m >= 1, k >= 1, m + k <= 256; got m={m}, k={k}")
    return [[gf_inv(j ^ (m + i)) for i in range(k)] for j in range(m)]


def invert(a: Sequence[Sequence[int]]) -> list[list[int]]:
    """The inverse of a square matrix over GF(2^8) (Gauss-Jordan); ValueError if singular."""
    n = len(a)
    rows = [list(r) + [int(i == j) for j in range(n)] for i, r in enumerate(a)]
    for col in range(n):
        piv = next((r for r in range(col, n) if rows[r][col]), None)
        if piv is None:
            raise ValueError("invert: singular matrix")
        rows[col], rows[piv] = rows[piv], rows[col]
        inv = gf_inv(rows[col][col])
        rows[col] = [gf_mul(inv, v) for v in rows[col]]
        for r in range(n):
            f = rows[r][col]
            if r != col and f:
                rows[r] = [v ^ gf_mul(f, p) for v, p in zip(rows[r], rows[col], strict=True)]
    return [r[n:] for r in rows]


def mul_into(out: torch.Tensor, coef: int, data: torch.Tensor) -> None:
    """``out ^= coef * data`` byte-wise (uint8 tensors of one shape, flat)."""
    if coef == 0:
        return
    if coef == 1:
        out.bitwise_xor_(data)
        return
    row = _MUL[coef]
    for lo in range(0, data.numel(), _STEP):
        hi = min(lo + _STEP, data.numel())
        out[lo:hi].bitwise_xor_(row[data[lo:hi].to(torch.int64)])


def _flat(blocks: Sequence[torch.Tensor]) -> tuple[int, torch.device]:
    if not blocks:
        raise ValueError("rs: no blocks")
    n = blocks[0].numel()
    for b in blocks:
        if b.dtype != torch.uint8 or b.dim() != 1 or b.numel() != n:
            raise ValueError(
                f"rs: blocks must be flat uint8 tensors of one length ({n}), got "
                f"{b.dtype} of shape {tuple(b.shape)}"
            )
    return n, blocks[0].device


def encode(data: Sequence[torch.Tensor], m: int) -> list[torch.Tensor]:
    """The ``m`` parities of the ``k = len(data)`` data blocks."""
    n, dev = _flat(data)
    c = cauchy(m, len(data))
    out = [torch.zeros(n, dtype=torch.uint8, device=dev) for _ in range(m)]
    for j in range(m):
        for i, d in enumerate(data):
            mul_into(out[j], c[j][i], d)
    return out


def decode(
    k: int, m: int, data: Mapping[int, torch.Tensor], parity: Mapping[int, torch.Tensor]
) -> dict[int, torch.Tensor]:
    """The missing data blocks (indices ``0..k-1`` not in ``data``), from the present
    ones and the surviving parities (indices ``0..m-1``); ValueError if more are missing
    than parities survive."""
    missing = [i for i in range(k) if i not in data]
    if not missing:
        return {}
    use = sorted(parity)[: len(missing)]
    if len(use) < len(missing):
        raise ValueError(
            f"rs: {len(missing)} data blocks missing ({missing}), only {len(parity)} "
            "parities survive"
        )
    n, dev = _flat([*data.values(), *parity.values()])
    c = cauchy(m, k)
    # syndromes: each used parity with the present data blocks' terms removed
    syn = []
    for j in use:
        s = parity[j].clone()
        for i, d in data.items():
            mul_into(s, c[j][i], d)
        syn.append(s)
    inv = invert([[c[j][i] for i in missing] for j in use])
    out = {}
    for a, i in enumerate(missing):
        d = torch.zeros(n, dtype=torch.uint8, device=dev)
        for b, s in enumerate(syn):
            mul_into(d, inv[a][b], s)
        out[i] = d
    return out


# ------------------------------------------------------------ striped across a group


class XorCollective(Collective, Protocol):
    def reduce_xor(self, tensor: torch.Tensor, dst: int) -> None:
        """Bitwise XOR of every member's ``tensor`` into ``dst``'s (SPMD)."""
        ...


def striped_share_nbytes(nbytes: int, size: int, m: int) -> int:
    """Bytes of one parity share; each member stores ``m`` of them."""
    if not 1 <= m < size:
        raise ValueError(f"striped code: need 1 <= m < group size; got m={m}, size={size}")
    return -(-nbytes // (size - m))


def _roles(size: int, m: int, s: int) -> tuple[list[int], list[int]]:
    """Stripe ``s``: its parity holders (parity j on ``s + j``) and its data members
    (data block i from ``s + m + i``), all mod ``size`` (leto.core.erasure's placement)."""
    return [(s + j) % size for j in range(m)], [(s + m + i) % size for i in range(size - m)]


def _blocks_of(data: torch.Tensor, size: int, m: int) -> torch.Tensor:
    """The member's bytes, zero-padded, as ``(size - m) x blk``: row b is its data block
    of stripe ``me - m - b`` (it is data member b there)."""
    blk = striped_share_nbytes(data.numel(), size, m)
    if (size - m) * blk == data.numel():
        return data.view(size - m, blk)
    out = torch.zeros((size - m) * blk, dtype=torch.uint8, device=data.device)
    out[: data.numel()] = data
    return out.view(size - m, blk)


def _flat_bytes(data: torch.Tensor, what: str) -> torch.Tensor:
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(
            f"rs: {what} must be a flat uint8 tensor, got {data.dtype} {tuple(data.shape)}"
        )
    return data


def encode_striped(coll: XorCollective, data: torch.Tensor, m: int, out: torch.Tensor) -> None:
    """Tier-2 encode with ``m`` parities; every member calls it. ``out`` (``m x blk``
    bytes, flat) receives this member's shares: share j is parity j of stripe
    ``me - j``."""
    size = coll.size
    blocks = _blocks_of(_flat_bytes(data, "data"), size, m)
    blk = blocks.shape[1]
    if _flat_bytes(out, "out").numel() != m * blk:
        raise ValueError(f"rs: share buffer has {out.numel()} bytes, expected {m * blk}")
    c = cauchy(m, size - m)
    for s in range(size):
        holders, members = _roles(size, m, s)
        for j, h in enumerate(holders):
            _parity_to(coll, c[j], members, blocks, h, out[j * blk : (j + 1) * blk])


def _parity_to(
    coll: XorCollective,
    coefs: Sequence[int],
    members: Sequence[int],
    blocks: torch.Tensor,
    holder: int,
    out: torch.Tensor,
) -> None:
    """One parity of one stripe, ``XOR_i coefs[i] * D_i`` of its data ``members``, into
    ``out`` on ``holder`` (every member calls it)."""
    me = coll.rank
    buf = torch.zeros(blocks.shape[1], dtype=torch.uint8, device=blocks.device)
    if me in members:
        i = members.index(me)
        mul_into(buf, coefs[i], blocks[i])
    coll.reduce_xor(buf, holder)
    if me == holder:
        out.copy_(buf)


def decode_striped(
    coll: XorCollective,
    data: torch.Tensor,
    m: int,
    lost: Sequence[int],
    shares: torch.Tensor | None,
) -> None:
    """Rebuild the members ``lost`` (at most ``m``): their bytes into ``data`` and their
    shares into ``shares``; every member calls it, survivors with their data and shares.

    Each missing block is one XOR-reduction: the inverse of the stripe's system folded
    into every survivor's coefficient, so no syndrome travels twice.
    """
    size, me = coll.size, coll.rank
    gone = sorted(set(lost))
    if len(gone) > m or any(not 0 <= x < size for x in gone):
        raise ValueError(f"rs: cannot rebuild members {list(lost)} of {size} with {m} parities")
    _flat_bytes(data, "data")
    blk = striped_share_nbytes(data.numel(), size, m)
    if shares is None or _flat_bytes(shares, "shares").numel() != m * blk:
        raise ValueError(f"rs: member {me} must pass its {m * blk}-byte share buffer")
    blocks = _blocks_of(data, size, m)
    padded = blocks.data_ptr() != data.data_ptr() or blocks.numel() != data.numel()
    c = cauchy(m, size - m)
    for s in range(size):
        holders, members = _roles(size, m, s)
        missing = [i for i, x in enumerate(members) if x in gone]
        if not missing:
            continue
        use = [j for j, h in enumerate(holders) if h not in gone][: len(missing)]
        inv = invert([[c[j][i] for i in missing] for j in use])
        for a, i in enumerate(missing):
            # D_i = sum_b inv[a][b] * (P_b + sum_{present k} C[b][k] * D_k)
            buf = torch.zeros(blk, dtype=torch.uint8, device=data.device)
            if me not in gone:
                for b, j in enumerate(use):
                    if me == holders[j]:
                        mul_into(buf, inv[a][b], shares[j * blk : (j + 1) * blk])
                if me in members:
                    k = members.index(me)
                    coef = 0
                    for b, j in enumerate(use):
                        coef ^= gf_mul(inv[a][b], c[j][k])
                    mul_into(buf, coef, blocks[k])
            coll.reduce_xor(buf, members[i])
            if me == members[i]:
                blocks[i] = buf
    if padded and me in gone:
        data.copy_(blocks.reshape(-1)[: data.numel()])
    # the lost members' shares, encoded again from the (now whole) data
    for s in range(size):
        holders, members = _roles(size, m, s)
        for j, h in enumerate(holders):
            if h in gone:
                _parity_to(coll, c[j], members, blocks, h, shares[j * blk : (j + 1) * blk])
