""":class:`HostStaged`: a parity collective run through host copies (gloo reduces host
tensors only, so a layout in GPU memory stages its tier-1 and tier-2 codes). The copies
move bytes: encode, decode and the rotated code give exactly the unstaged results."""

from __future__ import annotations

from typing import Any

import torch

from leto.retained.parity import HostStaged, decode, encode, run_spmd


def _data(r: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(r)
    return [torch.randn(37, generator=g), torch.randint(0, 255, (11,), generator=g).byte()]


def _encode_decode(staged: bool) -> tuple[list[Any], list[list[torch.Tensor]], list[int]]:
    counts: list[int] = [0] * 4

    def body(coll: Any) -> tuple[Any, list[torch.Tensor]]:
        c = HostStaged(coll, always=True) if staged else coll
        mine = _data(coll.rank)
        par = encode(c, mine, 0)
        held = None if par is None else par.clone()
        lost = [torch.zeros_like(t) for t in mine] if coll.rank == 2 else mine
        decode(c, lost, 2, 0, held)
        counts[coll.rank] = c.staged if staged else 0
        return par, lost

    out = run_spmd(4, body)
    return [p for p, _ in out], [d for _, d in out], counts


def test_staged_parity_is_bitwise_the_unstaged_one_and_rebuilds_a_lost_member() -> None:
    pars, data, _ = _encode_decode(False)
    spars, sdata, counts = _encode_decode(True)
    assert pars[0] is not None and spars[0] is not None and torch.equal(pars[0], spars[0])
    assert all(p is None for p in spars[1:])
    for want, got, back in zip(_data(2), sdata[2], data[2], strict=True):
        assert torch.equal(want, got) and torch.equal(want, back)  # member 2 rebuilt
    assert all(n >= 2 for n in counts), counts  # every member's reduces went through host copies


def test_host_tensors_go_straight_through_unless_always() -> None:
    def body(coll: Any) -> int:
        c = HostStaged(coll)
        t = torch.full((4,), float(coll.rank + 1))
        c.all_reduce_sum(t)
        assert t.tolist() == [3.0] * 4
        c.broadcast(t, 1)
        return c.staged

    assert run_spmd(2, body) == [0, 0]
