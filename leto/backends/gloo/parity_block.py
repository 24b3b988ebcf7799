"""Tier-1 parity in a node's host memory, shared by the node's trainers.

One block per chunk (and one for the gradients), all in one memfd segment of the node
(:data:`TIER1`, :func:`node_blocks`) that the node agent holds and every trainer of the
node maps once: a node's descriptors, mappings and requests for its tier 1 do not grow
with its chunks. A block's layout (int64 header, then bytes), at a 64-byte aligned
offset of the segment::

    valid   (MAGIC once encoded; 0: never encoded = the protocol's LOST)
    active  (0 or 1: which buffer is current)
    members, nbytes
    per buffer b: versions[members], checksums[members]
    buffer 0 | buffer 1

A member's update (``parity += new - old``) runs under a POSIX record lock on the
block's byte range of the segment (released by the kernel if the holder dies; the
blocks' locks are independent) and is **double-buffered**:
it writes ``inactive = active + delta`` and the inactive buffer's versions, then
flips ``active`` with one aligned 8-byte store. A trainer killed at any point of
an update leaves the previous parity and its versions intact; the protocol's
``ParityChunk`` is atomic here too. Sums are bytewise mod 256
(:mod:`leto.retained.parity`), so the order of the members' updates does not
matter.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from leto.core.chunk import NONE
from leto.retained.parity import as_bytes

from . import segments

__all__ = [
    "MAGIC",
    "TIER1",
    "ParityBlock",
    "block_bytes",
    "node_blocks",
    "tier1_bytes",
    "tier1_name",
]

MAGIC = 0x4C45544F50415259  # "LETOPARY"
TIER1 = "tier1"  # the node's segment of every tier-1 block: its name's prefix
_FIXED = 4
_ALIGN = 64  # each block's offset in the node's segment


def _header_words(members: int) -> int:
    w = _FIXED + 4 * members
    return -(-w // 8) * 8


def block_bytes(members: int, nbytes: int) -> int:
    return 8 * _header_words(members) + 2 * nbytes


def _stride(members: int, nbytes: int) -> int:
    return -(-block_bytes(members, nbytes) // _ALIGN) * _ALIGN


def tier1_bytes(members: int, chunk_bytes: int, n_chunks: int, grad_bytes: int) -> int:
    """The size of a node's :data:`TIER1` segment: ``n_chunks`` blocks of ``chunk_bytes``
    payload each, then the gradients' block of ``grad_bytes``."""
    return n_chunks * _stride(members, chunk_bytes) + _stride(members, grad_bytes)


def tier1_name(chunk_bytes: int, n_chunks: int, grad_bytes: int) -> str:
    """The name of a node's :data:`TIER1` segment: its geometry, so ranks whose layouts
    differ (a configuration the coordinator refuses) never share blocks at different
    offsets, even where the totals agree."""
    return f"{TIER1}.{n_chunks}x{chunk_bytes}.{grad_bytes}"


def node_blocks(
    fd: int, base: torch.Tensor, members: int, chunk_bytes: int, n_chunks: int, grad_bytes: int
) -> list[ParityBlock]:
    """The blocks of a node's :data:`TIER1` segment (``fd``, mapped as ``base``): one per
    chunk, then the gradients' (:func:`tier1_bytes` is its size)."""
    size = tier1_bytes(members, chunk_bytes, n_chunks, grad_bytes)
    if base.numel() != size:
        raise ValueError(f"a tier-1 segment of {base.numel()} bytes, {size} expected")
    step = _stride(members, chunk_bytes)
    out = [
        ParityBlock(fd, members, chunk_bytes, base=base, offset=c * step) for c in range(n_chunks)
    ]
    out.append(ParityBlock(fd, members, grad_bytes, base=base, offset=n_chunks * step))
    return out


class ParityBlock:
    """One block: a segment of its own (``fd``), or the bytes at ``offset`` of a node's
    segment ``fd`` mapped as ``base`` (locked by byte range)."""

    def __init__(
        self,
        fd: int,
        members: int,
        nbytes: int,
        *,
        base: torch.Tensor | None = None,
        offset: int = 0,
    ) -> None:
        self.fd = fd  # kept open: the lock is taken on it
        self.members = members
        self.nbytes = nbytes
        size = block_bytes(members, nbytes)
        if base is None:
            self.t = segments.as_tensor(fd, size)
            self._range = (0, 0)  # the whole file
        else:
            if offset % _ALIGN or offset + size > base.numel():
                raise ValueError(f"a block of {size} bytes at {offset} of {base.numel()}")
            self.t = base[offset : offset + size]
            self._range = (size, offset)
        hw = _header_words(members)
        self.h = self.t[: 8 * hw].view(torch.int64)
        self.hn = self.h.numpy()
        at = 8 * hw
        self.buf = [self.t[at : at + nbytes], self.t[at + nbytes : at + 2 * nbytes]]

    def _off(self, b: int) -> int:
        return _FIXED + b * 2 * self.members

    @contextmanager
    def lock(self) -> Iterator[None]:
        fcntl.lockf(self.fd, fcntl.LOCK_EX, *self._range)
        try:
            yield
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, *self._range)

    @property
    def valid(self) -> bool:
        return int(self.hn[0]) == MAGIC

    @property
    def active(self) -> int:
        return int(self.hn[1])

    def versions(self) -> list[int]:
        o = self._off(self.active)
        return list(map(int, self.hn[o : o + self.members].tolist()))

    def checksums(self) -> list[int]:
        o = self._off(self.active) + self.members
        return list(map(int, self.hn[o : o + self.members].tolist()))

    def parity(self) -> torch.Tensor:
        return self.buf[self.active]

    def update(
        self,
        member: int,
        old: torch.Tensor | Sequence[torch.Tensor],
        new: torch.Tensor | Sequence[torch.Tensor],
        version: int,
        checksum: int = 0,
    ) -> None:
        """``parity += new - old`` for one member; its recorded version becomes ``version``.

        Computed part by part into the inactive buffer (``inactive = active + new``,
        then ``-= old``): two passes, no temporary allocation.
        """
        olds = [old] if isinstance(old, torch.Tensor) else list(old)
        news = [new] if isinstance(new, torch.Tensor) else list(new)
        if len(olds) != len(news):
            raise ValueError("parity update: old and new have different parts")
        with self.lock():
            a = self.active
            b = 1 - a
            src, dst = self.buf[a], self.buf[b]
            pos = 0
            for o, n in zip(olds, news, strict=True):
                ob, nb = as_bytes(o), as_bytes(n)
                k = nb.numel()
                if ob.numel() != k or pos + k > self.nbytes:
                    raise ValueError("parity, old and new differ in size")
                # the block is host memory; a layout on a GPU sends its bytes over
                torch.add(src[pos : pos + k], nb.to(dst.device), out=dst[pos : pos + k])
                dst[pos : pos + k].sub_(ob.to(dst.device))
                pos += k
            if pos != self.nbytes:
                raise ValueError("parity, old and new differ in size")
            self._flip(a, b, member, version, checksum)

    def record(self, member: int, version: int, checksum: int | None = None) -> None:
        """Only the record: ``member``'s version (and checksum) becomes current.

        Tier 1 as replicas (``tier1_code = "replica"``, or ``"auto"`` on gloo with 2+
        ranks per node) keeps no parity bytes (a block of ``nbytes == 0``), only what
        each member's chunk was at its last update:
        the versions the recovery plans from and the checksums it verifies against.
        """
        with self.lock():
            a = self.active
            self._flip(a, 1 - a, member, version, checksum)

    def add_delta(self, member: int, delta: torch.Tensor, version: int) -> None:
        """``parity += delta`` (bytes) for one member's gradients."""
        with self.lock():
            a = self.active
            b = 1 - a
            torch.add(self.buf[a], as_bytes(delta).to(self.buf[a].device), out=self.buf[b])
            self._flip(a, b, member, version, None)

    def _flip(self, a: int, b: int, member: int, version: int, checksum: int | None) -> None:
        """Copy the versions to buffer ``b``, record ``member``'s, make ``b`` active."""
        oa, ob = self._off(a), self._off(b)
        m2 = 2 * self.members
        self.hn[ob : ob + m2] = self.hn[oa : oa + m2]
        self.hn[ob + member] = version
        if checksum is not None:
            self.hn[ob + self.members + member] = checksum
        self.hn[1] = b  # the flip: one aligned store

    def write_full(
        self, parity: torch.Tensor | None, versions: Sequence[int], checksums: Sequence[int]
    ) -> None:
        """Install a freshly encoded parity (None: zeros) with every member's version."""
        with self.lock():
            b = 1 - self.active if self.valid else 0
            if parity is None:
                self.buf[b].zero_()
            else:
                self.buf[b].copy_(as_bytes(parity))
            ob = self._off(b)
            self.hn[ob : ob + self.members] = list(versions)
            self.hn[ob + self.members : ob + 2 * self.members] = list(checksums)
            self.hn[1] = b
            self.hn[0] = MAGIC

    def invalidate(self) -> None:
        """Forget the parity (the protocol's LOST) until the next :meth:`write_full`.

        One aligned store; a block whose members are about to change without updating
        it says so here first, so no reader takes the stale records for current ones.
        """
        with self.lock():
            self.hn[0] = 0

    def state(self) -> list[int] | None:
        """The versions the parity encodes, or None if it was never encoded (LOST)."""
        return self.versions() if self.valid else None


def none_versions(members: int) -> list[int]:
    return [NONE] * members
