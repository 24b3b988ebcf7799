"""``leto bench tier2``: the tier-2 encode cost with ``m`` parities, side by side.

Real processes, one per node, on a gloo group over 127.0.0.1 (as the gloo backend's
cross-node group): every node holds ``--mib`` MiB of snapshot bytes and encodes them
as a snapshot does, with ``m = 1`` (the rotated sum, :func:`leto.retained.parity.
encode_rotated`) and each ``m >= 2`` (the striped Cauchy Reed-Solomon code,
:func:`leto.retained.rs.encode_striped`), interleaved round by round so drift hits
every ``m`` alike. Reported: the median wall time of one encode (the slowest node's:
a snapshot is done when every node is), each ``m``'s ratio to ``m = 1``, and the
parity bytes every node stores. A snapshot is taken every ``tier2_interval`` steps,
off the critical path: its cost per step is the encode over K.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["run_tier2", "tier2_table"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node(
    rank: int, nodes: int, port: int, nbytes: int, ms: Sequence[int], rounds: int, q: Any
) -> None:
    import torch.distributed as dist

    from leto.retained import rs
    from leto.retained.parity import TorchDistCollective, encode_rotated, rotated_share_nbytes

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nodes
    )
    coll = TorchDistCollective()
    data = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rank)
    )
    out = {
        m: torch.zeros(
            m
            * (
                rotated_share_nbytes(nbytes, nodes)
                if m == 1
                else rs.striped_share_nbytes(nbytes, nodes, m)
            ),
            dtype=torch.uint8,
        )
        for m in ms
    }
    times: dict[int, list[float]] = {m: [] for m in ms}
    for _ in range(rounds):
        for m in ms:
            dist.barrier()
            t0 = time.perf_counter()
            if m == 1:
                encode_rotated(coll, data, out=out[m])
            else:
                rs.encode_striped(coll, data, m, out[m])
            dist.barrier()  # done when every node is
            times[m].append(time.perf_counter() - t0)
    if rank == 0:
        q.put({m: (times[m], int(out[m].numel())) for m in ms})
    dist.destroy_process_group()


def run_tier2(nodes: int, mib: float, parities: Sequence[int], rounds: int) -> dict[str, Any]:
    """Encode ``mib`` MiB per node across ``nodes`` processes with each ``m`` in
    ``parities`` (1 is always measured: the baseline), ``rounds`` times each."""
    import torch.multiprocessing as mp

    ms = sorted(set(parities) | {1})
    if ms[-1] >= nodes:
        raise ValueError(f"m = {ms[-1]} parities need more than {ms[-1]} nodes, not {nodes}")
    nbytes = int(mib * (1 << 20))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_node, args=(r, nodes, port, nbytes, ms, rounds, q))
        for r in range(nodes)
    ]
    for p in procs:
        p.start()
    got = q.get(timeout=600)
    for p in procs:
        p.join(60)
    base = statistics.median(got[1][0])
    rows = []
    for m in ms:
        ts, stored = got[m]
        med = statistics.median(ts)
        rows.append(
            {
                "m": m,
                "code": "rotated sum" if m == 1 else "Cauchy Reed-Solomon",
                "encode_s": med,
                "encode_s_all": ts,
                "ratio_to_m1": med / base if base > 0 else float("nan"),
                "parity_bytes_per_node": stored,
            }
        )
    return {
        "benchmark": "tier2",
        "nodes": nodes,
        "bytes_per_node": nbytes,
        "rounds": rounds,
        "rows": rows,
    }


def tier2_table(res: dict[str, Any]) -> str:
    mib = res["bytes_per_node"] / (1 << 20)
    lines = [
        f"tier-2 encode, {res['nodes']} nodes x {mib:g} MiB, gloo over 127.0.0.1, "
        f"median of {res['rounds']} rounds (interleaved)",
        f"{'m':>3}  {'code':<20} {'encode s':>9} {'x m=1':>7} {'parity MiB/node':>16}",
    ]
    for r in res["rows"]:
        lines.append(
            f"{r['m']:>3}  {r['code']:<20} {r['encode_s']:>9.3f} {r['ratio_to_m1']:>7.2f} "
            f"{r['parity_bytes_per_node'] / (1 << 20):>16.2f}"
        )
    return "\n".join(lines)
