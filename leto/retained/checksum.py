"""Chunk checksums: a salted Fletcher pair of sums modulo the prime 2^31 - 1.

A chunk is a list of tensors (the chunk's slice of every retained buffer). Its
bytes are read as *signed* int32 words ``s_0 .. s_{n-1}`` in list order, and

    A = (sum_j s_j                 + (index + 1))            mod p
    B = (sum_j (j + 1) * s_j       + mix(domain, index, version)) mod p

with ``p = 2^31 - 1``; the checksum is the int64 ``A * 2^31 + B``.

Why this detects what we need:

* **Any single flipped bit.** Flipping bit k of word j changes ``s_j`` by
  ``+-2^k`` with ``0 <= k <= 31`` (bit 31 is the sign bit: ``+-2^31``). ``A``
  changes by ``+-2^k mod p``, which is never 0 because p is an odd prime and
  cannot divide a power of two. So A alone always detects it; B also does, since
  ``(j + 1) * 2^k`` is a product of two non-zero residues mod a prime. The same
  argument covers any error confined to one word unless the word changes by a
  multiple of p (a change of exactly +-p or +-2p).
* **Two chunks swapped.** If a chunk's bytes *and* header move to another index,
  the A salt ``index + 1`` differs (indices are < p), so the stored A no longer
  matches: detection is certain. If only the bytes swap (headers stay), the two
  chunks are told apart by their contents: different contents collide only when
  both A and B agree (probability about 2^-62 for unrelated data); identical
  contents swap harmlessly (nothing changed).
* **Reordered words inside a chunk** (``s_j <-> s_l``): A is unchanged but B
  changes by ``(l - j)(s_j - s_l) mod p``, non-zero unless the two words differ
  by a multiple of p.
* The version and a domain tag (data vs gradients) are mixed into B's salt, so a
  header from another step or another buffer kind is unlikely to fit the bytes.

Computation uses torch ops only (so it runs where the tensor lives, GPU
included, with no host sync until the caller reads the value): each part's words
are viewed as an ``R x L`` matrix (L a power of two dividing the word count, at
most 4096); two int64 reductions give the row sums ``S_a`` and column sums
``C_b``, and then

    sum (base + a*L + b + 1) * s_ab = (base + 1) * sum_a S_a + L * sum_a a*S_a + sum_b b*C_b

which needs only small vectors mod p. Every intermediate fits int64: a row sum is
below ``4096 * 2^31``, a column sum below ``R * 2^31 < 2^62``, and every product
is of two residues below 2^31 and reduced before summing.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

__all__ = [
    "PRIME",
    "DOMAIN_DATA",
    "DOMAIN_GRAD",
    "checksum",
    "checksum_chunks",
    "int32_words",
    "unpack",
]

PRIME = (1 << 31) - 1
"""The modulus p = 2^31 - 1 (a Mersenne prime)."""

DOMAIN_DATA = 1
"""Salt domain for a chunk's parameters and optimizer state."""
DOMAIN_GRAD = 2
"""Salt domain for a chunk's gradients."""

_MASK64 = (1 << 64) - 1
_MAX_COLS = 4096


def _mix(*values: int) -> int:
    """A splitmix64-style hash of small integers (Python ints, deterministic)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) & _MASK64
        h = (h * 0xBF58476D1CE4E5B9) & _MASK64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return h


def int32_words(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D int32 tensor (a view when aligned).

    Raises ``ValueError`` for a non-contiguous tensor or a byte size that is not a
    multiple of 4. A view whose byte offset is not 4-aligned is copied.
    """
    if not t.is_contiguous():
        raise ValueError("checksum needs a contiguous tensor")
    b = t.reshape(-1).view(torch.uint8)
    if b.numel() % 4:
        raise ValueError(f"checksum needs a multiple of 4 bytes, got {b.numel()}")
    try:
        return b.view(torch.int32)
    except RuntimeError:  # byte offset not a multiple of 4
        return b.clone().view(torch.int32)


def _split(n: int) -> tuple[int, int]:
    cols = min(n & -n, _MAX_COLS) if n else 1
    return n // cols, cols


@lru_cache(maxsize=256)
def _weights(sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, int]:
    """Weights of the row sums then the column sums of every part, and the row count.

    For a part at word offset ``base`` viewed as ``R x L``: row a weighs
    ``base + 1 + a*L`` and column b weighs ``b`` (all mod p), so that
    ``sum(w * sums) = sum_j (j + 1) * s_j`` over the part.
    """
    rows_w, cols_w = [], []
    base = 0
    for n in sizes:
        r, c = _split(n)
        rows_w.append(torch.arange(r, dtype=torch.int64) * c + (base + 1))
        cols_w.append(torch.arange(c, dtype=torch.int64))
        base += n
    w = torch.remainder(torch.cat(rows_w + cols_w), PRIME).to(device)
    return w, sum(x.numel() for x in rows_w)


def _sums(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Unsalted (A, B) as 0-dim int64 tensors, each in [0, p).

    Two reductions per part (row and column sums, written into one int64
    workspace), then one weighted reduction over the small workspace.
    """
    words = [int32_words(p) for p in parts]
    words = [w for w in words if w.numel()]
    if not words:
        raise ValueError("checksum of no words")
    device = words[0].device
    w, n_rows = _weights(tuple(x.numel() for x in words), device)
    v = torch.empty(w.numel(), dtype=torch.int64, device=device)
    r0, c0 = 0, n_rows
    for x in words:
        rows, cols = _split(x.numel())
        m = x.view(rows, cols)
        torch.sum(m, dim=1, dtype=torch.int64, out=v[r0 : r0 + rows])
        torch.sum(m, dim=0, dtype=torch.int64, out=v[c0 : c0 + cols])
        r0 += rows
        c0 += cols
    a = torch.remainder(v[:n_rows].sum(), PRIME)
    t = torch.remainder(v, PRIME)
    t.mul_(w).remainder_(PRIME)
    b = torch.remainder(t.sum(), PRIME)
    return a, b


def checksum(
    parts: Sequence[torch.Tensor] | torch.Tensor,
    *,
    index: int,
    version: int,
    domain: int = DOMAIN_DATA,
) -> torch.Tensor:
    """The salted checksum of ``parts`` (read in order) as a 0-dim int64 tensor.

    ``index`` is the chunk index (0 <= index < p - 1), ``version`` the step the
    bytes hold, ``domain`` tells data and gradient chunks apart. The value is
    ``A * 2^31 + B`` (see the module docstring); :func:`unpack` splits it.
    """
    if isinstance(parts, torch.Tensor):
        parts = [parts]
    if not parts:
        raise ValueError("checksum of no tensors")
    if not 0 <= index < PRIME - 1:
        raise ValueError(f"chunk index out of range: {index}")
    a, b = _sums(parts)
    a.add_(index + 1).remainder_(PRIME)
    b.add_(_mix(domain, index, version) % PRIME).remainder_(PRIME)
    return a.mul_(1 << 31).add_(b)


def checksum_chunks(
    buffers: Sequence[torch.Tensor],
    n_chunks: int,
    versions: Sequence[int],
    *,
    domain: int = DOMAIN_DATA,
) -> torch.Tensor:
    """Checksums of every chunk at once: int64 tensor of ``n_chunks`` values.

    Chunk i is ``[buf[i*m:(i+1)*m] for buf in buffers]`` with ``m = numel // n_chunks``
    (flat buffers of equal length), salted with index i and ``versions[i]``. Equal,
    value for value, to :func:`checksum` of each chunk, in about a dozen tensor
    ops instead of a dozen per chunk.
    """
    if not buffers or n_chunks <= 0 or len(versions) != n_chunks:
        raise ValueError("checksum_chunks needs buffers, n_chunks > 0 and one version per chunk")
    words = [int32_words(b) for b in buffers]
    total = words[0].numel()
    if total % n_chunks or any(w.numel() != total for w in words):
        raise ValueError("buffers must have equal sizes, a multiple of n_chunks words")
    m = total // n_chunks
    device = words[0].device
    w, n_rows = _weights(tuple([m] * len(words)), device)
    rows, cols = _split(m)
    v = torch.empty(n_chunks, w.numel(), dtype=torch.int64, device=device)
    k = len(words)
    for r, x in enumerate(words):
        t3 = x.view(n_chunks, rows, cols)
        torch.sum(t3, dim=2, dtype=torch.int64, out=v[:, r * rows : (r + 1) * rows])
        torch.sum(
            t3, dim=1, dtype=torch.int64, out=v[:, k * rows + r * cols : k * rows + (r + 1) * cols]
        )
    a = torch.remainder(v[:, :n_rows].sum(dim=1), PRIME)
    t = torch.remainder(v, PRIME)
    t.mul_(w).remainder_(PRIME)
    b = torch.remainder(t.sum(dim=1), PRIME)
    salt_a = torch.arange(1, n_chunks + 1, dtype=torch.int64, device=device)
    salt_b = torch.tensor(
        [_mix(domain, i, ver) % PRIME for i, ver in enumerate(versions)], dtype=torch.int64
    ).to(device)
    a.add_(salt_a).remainder_(PRIME)
    b.add_(salt_b).remainder_(PRIME)
    return a.mul_(1 << 31).add_(b)


def unpack(value: int) -> tuple[int, int]:
    """Split a checksum into its (A, B) sums."""
    return value >> 31, value & ((1 << 31) - 1)
