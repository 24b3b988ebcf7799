"""Hugging Face ``transformers.Trainer`` under ``leto launch`` (docs/trainers.md).

Theory of operation. Under ``leto launch`` every rank is one process of a data-parallel
job whose gradient all-reduce leto does itself (a hook at the end of backward), so the
``Trainer`` must not form a process group or wrap the model in DDP: to Accelerate each
rank is one process alone. :class:`TrainingArguments` sets Accelerate's state up with
the launcher's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` hidden (only while it does so),
and saves and logs on rank 0 only. :class:`Trainer` keeps ``train()`` and replaces its
inner loop by leto's (docs/loop.md), built from the Trainer's own parts:

* its optimizer and LR scheduler (``create_optimizer_and_scheduler``: ``learning_rate``,
  ``weight_decay``, ``lr_scheduler_type``, ``warmup_steps``...) and a resumable
  loader of this rank's batches (a ``StatefulDataLoader`` over a ``DistributedSampler``
  with the Trainer's collator) go to ``leto.wrap``, which retains their state;
* each item of ``session.batches(max_steps)`` is one step's micro-batches, each
  collated as the Trainer collates one; ``training_step`` runs each, the last outside
  ``session.no_sync()`` (the all-reduce), then ``session.clip_grad_norm_``,
  ``optimizer.step()`` (leto's transaction) and ``lr_scheduler.step()``;
* the step's end (callbacks' ``on_step_end``, logging, evaluation, saving) runs only
  ``if session.committed``: an iteration a recovery made void counts for nothing. The
  global step is leto's committed step, so a rank started anew (a promoted shadow)
  counts, logs and saves as the rank it replaced. Evaluation leaves every RNG as it
  found it (the loop's tail must change no state leto does not replay).

Token counts: each rank's loss is the mean over its own label tokens (the Trainer's
count of one step's micro-batches on this rank), and leto averages the ranks'
gradients: the Trainer's DDP run with ``average_tokens_across_devices=False``. With
batches of equal token counts (fixed-length sequences, no padding) that is the mean
over every rank's tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import sys
import time
from collections.abc import Iterator, Mapping
from functools import cached_property
from typing import Any

import numpy
import torch
import torch.distributed as dist
import transformers
from torch.utils.data import DistributedSampler

from leto.backends.gloo.runtime import GlooSession
from leto.errors import ConfigError

from .api import wrap

try:  # resumable: leto retains its position (a plain DataLoader is re-read and skipped)
    from torchdata.stateful_dataloader import (  # type: ignore[import-untyped]
        StatefulDataLoader as _DataLoader,
    )
except ImportError:  # pragma: no cover
    from torch.utils.data import DataLoader as _DataLoader

__all__ = ["Trainer", "TrainingArguments"]

# what a launcher sets that makes Accelerate form a process group of its own
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# the parts of transformers' Trainer this loop is built from (transformers 5)
_NEEDS = ("_finalize_training", "_maybe_log_save_evaluate", "_get_num_items_in_batch")
_missing = [n for n in _NEEDS if not hasattr(transformers.Trainer, n)]
if _missing:
    raise ImportError(
        f"leto.hf needs transformers >= 5 (found {transformers.__version__}: its Trainer "
        f"has no {', '.join(_missing)})"
    )


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """The launcher's rank variables hidden from Accelerate, only while this runs."""
    saved = {k: os.environ.pop(k) for k in _LAUNCHER_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """torch's, Python's and NumPy's global RNGs as they were before (an evaluation
    creates a DataLoader iterator, which draws its seed from torch's)."""
    py, np_ = random.getstate(), numpy.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py)
            numpy.random.set_state(np_)


@dataclasses.dataclass
class TrainingArguments(transformers.TrainingArguments):
    """``transformers.TrainingArguments`` for a :class:`Trainer` under ``leto launch``:
    each rank is one process to Accelerate (no process group, no DDP: leto reduces the
    gradients), rank 0 alone logs and saves (``save_on_each_node``: each node's local
    rank 0), and checkpoints hold the model only (``save_only_model``): leto retains the
    optimizer, scheduler, RNG and data position, and resumes from its own checkpoint."""

    save_only_model: bool = dataclasses.field(
        default=True,
        metadata={"help": "leto: a checkpoint holds the model only (leto retains the rest)"},
    )

    @cached_property
    def _setup_devices(self) -> torch.device:
        with _one_process():
            return transformers.TrainingArguments._setup_devices.func(self)  # type: ignore[attr-defined,no-any-return]

    @property
    def should_save(self) -> bool:
        if self.save_on_each_node:
            return int(os.environ.get("LOCAL_RANK", "0")) == 0
        return _rank() == 0

    @property
    def should_log(self) -> bool:
        if self.log_on_each_node:
            return int(os.environ.get("LOCAL_RANK", "0")) == 0
        return _rank() == 0


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` whose training loop is leto's (module docstring).

    ``leto_config``: leto's config (a path, a dict, a :class:`leto.Config`; None: the
    environment's, as ``leto.wrap``). ``session``: the leto session once ``train()``
    has wrapped the model (``session.stats``, ``session.step``).
    """

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        *rest: Any,
        leto_config: Any = None,
        **kwargs: Any,
    ) -> None:
        a = TrainingArguments() if args is None else args  # not transformers' default
        state = a.distributed_state
        if state is not None and state.num_processes != 1:
            raise ValueError(
                "leto.hf.Trainer: Accelerate runs a process group of its own "
                f"({state.num_processes} processes): build the arguments with "
                "leto.hf.TrainingArguments (leto reduces the gradients itself)"
            )
        refused = {
            "save_only_model=False": not a.save_only_model,
            "fp16 (a GradScaler leto would have to retain)": a.fp16,
            "deepspeed": bool(a.deepspeed),
            "fsdp (leto shards itself: shard = true in its config)": bool(a.fsdp),
            "auto_find_batch_size": a.auto_find_batch_size,
            "lr_scheduler_type reduce_lr_on_plateau (a metric scheduler stepped after "
            "the step: docs/loop.md)": str(a.lr_scheduler_type).endswith("reduce_lr_on_plateau"),
        }
        bad = [k for k, v in refused.items() if v]
        if bad:
            raise ValueError(f"leto.hf.Trainer does not support {', '.join(bad)}")
        super().__init__(model, a, *rest, **kwargs)
        self.leto_config = leto_config
        self.session: GlooSession | None = None

    def is_world_process_zero(self) -> bool:
        return _rank() == 0

    def is_local_process_zero(self) -> bool:
        return int(os.environ.get("LOCAL_RANK", "0")) == 0

    # ------------------------------------------------------------ train()

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        if resume_from_checkpoint:
            raise ValueError(
                "leto.hf.Trainer.train(resume_from_checkpoint=...): leto resumes from its own "
                "checkpoint (checkpoint_dir in its config; `leto launch --resume DIR`)"
            )
        if trial is not None:
            raise ValueError("leto.hf.Trainer: hyper-parameter search is not supported")
        return super().train(ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """The Trainer's evaluation, leaving every RNG as it was (it may run in the
        loop's tail, after ``optimizer.step()``, where nothing may change state)."""
        with _rng_kept():
            return super().evaluate(*args, **kwargs)

    def _leto_loader(self) -> Any:
        """This rank's batches: one item a step, a list of its micro-batches."""
        ds = self.train_dataset
        if ds is None or not hasattr(ds, "__len__"):
            raise ValueError(
                "leto.hf.Trainer: train_dataset must be a map-style dataset (with __len__): "
                "leto splits it over the ranks with a DistributedSampler"
            )
        collator = self.data_collator
        datasets = sys.modules.get("datasets")  # a `datasets.Dataset` has imported it
        if datasets is not None and isinstance(ds, datasets.Dataset):
            ds = self._remove_unused_columns(ds, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, "training")
        a = self.args
        b = a.per_device_train_batch_size
        world = int(os.environ.get("WORLD_SIZE", "1"))
        seed = a.data_seed if a.data_seed is not None else a.seed
        sampler: DistributedSampler[Any] = DistributedSampler(
            ds, world, _rank(), shuffle=True, seed=seed
        )

        def collate(samples: list[Any]) -> list[Any]:
            return [collator(samples[i : i + b]) for i in range(0, len(samples), b)]

        return _DataLoader(
            ds,
            batch_size=b * a.gradient_accumulation_steps,
            sampler=sampler,
            collate_fn=collate,
            drop_last=a.dataloader_drop_last,
            num_workers=a.dataloader_num_workers,
        )

    def _inner_training_loop(
        self,
        batch_size: int | None = None,
        args: Any = None,
        resume_from_checkpoint: str | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        a = self.args
        loader = self._leto_loader()
        per_epoch = len(loader)
        if a.max_steps > 0:
            max_steps = a.max_steps
        else:
            max_steps = math.ceil(a.num_train_epochs * per_epoch)
        epochs = math.ceil(max_steps / per_epoch)
        self.create_optimizer_and_scheduler(num_training_steps=max_steps)
        model = self.accelerator.prepare_model(self.model)  # one process: no DDP
        self.model_wrapped = model
        assert self.model is not None and self.optimizer is not None
        sched = self.lr_scheduler
        assert sched is not None
        s = wrap(self.model, self.optimizer, sched, loader, config=self.leto_config)
        if not isinstance(s, GlooSession):
            raise ConfigError(
                "backend",
                'leto.hf.Trainer runs one process per rank: backend = "gloo", under '
                "`leto launch` (the fake backend's ranks share one process)",
            )
        self.session = s

        stateful: list[Any] = [
            cb
            for cb in [*self.callback_handler.callbacks, self.control]
            if isinstance(cb, transformers.trainer_callback.ExportableState)
        ]
        self.state = transformers.TrainerState(stateful_callbacks=stateful)
        self.state.train_batch_size = a.per_device_train_batch_size
        self.state.compute_steps(a, max_steps)  # type: ignore[no-untyped-call]
        self.state.init_training_references(self, max_steps, epochs, trial)  # type: ignore[no-untyped-call]
        self.state.global_step = s.step  # a rank started anew: the committed step
        self.state.epoch = s.step / per_epoch
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = loader

        start = time.time()
        self._initial_num_input_tokens_seen = self.state.num_input_tokens_seen
        self._initial_global_step = s.step
        self._tr_loss = torch.tensor(0.0, device=a.device)
        self._total_loss_scalar = 0.0
        self._globalstep_last_logged = s.step
        model.zero_grad()
        self.control = self.callback_handler.on_train_begin(a, self.state, self.control)
        self.control = self.callback_handler.on_epoch_begin(a, self.state, self.control)
        told_stop = False

        def step_end(grad_norm: Any, lr: float | None) -> None:
            """The Trainer's end of the committed step ``s.step``: callbacks, logging,
            evaluation, saving (state-neutral: the loop's tail, docs/loop.md)."""
            nonlocal told_stop
            self.state.global_step = s.step
            self.state.epoch = s.step / per_epoch
            epoch = (s.step - 1) // per_epoch
            self.control = self.callback_handler.on_step_end(a, self.state, self.control)
            self._maybe_log_save_evaluate(
                self._tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start, lr
            )
            if s.step % per_epoch == 0 or s.step == max_steps:
                self.control = self.callback_handler.on_epoch_end(a, self.state, self.control)
                self._maybe_log_save_evaluate(
                    self._tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start, lr
                )
                if s.step < max_steps:
                    self.control = self.callback_handler.on_epoch_begin(a, self.state, self.control)
            if self.control.should_training_stop and s.step < max_steps and not told_stop:
                told_stop = True  # every rank trains on to max_steps (a stop is not retained)
                transformers.utils.logging.get_logger(__name__).warning(
                    "leto.hf.Trainer: a callback asked to stop at step %d; under leto the "
                    "run trains to max_steps (%d)",
                    s.step,
                    max_steps,
                )

        # the last step whose end this process ran: a promoted shadow owes the step it
        # starts at (the rank it replaced may have died before its end), and a step
        # rolled forward while this rank was in a recovery is owed at the next batch
        ended = s.step - 1 if s.stats["recoveries"] and s.step > 0 else s.step
        for micro in s.batches(max_steps):
            if s.step > ended:
                ended = s.step
                step_end(None, None)
            self.state.global_step = s.step  # after a recovery: the step it resumed at
            self.control = self.callback_handler.on_step_begin(a, self.state, self.control)
            micro = [dict(m) if isinstance(m, Mapping) else m for m in micro]
            n_items = self._get_num_items_in_batch(micro, a.device)
            self.current_gradient_accumulation_steps = len(micro)
            loss = torch.tensor(0.0, device=a.device)
            flos = 0
            for i, inputs in enumerate(micro):
                last = i == len(micro) - 1
                with contextlib.nullcontext() if last else s.no_sync():
                    loss += self.training_step(model, inputs, n_items)
                flos += self.floating_point_ops(inputs)
                if not last:
                    self.control = self.callback_handler.on_substep_end(a, self.state, self.control)
            grad_norm = s.clip_grad_norm_(a.max_grad_norm) if a.max_grad_norm > 0 else None
            self.control = self.callback_handler.on_pre_optimizer_step(a, self.state, self.control)
            self.optimizer.step()  # leto's transaction
            self.control = self.callback_handler.on_optimizer_step(a, self.state, self.control)
            lr = self._get_learning_rate()
            sched.step()
            model.zero_grad()
            if not s.committed:  # a recovery made this iteration void: it counts for nothing
                continue
            self._tr_loss += loss
            self.current_flos += flos
            ended = s.step
            step_end(grad_norm, lr)
        if s.step > ended:
            step_end(None, None)
        self.state.global_step = s.step
        return self._finalize_training(trial, max_steps * self._leto_batch(), start)  # type: ignore[no-untyped-call]

    def _leto_batch(self) -> int:
        """Samples per step over every rank."""
        a = self.args
        world = dist.get_world_size() if dist.is_initialized() else 1
        return a.per_device_train_batch_size * a.gradient_accumulation_steps * world
