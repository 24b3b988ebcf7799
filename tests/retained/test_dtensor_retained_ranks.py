"""FSDP2 and 2-D (dp x tp) shards as a chunked retained layout (``retain_shards``) on 4
processes over gloo: bitwise plain FSDP2, interrupted steps rolled back and forward,
tier-1 parity across the ranks' different shards, a new model attached to the retained
bytes (dtensor_retained_cases.worker)."""

from __future__ import annotations

import pytest
from dtensor_cases import spawn_ranks
from dtensor_retained_cases import worker


@pytest.mark.slow
def test_retained_shards_train_bitwise_and_survive_cuts_losses_and_attachment() -> None:
    res = spawn_ranks(worker)
    assert sorted(res) == [0, 1, 2, 3]
    for rank, out in sorted(res.items()):
        for cfg, r in out.items():
            assert isinstance(r, dict), f"rank {rank} {cfg}: {r}"
            assert r.pop("chunks") > 1, (rank, cfg)  # several chunks per rank
            if rank == 2:
                assert r.pop("loss seen"), (rank, cfg)  # the zeroed bytes fail their checksums
            assert all(r.values()), f"rank {rank} {cfg}: {r}"
