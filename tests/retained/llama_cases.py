"""4-rank workers for ``test_llama_fsdp_tp.py``: the example's Llama (FSDP2 + TP on a
2 x 2 ``("dp", "tp")`` mesh) retained by leto against the same run without leto, its DCP
checkpoints, and their resume on other mesh shapes. Imported by the test and, by name,
by the processes it spawns (which import ``examples/llama_fsdp_tp.py`` as a module)."""

from __future__ import annotations

import logging
import random
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dtensor_cases import inside, join, same_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import llama_fsdp_tp as ex  # noqa: E402

STEPS = 3


def _quiet() -> None:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _train(run: ex.Run, steps: int) -> list[torch.Tensor]:
    return [run.train_step() for _ in range(steps)]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(same_bytes(a[k], b[k]) for k in a)


def _losses(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(same_bytes(x, y) for x, y in zip(a, b, strict=True))


def _local_state(run: ex.Run) -> dict[str, torch.Tensor]:
    """This rank's shards of every parameter and optimizer state, by flat key."""
    sd = run.state_dict()
    out = {f"model.{k}": v.to_local().clone() for k, v in sd["model"].items()}
    for fqn, st in sd["optimizer"]["state"].items():
        for k, v in st.items():
            out[f"optimizer.{fqn}.{k}"] = (v.to_local() if k != "step" else v).clone()
    return out


def _in_layout(run: ex.Run) -> bool:
    """Every parameter and AdamW moment this rank holds is a view of the retained buffers."""
    assert run.rs is not None
    lay = run.rs.layout
    sd = run.state_dict()
    ok = all(inside(lay.param_buffer, v.to_local()) for v in sd["model"].values())
    for st in sd["optimizer"]["state"].values():
        ok &= inside(lay.state_buffer("exp_avg"), st["exp_avg"].to_local())
        ok &= inside(lay.state_buffer("exp_avg_sq"), st["exp_avg_sq"].to_local())
    return ok


def as_without_leto(mesh: Any, bf16: bool) -> dict[str, Any]:
    plain = ex.Run(mesh, plain=True, bf16=bf16)
    leto = ex.Run(mesh, plain=False, bf16=bf16, tag=f"bitwise{bf16}")
    a, b = _train(plain, STEPS), _train(leto, STEPS)
    assert leto.rs is not None
    return {
        "losses": _losses(a, b),
        "shards and states": _same(_local_state(plain), _local_state(leto)),
        "in the layout": _in_layout(leto),
        "grads reduce-scattered into the layout": all(
            c.hits == STEPS for c in leto.rs.reduce_scatters
        ),
        "checksums": leto.rs.layout.verify() == [],
        "several chunks": leto.rs.layout.n_chunks > 1,
        "lr as the scheduler's": leto.opt.param_groups[0]["lr"] == plain.opt.param_groups[0]["lr"],
    }


def bitwise_worker(rank: int, world: int, port: int, q: Any) -> None:
    _run_cases(
        rank,
        world,
        port,
        q,
        lambda: {
            "fp32": as_without_leto(ex.make_mesh("2x2"), bf16=False),
            "bf16": as_without_leto(ex.make_mesh("2x2"), bf16=True),
        },
    )


def phases(n_chunks: int) -> list[tuple[str, int]]:
    """The points of a retained step, in order: gradients prepared, step begun, then per
    chunk its undo copy saved, its new bytes applied, its undo copy released."""
    per_chunk = [(e, c) for c in range(n_chunks) for e in ("save_undo", "apply", "finish")]
    return [("prepare", -1), ("begin", -1), *per_chunk]


def cut_step(run: ex.Run, point: int, how: str) -> None:
    """Step ``run`` as a process stopped after ``point`` phases would leave it, then
    recovered: rolled back and stepped again, or rolled forward."""
    assert run.rs is not None
    rs, ropt = run.rs, run.rs.optimizer
    loss = ex.loss_of(run.model, run.cfg, run.step, ex.dp_rank(run.mesh))
    loss.backward()
    v = ropt.version + 1
    rs.present()
    act = {
        "prepare": lambda c: ropt.prepare(v),
        "begin": lambda c: ropt.begin(v),
        "save_undo": ropt.save_undo,
        "apply": ropt.apply_chunk,
        "finish": ropt.finish_chunk,
    }
    for name, c in phases(rs.layout.n_chunks)[:point]:
        act[name](c)
    if how == "forward" and point > 0:
        ropt.roll_forward()
    else:
        ropt.roll_back()
        rs.step()
    rs.zero_grad()
    run.sched.step()
    run.step += 1


def cut_everywhere(mesh: Any) -> dict[str, Any]:
    """A step cut at every phase (rolled back, then forward), then at random phases (a
    different one on each rank): bitwise the uninterrupted plain run."""
    leto = ex.Run(mesh, plain=False, tag="cut", chunk_numel=24576)
    assert leto.rs is not None
    n = len(phases(leto.rs.layout.n_chunks))
    rng = random.Random(dist.get_rank())
    cuts = [(p, how) for how in ("back", "forward") for p in range(n + 1)]
    cuts += [(rng.randrange(n + 1), rng.choice(["back", "forward"])) for _ in range(4)]
    for point, how in cuts:
        cut_step(leto, point, how)
        assert leto.rs.layout.verify() == [], (point, how)
    plain = ex.Run(mesh, plain=True)
    _train(plain, len(cuts))
    return {
        "several chunks": leto.rs.layout.n_chunks > 1,
        "every phase, both ways": len(cuts) == 2 * (n + 1) + 4,
        "shards and states": _same(_local_state(plain), _local_state(leto)),
        "version": leto.rs.optimizer.version == len(cuts),
    }


def cut_worker(rank: int, world: int, port: int, q: Any) -> None:
    _run_cases(rank, world, port, q, lambda: {"2x2": cut_everywhere(ex.make_mesh("2x2"))})


def saved_as_torch(root: Path) -> dict[str, Any]:
    """Leto's checkpoint after STEPS steps on 2 x 2 has torch's keys and bytes."""
    mesh = ex.make_mesh("2x2")
    plain, leto = ex.Run(mesh, plain=True), ex.Run(mesh, plain=False, tag="saved")
    _train(plain, STEPS)
    _train(leto, STEPS)
    plain.save(str(root / "plain"))
    leto.save(str(root / "leto"))
    keys = {
        w: sorted(dcp.FileSystemReader(str(root / w)).read_metadata().state_dict_metadata)
        for w in ("plain", "leto")
    }
    sd = leto.state_dict()
    return {
        "same keys as torch's": keys["plain"] == keys["leto"],
        "model FQNs": "model.layers.0.attention.wq.weight" in keys["leto"],
        "optimizer FQNs": "optimizer.state.layers.1.feed_forward.w2.weight.exp_avg_sq"
        in keys["leto"],
        "scheduler and step": "lr_scheduler.last_epoch" in keys["leto"]
        and "train_state.step" in keys["leto"],
        "state_dict keys as get_state_dict's": sorted(sd["model"])
        == sorted(plain.state_dict()["model"])
        and sorted(sd["optimizer"]["state"]) == sorted(plain.state_dict()["optimizer"]["state"]),
        "full state as torch's": _same(plain.full_state(), leto.full_state()),
    }


def resumed(root: Path, shape: str, saved: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Load the 2 x 2 checkpoint on ``shape``, retained, and train on: bitwise the plain
    FSDP2 run that loads it the torchtitan way on the same shape."""
    mesh = ex.make_mesh(shape)
    plain, leto = ex.Run(mesh, plain=True), ex.Run(mesh, plain=False, tag=f"resume{shape}")
    plain.load(str(root / "leto"))
    leto.load(str(root / "leto"))
    assert leto.rs is not None
    loaded = leto.full_state()
    out = {
        "loaded is what was saved": _same(loaded, saved),
        "plain loaded the same": _same(plain.full_state(), saved),
        "loaded in place": _in_layout(leto),
        "sealed": leto.rs.layout.verify() == [] and leto.rs.optimizer.version == STEPS,
        "step and lr": leto.step == plain.step == STEPS
        and leto.opt.param_groups[0]["lr"] == plain.opt.param_groups[0]["lr"],
    }
    a, b = _train(plain, 2), _train(leto, 2)
    out["losses"] = _losses(a, b)
    out["shards and states"] = _same(_local_state(plain), _local_state(leto))
    out["checksums after"] = leto.rs.layout.verify() == []
    return out


def _first(root: str) -> dict[str, torch.Tensor]:
    """3 steps retained on 2 x 2, saved at ``root/leto``; the state gathered to full tensors."""
    run = ex.Run(ex.make_mesh("2x2"), plain=False, tag="first")
    _train(run, STEPS)
    run.save(str(Path(root) / "leto"))
    return run.full_state()


def resume_worker(rank: int, world: int, port: int, q: Any, root: str) -> None:
    def cases() -> dict[str, Any]:
        saved = _first(root)
        return {shape: resumed(Path(root), shape, saved) for shape in ("4x1", "1x4")}

    _run_cases(rank, world, port, q, cases)


def first_worker(rank: int, world: int, port: int, q: Any, root: str) -> None:
    """Writes the 2 x 2 checkpoint and, from rank 0, its full state (``full.pt``)."""

    def cases() -> dict[str, Any]:
        saved = _first(root)
        if dist.get_rank() == 0:
            torch.save(saved, Path(root) / "full.pt")
        return {"saved": {"keys": len(saved) > 0}}

    _run_cases(rank, world, port, q, cases)


def two_ranks_worker(rank: int, world: int, port: int, q: Any, root: str) -> None:
    """On 2 processes: the 4-process checkpoint resumed on 2 x 1 and 1 x 2."""

    def cases() -> dict[str, Any]:
        saved = torch.load(Path(root) / "full.pt")
        return {shape: resumed(Path(root), shape, saved) for shape in ("2x1", "1x2")}

    _run_cases(rank, world, port, q, cases)


def save_worker(rank: int, world: int, port: int, q: Any, root: str) -> None:
    _run_cases(rank, world, port, q, lambda: {"2x2": saved_as_torch(Path(root))})


def _run_cases(
    rank: int, world: int, port: int, q: Any, cases: Callable[[], dict[str, Any]]
) -> None:
    join(rank, world, port)
    _quiet()
    try:
        out: dict[str, Any] = cases()
    except Exception:
        out = {"error": traceback.format_exc()}
    q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()
