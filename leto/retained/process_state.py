"""Reusable process state as JSON: RNG states, the data sampler's position, the scheduler,
the model's buffers.

A resumed rank must continue *bitwise* as the run that never failed, so besides the
retained tensors it needs the small state a training process carries: the RNG
streams (torch's CPU generator, Python's ``random``, NumPy's global generator when
NumPy is loaded), the position of the data sampler, the LR scheduler's state and
the model's persistent buffers (BatchNorm's running statistics, which a forward
changes: kept with the step, so a rolled-back step gets the committed step's).
All of it is encoded as JSON here (never pickle: it is read back by another process).

Data: :class:`ResumableBatchSampler` is a deterministic, resumable sampler of global
batches (a shuffled permutation per epoch from ``seed + epoch``); :class:`BatchCursor`
feeds one global batch per step to every rank (rank ``r`` of ``W`` gets
``batch[r::W]``, the split ``DistributedSampler`` uses) and records its position
after each step. Any sampler with JSON-able ``state_dict()``/``load_state_dict()``
works the same way; any other iterable is re-iterated and skipped ahead on resume,
which is right only if its iteration order is deterministic.
"""

from __future__ import annotations

import base64
import inspect
import json
import random
import struct
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler

__all__ = [
    "BatchCursor",
    "ProcessStateError",
    "ResumableBatchSampler",
    "capture_buffers",
    "capture_rng",
    "check_json",
    "flush_denormal_on",
    "from_json",
    "is_per_rank",
    "restore_buffers",
    "restore_rng",
    "scheduler_state",
    "shard",
    "step_scheduler",
    "takes_metric",
    "to_json",
]


class ProcessStateError(ValueError):
    """A piece of process state cannot be encoded as JSON (or decoded)."""


def check_json(value: Any, what: str) -> Any:
    """``value`` if it survives a JSON round trip unchanged in meaning, else a clear error."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise ProcessStateError(
            f"{what} is not JSON-serialisable ({e}); leto retains process state as JSON, "
            "never as pickle"
        ) from None
    return json.loads(text)


def to_json(value: Any, what: str) -> Any:
    """``value`` as JSON, tensors included (a tagged object: dtype, shape, base64 bytes).

    Stateful data loaders keep a generator's state as a uint8 tensor (torchdata's
    ``StatefulDataLoader`` does); everything else must be JSON already.
    """
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return {
            "__tensor__": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "b64": base64.b64encode(t.reshape(-1).view(torch.uint8).numpy().tobytes()).decode(),
        }
    if isinstance(value, dict):
        return {k: to_json(v, what) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v, what) for v in value]
    return check_json(value, what)


def from_json(value: Any) -> Any:
    """The inverse of :func:`to_json` (tagged tensors back to tensors)."""
    if isinstance(value, dict):
        if "__tensor__" in value:
            dtype = getattr(torch, str(value["__tensor__"]))
            raw = bytearray(base64.b64decode(value["b64"]))
            flat = (
                torch.frombuffer(raw, dtype=torch.uint8).clone()
                if raw
                else torch.empty(0, dtype=torch.uint8)
            )
            return flat.view(dtype).reshape(value["shape"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


# ----------------------------------------------------------------------------- RNG


def capture_rng() -> dict[str, Any]:
    """The process's RNG states as JSON: torch (CPU, and every CUDA device when CUDA is
    initialised), Python ``random``, NumPy if loaded."""
    t = torch.get_rng_state()
    version, internal, gauss = random.getstate()
    # the Mersenne Twister words (and the position) as little-endian uint32 bytes in
    # base64: a string is cheap to encode and parse, 625 numbers are not (two messages
    # carry this every step)
    out: dict[str, Any] = {
        "torch": base64.b64encode(t.numpy().tobytes()).decode(),
        "python": [version, _b64_words(internal), gauss],
    }
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        words = base64.b64encode(np.asarray(keys, dtype="<u4").tobytes()).decode()
        out["numpy"] = [kind, words, int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = [
            base64.b64encode(g.numpy().tobytes()).decode() for g in torch.cuda.get_rng_state_all()
        ]
    return out


def _b64_words(words: tuple[int, ...]) -> str:
    return base64.b64encode(struct.pack(f"<{len(words)}I", *words)).decode()


def _words(value: str | list[int]) -> tuple[int, ...]:
    """uint32 words from :func:`_b64_words` (or, as a process state written before it, a
    list of numbers)."""
    if isinstance(value, list):
        return tuple(int(x) for x in value)
    raw = base64.b64decode(value)
    return struct.unpack(f"<{len(raw) // 4}I", raw)


_SUBNORMAL = 1e-39  # below float32's smallest normal (1.18e-38)


def flush_denormal_on() -> bool:
    """Whether this thread flushes subnormal floats to zero (``torch.set_flush_denormal``).

    The mode is the thread's own (the CPU's control register: MXCSR on x86, FPCR on
    ARM); a thread starts with the mode of the thread that created it, and torch has no
    getter, so it is read by a computation: a subnormal float32 times 2 is zero only
    when flushed. The mode decides the bytes of a step's math where subnormals occur,
    so it is as much the process's state as its RNG."""
    x = torch.full((1,), _SUBNORMAL, dtype=torch.float32)
    return bool(float((x * 2.0).item()) == 0.0)


def restore_rng(state: dict[str, Any]) -> None:
    """Make ``state`` (from :func:`capture_rng`) the process's RNG states."""
    raw = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone())
    version, internal, gauss = state["python"]
    random.setstate((version, _words(internal), gauss))
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        keys = np.array(_words(keys), dtype=np.uint32)
        np.random.set_state((kind, keys, pos, has_gauss, cached))
    if "cuda" in state:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(state["cuda"]):
            raise ProcessStateError(
                f"the retained RNG state has {len(state['cuda'])} CUDA generator(s), this "
                f"process sees {torch.cuda.device_count() if torch.cuda.is_available() else 0}"
            )
        torch.cuda.set_rng_state_all(
            [
                torch.frombuffer(bytearray(base64.b64decode(g)), dtype=torch.uint8).clone()
                for g in state["cuda"]
            ]
        )


# ----------------------------------------------------------------------- scheduler


def scheduler_state(scheduler: Any) -> Any:
    """The scheduler's ``state_dict()`` as JSON (``None`` without a scheduler)."""
    if scheduler is None:
        return None
    return check_json(scheduler.state_dict(), f"the state of {type(scheduler).__name__}")


def takes_metric(scheduler: Any) -> bool:
    """Does ``scheduler.step`` need a metric (``ReduceLROnPlateau`` and its kind)?"""
    if scheduler is None:
        return False
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    try:
        sig = inspect.signature(scheduler.step)
    except (TypeError, ValueError):
        return False
    return any(
        p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in sig.parameters.values()
    )


def step_scheduler(scheduler: Any, metric: float | None = None) -> None:
    """``scheduler.step()`` (``scheduler.step(metric)`` for one that takes a metric, such
    as ``ReduceLROnPlateau``: the step's loss), without torch's warning that the
    (retained) optimizer's ``step()`` was not called: the chunked optimizer steps in
    its place."""
    if scheduler is None:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
        if takes_metric(scheduler):
            if metric is None:
                raise ProcessStateError(
                    f"{type(scheduler).__name__}.step needs a metric, and this step has none"
                )
            scheduler.step(metric)
        else:
            scheduler.step()


# ------------------------------------------------------------------ module buffers


def _persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers ``model.state_dict()`` holds (a non-persistent one, such as a causal
    mask, is rebuilt by the constructor and not state)."""
    out = []
    for name, buf in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in model.get_submodule(owner)._non_persistent_buffers_set:
            out.append((name, buf))
    return out


def capture_buffers(model: torch.nn.Module) -> dict[str, Any]:
    """The model's persistent buffers (BatchNorm's running statistics and batch count)
    as JSON: each its exact bytes (:func:`to_json`). Empty for a model without any."""
    return {name: to_json(buf, f"buffer {name!r}") for name, buf in _persistent_buffers(model)}


def restore_buffers(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Write :func:`capture_buffers`'s ``state`` back into the model's buffers, in place
    (checked first: the same names, shapes and dtypes, else one line naming the first
    that differs, nothing written)."""
    have = dict(_persistent_buffers(model))
    if set(have) != set(state):
        odd = sorted(set(have) ^ set(state))
        raise ProcessStateError(
            f"the retained buffers {sorted(state)} are not the model's {sorted(have)} "
            f"(first difference: {odd[0]!r})"
        )
    values = {name: from_json(v) for name, v in state.items()}
    for name, t in values.items():
        buf = have[name]
        if t.shape != buf.shape or t.dtype != buf.dtype:
            raise ProcessStateError(
                f"buffer {name!r}: retained {t.dtype} {tuple(t.shape)}, the model has "
                f"{buf.dtype} {tuple(buf.shape)}"
            )
    with torch.no_grad():
        for name, t in values.items():
            have[name].copy_(t)


# --------------------------------------------------------------------------- data


class ResumableBatchSampler:
    """Global batches of ``batch_size`` indices of ``range(num_items)``, resumable.

    Epoch ``e`` is a permutation drawn from a generator seeded with ``seed + e``
    (or the identity with ``shuffle=False``); the last incomplete batch is dropped.
    Iterating yields batches from the current position and advances it;
    ``state_dict()`` is ``{"epoch", "index"}`` (JSON).
    """

    def __init__(
        self, num_items: int, batch_size: int, *, seed: int = 0, shuffle: bool = True
    ) -> None:
        if num_items < batch_size or batch_size < 1:
            raise ValueError(f"batch_size must be in 1..num_items ({num_items}), got {batch_size}")
        self.num_items = num_items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0  # batches consumed in this epoch
        self._perm: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.num_items // self.batch_size

    def _order(self) -> torch.Tensor:
        if self._perm is None:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._perm = torch.randperm(self.num_items, generator=g)
            else:
                self._perm = torch.arange(self.num_items)
        return self._perm

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            if self.index >= len(self):
                self.epoch += 1
                self.index = 0
                self._perm = None
            a = self.index * self.batch_size
            batch = self._order()[a : a + self.batch_size].tolist()
            self.index += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self._perm = None


def shard(batch: Any, rank: int, world_size: int) -> Any:
    """Rank ``rank``'s part of a global batch, ``[rank::world_size]`` along the batch:
    a tensor, a list or tuple of indices, or a tuple/list/dict of those (each element
    or value split alike: ``(x, y)`` gives ``(x[r::W], y[r::W])``)."""
    if batch is None:
        return None
    if isinstance(batch, torch.Tensor):
        return batch[rank::world_size]
    if isinstance(batch, dict):
        return {k: shard(v, rank, world_size) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        if all(isinstance(x, int) and not isinstance(x, bool) for x in batch):
            return batch[rank::world_size]  # indices
        parts = [shard(x, rank, world_size) for x in batch]
        return type(batch)(parts) if isinstance(batch, list) else tuple(parts)
    if isinstance(batch, (str, bytes, int, float, bool)):
        return batch  # a scalar travels with every part
    raise TypeError(
        f"cannot shard a global batch of type {type(batch).__name__}: yield tensors, "
        "lists of indices, or tuples/lists/dicts of them"
    )


def is_per_rank(data: Any) -> bool:
    """Does ``data`` already yield this rank's batches (a loader over a
    ``DistributedSampler``), rather than global batches leto splits?"""
    for s in (
        getattr(data, "sampler", None),
        getattr(getattr(data, "batch_sampler", None), "sampler", None),
    ):
        if isinstance(s, DistributedSampler):
            return True
    return isinstance(data, DistributedSampler)


class BatchCursor:
    """One global batch per step from ``sampler``, shared by every rank, resumable.

    ``batch(step)`` returns the global batch of ``step`` (fetched once, when the
    first rank computes it); ``state_after(step)`` is the sampler position once it
    was drawn (JSON, part of each rank's process state); ``restore(state)`` puts
    the sampler back there (on resume).

    Epochs: the sampler is iterated again when it runs out, and every sampler under
    it with ``set_epoch`` (a ``DistributedSampler``, the loader's or its batch
    sampler's) is told the epoch first, 0, 1, 2, ..., as a torchrun loop calls
    ``sampler.set_epoch(epoch)``: each epoch is shuffled anew, and a resumed run
    shuffles as the run that never failed.
    """

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.stateful = (
            sampler is not None
            and hasattr(sampler, "state_dict")
            and hasattr(sampler, "load_state_dict")
        )
        self.consumed = 0  # steps drawn
        self.epoch = 0  # passes over the sampler begun before the current one
        self._it: Iterator[Any] | None = None
        self._cache: dict[int, Any] = {}
        self._after: dict[int, Any] = {}
        if sampler is not None and not self.stateful and not hasattr(sampler, "__iter__"):
            raise TypeError(f"sampler: {type(sampler).__name__} is not iterable")
        self._initial = self.state()

    def state(self) -> dict[str, Any]:
        inner = None
        if self.stateful:
            # torch's global RNG as it was: a StatefulDataLoader's state_dict() before its
            # first pass makes an iterator, which draws its base seed from it
            with torch.random.fork_rng(devices=[]):
                sd = self.sampler.state_dict()
            inner = to_json(sd, f"the state of {type(self.sampler).__name__}")
        return {"consumed": self.consumed, "sampler": inner, "epoch": self.epoch}

    @property
    def initial(self) -> dict[str, Any]:
        return self._initial

    def _next(self) -> Any:
        """The next batch; torch's global RNG left as it was: a ``DataLoader`` draws its
        base seed from it when an iterator starts, which a resumed run does at another
        step than the run that never failed (its own shuffling is in its state)."""
        if self.sampler is None:
            return None
        with torch.random.fork_rng(devices=[]):
            if self._it is None:
                self._set_epoch()
                self._it = iter(self.sampler)
            try:
                return next(self._it)
            except StopIteration:
                self.epoch += 1  # a new epoch
                self._set_epoch()
                self._it = iter(self.sampler)
                return next(self._it)

    def _set_epoch(self) -> None:
        """Every sampler under the loader that shuffles by epoch is told this one."""
        seen: list[Any] = []
        bs = getattr(self.sampler, "batch_sampler", None)
        for s in (
            self.sampler,
            getattr(self.sampler, "sampler", None),
            bs,
            getattr(bs, "sampler", None),
        ):
            if (
                s is not None
                and callable(getattr(s, "set_epoch", None))
                and all(s is not x for x in seen)
            ):
                seen.append(s)
                s.set_epoch(self.epoch)

    def batch(self, step: int) -> Any:
        if step in self._cache:
            return self._cache[step]
        if step != self.consumed + 1:
            raise RuntimeError(
                f"data: step {step} requested, the sampler is positioned after step {self.consumed}"
            )
        b = self._next()
        self.consumed = step
        self._cache = {step: b}
        self._after = {step: self.state()}
        return b

    def state_after(self, step: int) -> dict[str, Any]:
        if step not in self._after:
            raise RuntimeError(f"data: no position recorded after step {step}")
        out: dict[str, Any] = self._after[step]
        return out

    def restore(self, state: dict[str, Any]) -> None:
        self._cache.clear()
        self._after.clear()
        target = int(state["consumed"])
        if self.sampler is None:
            self.consumed = target
            return
        if self.stateful:
            with torch.random.fork_rng(devices=[]):
                self.sampler.load_state_dict(from_json(state["sampler"]))
            self._it = None
            self.consumed = target
            self.epoch = int(state.get("epoch", 0))  # absent in an older leto's state
            return
        # a plain iterable: start over and skip ahead (deterministic iterables only)
        self._it = None
        self.consumed = 0
        self.epoch = 0
        for _ in range(target):
            self._next()
        self.consumed = target
