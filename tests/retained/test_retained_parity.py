"""Parity: exact encode / update / decode over simulated ranks, wraparound, layouts."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
import torch
from torch import nn

from leto.retained import InMemorySegments, retain
from leto.retained.parity import (
    InProcessGroup,
    TorchDistCollective,
    add_delta_,
    as_bytes,
    decode,
    decode_local,
    decode_rotated,
    encode,
    encode_local,
    encode_rotated,
    encode_rotated_alike,
    rotated_share_nbytes,
    run_spmd,
    update,
    update_rotated,
)


def member_data(rank: int, seed: int, sizes: tuple[int, ...] = (13, 7)) -> list[torch.Tensor]:
    """A member's data: several tensors of mixed dtypes (parity works on their bytes)."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return [
        torch.randn(sizes[0], generator=g),
        torch.randint(-(2**31), 2**31 - 1, (sizes[1],), dtype=torch.int32, generator=g),
    ]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(as_bytes(x), as_bytes(y)) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("size,seed", [(2, 0), (3, 1), (4, 2), (5, 3), (3, 4), (4, 5)])
def test_holder_encode_update_decode_exact(size: int, seed: int) -> None:
    rnd = random.Random(seed)
    holder, lost = rnd.randrange(size), rnd.randrange(size)
    changed = {r for r in range(size) if rnd.random() < 0.6}
    truth = [member_data(r, seed) for r in range(size)]
    new_truth = [member_data(r, seed + 50) if r in changed else truth[r] for r in range(size)]

    def program(c: Any) -> Any:
        r = c.rank
        data = [t.clone() for t in truth[r]]
        parity = encode(c, data, holder)
        assert (parity is not None) == (r == holder)
        old = [t.clone() for t in data]
        for t, n in zip(data, new_truth[r], strict=True):
            t.copy_(n)
        update(c, old, data, holder, parity)  # unchanged members contribute zeros
        if r == lost:  # memory lost: garbage in the buffers to refill
            for t in data:
                t.view(torch.uint8).fill_(0xA5)
        decode(c, data, lost, holder, parity)
        return data, parity

    out = run_spmd(size, program)
    for r in range(size):
        assert same(out[r][0], new_truth[r])
    assert torch.equal(out[holder][1], encode_local(new_truth))  # incremental == re-encoded


@pytest.mark.parametrize("size,seed", [(2, 0), (3, 1), (4, 2), (5, 3)])
def test_rotated_encode_update_decode_exact(size: int, seed: int) -> None:
    rnd = random.Random(seed)
    lost = rnd.randrange(size)
    sizes = (rnd.randrange(1, 40), rnd.randrange(1, 9))  # not a multiple of size-1: padding
    truth = [member_data(r, seed, sizes) for r in range(size)]
    new_truth = [member_data(r, seed + 7, sizes) for r in range(size)]

    def program(c: Any) -> Any:
        r = c.rank
        data = [t.clone() for t in truth[r]]
        share = encode_rotated(c, data)
        old = [t.clone() for t in data]
        for t, n in zip(data, new_truth[r], strict=True):
            t.copy_(n)
        update_rotated(c, old, data, share)
        fresh = encode_rotated(c, data)
        assert torch.equal(share, fresh)
        if r == lost:
            for t in data:
                t.zero_()
        rebuilt = decode_rotated(c, data, lost, None if r == lost else share)
        return data, share, rebuilt

    out = run_spmd(size, program)
    for r in range(size):
        assert same(out[r][0], new_truth[r])
        assert (out[r][2] is not None) == (r == lost)
    assert torch.equal(out[lost][2], out[lost][1])  # the lost share is rebuilt too
    nbytes = sum(t.numel() * t.element_size() for t in truth[0])
    assert out[0][1].numel() == rotated_share_nbytes(nbytes, size)


@pytest.mark.parametrize("size", [2, 3])
def test_rotated_encode_into_a_given_buffer(size: int) -> None:
    truth = [member_data(r, 11, (24, 8)) for r in range(size)]
    nbytes = sum(t.numel() * t.element_size() for t in truth[0])
    blk = rotated_share_nbytes(nbytes, size)

    def program(c: Any) -> Any:
        fresh = encode_rotated(c, truth[c.rank])
        out = torch.full((blk,), 0x5A, dtype=torch.uint8)
        got = encode_rotated(c, truth[c.rank], out=out)
        with pytest.raises(ValueError, match="share buffer"):
            encode_rotated(c, truth[c.rank], out=torch.empty(blk + 1, dtype=torch.uint8))
        return fresh, out, got.data_ptr() == out.data_ptr()

    res = run_spmd(size, program)
    for r in range(size):
        fresh, out, same_buffer = res[r]
        assert torch.equal(fresh, out) and same_buffer
    if size == 2:  # a two-member share is the other member's bytes, verbatim
        peer = torch.cat([t.reshape(-1).view(torch.uint8) for t in truth[1]])
        assert torch.equal(res[0][1], peer)


def test_wraparound_is_explicit_and_exact() -> None:
    # every member all 0xFF: the sum wraps many times over
    members = [torch.full((64,), 0xFF, dtype=torch.uint8) for _ in range(5)]
    parity = encode_local(members)
    assert parity.tolist() == [(5 * 255) % 256] * 64
    assert torch.equal(decode_local(parity, members[1:]), members[0])
    # an incremental update that wraps below zero
    old, new = torch.zeros(4, dtype=torch.uint8), torch.tensor([1, 0, 255, 128], dtype=torch.uint8)
    p = torch.zeros(4, dtype=torch.uint8)
    add_delta_(p, new, old)  # p += old - new
    assert p.tolist() == [255, 0, 1, 128]

    # the in-process group wraps each integer width explicitly
    def sums(dtype: torch.dtype, values: list[int]) -> list[int]:
        def program(c: Any) -> list[int]:
            t = torch.tensor([values[c.rank]], dtype=dtype)
            c.all_reduce_sum(t)
            return t.tolist()

        return run_spmd(len(values), program)[0]

    assert sums(torch.int32, [2**31 - 1, 1]) == [-(2**31)]
    assert sums(torch.int32, [-(2**31), -1]) == [2**31 - 1]
    assert sums(torch.int32, [-(2**31), -1, -(2**31)]) == [-1]
    assert sums(torch.uint8, [200, 200, 255]) == [(655) % 256]
    assert sums(torch.int8, [127, 1]) == [-128]
    assert sums(torch.int64, [2**63 - 1, 1]) == [-(2**63)]


def test_collective_primitives() -> None:
    def program(c: Any) -> Any:
        t = torch.tensor([float(c.rank + 1)])
        c.reduce_sum(t, 2)
        b = torch.tensor([c.rank * 10])
        c.broadcast(b, 1)
        a = torch.tensor([c.rank], dtype=torch.int64)
        c.all_reduce_sum(a)
        return t.item(), b.item(), a.item()

    out = run_spmd(3, program)
    assert out[2][0] == 6.0 and out[0][0] == 1.0  # only dst receives the sum
    assert [o[1] for o in out] == [10, 10, 10]
    assert [o[2] for o in out] == [3, 3, 3]


def test_errors_and_no_hang() -> None:
    with pytest.raises(ValueError, match="holder"):
        run_spmd(2, lambda c: encode(c, torch.zeros(4), 2))
    with pytest.raises(ValueError, match="must pass its parity"):
        run_spmd(2, lambda c: update(c, torch.zeros(4), torch.zeros(4), 0, None))
    with pytest.raises(ValueError, match="bytes"):
        run_spmd(
            2,
            lambda c: update(
                c, torch.zeros(4), torch.zeros(4), 0, torch.zeros(3, dtype=torch.uint8)
            ),
        )
    with pytest.raises(ValueError, match="contiguous"):
        encode_local([torch.zeros(4, 4)[:, 0]])
    with pytest.raises(ValueError, match="differ in size"):
        encode_local([torch.zeros(4), torch.zeros(5)])
    with pytest.raises(ValueError, match="at least 2"):
        rotated_share_nbytes(10, 1)
    with pytest.raises(ValueError, match="group size"):
        InProcessGroup(0)

    # one rank fails before a collective: the others are released, the error surfaces
    def program(c: Any) -> None:
        if c.rank == 1:
            raise RuntimeError("rank 1 died")
        c.all_reduce_sum(torch.zeros(2))

    before = threading.active_count()
    with pytest.raises(RuntimeError, match="rank 1 died"):
        run_spmd(3, program, timeout=10)
    assert threading.active_count() == before


def test_torch_dist_collective_single_rank() -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        c = TorchDistCollective()
        assert (c.rank, c.size) == (0, 1)
        data = [torch.randn(5), torch.arange(3, dtype=torch.int32)]
        parity = encode(c, data, 0)
        assert parity is not None and torch.equal(parity, encode_local([data]))
        lost = [torch.zeros(5), torch.zeros(3, dtype=torch.int32)]
        decode(c, lost, 0, 0, parity)
        assert same(lost, data)
    finally:
        dist.destroy_process_group()


def test_layout_chunks_survive_a_lost_rank() -> None:
    """Tier 1 over the chunks of 3 ranks' layouts, kept in step with the optimizer."""
    size, chunk = 3, 16
    stores = [InMemorySegments() for _ in range(size)]
    models = []
    opts = []
    for r in range(size):
        torch.manual_seed(r)
        m = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
        models.append(m)
        opts.append(
            retain(m, torch.optim.Adam(m.parameters(), lr=1e-2), chunk_numel=chunk, alloc=stores[r])
        )
    n = opts[0].layout.n_chunks

    def program(c: Any) -> Any:
        r = c.rank
        opt, lay, model = opts[r], opts[r].layout, models[r]
        parity = [encode(c, lay.chunk_data(i), 0) for i in range(n)]
        for step in range(1, 4):
            opt.zero_grad()
            model(torch.randn(5, 4)).sum().backward()
            opt.prepare(step)
            opt.begin(step)
            for i in range(n):  # apply, then parity from the undo copy, then release
                opt.save_undo(i)
                opt.apply_chunk(i)
                update(c, lay.undo_data(i), lay.chunk_data(i), 0, parity[i])
                opt.finish_chunk(i)
            opt.end()
        return parity

    parity = run_spmd(size, program)[0]
    lost = 1
    truth = [[t.clone() for t in opts[lost].layout.chunk_data(i)] for i in range(n)]
    lay = opts[lost].layout
    for buf in lay.data_buffers():
        buf.view(torch.uint8).fill_(0xEE)  # its memory is gone
    assert len(lay.verify()) == n

    def repair(c: Any) -> None:
        for i in range(n):
            decode(
                c, opts[c.rank].layout.chunk_data(i), lost, 0, parity[i] if c.rank == 0 else None
            )

    run_spmd(size, repair)
    assert lay.verify() == []  # the rebuilt bytes match the checksums in the header
    for i in range(n):
        assert same(lay.chunk_data(i), truth[i])


@pytest.mark.parametrize("size", [2, 3, 4, 5, 7])
def test_rotated_share_of_alike_members_is_computed_without_a_collective(size: int) -> None:
    """Members holding the same bytes (data-parallel replicas): each share computed
    alone is bitwise the collective's, and decodes a lost member; members whose bytes
    differ get shares that are not the collective's."""
    alike = member_data(0, 21, (40, 9))  # 196 bytes: padded for 3, 5 and 7 members
    nbytes = sum(t.numel() * t.element_size() for t in alike)
    blk = rotated_share_nbytes(nbytes, size)
    lost = size - 1

    def program(c: Any) -> Any:
        data = [t.clone() for t in alike]
        share = encode_rotated(c, data)
        out = torch.full((blk,), 0x5A, dtype=torch.uint8)
        local = encode_rotated_alike(data, size, c.rank, out=out)
        if c.rank == lost:
            for t in data:
                t.zero_()
        decode_rotated(c, data, lost, None if c.rank == lost else local)
        return share, local, data

    res = run_spmd(size, program)
    for r in range(size):
        share, local, data = res[r]
        assert torch.equal(share, local)
        assert same(data, alike)  # the lost member rebuilt from the local shares
    differ = [member_data(r, 22, (40, 9)) for r in range(size)]
    got = run_spmd(size, lambda c: encode_rotated(c, differ[c.rank]))
    assert not all(
        torch.equal(got[r], encode_rotated_alike(differ[r], size, r)) for r in range(size)
    )
    with pytest.raises(ValueError, match="share buffer has"):
        encode_rotated_alike(alike, size, 0, out=torch.empty(blk + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="is not a rank"):
        encode_rotated_alike(alike, size, size)
