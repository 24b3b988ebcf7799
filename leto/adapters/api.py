"""``leto.wrap``: a plain training loop with in-place recovery.

::

    import leto

    session = leto.wrap(model, optimizer, scheduler, sampler,
                        config=leto.Config(backend="fake", nodes=2, ranks_per_node=2))

    def step_fn(model, batch):          # one rank's forward; leto calls backward
        x, y = batch_to_tensors(batch)
        return F.cross_entropy(model(x), y)

    while session.step < 1000:
        session.run_step(step_fn)       # every rank: compute, all-reduce, prepare,
                                        # decide, apply chunk by chunk, finish

Each step is the protocol's transaction; when a rank fails at any point of it
(``session.faults`` plans failures on the fake backend), the step is recovered in
place: the run continues from the committed step (or the tier-2 snapshot, or the
step-0 checkpoint) and stays bitwise equal to a run that never failed.

What leto retains besides the tensors, as JSON: the optimizer's scalars, the LR
scheduler's ``state_dict()``, the sampler position and every rank's RNG states.
``sampler`` yields one *global* batch per step (lists or tensors of indices);
rank ``r`` of ``W`` receives ``batch[r::W]``. Samplers with ``state_dict()`` /
``load_state_dict()`` (such as :class:`leto.ResumableBatchSampler`)
resume exactly; other iterables are re-iterated and skipped ahead.

The optimizer is any ``torch.optim.Optimizer`` whose step is deterministic:
``SGD``, ``Adam`` and ``AdamW`` run chunk by chunk with torch's own math, every
other one (user subclasses included) through the generic path, which replays its
``step()`` from a retained copy of the step before; ``LBFGS`` and ``SparseAdam``
are refused (:class:`leto.retained.UnsupportedOptimizerError`, naming why). On the fake backend, the simulated ranks get deep
copies of model, optimizer and scheduler; rank 0 uses the objects passed in
(until a failure of rank 0 replaces its process: use ``session.model``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn

from leto.backends.base import Backend
from leto.backends.fake.engine import Engine, EngineOptions, Replica
from leto.backends.fake.rank import StepFn
from leto.retained.checkpoint import Checkpointer, CheckpointError, DCPCheckpointer
from leto.retained.dcp_state import read_checkpoint

from .config import Config, ConfigError

if TYPE_CHECKING:
    from leto.backends.gloo.runtime import GlooSession

__all__ = ["Session", "wrap"]


class Session:
    """A wrapped training job (returned by :func:`wrap`)."""

    def __init__(self, config: Config, backend: Backend, engine: Engine) -> None:
        self.config = config
        self.backend = backend
        self.engine = engine

    @property
    def model(self) -> nn.Module:
        """Rank 0's live model (its parameters are views of retained memory)."""
        return self.engine.procs[0].replica.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """Rank 0's retained (chunked) optimizer."""
        ropt = self.engine.procs[0].ropt
        assert ropt is not None
        return ropt

    @property
    def step(self) -> int:
        """The last committed step."""
        return self.engine.state.committed

    @property
    def faults(self) -> Any:
        """The backend's fault injector (fake backend only)."""
        inj = getattr(self.backend, "faults", None)
        if inj is None:
            raise AttributeError(f"the {self.backend.name} backend has no fault injector")
        return inj

    @property
    def timeline(self) -> list[dict[str, Any]]:
        return self.engine.timeline

    @property
    def stats(self) -> dict[str, int]:
        return self.engine.stats

    def run_step(self, step_fn: StepFn) -> float | None:
        """One step on every rank (recovering in place on a failure); its mean loss,
        or None if it was interrupted (the run then continues from the recovered step)."""
        return self.engine.run_step(step_fn)

    def batches(self, steps: int | None = None) -> Any:
        """The user's own loop is gloo's (one process per rank): see docs/loop.md."""
        raise NotImplementedError(
            "the user's own loop (session.batches) runs on the gloo backend (`leto launch`); "
            "on the fake backend, whose ranks share one process, use session.train(step_fn)"
        )

    def train(self, step_fn: StepFn, steps: int) -> dict[str, Any]:
        """Run steps until the committed step is ``steps``; the counters."""
        self.engine.train(steps, step_fn)
        return dict(self.engine.stats)

    def retained_state(self) -> list[dict[str, torch.Tensor]]:
        return self.engine.retained_state()


def _checkpointer(config: Config) -> Checkpointer | None:
    if config.checkpoint_dir is None:
        return None
    os.makedirs(config.checkpoint_dir, exist_ok=True)
    return DCPCheckpointer(config.checkpoint_dir)


def check_wrapped(model: Any, optimizer: Any, scheduler: Any) -> None:
    """ValueError in one line naming the argument of ``leto.wrap`` that is not what it
    takes, before anything is retained (a data loader given as the scheduler, the
    third positional argument, would otherwise fail at the first step's state)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"leto.wrap: model is a {type(model).__name__}, not a torch.nn.Module")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"leto.wrap: optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer"
        )
    if scheduler is None:
        return
    if not (
        callable(getattr(scheduler, "step", None))
        and callable(getattr(scheduler, "state_dict", None))
    ):
        what = type(scheduler).__name__
        hint = (
            "; a data loader or sampler is the fourth argument (leto.wrap(model, optimizer, "
            "scheduler, loader), or sampler=...)"
            if hasattr(scheduler, "__iter__")
            else ""
        )
        raise ValueError(
            f"leto.wrap: scheduler (the third argument) is a {what}, with no step() and "
            f"state_dict() of an LR scheduler{hint}"
        )
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("leto.wrap: scheduler is bound to another optimizer than the one wrapped")


def refuse_fsdp(model: nn.Module) -> None:
    """An FSDP-wrapped model (``fully_shard``: DTensor parameters in FSDP's own storage)
    cannot be retained: refused in one line naming ``shard = true``, leto's sharding."""
    fsdp = any(
        c.__name__ in ("FSDPModule", "FullyShardedDataParallel") for c in type(model).__mro__
    )
    if fsdp or any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise TypeError(
            "leto.wrap: the model is FSDP-wrapped (fully_shard / DTensor parameters), whose "
            "sharded storage leto cannot retain; pass the plain model and set shard = true "
            '(leto shards it itself: docs/gloo.md, "Sharded state")'
        )


def make_backend(config: Config) -> Backend:
    """The in-process backend ``config`` names: ``fake`` (``gloo`` runs one process per
    rank and has no backend object: :func:`wrap` hands it to the gloo runtime)."""
    if config.backend == "fake":
        from leto.backends.fake import FakeBackend

        return FakeBackend(config.topology)
    raise ConfigError(  # gloo and nccl run one process per rank
        "backend",
        f"{config.backend!r} has no in-process backend object: call leto.wrap in a script "
        "started by `leto launch`",
    )


def wrap(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    sampler: Any = None,
    *,
    config: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    backend: Backend | None = None,
    checkpointer: Checkpointer | None = None,
    step_fn: StepFn | None = None,
    check: bool = False,
    scaler: Any = None,
    per_rank: bool | None = None,
) -> Session | GlooSession:
    """Wrap a model, its optimizer, an LR scheduler and a data sampler for in-place recovery.

    ``config``: a :class:`Config`, a dict, a TOML path, or None (the environment).
    ``backend``: an existing backend holding retained state of this job (a new
    trainer attaching to it); the model must match the retained shapes, and
    nothing retained is modified if it does not. ``check``: after every recovery,
    compare the real state with the protocol core's and recompute the parity (slow;
    for tests and the demo).

    With ``backend="gloo"`` the script must run under ``leto launch`` (one process per
    rank); the result is then a :class:`leto.backends.gloo.runtime.GlooSession`, and
    run outside ``leto launch`` it raises a :class:`ConfigError` that says so.

    The user's own loop (gloo; docs/loop.md): ``for batch in session.batches(steps)``,
    ``loss.backward()`` (inside ``session.no_sync()`` for all micro-batches but the
    last), clipping, ``optimizer.step()`` on the optimizer passed here (its step is now
    leto's transaction), ``scheduler.step()``. ``scaler``: a ``torch.amp.GradScaler``
    whose state leto retains (with ``shard`` or ``master_weights`` it unscales the
    retained gradients, its inf/NaN finding shared by every rank); ``per_rank``: the
    loader yields this rank's batches (default: it does when its sampler is a
    ``DistributedSampler``), else leto splits global batches (tensors, lists of
    indices, tuples or dicts of them).
    """
    cfg = Config.load(config)
    check_wrapped(model, optimizer, scheduler)
    refuse_fsdp(model)
    launched = bool(os.environ.get("LETO_ROLE"))
    resume = os.environ.get("LETO_RESUME") if launched else None
    if launched and os.environ.get("LETO_RESTART") and cfg.checkpoint_dir is not None:
        # a restart of `leto launch --max-restarts`: from the latest checkpoint
        cfg = attrs.evolve(cfg, resume=cfg.checkpoint_dir)
    elif resume and cfg.resume is None:  # `leto launch --resume DIR`, whatever the config
        cfg = attrs.evolve(cfg, resume=resume)
    if cfg.backend in ("gloo", "nccl"):  # nccl: the gloo backend's processes, NCCL's data plane
        from leto.backends.gloo.runtime import wrap_gloo

        return wrap_gloo(
            model,
            optimizer,
            scheduler,
            sampler,
            config=cfg,
            backend=backend,
            checkpointer=checkpointer,
            step_fn=step_fn,
            check=check,
            scaler=scaler,
            per_rank=per_rank,
        )
    if scaler is not None or per_rank:
        raise ConfigError(
            "backend",
            "the user's own loop (scaler, per-rank data) runs on gloo (`leto launch`); "
            "on the fake backend use session.train(step_fn)",
        )
    attach = backend is not None
    if backend is None:
        backend = make_backend(cfg)
    else:
        if backend.name != cfg.backend:
            raise ConfigError(
                "backend", f"{cfg.backend!r}, but the retained job runs on {backend.name!r}"
            )
        if backend.topology != cfg.topology:
            raise ConfigError(
                "topology",
                f"{cfg.nodes}x{cfg.ranks_per_node}, but the retained job has node sizes "
                f"{list(backend.topology.node_sizes)}",
            )
    options = EngineOptions(
        chunk_numel=cfg.chunk_size,
        tier1=cfg.tier1,
        tier2=cfg.tier2,
        tier2_interval=cfg.tier2_interval,
        tier2_parity=cfg.tier2_parity,
        verify=cfg.verify_chunks,
        master_weights=cfg.master_weights,
        check=check,
        checkpoint_interval=cfg.checkpoint_interval,
        checkpoint_mtbf=float(cfg.checkpoint_mtbf),
    )
    start = None
    if cfg.resume is not None:
        try:
            state, meta = read_checkpoint(cfg.resume)
        except CheckpointError as e:
            raise ConfigError("resume", str(e)) from None
        start = (state, meta, cfg.resume)
    engine = Engine(
        backend,
        Replica(model, optimizer, scheduler),
        step_fn=step_fn,
        sampler=sampler,
        options=options,
        checkpointer=checkpointer if checkpointer is not None else _checkpointer(cfg),
        attach=attach,
        resume=start,
    )
    return Session(cfg, backend, engine)
