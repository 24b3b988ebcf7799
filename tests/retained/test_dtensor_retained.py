"""``retain_shards`` on one rank, in this process: what it refuses (one line naming the
part), what an attachment checks, and that a step's bytes are the chunked layout's. The
4-rank comparison with plain FSDP2 (and 2-D), the cut steps, tier-1 parity over the
ranks' shards and the attachment are test_dtensor_retained_ranks.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dtensor_cases import batch, build, one_rank_group

from leto.retained.alloc import InMemorySegments
from leto.retained.dtensor_retained import retain_shards
from leto.retained.errors import LayoutError
from leto.retained.optim import UnsupportedOptimizerError


@pytest.fixture
def mesh() -> Any:
    with one_rank_group() as m:
        yield m


def test_an_optimizer_without_a_chunked_step_is_refused_in_one_line(mesh: Any) -> None:
    model = build("fsdp", mesh)
    with pytest.raises(UnsupportedOptimizerError, match="FSDP2 state: Adagrad has no chunked step"):
        retain_shards(
            model, torch.optim.Adagrad(model.parameters()), chunk_numel=64, alloc=InMemorySegments()
        )


def test_an_optimizer_that_stepped_already_is_refused(mesh: Any) -> None:
    model = build("fsdp", mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = batch(0, 0)
    F.mse_loss(model(x), y).backward()
    opt.step()
    with pytest.raises(UnsupportedOptimizerError, match="already has state; wrap it before"):
        retain_shards(model, opt, chunk_numel=64, alloc=InMemorySegments())


def test_an_attachment_needs_retained_bytes_and_a_sharded_model(mesh: Any) -> None:
    model = build("fsdp", mesh)
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(LayoutError, match="no complete retained layout"):
        retain_shards(model, opt, chunk_numel=64, alloc=InMemorySegments(), attach=True)
    segs = InMemorySegments()
    retain_shards(model, opt, chunk_numel=64, alloc=segs)
    plain = torch.nn.Linear(3, 3)  # not sharded at all
    with pytest.raises(LayoutError, match="no parameter of the model is managed by fully_shard"):
        retain_shards(
            plain, torch.optim.Adam(plain.parameters()), chunk_numel=64, alloc=segs, attach=True
        )


def test_a_step_writes_the_layouts_chunks_and_seals_them(mesh: Any) -> None:
    model = build("fsdp", mesh)
    rs = retain_shards(
        model, torch.optim.SGD(model.parameters(), lr=0.1), chunk_numel=64, alloc=InMemorySegments()
    )
    lay = rs.layout
    before = lay.param_buffer.clone()
    x, y = batch(0, 0)
    F.mse_loss(model(x), y).backward()
    assert all(rs.present())
    rs.step()
    assert [lay.chunk_version(i) for i in range(lay.n_chunks)] == [1] * lay.n_chunks
    assert lay.verify() == [] and not torch.equal(before, lay.param_buffer)
    rs.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert not any(rs.present())  # no backward since: no piece has a gradient
