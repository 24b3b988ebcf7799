"""Real processes for ``test_regroup_ranks.py``: 4 ranks train the 2-D (dp x tp) model
retained (``retain_shards``) in files under ``/dev/shm`` that outlive them, one is
SIGKILLed at a named point of a step, the 3 survivors form a new generation of process
groups and :func:`~leto.retained.regroup.regroup` their live FSDP2/TP model onto it, a
new process builds the same model on the new groups and attaches to the dead rank's
retained bytes, the 4 settle the interrupted step alike
(:func:`~leto.retained.regroup.agree_step`) and train on. Each rank reports its final
shards and Adam moments, and those of a plain FSDP2 run never interrupted.

The coordinator is the test (its TCPStore outlives every rank): it notices the death
(the process's exit) and says so in the store; ranks wait for each other through the
store (the step's start and the vote after sealing the gradients), never in a gloo
collective with a dead peer, so they notice at once. Kill points are those of the
retained step after the backward (:data:`POINTS`): a rank killed inside FSDP2's own
collectives would leave the survivors' FSDP2 state mid-forward/backward, not covered.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dtensor_cases import batch, build, make_mesh, same_bytes

from leto.backends.gloo.process_groups import reset_group_count
from leto.retained import dtensor_layout as dl
from leto.retained.alloc import Allocator
from leto.retained.dtensor_retained import RetainedShards, retain_shards
from leto.retained.regroup import StepReport, agree_step, mesh_groups, regroup

WORLD = 4
STEPS = 5
CHUNK = 64
STATES = ("exp_avg", "exp_avg_sq")

POINTS = ["between", "backward", "prepared", "voted", "ended"]
"""Named kill points of a step: after its backward (gradients not sealed), after
sealing them, after the vote, after ``end`` (the process state not yet saved), and
between steps; plus :func:`chunk_points` inside the chunk loop."""


def chunk_points(n_chunks: int) -> list[str]:
    return [f"{what}:{c}" for c in range(n_chunks) for what in ("undo", "applied", "finished")]


class Failed(Exception):
    """The coordinator declared a rank dead in this generation."""


def _opt(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)


def shm_alloc(root: Path) -> Allocator:
    """Retained segments as files in ``root`` (under /dev/shm): they outlive the process."""
    root.mkdir(parents=True, exist_ok=True)

    def alloc(name: str, nbytes: int) -> torch.Tensor:
        path = root / name.replace("/", "_")
        if not path.exists():
            with open(path, "wb") as f:
                f.truncate(nbytes)
        elif path.stat().st_size != nbytes:
            raise ValueError(f"segment {name!r} has {path.stat().st_size} bytes, {nbytes} asked")
        return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)

    return alloc


def form(store: Any, gen: int, rank: int) -> Any:
    """Join generation ``gen``'s world and make the 2 x 2 ("dp", "tp") mesh over it."""
    reset_group_count()
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"gen{gen}", store),  # type: ignore[attr-defined]
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    return make_mesh("2d")


def meet(store: Any, gen: int, what: str) -> None:
    """Wait until every rank of generation ``gen`` got to ``what``; :class:`Failed` once
    the coordinator says one died (a barrier every rank passed is passed by all)."""
    key = f"gen{gen}/{what}"
    store.add(key, 1)
    while True:
        if int(store.add(key, 0)) >= WORLD:
            return
        if store.check([f"gen{gen}/failed"]):
            raise Failed(what)
        time.sleep(0.002)


class Trainer:
    """One rank's retained training, with its kill point (victim only)."""

    def __init__(self, rank: int, store: Any, root: Path, kill: tuple[int, str] | None) -> None:
        self.rank, self.store, self.kill = rank, store, kill
        self.dir = root / f"rank{rank}"
        self.gen = 0

    def start(self, mesh: Any, *, attach: bool) -> None:
        self.mesh = mesh
        self.model = build("2d", mesh, src_data_rank=None)
        self.rs: RetainedShards = retain_shards(
            self.model,
            _opt(self.model),
            chunk_numel=CHUNK,
            alloc=shm_alloc(self.dir),
            attach=attach,
        )
        if attach:
            self.rs.optimizer.load_process_state(json.loads((self.dir / "ps.json").read_text()))
        else:
            self.save()

    def save(self) -> None:
        tmp = self.dir / "ps.json.tmp"
        tmp.write_text(json.dumps(self.rs.optimizer.process_state()))
        os.replace(tmp, self.dir / "ps.json")

    def point(self, name: str) -> None:
        if self.kill == (self.rs.optimizer.version, name):
            os.kill(os.getpid(), signal.SIGKILL)

    def step(self) -> None:
        ropt, v = self.rs.optimizer, self.rs.optimizer.version
        meet(self.store, self.gen, f"start{v}")
        x, y = batch(v, int(self.mesh["dp"].get_local_rank()))
        F.mse_loss(self.model(x), y).backward()
        self.point("backward")
        self.rs.present()
        ropt.prepare(v + 1)
        self.point("prepared")
        meet(self.store, self.gen, f"vote{v}")
        self.point("voted")
        ropt.begin(v + 1)
        for c in range(self.rs.layout.n_chunks):
            ropt.save_undo(c)
            self.point(f"undo:{c}")
            ropt.apply_chunk(c)
            self.point(f"applied:{c}")
            ropt.finish_chunk(c)
            self.point(f"finished:{c}")
        ropt.end()
        self.point("ended")
        self.save()
        self.rs.zero_grad()
        self.point("between")

    def settle(self) -> dict[str, Any]:
        """Agree with the other ranks on the step to end at, and end there."""
        ropt = self.rs.optimizer
        mine = StepReport(ropt.version, self.rs.layout.prepared_step)
        reports: list[Any] = [None] * WORLD
        dist.all_gather_object(reports, (mine.version, mine.prepared))
        target = agree_step([StepReport(*r) for r in reports])
        how = "forward" if ropt.version < target else "back"
        if how == "forward":
            ropt.roll_forward()
        else:
            ropt.roll_back()
        self.rs.zero_grad()
        self.save()
        return {"reports": reports, "target": target, "how": how}

    def result(self) -> dict[str, Any]:
        lay = self.rs.layout
        return {
            "params": {n: p.to_local().detach().clone() for n, p in self.model.named_parameters()},
            "states": {
                (n, k): dl.shard_view(self.rs.plan, lay.state_buffer(k), n).clone()
                for n, _ in self.model.named_parameters()
                for k in STATES
            },
            "version": self.rs.optimizer.version,
            "chunks": lay.n_chunks,
            "verify": lay.verify(),
        }


def plain(mesh: Any) -> dict[str, Any]:
    """The same model trained by plain FSDP2 and torch's Adam, never interrupted."""
    model = build("2d", mesh, src_data_rank=None)
    opt = _opt(model)
    for s in range(STEPS):
        x, y = batch(s, int(mesh["dp"].get_local_rank()))
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    named = dict(model.named_parameters())
    return {
        "params": {n: p.to_local().detach().clone() for n, p in named.items()},
        "states": {
            (n, k): opt.state[p][k].to_local().detach().clone()
            for n, p in named.items()
            for k in STATES
        },
    }


def _report(root: str, kind: str, rank: int, obj: Any) -> None:
    """A file, not a queue: a rank killed while its queue's feeder writes corrupts it."""
    tmp = Path(root) / f"{kind}{rank}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, Path(root) / f"{kind}{rank}.pt")


def _uses(model: torch.nn.Module, mesh: Any) -> bool:
    new = set(mesh_groups(mesh).values())
    ok = True
    for p in model.parameters():
        m = p.device_mesh  # type: ignore[attr-defined]
        ok &= all(m.get_group(i) in new for i in range(m.ndim))
    return ok


def worker(rank: int, port: int, root: str, kill: tuple[int, str] | None, gen: int = 0) -> None:
    """A rank of generation ``gen``: 0 for the first four, 1 for the replacement."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60)
        )
        t = Trainer(rank, store, Path(root), kill)
        t.gen = gen
        mesh = form(store, gen, rank)
        if gen == 0:
            _report(root, "plain", rank, plain(mesh))
        t.start(mesh, attach=gen > 0)
        out["started at"] = t.rs.optimizer.version
        try:
            while gen == 0 and t.rs.optimizer.version < STEPS:
                t.step()
        except Failed as e:
            out["failed at"] = (str(e), t.rs.optimizer.version, t.rs.layout.prepared_step)
            dist.destroy_process_group()
            t.gen = gen = gen + 1
            new = form(store, gen, rank)
            done = regroup(t.model, mesh_groups(new), meshes=[mesh])
            out["regrouped"] = (done.meshes, done.mesh_infos)
            t.mesh = new
        if gen > 0:
            out["uses new groups"] = _uses(t.model, t.mesh)
            out["settled"] = t.settle()
            while t.rs.optimizer.version < STEPS:
                t.step()
        out.update(t.result())
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        out["error"] = traceback.format_exc()
    _report(root, "retained", rank, out)


def coordinate(root: Path, victim: int, kill: tuple[int, str]) -> dict[str, Any]:
    """Run the four ranks, notice the victim's death, start its replacement; every
    rank's report and plain run, by kind and rank."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [
        ctx.Process(target=worker, args=(r, store.port, str(root), kill if r == victim else None))
        for r in range(WORLD)
    ]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    try:
        procs[victim].join(timeout=120)
        died = procs[victim].exitcode
        store.set("gen0/failed", str(victim))
        procs.append(ctx.Process(target=worker, args=(victim, store.port, str(root), None, 1)))
        procs[-1].start()
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    res: dict[str, Any] = {
        kind: {
            r: torch.load(root / f"{kind}{r}.pt", weights_only=False)
            for r in range(WORLD)
            if (root / f"{kind}{r}.pt").exists()
        }
        for kind in ("plain", "retained")
    }
    res["died"] = died
    res["seconds"] = time.monotonic() - t0
    return res


def bitwise(res: dict[str, Any]) -> dict[int, bool]:
    """Per rank: its final shards and Adam moments are the plain run's, byte for byte."""
    out = {}
    for rank in range(WORLD):
        a, b = res["plain"][rank], res["retained"][rank]
        out[rank] = all(same_bytes(a["params"][n], b["params"][n]) for n in a["params"]) and all(
            same_bytes(a["states"][k], b["states"][k]) for k in a["states"]
        )
    return out
