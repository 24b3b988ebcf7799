"""RetainedLayout: views alias the flat buffers, chunking, header, undo, attach, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leto.retained import (
    ChecksumError,
    ChunkStateError,
    ChunkStatus,
    InMemorySegments,
    LayoutError,
    RetainedLayout,
    ShapeMismatchError,
)


def mlp(device: str = "cpu", hidden: int = 7) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, hidden, device=device), nn.Tanh(), nn.Linear(hidden, 3, device=device)
    )


def inside(t: torch.Tensor, buf: torch.Tensor) -> bool:
    start = buf.data_ptr()
    end = start + buf.numel() * buf.element_size()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end


def test_params_and_grads_are_views_of_the_flat_buffers() -> None:
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    ids = [id(p) for p in model.parameters()]
    lay = RetainedLayout.create(model, chunk_numel=16, states=["exp_avg"])
    assert [id(p) for p in model.parameters()] == ids  # same Parameter objects
    for i, (p, b) in enumerate(zip(model.parameters(), before, strict=True)):
        assert torch.equal(p, b)
        assert inside(p, lay.param_buffer)
        assert p.data_ptr() == lay.param_buffer.data_ptr() + 4 * lay.slots[i].offset
        assert inside(p.grad, lay.grad_buffer)
    # write through the parameter -> seen in the buffer, and back
    w = model[0].weight
    off = lay.slots[0].offset
    with torch.no_grad():
        w[1, 2] = 42.0
    assert lay.param_buffer[off + 1 * 5 + 2].item() == 42.0
    lay.param_buffer[off] = -7.0
    assert w[0, 0].item() == -7.0
    # backward lands in the flat grad buffer, values as plain autograd gives them
    ref = mlp()
    x = torch.randn(4, 5)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), model.parameters(), strict=True):
            p.copy_(q)
    ref(x).pow(2).sum().backward()
    model(x).pow(2).sum().backward()
    for i, (p, q) in enumerate(zip(ref.parameters(), model.parameters(), strict=True)):
        assert inside(q.grad, lay.grad_buffer)
        assert torch.equal(q.grad, p.grad)
        assert torch.equal(lay.grad_view(i), p.grad)
    assert lay.grads.collect() == [True] * 4


def test_chunk_boundaries_with_parameters_spanning_chunks() -> None:
    model = mlp(hidden=11)  # weights 55 and 33 elements, biases 11 and 3
    lay = RetainedLayout.create(model, chunk_numel=12, align_bytes=4, states=["m"])
    offsets = [s.offset for s in lay.slots]
    assert offsets == [0, 55, 66, 99]  # packed (align 1 element)
    assert lay.n_chunks == 9 and lay.numel == 108
    covered: dict[int, list[tuple[int, int]]] = {}
    for i in range(lay.n_chunks):
        a, b = lay.geometry.chunk_range(i)
        for pc in lay.geometry.chunk_pieces(i):
            assert a <= pc.start < pc.stop <= b
            covered.setdefault(pc.param, []).append((pc.start, pc.stop))
    for k, s in enumerate(lay.slots):
        spans = covered[k]
        assert spans[0][0] == s.offset and spans[-1][1] == s.offset + s.numel
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:], strict=False))
    assert len(covered[0]) == 5  # 55 elements over chunks 0..4
    # chunk data: param slice then state slices; padding is zero
    data = lay.chunk_data(4)
    assert [t.numel() for t in data] == [12, 12]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(lay.param_buffer[:102], flat)
    assert torch.equal(lay.param_buffer[102:], torch.zeros(6))
    with pytest.raises(IndexError):
        lay.geometry.chunk_range(9)


def test_alignment_default_and_mixed_sizes() -> None:
    lay = RetainedLayout.create(mlp(), chunk_numel=64)
    assert [s.offset for s in lay.slots] == [0, 64, 128, 192]  # 256-byte aligned
    assert lay.param_buffer[35:64].abs().sum().item() == 0


def test_versions_checksums_and_undo_lifecycle() -> None:
    lay = RetainedLayout.create(mlp(), chunk_numel=16, states=["s"], undo_slots=2)
    n = lay.n_chunks
    assert [lay.chunk_version(i) for i in range(n)] == [0] * n
    assert lay.verify() == []
    before = [t.clone() for t in lay.data_buffers()]
    lay.save_undo(3)
    assert lay.chunk_status(3) is ChunkStatus.TORN
    with pytest.raises(ChunkStateError, match="torn"):
        lay.save_undo(3)
    with pytest.raises(ChunkStateError, match="still needed"):
        lay.undo.release(3)
    lay.chunk_data(3)[0].fill_(9.0)  # a step half-written
    lay.undo.restore(3)
    assert lay.chunk_status(3) is ChunkStatus.CLEAN
    assert all(torch.equal(a, b) for a, b in zip(before, lay.data_buffers(), strict=True))
    # apply: new bytes sealed at version 1, undo kept until released
    lay.save_undo(3)
    lay.chunk_data(3)[1].fill_(1.5)
    lay.seal_chunk(3, 1)
    assert lay.chunk_status(3) is ChunkStatus.APPLIED and lay.undo.version(3) == 0
    assert torch.equal(lay.undo_data(3)[1], before[1][48:64])
    lay.save_undo(4)
    with pytest.raises(ChunkStateError, match="no free undo slot"):
        lay.save_undo(5)
    lay.undo.release(3)
    assert lay.chunk_status(3) is ChunkStatus.CLEAN and lay.chunk_version(3) == 1
    assert lay.verify() == []
    assert lay.base_version() == 0
    # a corrupted undo copy is never restored
    lay.undo.copies[lay.undo.slot_of(4)][0][0] += 1
    with pytest.raises(ChecksumError):
        lay.undo.restore(4)
    # corruption of a clean chunk is found by verify
    lay.param_buffer[0] += 1
    assert lay.verify() == [0]
    with pytest.raises(ChecksumError):
        lay.save_undo(0, verify=True)


def test_the_bulk_header_reads_are_the_per_chunk_ones() -> None:
    """chunk_statuses, records.versions and records.stored_checksum_list (a recovery's
    reads of every chunk in one call) say what chunk_status, chunk_version and
    stored_checksum say of each chunk, in every status, and raise as chunk_status does."""
    lay = RetainedLayout.create(mlp(), chunk_numel=16, states=["s"], undo_slots=3)
    n = lay.n_chunks
    assert n >= 5 and lay.chunk_statuses() == [ChunkStatus.CLEAN] * n

    def same() -> None:
        assert lay.chunk_statuses() == [lay.chunk_status(i) for i in range(n)]
        assert lay.records.versions() == [lay.chunk_version(i) for i in range(n)]
        assert lay.records.stored_checksum_list() == [lay.stored_checksum(i) for i in range(n)]

    lay.save_undo(1)  # torn
    lay.save_undo(3)
    lay.chunk_data(3)[0].fill_(2.5)
    lay.seal_chunk(3, 1)  # applied
    lay.chunk_data(4)[0].fill_(0.5)
    lay.seal_chunk(4, 1)  # clean at another version
    same()
    st = lay.chunk_statuses()
    assert (st[1], st[3], st[4]) == (ChunkStatus.TORN, ChunkStatus.APPLIED, ChunkStatus.CLEAN)
    assert lay.records.versions()[3:5] == [1, 1]
    lay.records.versions()[0] = 99  # a copy: the layout's own is untouched
    assert lay.chunk_version(0) == 0
    lay.undo.release(3)
    lay.undo.restore(1)
    same()
    lay.records._ver[2] = 5  # a header no protocol step writes: neither read accepts it
    lay.save_undo(2)
    lay.records._ver[2] = 9
    with pytest.raises(ChunkStateError, match="inconsistent"):
        lay.chunk_statuses()
    with pytest.raises(ChunkStateError, match="inconsistent"):
        lay.chunk_status(2)


def test_an_undo_copy_staged_ahead_serves_only_its_chunk_at_its_version() -> None:
    lay = RetainedLayout.create(mlp(), chunk_numel=16, states=["s"], undo_slots=1)
    assert lay.undo.stage(2)
    # staged: the slot stays free in the header, the chunk clean
    assert lay.chunk_status(2) is ChunkStatus.CLEAN and lay.undo.slot_of(2) is None
    marked = [t.clone() for t in lay.undo.copies[0]]
    for t in lay.undo.copies[0]:
        t.fill_(7.0)  # stands for the staged bytes: save_undo must take them as they are
    lay.save_undo(2, staged=True)
    assert lay.chunk_status(2) is ChunkStatus.TORN
    assert all(bool((u == 7.0).all()) for u in lay.undo_data(2))
    with pytest.raises(ChecksumError):  # bytes that are not the chunk's are never restored
        lay.undo.restore(2)
    for t, m in zip(lay.undo.copies[0], marked, strict=True):
        t.copy_(m)
    lay.undo.restore(2)
    # refused: another chunk, a chunk sealed since, or no staged=True: copied afresh
    for case in ("other", "sealed", "unflagged"):
        assert lay.undo.stage(2)
        for t in lay.undo.copies[0]:
            t.fill_(7.0)
        c = 3 if case == "other" else 2
        if case == "sealed":
            lay.chunk_data(2)[0].fill_(1.5)
            lay.seal_chunk(2, lay.chunk_version(2))
        lay.save_undo(c, staged=case != "unflagged")
        assert all(
            torch.equal(u, d) for u, d in zip(lay.undo_data(c), lay.chunk_data(c), strict=True)
        ), case
        lay.undo.restore(c)
    # nothing to stage into: the only slot holds a chunk's undo copy
    lay.save_undo(0)
    assert not lay.undo.stage(1)


def test_unresumable_names_chunks_off_target_and_corrupt_ones() -> None:
    lay = RetainedLayout.create(mlp(), chunk_numel=16, states=["s"], undo_slots=2)
    assert lay.unresumable(0) is None
    n = lay.n_chunks
    assert lay.unresumable(1) == (
        f"chunks {list(range(n))} not clean at step 1, chunks [] fail their checksums"
    )
    lay.save_undo(2)  # torn: not resumable even at its old version
    assert lay.unresumable(0) == "chunks [2] not clean at step 0, chunks [] fail their checksums"
    lay.undo.restore(2)
    lay.param_buffer[0] += 1  # chunk 0 corrupted
    assert lay.unresumable(0) == "chunks [] not clean at step 0, chunks [0] fail their checksums"


def test_chunks_a_recovery_found_intact_are_not_read_again_the_others_are() -> None:
    from leto.retained.recovery import IntegrityError, check_resumable, intact_at, observe

    lay = RetainedLayout.create(mlp(), chunk_numel=16, states=["s"], undo_slots=2)
    good = float(lay.param_buffer[16])
    lay.param_buffer[16] += 1  # chunk 1 corrupted before the report
    lay.save_undo(2)  # chunk 2 torn
    data, _ = observe(lay)
    intact = intact_at(lay, data)
    assert 1 not in intact and 2 not in intact
    assert intact == {c: 0 for c in range(lay.n_chunks) if c not in (1, 2)}
    assert lay.verify(intact) == [1]  # chunk 1 is read again and still fails
    lay.undo.restore(2)
    with pytest.raises(IntegrityError, match=r"chunks \[1\] fail their checksums"):
        check_resumable(lay, None, 0, "rank 0", intact)
    lay.param_buffer[16] = good  # repaired (as a tier-1 repair would)
    lay.param_buffer[0] += 1  # a chunk the caller vouches for is not read (its bytes fail)
    assert lay.unresumable(0, intact) is None
    assert lay.unresumable(0) is not None  # a full check still finds it


def test_attach_binds_a_skeleton_without_copying_and_keeps_the_header() -> None:
    store = InMemorySegments()
    model = mlp()
    lay = RetainedLayout.create(
        model, chunk_numel=16, states=["exp_avg"], alloc=store, prefix="job"
    )
    with torch.no_grad():
        model[0].weight.add_(1.0)
    for i in range(3):  # the 35-element weight spans chunks 0..2
        lay.seal_chunk(i, 0)
    lay.save_undo(1)  # left TORN by a "dead" trainer
    lay.seal_grads(1, [True, False, True, True])
    values = [p.detach().clone() for p in model.parameters()]
    del model, lay

    skeleton = mlp(device="meta")
    lay2 = RetainedLayout.attach(skeleton, alloc=store, prefix="job")
    seg = store.segments["job.param"]
    for p, v, s in zip(skeleton.parameters(), values, lay2.slots, strict=True):
        assert p.device.type == "cpu" and isinstance(p, nn.Parameter)
        assert torch.equal(p, v)
        assert p.data_ptr() == seg.data_ptr() + 4 * s.offset
        assert inside(p.grad, lay2.grad_buffer)
    assert lay2.chunk_status(1) is ChunkStatus.TORN
    assert lay2.prepared_step == 1 and lay2.grads.present_mask() == [True, False, True, True]
    assert lay2.verify() == []
    assert lay2.grads.verify(1) == []
    lay2.grad_buffer[3] += 1.0
    assert lay2.grads.verify(1) == [0]
    assert lay2.grads.verify(2) == list(range(lay2.n_chunks))


def test_the_layout_records_its_checksum_algorithm_and_attach_checks_it() -> None:
    import zlib

    store = InMemorySegments()
    lay = RetainedLayout.create(mlp(), chunk_numel=16, states=["exp_avg"], alloc=store)
    assert lay.checksum_algorithm == "xxh3"  # host memory
    want = lay.records.data_checksums([0] * lay.n_chunks).tolist()
    assert want == [lay.stored_checksum(c) for c in range(lay.n_chunks)]
    assert RetainedLayout.attach(mlp(device="meta"), alloc=store).checksum_algorithm == "xxh3"
    other = RetainedLayout.create(mlp(), chunk_numel=16, checksum_algorithm="fletcher")
    assert other.checksum_algorithm == "fletcher" and other.verify() == []
    assert other.stored_checksum(0) != lay.stored_checksum(0)  # same bytes, the other hash
    with pytest.raises(LayoutError, match="unknown checksum algorithm 'md5'"):
        RetainedLayout.create(mlp(), chunk_numel=16, checksum_algorithm="md5")
    with pytest.raises(LayoutError, match="unknown checksum algorithm ''"):
        RetainedLayout.create(mlp(), chunk_numel=16, checksum_algorithm="")
    # a description naming an algorithm this version does not know: refused, untouched
    meta = store.segments["leto.meta"]
    raw = bytes(meta.numpy().tobytes()).replace(b'"xxh3"', b'"crc9"')
    meta.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    store.segments["leto.super"].view(torch.int64)[3] = zlib.crc32(raw)
    before = store.segments["leto.param"].clone()
    with pytest.raises(LayoutError, match="unknown checksum algorithm 'crc9'"):
        RetainedLayout.attach(mlp(device="meta"), alloc=store)
    assert torch.equal(store.segments["leto.param"], before)


def test_attach_shape_mismatch_names_the_parameter_and_modifies_nothing() -> None:
    store = InMemorySegments()
    RetainedLayout.create(mlp(), chunk_numel=16, alloc=store)
    other = mlp(hidden=9)
    snapshot = {n: (p.detach().clone(), p.data_ptr()) for n, p in other.named_parameters()}
    seg_before = {k: v.clone() for k, v in store.segments.items()}
    with pytest.raises(ShapeMismatchError, match=r"'0\.weight'.*\(9, 5\).*\(7, 5\)"):
        RetainedLayout.attach(other, alloc=store)
    for n, p in other.named_parameters():
        assert torch.equal(p, snapshot[n][0]) and p.data_ptr() == snapshot[n][1]
        assert p.grad is None
    assert all(torch.equal(seg_before[k], v) for k, v in store.segments.items())
    with pytest.raises(ShapeMismatchError, match="lacks retained parameters"):
        RetainedLayout.attach(nn.Sequential(nn.Linear(5, 7)), alloc=store)
    with pytest.raises(ShapeMismatchError, match="not in the retained layout"):
        RetainedLayout.attach(
            nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Linear(3, 1)), alloc=store
        )
    with pytest.raises(ShapeMismatchError, match="dtype"):
        RetainedLayout.attach(mlp().double(), alloc=store)
    with pytest.raises(LayoutError, match="bad magic"):
        RetainedLayout.attach(mlp(), alloc=store, prefix="other")


@pytest.mark.parametrize("chunk", [0, -4, 1.5, True, None])
def test_bad_chunk_sizes(chunk: object) -> None:
    with pytest.raises(LayoutError, match="chunk_numel"):
        RetainedLayout.create(mlp(), chunk_numel=chunk)  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    with pytest.raises(LayoutError, match="multiple of 4 bytes"):
        RetainedLayout.create(mlp().half(), chunk_numel=7)
    RetainedLayout.create(mlp().half(), chunk_numel=8)
    mixed = mlp()
    mixed[2].double()
    with pytest.raises(LayoutError, match=r"'2\.weight' has dtype torch\.float64"):
        RetainedLayout.create(mixed, chunk_numel=8)
    with pytest.raises(LayoutError, match="no parameters"):
        RetainedLayout.create(nn.Tanh(), chunk_numel=8)
    with pytest.raises(LayoutError, match="floating point"):
        RetainedLayout.create(
            [("x", nn.Parameter(torch.zeros(4, dtype=torch.int32), requires_grad=False))],
            chunk_numel=8,
        )
    for bad in (["grad"], ["a b"], ["x", "x"]):
        with pytest.raises(LayoutError):
            RetainedLayout.create(mlp(), chunk_numel=8, states=bad)
    with pytest.raises(LayoutError, match="undo_slots"):
        RetainedLayout.create(mlp(), chunk_numel=8, undo_slots=0)
    with pytest.raises(LayoutError, match="align_bytes"):
        RetainedLayout.create(mlp(), chunk_numel=8, align_bytes=6)
    with pytest.raises(LayoutError, match="meta device"):
        RetainedLayout.create(mlp(device="meta"), chunk_numel=8)
    lay = RetainedLayout.create(mlp(), chunk_numel=8)
    with pytest.raises(LayoutError, match="no state buffer"):
        lay.state_buffer("exp_avg")
    with pytest.raises(LayoutError, match="not a parameter"):
        lay.index_of(torch.zeros(1))


def test_bad_allocator_and_segment_sizes() -> None:
    with pytest.raises(LayoutError, match="bad segment"):
        RetainedLayout.create(
            mlp(), chunk_numel=8, alloc=lambda name, n: torch.empty(n, dtype=torch.float32)
        )
    store = InMemorySegments()
    store.segments["leto.param"] = torch.zeros(3, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="has 3 bytes"):
        RetainedLayout.create(mlp(), chunk_numel=8, alloc=store)


def test_grad_presence_follows_torch_none_semantics() -> None:
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
    lay = RetainedLayout.create(model, chunk_numel=8)
    assert lay.grads.collect() == [False] * 4  # nothing accumulated yet (torch: None)
    x = torch.randn(2, 3)
    model["a"](x).sum().backward()
    assert lay.grads.collect() == [True, True, False, False]
    lay.grads.zero(set_to_none=True)
    assert lay.grads.collect() == [False] * 4
    assert torch.equal(lay.grad_buffer, torch.full_like(lay.grad_buffer, -0.0))
    assert lay.grad_buffer[0].view(torch.int32).item() == -(2**31)  # really -0.0
    model["b"](x).sum().backward()
    assert lay.grads.collect() == [False, False, True, True]
    lay.grads.zero(set_to_none=False)  # torch: zeroed grads still exist
    assert lay.grads.collect() == [False, False, True, True]
    assert lay.grad_buffer.view(torch.int32).abs().sum().item() == 0  # +0.0
    # the user sets grads to None (module.zero_grad) and backward makes fresh ones
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    model["a"](x).sum().backward()
    fresh = model["a"].weight.grad
    assert not inside(fresh, lay.grad_buffer)
    assert lay.grads.collect() == [True, True, False, False]
    assert inside(model["a"].weight.grad, lay.grad_buffer)
    assert torch.equal(model["a"].weight.grad, fresh)
    assert model["b"].weight.grad is None
    # a grad assigned by hand is present and copied in
    model["b"].bias.grad = torch.ones(3)
    assert lay.grads.collect() == [True, True, False, True]
    assert torch.equal(lay.grad_view(3), torch.ones(3)) and inside(
        model["b"].bias.grad, lay.grad_buffer
    )
