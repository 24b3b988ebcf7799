"""FSDP2, HSDP and 2-D (dp x tp) shards bound to flat buffers by leto.retained.dtensor_layout
train bitwise as plain FSDP2: 4 processes over gloo on 127.0.0.1 (dtensor_cases.worker)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch.multiprocessing as mp
from dtensor_cases import CASES, free_port, worker


@pytest.mark.slow
def test_bound_shards_train_bitwise_as_plain_fsdp2_on_four_ranks() -> None:
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
    print(f"4 ranks, {len(CASES)} cases: {time.monotonic() - t0:.1f} s")
    for tag in res[0]:
        if tag != "pipeline refused":  # padded shards covered in every case, on some rank
            assert any(res[k][tag]["uneven"] for k in res if isinstance(res[k][tag], dict)), tag
    for rank, out in sorted(res.items()):
        for tag, r in out.items():
            if tag == "pipeline refused":
                assert r == (
                    "no parameter is placed over dimension(s) ['pp'] of the root mesh"
                    " ('pp', 'dp'): pipeline or another parallelism is not supported"
                ), r
                continue
            assert isinstance(r, dict), f"rank {rank} {tag}: {r}"
            r.pop("uneven")
            assert all(r.values()), f"rank {rank} {tag}: {r}"
