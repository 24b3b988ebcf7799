"""Parity on tensors: sums of bytes modulo 256, computed with ordinary collectives.

The code is a single-parity sum code over the *bytes* of the members' data:
``parity = sum_r data_r (mod 256, bytewise)``. Then

* encode:  parity = sum of every member's bytes (one ``reduce_sum``);
* update:  parity += new - old, for every member whose bytes changed (one
  ``reduce_sum`` of the deltas; a member that did not change sends zeros);
* decode:  lost = parity - sum of the other members' bytes (one ``reduce_sum``
  to the member being rebuilt).

Why bytes (uint8) and not int32 words, as first suggested: the arithmetic is the
same code (any width 2^w works), but unsigned overflow is *defined* behaviour in
C, C++ and CUDA, so the wraparound of gloo's and NCCL's SUM on uint8 is
guaranteed, not merely what compilers happen to emit for signed int32 (whose
overflow is undefined in C++). uint8 also has no alignment or size constraints
(any tensor's bytes qualify) and moves the same number of bytes. Both gloo and
NCCL support SUM on uint8 (checked here for gloo: 200 + 200 -> 144). XOR would be
the other exact code, but NCCL has no XOR reduction.

Two placements are provided:

* **holder** (tier 1): every member of the group contributes; the parity lands on
  one member, ``holder``, which stores it outside its own retained state (in the
  node's host memory). Survives the loss of any one member's retained state.
* **rotated** (tier 2, RAID-5 style): each member's bytes are cut into ``size-1``
  blocks; stripe s holds one block of every member except s, and its parity
  lives on member s. The parity is spread evenly (each member stores
  ``1/(size-1)`` of its data size) and no member holds parity of its own blocks,
  so the loss of any one member (its data *and* its parity share, e.g. a whole
  node when members are on different nodes) is recoverable.

Safety: retained data is never handed to a collective. Every contribution is a
fresh tensor (a clone, a difference or a negation), so a backend that uses its
input as scratch space (some reduce algorithms do on non-root ranks) cannot
corrupt retained state.

Ranks passed to these functions are ranks *within the group* of the collective.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

__all__ = [
    "Collective",
    "InProcessGroup",
    "InProcessCollective",
    "TorchDistCollective",
    "HostStaged",
    "run_spmd",
    "as_bytes",
    "encode",
    "update",
    "decode",
    "encode_rotated",
    "update_rotated",
    "encode_rotated_alike",
    "decode_rotated",
    "rotated_share_nbytes",
    "encode_local",
    "decode_local",
    "add_delta_",
]

Data = torch.Tensor | Sequence[torch.Tensor]
T = TypeVar("T")
C_co = TypeVar("C_co", covariant=True)


@runtime_checkable
class Collective(Protocol):
    """The collective operations parity needs, over one group of ``size`` ranks.

    All operations are in place on ``tensor`` and called by every member of the
    group (SPMD). ``reduce_sum`` leaves the sum on ``dst`` (other ranks' tensors
    are unspecified afterwards); integer sums wrap around (mod 2^bits).
    """

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def reduce_sum(self, tensor: torch.Tensor, dst: int) -> None: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> None: ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...


# --------------------------------------------------------------------------- bytes


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    if not t.is_contiguous():
        raise ValueError("parity needs contiguous tensors")
    return t.reshape(-1).view(torch.uint8)


def _parts(data: Data) -> list[torch.Tensor]:
    parts = [data] if isinstance(data, torch.Tensor) else list(data)
    if not parts:
        raise ValueError("parity of no tensors")
    return [as_bytes(p) for p in parts]


def _packed(data: Data) -> torch.Tensor:
    """A fresh uint8 copy of the concatenated bytes of ``data``."""
    parts = _parts(data)
    return parts[0].clone() if len(parts) == 1 else torch.cat(parts)


def _nbytes(data: Data) -> int:
    return sum(p.numel() for p in _parts(data))


def _scatter(flat: torch.Tensor, data: Data) -> None:
    """Write ``flat`` (uint8) back into the tensors of ``data``, in order."""
    pos = 0
    for part in _parts(data):
        n = part.numel()
        part.copy_(flat[pos : pos + n])
        pos += n


def _check_rank(coll: Collective, r: int, what: str) -> None:
    if not 0 <= r < coll.size:
        raise ValueError(f"{what} {r} is not a rank of a group of size {coll.size}")


def _check_parity(parity: torch.Tensor | None, nbytes: int, who: str) -> torch.Tensor:
    if parity is None:
        raise ValueError(f"{who} must pass its parity tensor")
    pb = as_bytes(parity)
    if pb.numel() != nbytes:
        raise ValueError(f"parity has {pb.numel()} bytes, data has {nbytes}")
    return pb


# ---------------------------------------------------------------- local (no comms)


def encode_local(members: Sequence[Data]) -> torch.Tensor:
    """Parity (uint8) of several members' data held in one process."""
    if not members:
        raise ValueError("parity of no members")
    acc = _packed(members[0])
    for m in members[1:]:
        b = _packed(m)
        if b.numel() != acc.numel():
            raise ValueError(f"members differ in size: {b.numel()} vs {acc.numel()} bytes")
        acc.add_(b)  # uint8: wraps mod 256 (unsigned overflow is defined)
    return acc


def decode_local(parity: torch.Tensor, survivors: Sequence[Data]) -> torch.Tensor:
    """The lost member's bytes: ``parity - sum(survivors)`` (uint8, mod 256)."""
    out = as_bytes(parity).clone()
    for s in survivors:
        b = _packed(s)
        if b.numel() != out.numel():
            raise ValueError(f"survivor has {b.numel()} bytes, parity {out.numel()}")
        out.sub_(b.to(out.device))
    return out


def add_delta_(parity: torch.Tensor, old: Data, new: Data) -> None:
    """In place ``parity += new - old`` for one member's change (mod 256)."""
    pb = as_bytes(parity)
    ob, nb = _packed(old), _packed(new)
    if not pb.numel() == ob.numel() == nb.numel():
        raise ValueError("parity, old and new differ in size")
    pb.add_(nb.sub_(ob).to(pb.device))


# ------------------------------------------------------------ holder placement


def encode(coll: Collective, data: Data, holder: int) -> torch.Tensor | None:
    """Tier-1 encode: every member calls it; returns the parity on ``holder``, else None."""
    _check_rank(coll, holder, "holder")
    buf = _packed(data)
    coll.reduce_sum(buf, holder)
    return buf if coll.rank == holder else None


def update(
    coll: Collective, old: Data, new: Data, holder: int, parity: torch.Tensor | None = None
) -> None:
    """Incremental update: ``parity += sum_r (new_r - old_r)``.

    Every member calls it with its old and new bytes (a member whose data did not
    change passes the same tensor twice: it contributes zeros). ``holder`` passes
    its parity tensor, updated in place.
    """
    _check_rank(coll, holder, "holder")
    delta = _packed(new)
    ob = _packed(old)
    if ob.numel() != delta.numel():
        raise ValueError(f"old has {ob.numel()} bytes, new has {delta.numel()}")
    delta.sub_(ob)
    pb = _check_parity(parity, delta.numel(), "holder") if coll.rank == holder else None
    coll.reduce_sum(delta, holder)
    if pb is not None:
        pb.add_(delta.to(pb.device))  # a parity kept in host memory, data on a device


def decode(
    coll: Collective, data: Data, lost: int, holder: int, parity: torch.Tensor | None = None
) -> None:
    """Rebuild member ``lost``'s bytes into its ``data`` tensors (in place).

    Survivors pass their intact data; ``lost`` passes the tensors to fill (their
    contents are ignored); ``holder`` passes its parity, which must still encode
    the survivors' current bytes. ``lost == holder`` is allowed when the parity
    (kept outside the holder's retained state) survived.
    """
    _check_rank(coll, lost, "lost")
    _check_rank(coll, holder, "holder")
    n = _nbytes(data)
    if coll.rank == lost:
        contrib = torch.zeros(n, dtype=torch.uint8, device=_parts(data)[0].device)
    else:
        contrib = _packed(data).neg_()  # -x mod 256
    if coll.rank == holder:
        contrib.add_(_check_parity(parity, n, "holder").to(contrib.device))
    coll.reduce_sum(contrib, lost)
    if coll.rank == lost:
        _scatter(contrib, data)


# ----------------------------------------------------------- rotated placement


def rotated_share_nbytes(nbytes: int, size: int) -> int:
    """Bytes of parity each member stores under the rotated placement."""
    if size < 2:
        raise ValueError("rotated parity needs a group of at least 2 members")
    return -(-nbytes // (size - 1))


def _block_of(member: int, stripe: int) -> int:
    """Which of ``member``'s blocks belongs to ``stripe`` (stripe != member)."""
    return stripe if stripe < member else stripe - 1


def _blocks(data: Data, size: int, *, copy: bool = True) -> torch.Tensor:
    """The member's bytes, zero-padded, as a ``(size-1) x blk`` uint8 matrix.

    A copy, unless ``copy=False`` and ``data`` is one tensor needing no padding:
    then a view of it (for callers that only read it).
    """
    parts = _parts(data)
    if not copy and len(parts) == 1:
        blk = rotated_share_nbytes(parts[0].numel(), size)
        if (size - 1) * blk == parts[0].numel():
            return parts[0].view(size - 1, blk)
    flat = _packed(data)
    blk = rotated_share_nbytes(flat.numel(), size)
    out = torch.zeros((size - 1) * blk, dtype=torch.uint8, device=flat.device)
    out[: flat.numel()] = flat
    return out.view(size - 1, blk)


def encode_rotated(coll: Collective, data: Data, out: torch.Tensor | None = None) -> torch.Tensor:
    """Tier-2 encode; every member calls it and gets back its own parity share.

    ``out`` (uint8, the share's size) receives the share in place of a new tensor.
    With two members a share is the other member's bytes, so they are exchanged
    by two broadcasts straight into ``out``: no sums, no copies.
    """
    blocks = _blocks(data, coll.size, copy=False)  # read only: each block is cloned
    blk = blocks.shape[1]
    if out is not None and as_bytes(out).numel() != blk:
        raise ValueError(f"share buffer has {as_bytes(out).numel()} bytes, expected {blk}")
    if coll.size == 2:
        share = as_bytes(out) if out is not None else torch.empty_like(blocks[0])
        for s in range(2):
            coll.broadcast(blocks[0] if s == coll.rank else share, s)
        return share
    share = torch.empty(0)
    for s in range(coll.size):
        if s == coll.rank:
            buf = torch.zeros_like(blocks[0])
        else:
            buf = blocks[_block_of(coll.rank, s)].clone()
        coll.reduce_sum(buf, s)
        if s == coll.rank:
            share = buf
    if out is not None:
        as_bytes(out).copy_(share)
        return as_bytes(out)
    return share


def encode_rotated_alike(
    data: Data, size: int, rank: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Member ``rank``'s share of :func:`encode_rotated` where every one of the ``size``
    members holds the same bytes ``data`` (data-parallel replicas): computed here, with
    no collective, bitwise what :func:`encode_rotated` returns for those members.

    Stripe ``s``'s share is the sum of block ``s`` of the members after ``s`` and block
    ``s - 1`` of those before it (:func:`_block_of`); alike members make that
    ``(size - 1 - s) * D[s] + s * D[s - 1]``, bytewise mod 256. Where the members' bytes
    differ after all, the shares are wrong: a decode from them fails the lost member's
    checksums, which every tier-2 restore checks.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not a rank of a group of size {size}")
    blocks = _blocks(data, size, copy=False)  # refuses a group of fewer than 2
    blk = blocks.shape[1]
    share = as_bytes(out) if out is not None else torch.empty(blk, dtype=torch.uint8)
    if share.numel() != blk:
        raise ValueError(f"share buffer has {share.numel()} bytes, expected {blk}")
    # (block, how many members add it): D[s] from the members after s, D[s-1] before
    terms = [(blocks[rank], size - 1 - rank)] if rank < size - 1 else []
    if rank > 0:
        terms.append((blocks[rank - 1], rank))
    torch.mul(terms[0][0], terms[0][1], out=share)
    for block, times in terms[1:]:
        share.add_(block, alpha=times)
    return share


def update_rotated(coll: Collective, old: Data, new: Data, share: torch.Tensor) -> None:
    """``share += `` this member's stripe of ``sum_r (new_r - old_r)``; every member calls it."""
    delta = _blocks(new, coll.size)
    delta.sub_(_blocks(old, coll.size))
    sb = as_bytes(share)
    if sb.numel() != delta.shape[1]:
        raise ValueError(f"share has {sb.numel()} bytes, expected {delta.shape[1]}")
    for s in range(coll.size):
        buf = (
            torch.zeros_like(delta[0]) if s == coll.rank else delta[_block_of(coll.rank, s)].clone()
        )
        coll.reduce_sum(buf, s)
        if s == coll.rank:
            sb.add_(buf.to(sb.device))


def decode_rotated(
    coll: Collective, data: Data, lost: int, share: torch.Tensor | None
) -> torch.Tensor | None:
    """Rebuild member ``lost``: its bytes into ``data`` and its parity share (returned).

    Survivors pass their data and share; ``lost`` passes the tensors to fill and
    ``share=None``. Returns the rebuilt share on ``lost``, None elsewhere.
    """
    _check_rank(coll, lost, "lost")
    size, me = coll.size, coll.rank
    n = _nbytes(data)
    blk = rotated_share_nbytes(n, size)
    device = _parts(data)[0].device
    if me != lost:
        blocks = _blocks(data, size)
        if share is None or as_bytes(share).numel() != blk:
            raise ValueError(f"survivor {me} must pass its {blk}-byte parity share")
    rebuilt = torch.zeros((size - 1) * blk, dtype=torch.uint8, device=device).view(size - 1, blk)
    for s in range(size):
        if s == lost:
            continue
        # block of `lost` in stripe s = P_s - sum of the other stripe members' blocks
        if me == lost:
            buf = torch.zeros(blk, dtype=torch.uint8, device=device)
        elif me == s:
            buf = as_bytes(share).clone()  # type: ignore[arg-type]
        else:
            buf = blocks[_block_of(me, s)].neg()
        coll.reduce_sum(buf, lost)
        if me == lost:
            rebuilt[_block_of(lost, s)] = buf
    # the lost member's own share: P_lost = sum of the others' blocks of stripe `lost`
    if me == lost:
        new_share = torch.zeros(blk, dtype=torch.uint8, device=device)
    else:
        new_share = blocks[_block_of(me, lost)].clone()
    coll.reduce_sum(new_share, lost)
    if me != lost:
        return None
    _scatter(rebuilt.view(-1)[:n], data)
    return new_share


# ------------------------------------------------------ in-process collective


class InProcessGroup:
    """A group of ``size`` simulated ranks in one process (one thread each).

    ``member(r)`` gives rank r's :class:`InProcessCollective`. Every collective
    is two barrier phases (deposit, then combine), so it is exact and
    deterministic whatever the thread schedule: integer sums are accumulated in
    int64 and wrapped explicitly to the tensor's width; float sums are added in
    rank order. A rank that raises should call :meth:`abort` (``run_spmd`` does)
    so the others fail instead of waiting for ``timeout`` seconds.
    """

    def __init__(self, size: int, timeout: float = 60.0) -> None:
        if size < 1:
            raise ValueError(f"group size must be positive, got {size}")
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list[torch.Tensor | None] = [None] * size

    def member(self, rank: int) -> InProcessCollective:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} not in a group of size {self.size}")
        return InProcessCollective(self, rank)

    def abort(self) -> None:
        self._barrier.abort()

    def _sum(self) -> torch.Tensor:
        ts = [t for t in self._slots if t is not None]
        if len(ts) != self.size:
            raise RuntimeError("collective called by only some ranks")
        shape, dtype = ts[0].shape, ts[0].dtype
        for t in ts:
            if t.shape != shape or t.dtype != dtype:
                raise ValueError(
                    f"ranks disagree on tensor shape/dtype: {tuple(t.shape)} {t.dtype}"
                )
        if dtype.is_floating_point or dtype.is_complex:
            acc = ts[0].clone()
            for t in ts[1:]:
                acc.add_(t)
            return acc
        if dtype == torch.int64:
            acc = ts[0].clone()
            for t in ts[1:]:
                acc.add_(t)  # int64 adds wrap mod 2^64 on every platform torch supports
            return acc
        bits = torch.iinfo(dtype).bits
        total = torch.zeros(shape, dtype=torch.int64, device=ts[0].device)
        for t in ts:
            total += t.to(torch.int64)
        total = torch.remainder(total, 1 << bits)  # explicit wraparound, in [0, 2^bits)
        if torch.iinfo(dtype).min < 0:
            total = torch.where(total >= (1 << (bits - 1)), total - (1 << bits), total)
        return total.to(dtype)

    def _xor(self) -> torch.Tensor:
        ts = [t for t in self._slots if t is not None]
        if len(ts) != self.size:
            raise RuntimeError("collective called by only some ranks")
        acc = ts[0].clone()
        for t in ts[1:]:
            if t.shape != acc.shape or t.dtype != acc.dtype:
                raise ValueError(
                    f"ranks disagree on tensor shape/dtype: {tuple(t.shape)} {t.dtype}"
                )
            acc.bitwise_xor_(t)
        return acc

    def _phase(self) -> None:
        self._barrier.wait()


class InProcessCollective:
    """One simulated rank of an :class:`InProcessGroup` (implements :class:`Collective`)."""

    def __init__(self, group: InProcessGroup, rank: int) -> None:
        self._group = group
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._group.size

    def _deposit(self, tensor: torch.Tensor) -> None:
        g = self._group
        g._slots[self._rank] = tensor
        g._phase()

    def reduce_sum(self, tensor: torch.Tensor, dst: int) -> None:
        g = self._group
        self._deposit(tensor)
        total = g._sum() if self._rank == dst else None
        g._phase()  # nobody writes before everyone has been read
        if total is not None:
            tensor.copy_(total)
        g._slots[self._rank] = None

    def reduce_xor(self, tensor: torch.Tensor, dst: int) -> None:
        g = self._group
        self._deposit(tensor)
        total = g._xor() if self._rank == dst else None
        g._phase()
        if total is not None:
            tensor.copy_(total)
        g._slots[self._rank] = None

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        g = self._group
        self._deposit(tensor)
        total = g._sum()
        g._phase()
        tensor.copy_(total)
        g._slots[self._rank] = None

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        g = self._group
        self._deposit(tensor)
        if self._rank != src:
            source = g._slots[src]
            assert source is not None
            tensor.copy_(source)
        g._phase()
        g._slots[self._rank] = None


def run_spmd(size: int, fn: Callable[[InProcessCollective], T], timeout: float = 60.0) -> list[T]:
    """Run ``fn(collective)`` on ``size`` simulated ranks (threads); return results by rank.

    The first exception raised by any rank is re-raised here (after the others
    have been released).
    """
    return run_on_threads(InProcessGroup(size, timeout=timeout), size, fn)


class ThreadGroup(Protocol[C_co]):
    """An in-process group whose members threads can run: ``member(r)`` is rank ``r``'s
    collective, ``abort()`` releases every member waiting in one."""

    def member(self, rank: int) -> C_co: ...

    def abort(self) -> None: ...


def run_on_threads(group: ThreadGroup[C_co], size: int, fn: Callable[[C_co], T]) -> list[T]:
    """``fn(group.member(r))`` on one thread per rank; results by rank. A rank that
    raises aborts the group (releasing the others); the first error that is not a
    released barrier is re-raised here, else the first error."""
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def body(r: int) -> None:
        try:
            results[r] = fn(group.member(r))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[r] = e
            group.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"spmd-{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    firsts = [
        e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)
    ]
    if firsts:
        raise firsts[0]
    for e in errors:
        if e is not None:
            raise e
    return results


# ----------------------------------------------------- torch.distributed adapter


class TorchDistCollective:
    """:class:`Collective` over a ``torch.distributed`` process group (gloo or NCCL).

    ``group=None`` is the default group. Group-local ranks are translated to
    global ranks for ``dst``/``src``.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def _global(self, r: int) -> int:
        if self._group is None:
            return r
        return int(self._dist.get_global_rank(self._group, r))

    def reduce_sum(self, tensor: torch.Tensor, dst: int) -> None:
        self._dist.reduce(
            tensor, dst=self._global(dst), op=self._dist.ReduceOp.SUM, group=self._group
        )

    def reduce_xor(self, tensor: torch.Tensor, dst: int) -> None:
        self._dist.reduce(
            tensor, dst=self._global(dst), op=self._dist.ReduceOp.BXOR, group=self._group
        )

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.SUM, group=self._group)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._dist.broadcast(tensor, src=self._global(src), group=self._group)

    def gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        mine = torch.tensor(list(values), dtype=torch.int64)
        out = [torch.zeros_like(mine) for _ in range(self._size)]
        self._dist.all_gather(out, mine, group=self._group)
        return [[int(x) for x in t.tolist()] for t in out]

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._dist.send(tensor, dst=self._global(dst), group=self._group)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self._dist.recv(tensor, src=self._global(src), group=self._group)


class HostStaged:
    """A :class:`TorchDistCollective` for tensors the backend cannot reduce where they
    are: each operation runs on a host copy, copied back in place afterwards.

    gloo reduces only host tensors (``reduce`` with a CUDA tensor is refused), so a
    layout in GPU memory stages every parity collective through host memory. A tensor
    already on the host goes straight through unless ``always`` (the device path,
    exercised on a CPU: the same copies, out and back). Results are bitwise those of the
    unstaged operation: the copies move bytes, the reduction runs on the same values.
    """

    def __init__(self, inner: TorchDistCollective, *, always: bool = False) -> None:
        self.inner = inner
        self.always = always
        self.staged = 0  # operations staged, for the tests

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def _run(self, op: Callable[..., None], tensor: torch.Tensor, *args: Any) -> None:
        if tensor.device.type == "cpu" and not self.always:
            op(tensor, *args)
            return
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        host.copy_(tensor)
        op(host, *args)
        tensor.copy_(host)
        self.staged += 1

    def reduce_sum(self, tensor: torch.Tensor, dst: int) -> None:
        self._run(self.inner.reduce_sum, tensor, dst)

    def reduce_xor(self, tensor: torch.Tensor, dst: int) -> None:
        self._run(self.inner.reduce_xor, tensor, dst)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._run(self.inner.all_reduce_sum, tensor)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._run(self.inner.broadcast, tensor, src)

    def gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        return self.inner.gather_ints(values)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        if tensor.device.type == "cpu" and not self.always:
            self.inner.send(tensor, dst)
            return
        self.inner.send(tensor.to("cpu", copy=True), dst)
        self.staged += 1

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self._run(self.inner.recv, tensor, src)
