"""FSDP2, HSDP and 2-D (dp x tp) shards bound to flat buffers by leto.retained.dtensor_layout
train bitwise as plain FSDP2: 4 processes over gloo on 127.0.0.1 (dtensor_cases.worker)."""

from __future__ import annotations

import pytest
from dtensor_cases import spawn_ranks, worker


@pytest.mark.slow
def test_bound_shards_train_bitwise_as_plain_fsdp2_on_four_ranks() -> None:
    res = spawn_ranks(worker)
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
