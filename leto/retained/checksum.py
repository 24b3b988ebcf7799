"""Chunk checksums: xxh3 for bytes in host memory, a salted Fletcher pair elsewhere.

A chunk is a list of tensors (the chunk's slice of every retained buffer), read
as one byte string in list order. Its checksum is an int64 salted with the chunk
index, the version (step) the bytes hold and a domain tag (data vs gradients),
so a header from another chunk, another step or another buffer kind does not fit
the bytes. Two algorithms compute it; a retained layout records which one its
checksums use (:data:`ALGORITHMS`, :func:`default_algorithm`), so every copy of
its bytes, wherever it is, is checked the same way.

``"xxh3"`` (host memory): XXH3-64 (the ``xxhash`` library) of the bytes, seeded
with a 64-bit mix of (domain, index, version). One pass at memory speed (1.5 to
1.9 times faster here than the torch-op Fletcher below, which reads the bytes
twice: ``benchmarks/retained_step.py``), and a 64-bit hash: any corruption - a
flipped bit, swapped words, another chunk's bytes under this chunk's header -
goes unnoticed with probability about 2^-64. It runs on CPU tensors only.

``"fletcher"`` (any device, GPU included: torch ops only, no host sync until the
caller reads the value). The bytes are read as int32 words ``s_0 .. s_{n-1}``,
and

    A = (sum_j s_j                 + (index + 1))            mod 2^32
    B = (sum_j (j + 1) * s_j       + mix(domain, index, version)) mod 2^32

the checksum is the int64 whose high 32 bits are A and low 32 bits are B
(``A`` sign-extended: ``A_s * 2^32 + B``; :func:`unpack` splits it back).
What it detects with certainty:

* **Any single flipped bit.** Flipping bit k of word j changes ``s_j`` by
  ``+-2^k`` with ``0 <= k <= 31``; modulo 2^32 that is never 0, so A always
  changes, and A alone fills the checksum's high half. The same holds for any
  error confined to one word (a word's change is below 2^32 in magnitude).
* **Two chunks swapped.** If a chunk's bytes *and* header move to another index,
  the A salt ``index + 1`` differs (indices are < 2^32 - 1), so the stored A no
  longer matches: detection is certain. If only the bytes swap (headers stay),
  different contents collide only when both A and B agree (about 2^-64 for
  unrelated data); identical contents swap harmlessly (nothing changed).
* **Reordered words inside a chunk** (``s_j <-> s_l``): A is unchanged but B
  changes by ``(l - j)(s_j - s_l) mod 2^32``: non-zero unless that product is
  a multiple of 2^32 (both factors together carrying 32 factors of two).

Why modulo 2^32 and not a prime: the sums are then plain int32 reductions,
which torch vectorises (about ten times faster on CPU than reductions that widen
int32 to int64). Each part's words are viewed as an ``R x L`` matrix (L a power
of two dividing the word count, at most 4096); two int32 reductions (wrapping,
i.e. exact modulo 2^32) give the row sums ``S_a`` and column sums ``C_b``, and then

    sum (base + a*L + b + 1) * s_ab = (base + 1) * sum_a S_a + L * sum_a a*S_a + sum_b b*C_b

which needs only small vectors. Their weighted sums are taken in int64 on
residues below 2^32, each product split in 16-bit halves of the weight so no
intermediate exceeds 2^49.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy
import torch
import xxhash

__all__ = [
    "ALGORITHMS",
    "MODULUS",
    "algorithm_error",
    "DOMAIN_DATA",
    "DOMAIN_GRAD",
    "checksum",
    "checksum_chunks",
    "copy_checksum",
    "div_checksums",
    "default_algorithm",
    "int32_words",
    "unpack",
]

MODULUS = 1 << 32
"""Both sums are taken modulo 2^32."""
_MASK32 = MODULUS - 1

DOMAIN_DATA = 1
"""Salt domain for a chunk's parameters and optimizer state."""
DOMAIN_GRAD = 2
"""Salt domain for a chunk's gradients."""

_MASK64 = (1 << 64) - 1
_MAX_COLS = 4096

ALGORITHMS = ("xxh3", "fletcher")
"""The checksum algorithms a retained layout may record."""


def default_algorithm(device: torch.device | str) -> str:
    """The algorithm a new layout on ``device`` uses: xxh3 in host memory, else Fletcher."""
    return "xxh3" if torch.device(device).type == "cpu" else "fletcher"


def algorithm_error(name: object) -> str | None:
    """Why ``name`` is not a checksum algorithm (None: it is one)."""
    if name in ALGORITHMS:
        return None
    return f"unknown checksum algorithm {name!r} (known: {', '.join(ALGORITHMS)})"


def _algorithm(algorithm: str | None, parts: Sequence[torch.Tensor]) -> str:
    if algorithm is None:
        return default_algorithm(parts[0].device)
    why = algorithm_error(algorithm)
    if why:
        raise ValueError(why)
    return algorithm


def _signed(h: int) -> int:
    """An unsigned 64-bit value as the int64 that holds the same bits."""
    return h - (1 << 64) if h >> 63 else h


def _host_bytes(t: torch.Tensor) -> Any:
    """The bytes of a contiguous CPU tensor, as a buffer xxhash reads without a copy."""
    if not t.is_contiguous():
        raise ValueError("checksum needs a contiguous tensor")
    if t.device.type != "cpu":
        raise ValueError(f"the xxh3 checksum reads host memory; this tensor is on {t.device}")
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _xxh3(parts: Sequence[torch.Tensor], seed: int) -> int:
    h = xxhash.xxh3_64(seed=seed)
    for p in parts:
        h.update(_host_bytes(p))
    return _signed(h.intdigest())


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
    ``base + 1 + a*L`` and column b weighs ``b`` (all mod 2^32), so that
    ``sum(w * sums) = sum_j (j + 1) * s_j`` over the part.
    """
    rows_w, cols_w = [], []
    base = 0
    for n in sizes:
        r, c = _split(n)
        rows_w.append(torch.arange(r, dtype=torch.int64) * c + (base + 1))
        cols_w.append(torch.arange(c, dtype=torch.int64))
        base += n
    w = torch.bitwise_and(torch.cat(rows_w + cols_w), _MASK32).to(device)
    return w, sum(x.numel() for x in rows_w)


def _residues(v: torch.Tensor) -> torch.Tensor:
    """int32 sums (exact modulo 2^32) as int64 residues in [0, 2^32)."""
    return v.to(torch.int64).bitwise_and_(_MASK32)


def _weighted(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum(v * w) mod 2^32`` along the last dim; v, w residues below 2^32, no overflow."""
    lo = (v * w.bitwise_and(0xFFFF)).sum(dim=-1)  # each term < 2^48
    hi = (v * w.bitwise_right_shift(16)).bitwise_and_(0xFFFF).sum(dim=-1)  # < 2^16 each
    return lo.add_(hi.bitwise_left_shift_(16)).bitwise_and_(_MASK32)


def _combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``A`` (sign-extended from 32 bits) ``* 2^32 + B``: both halves in one int64."""
    a = a - a.bitwise_right_shift(31).bitwise_left_shift_(32)
    return a.mul_(MODULUS).add_(b)


def _sums(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Unsalted (A, B) as 0-dim int64 tensors, each in [0, 2^32).

    Two int32 reductions per part (row and column sums, written into one
    workspace), then one weighted reduction over the small workspace.
    """
    words = [int32_words(p) for p in parts]
    words = [w for w in words if w.numel()]
    if not words:
        raise ValueError("checksum of no words")
    device = words[0].device
    w, n_rows = _weights(tuple(x.numel() for x in words), device)
    v = torch.empty(w.numel(), dtype=torch.int32, device=device)
    r0, c0 = 0, n_rows
    for x in words:
        rows, cols = _split(x.numel())
        m = x.view(rows, cols)
        torch.sum(m, dim=1, dtype=torch.int32, out=v[r0 : r0 + rows])
        torch.sum(m, dim=0, dtype=torch.int32, out=v[c0 : c0 + cols])
        r0 += rows
        c0 += cols
    r = _residues(v)
    a = r[:n_rows].sum().bitwise_and_(_MASK32)
    return a, _weighted(r, w)


def checksum(
    parts: Sequence[torch.Tensor] | torch.Tensor,
    *,
    index: int,
    version: int,
    domain: int = DOMAIN_DATA,
    algorithm: str | None = None,
) -> torch.Tensor:
    """The salted checksum of ``parts`` (read in order) as a 0-dim int64 tensor.

    ``index`` is the chunk index (0 <= index < 2^32 - 1), ``version`` the step
    the bytes hold, ``domain`` tells data and gradient chunks apart;
    ``algorithm`` is one of :data:`ALGORITHMS` (None: :func:`default_algorithm`
    of the parts' device). A Fletcher value holds A in its high and B in its low
    32 bits (see the module docstring); :func:`unpack` splits it.
    """
    if isinstance(parts, torch.Tensor):
        parts = [parts]
    if not parts:
        raise ValueError("checksum of no tensors")
    if not 0 <= index < _MASK32:
        raise ValueError(f"chunk index out of range: {index}")
    if _algorithm(algorithm, parts) == "xxh3":
        value = _xxh3(parts, _mix(domain, index, version))
        return torch.tensor(value, dtype=torch.int64)
    a, b = _sums(parts)
    a.add_(index + 1).bitwise_and_(_MASK32)
    b.add_(_mix(domain, index, version) & _MASK32).bitwise_and_(_MASK32)
    return _combine(a, b)


def checksum_chunks(
    buffers: Sequence[torch.Tensor],
    n_chunks: int,
    versions: Sequence[int],
    *,
    domain: int = DOMAIN_DATA,
    algorithm: str | None = None,
) -> torch.Tensor:
    """Checksums of every chunk at once: int64 tensor of ``n_chunks`` values.

    Chunk i is ``[buf[i*m:(i+1)*m] for buf in buffers]`` with ``m = numel // n_chunks``
    (flat buffers of equal length), salted with index i and ``versions[i]``. Equal,
    value for value, to :func:`checksum` of each chunk (Fletcher: in about a dozen
    tensor ops instead of a dozen per chunk).
    """
    if not buffers or n_chunks <= 0 or len(versions) != n_chunks:
        raise ValueError("checksum_chunks needs buffers, n_chunks > 0 and one version per chunk")
    if _algorithm(algorithm, buffers) == "xxh3":
        total = buffers[0].numel()
        if total % n_chunks or any(b.numel() != total for b in buffers):
            raise ValueError("buffers must have equal sizes, a multiple of n_chunks elements")
        m = total // n_chunks
        values = [
            _xxh3([b[i * m : (i + 1) * m] for b in buffers], _mix(domain, i, versions[i]))
            for i in range(n_chunks)
        ]
        return torch.tensor(values, dtype=torch.int64)
    words = [int32_words(b) for b in buffers]
    total = words[0].numel()
    if total % n_chunks or any(w.numel() != total for w in words):
        raise ValueError("buffers must have equal sizes, a multiple of n_chunks words")
    m = total // n_chunks
    device = words[0].device
    w, n_rows = _weights(tuple([m] * len(words)), device)
    rows, cols = _split(m)
    v = torch.empty(n_chunks, w.numel(), dtype=torch.int32, device=device)
    k = len(words)
    for r, x in enumerate(words):
        t3 = x.view(n_chunks, rows, cols)
        torch.sum(t3, dim=2, dtype=torch.int32, out=v[:, r * rows : (r + 1) * rows])
        torch.sum(
            t3, dim=1, dtype=torch.int32, out=v[:, k * rows + r * cols : k * rows + (r + 1) * cols]
        )
    res = _residues(v)
    a = res[:, :n_rows].sum(dim=1).bitwise_and_(_MASK32)
    b = _weighted(res, w)
    salt_a = torch.arange(1, n_chunks + 1, dtype=torch.int64, device=device)
    salt_b = torch.tensor(
        [_mix(domain, i, ver) & _MASK32 for i, ver in enumerate(versions)], dtype=torch.int64
    ).to(device)
    a.add_(salt_a).bitwise_and_(_MASK32)
    b.add_(salt_b).bitwise_and_(_MASK32)
    return _combine(a, b)


BLOCK_BYTES = 1 << 18
"""The bytes :func:`copy_checksum` copies before it hashes them: a block small enough
that its source and copy are still in a core's L2 cache when the hash reads it."""


def copy_checksum(
    dst: Sequence[torch.Tensor],
    src: Sequence[torch.Tensor],
    *,
    index: int,
    version: int,
    domain: int = DOMAIN_DATA,
    algorithm: str | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> torch.Tensor:
    """Copy ``src`` into ``dst`` (part by part, equal shapes) and return the checksum of
    the copy, equal to :func:`checksum` of ``dst`` after it.

    xxh3: one pass over the bytes instead of two. Each part is copied ``block_bytes`` at
    a time and the block just written is hashed while it is still in cache (XXH3's
    streaming digest is the one-shot digest of the bytes fed in order, so the value is
    the chunk's checksum as any other pass computes it). Fletcher (any device): the copy,
    then :func:`checksum` of it (torch ops cannot share a pass).
    """
    if len(dst) != len(src) or not dst:
        raise ValueError("copy_checksum needs as many destination parts as source parts")
    if not 0 <= index < _MASK32:
        raise ValueError(f"chunk index out of range: {index}")
    if _algorithm(algorithm, dst) != "xxh3":
        with torch.no_grad():
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
        return checksum(list(dst), index=index, version=version, domain=domain, algorithm=algorithm)
    h = xxhash.xxh3_64(seed=_mix(domain, index, version))
    for d, s in zip(dst, src, strict=True):
        # numpy views of the bytes: slicing and copying a block costs a microsecond
        # there, against ten for a tensor's, and a chunk is copied in tens of blocks
        db, sb = _host_bytes(d), _host_bytes(s)
        if db.shape != sb.shape:
            raise ValueError(f"copy_checksum: a part of {sb.size} bytes into {db.size}")
        for a in range(0, db.size, block_bytes):
            block = db[a : a + block_bytes]
            numpy.copyto(block, sb[a : a + block_bytes])
            h.update(block)
    return torch.tensor(_signed(h.intdigest()), dtype=torch.int64)


_NUMPY_FLOATS = (torch.float32, torch.float64)  # numpy divides them as torch does


def div_checksums(
    dst: torch.Tensor,
    src: torch.Tensor,
    divisor: int,
    n_chunks: int,
    version: int,
    *,
    domain: int = DOMAIN_DATA,
    algorithm: str | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> torch.Tensor:
    """``torch.div(src, divisor, out=dst)`` (flat tensors of a size ``n_chunks`` divides)
    and :func:`checksum_chunks` of ``dst`` after it, at ``version``, in one pass.

    xxh3, float32 or float64: each block of ``dst`` hashed just after it is
    written, while it is in cache. numpy divides the blocks (a microsecond a block, a
    torch op ten): IEEE division, correctly rounded either way, on the same thread
    (so under the same flush-to-zero mode), so the bytes are ``torch.div``'s
    (tests/retained/test_fused_passes.py checks it, subnormals included). Else
    (Fletcher, 16-bit floats): the two passes apart."""
    if dst.shape != src.shape or dst.dim() != 1 or n_chunks <= 0 or dst.numel() % n_chunks:
        raise ValueError("div_checksums needs flat tensors of one size, a multiple of n_chunks")
    if _algorithm(algorithm, [dst]) != "xxh3" or dst.dtype not in _NUMPY_FLOATS:
        with torch.no_grad():
            torch.div(src, divisor, out=dst)
        return checksum_chunks(
            [dst], n_chunks, [version] * n_chunks, domain=domain, algorithm=algorithm
        )
    _host_bytes(dst), _host_bytes(src)  # contiguous, in host memory (else: one clear line)
    d: Any = dst.detach().numpy()  # a buffer xxhash reads without a copy
    s: Any = src.detach().numpy()
    m = dst.numel() // n_chunks
    step = max(1, block_bytes // dst.element_size())
    values = []
    for i in range(n_chunks):
        h = xxhash.xxh3_64(seed=_mix(domain, i, version))
        for a in range(i * m, (i + 1) * m, step):
            b = min(a + step, (i + 1) * m)
            numpy.divide(s[a:b], divisor, out=d[a:b])
            h.update(d[a:b])
        values.append(_signed(h.intdigest()))
    return torch.tensor(values, dtype=torch.int64)


def unpack(value: int) -> tuple[int, int]:
    """Split a Fletcher checksum into its (A, B) sums."""
    return (value >> 32) & _MASK32, value & _MASK32
