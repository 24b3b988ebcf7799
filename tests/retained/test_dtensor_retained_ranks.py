"""FSDP2 and 2-D (dp x tp) shards as a chunked retained layout (``retain_shards``) on 4
processes over gloo: bitwise plain FSDP2, interrupted steps rolled back and forward,
tier-1 parity across the ranks' different shards, a new model attached to the retained
bytes (dtensor_retained_cases.worker)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch.multiprocessing as mp
from dtensor_cases import free_port
from dtensor_retained_cases import worker


@pytest.mark.slow
def test_retained_shards_train_bitwise_and_survive_cuts_losses_and_attachment() -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, 4, port, q)) for r in range(4)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    try:
        res: dict[int, dict[str, Any]] = dict(q.get(timeout=240) for _ in range(4))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    print(f"4 ranks: {time.monotonic() - t0:.1f} s")
    for rank, out in sorted(res.items()):
        for cfg, r in out.items():
            assert isinstance(r, dict), f"rank {rank} {cfg}: {r}"
            assert r.pop("chunks") > 1, (rank, cfg)  # several chunks per rank
            if rank == 2:
                assert r.pop("loss seen"), (rank, cfg)  # the zeroed bytes fail their checksums
            assert all(r.values()), f"rank {rank} {cfg}: {r}"
