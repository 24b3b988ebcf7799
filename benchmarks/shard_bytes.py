"""Per-rank retained bytes with ``shard = true`` against pure data-parallel retention.

In one process (the layouts are deterministic: a rank's bytes do not depend on the
run), for the benchmark workload's model (1.06M parameters, AdamW) with chunks of
65,536 and of 4,096 elements (``leto bench``'s, about 530k, leaves W = 4 a rank of
padding only, which sharding refuses): the bytes of one rank's retained segments
(parameters, gradients, optimizer states, one chunk's undo copy, the header) without
sharding (every rank the same) and sharded over W ranks (the largest rank's), and
their ratio against 1/W. Run: python benchmarks/shard_bytes.py [--width 512] [--json]
"""

from __future__ import annotations

import argparse
import json

from leto.bench.workload import Workload
from leto.retained.optim import retain
from leto.retained.shard import ShardPlan, retain_shard, retained_nbytes


def measure(width: int, chunk: int | None, worlds: tuple[int, ...]) -> dict[str, object]:
    wl = Workload(width=width) if chunk is None else Workload(width=width, chunk_numel=chunk)
    model = wl.build_model()
    whole = retained_nbytes(
        retain(model, wl.build_optimizer(model), chunk_numel=wl.chunk_numel).layout
    )
    rows = []
    for W in worlds:
        model = wl.build_model()
        plan = ShardPlan(list(model.named_parameters()), W, wl.chunk_numel)
        sizes = [
            retained_nbytes(
                retain_shard(
                    model, wl.build_optimizer(model), plan, r, alloc=None, attach=False
                ).layout
            )
            for r in range(W)
        ]
        rows.append(
            {
                "world": W,
                "per_rank_bytes": max(sizes),
                "ratio": max(sizes) / whole,
                "ratio_x_world": max(sizes) * W / whole,
            }
        )
    return {
        "params": wl.params,
        "chunk_numel": wl.chunk_numel,
        "unsharded_bytes": whole,
        "sharded": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = [measure(args.width, c, (2, 4, 8)) for c in (65536, 4096)]
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for m in out:
        print(
            f"{m['params']:,} parameters, AdamW, chunks of {m['chunk_numel']:,} elements: "
            f"unsharded {m['unsharded_bytes']:,} B per rank"
        )
        for row in m["sharded"]:  # type: ignore[attr-defined]
            print(
                f"  W={row['world']}: sharded {row['per_rank_bytes']:,} B per rank = "
                f"{row['ratio']:.4f} of unsharded ({row['ratio_x_world']:.3f} x 1/W)"
            )


if __name__ == "__main__":
    main()
