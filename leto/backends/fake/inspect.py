"""What tests, the demo and the engine's own ``check`` read of the simulated ranks.

Read-only: the real retained state compared with the core's model of it (a refinement
check), bitwise copies of every rank's buffers and process state, and a one-line
description of the run for the timeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from leto.core.chunk import LOST, NONE, TORN
from leto.core.cluster import ClusterState
from leto.retained import recovery as rx
from leto.retained.checkpoint import Checkpointer
from leto.retained.layout import ChunkStatus
from leto.retained.process_state import capture_buffers, scheduler_state

from .host import RanksHost
from .rank import RankProc

__all__ = ["describe", "mismatches", "process_states", "retained_state"]


def mismatches(ranks: RanksHost, s: ClusterState) -> list[str]:
    """Where the real state disagrees with the core's ``s`` (empty: it refines it)."""
    out: list[str] = []
    for r in range(ranks.W):
        p = ranks.procs[r]
        if all(d == LOST for d in s.data[r]) or p.ropt is None or ranks.backend.memory_lost(r):
            continue
        lay = p.layout
        for c in range(lay.n_chunks):
            d, u = s.data[r][c], s.undo[r][c]
            st, v = lay.chunk_status(c), lay.chunk_version(c)
            if u == NONE:
                ok = st is ChunkStatus.CLEAN and v == d
            elif d == TORN:
                ok = st is ChunkStatus.TORN and lay.undo.version(c) == u
            else:
                ok = st is ChunkStatus.APPLIED and v == d and lay.undo.version(c) == u
            if not ok:
                out.append(f"rank {r} chunk {c}: model data={d} undo={u}, real {st.value} v{v}")
    for n in range(ranks.backend.nodes):
        store = ranks.backend.node_store(n)
        par, gpar = s.par[n], s.gpar[n]
        if par is not None and ranks.options.tier1:
            real = [list(x) for x in store.parity_versions]
            if real != [list(x) for x in par]:
                out.append(f"node {n}: parity versions {real}, model {par}")
        if gpar is not None and ranks.options.tier1 and list(gpar) != store.gparity_versions:
            out.append(f"node {n}: gradient parity versions {store.gparity_versions}, model {gpar}")
    return out


def retained_state(procs: Sequence[RankProc]) -> list[dict[str, torch.Tensor]]:
    """Every rank's params and optimizer state buffers (copies), for bitwise checks,
    with the model's parameters derived from them (``model.<name>``; master weights)."""
    out = []
    for p in procs:
        lay = p.layout
        state = {name: buf.clone() for name, buf in rx.named_buffers(lay)}
        for i in lay.derived:
            state["model." + lay.slots[i].name] = lay.params[i].detach().clone()
        out.append(state)
    return out


def process_states(procs: Sequence[RankProc]) -> list[dict[str, Any]]:
    """Every rank's optimizer and scheduler process state, RNG and module buffers
    (JSON-able)."""
    out = []
    for p in procs:
        assert p.ropt is not None
        out.append(
            {
                "optimizer": p.ropt.process_state(),
                "scheduler": scheduler_state(p.replica.scheduler),
                "rng": p.rng,
                "buffers": capture_buffers(p.replica.model),
            }
        )
    return out


def describe(ranks: RanksHost, checkpointer: Checkpointer | None) -> str:
    """The run in one line: machine, chunking, master weights, tiers, checkpoint."""
    t = ranks.backend.topology
    lay = ranks.procs[0].layout
    opt = ranks.options
    master = (
        f"{str(lay.dtype).removeprefix('torch.')} master weights "
        f"({len(lay.derived)} parameters derived), "
        if lay.derived
        else ""
    )
    return (
        f"{ranks.backend.name} backend, {t.nodes} node(s) x {t.node_sizes[0]} rank(s), "
        f"{lay.n_chunks} chunks of {lay.chunk_numel} elements, states {list(lay.states)}, "
        f"{master}tier1={'on' if opt.tier1 else 'off'}, "
        f"tier2={'every ' + str(opt.tier2_interval) + ' steps' if opt.tier2 else 'off'}, "
        f"checkpoint={checkpointer.describe() if checkpointer else 'none'}"
    )
