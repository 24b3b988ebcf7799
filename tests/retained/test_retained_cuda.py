"""The tensor layer on CUDA: checksums, layout, chunked Adam, parity (skipped without a GPU).

Expected, not yet observed on a GPU (no device was available when this was
written): torch's CUDA default for Adam is the foreach path, whose kernels are
elementwise, so the chunked step is expected BITWISE equal to torch.optim.Adam;
the fused CUDA kernel is only checked within 1e-6 relative.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from leto.retained import InMemorySegments, retain, run_spmd
from leto.retained.checksum import checksum, checksum_chunks
from leto.retained.parity import as_bytes, decode, encode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_checksums_agree_with_cpu() -> None:
    g = torch.Generator().manual_seed(0)
    bufs = [torch.randn(6 * 4096, generator=g) for _ in range(3)]
    cpu = checksum_chunks(bufs, 6, list(range(6)), algorithm="fletcher").tolist()
    gpu = checksum_chunks([b.cuda() for b in bufs], 6, list(range(6))).tolist()
    assert cpu == gpu
    assert checksum([b[:4096].cuda() for b in bufs], index=0, version=0).item() == cpu[0]


@pytest.mark.parametrize("hp", [{"lr": 1e-2, "weight_decay": 0.1}, {"lr": 1e-2, "fused": True}])
def test_chunked_adam_on_cuda(hp: dict[str, Any]) -> None:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()

    ref_model, model = make(), make()
    ref = torch.optim.Adam(ref_model.parameters(), **hp)
    store = InMemorySegments("cuda")
    opt = retain(model, torch.optim.Adam(model.parameters(), **hp), chunk_numel=4096, alloc=store)
    assert all(p.is_cuda for p in model.parameters())
    assert opt.layout.param_buffer.data_ptr() == store.segments["leto.param"].data_ptr()
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(50):
        x = torch.randn(32, 64, device="cuda", generator=g)
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
        if hp.get("fused"):
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(p, q)
    assert opt.layout.checksum_algorithm == "fletcher"  # a layout in GPU memory
    assert opt.layout.verify() == []


def test_parity_on_cuda() -> None:
    truth = [
        torch.randn(1000, device="cuda", generator=torch.Generator("cuda").manual_seed(r))
        for r in range(3)
    ]

    def program(c: Any) -> torch.Tensor:
        data = truth[c.rank].clone()
        parity = encode(c, data, 0)
        if c.rank == 2:
            data.zero_()
        decode(c, data, 2, 0, parity)
        return data

    out = run_spmd(3, program)
    assert torch.equal(as_bytes(out[2]), as_bytes(truth[2]))
