"""Tier 3: the disk checkpoints behind both erasure tiers, and where they are kept.

A checkpoint of step n is written by its writers (:meth:`CheckpointStore.write`, the
protocol's ``SaveCheckpoint``: each writer's DCP files; the protocol's ``WriteShard``
when a writer's part is done) and becomes durable only when every writer finished
(:meth:`CheckpointStore.publish`, ``PublishCheckpoint``: ``leto.json`` is written last).
Only a durable checkpoint is ever loaded, and a fallback loads the latest one
(``ckpt`` in ``spec/PROTOCOL.md``). What a checkpoint holds (the model's and optimizer's
own state dicts) is :mod:`leto.retained.dcp_state`'s business.
:class:`MemoryCheckpointer` keeps the same in memory, for tests.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from leto.private import InsecurePathError, check_tree, private_dir

__all__ = [
    "Checkpointer",
    "CheckpointError",
    "CheckpointStore",
    "DCPCheckpointer",
    "MemoryCheckpointer",
    "load_all",
    "read_meta",
]

META = "leto.json"


class CheckpointError(RuntimeError):
    """The checkpoint is missing, incomplete, or does not fit the model."""


class Checkpointer(Protocol):
    # what write returns is the implementation's own (DCP's: the future of an
    # asynchronous save, or None); the engine never reads it
    def write(self, step: int, state: dict[str, Any]) -> object: ...

    def publish(self, step: int, meta: dict[str, Any]) -> None: ...

    def abort(self, step: int) -> None: ...

    def read(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """The state and metadata of the durable checkpoint of ``step``."""
        ...

    def latest(self) -> int | None: ...

    def describe(self) -> str: ...


class MemoryCheckpointer:
    """Checkpoints kept in this process (for tests)."""

    def __init__(self) -> None:
        self._written: dict[int, dict[str, Any]] = {}
        self._durable: dict[int, tuple[dict[str, Any], str]] = {}

    def write(self, step: int, state: dict[str, Any]) -> None:
        self._written[step] = copy.deepcopy(state)

    def publish(self, step: int, meta: dict[str, Any]) -> None:
        self._durable = {step: (self._written.pop(step), json.dumps(meta))}

    def abort(self, step: int) -> None:
        self._written.pop(step, None)

    def read(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        if step not in self._durable:
            raise CheckpointError(f"no durable checkpoint of step {step} in memory")
        state, meta = self._durable[step]
        out: dict[str, Any] = json.loads(meta)
        return copy.deepcopy(state), out

    def latest(self) -> int | None:
        return max(self._durable, default=None)

    def describe(self) -> str:
        return "memory"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """DCP's warnings about running without a process group, and overwriting."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*torch.distributed is unavailable.*")
        warnings.filterwarnings("ignore", message=".*existing checkpoint.*overwriting.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
        yield


def load_all(path: Path) -> dict[str, Any]:
    """Everything in the DCP checkpoint at ``path``, nested as it was saved."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    if not (path / ".metadata").is_file():
        raise CheckpointError(
            f"{path} is not a torch.distributed.checkpoint directory (no .metadata)"
        )
    try:
        check_tree(path, "checkpoint")  # before DCP unpickles anything in it
    except InsecurePathError as e:
        raise CheckpointError(str(e)) from None
    try:
        with quiet():
            out: dict[str, Any] = _load_state_dict_from_keys(checkpoint_id=str(path))
    except Exception as e:  # noqa: BLE001 - DCP raises several types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read the checkpoint in {path}: {first}") from None
    return out


class CheckpointStore:
    """Checkpoints under ``directory/step-<n>/``; the complete ones are durable."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step}"

    def describe(self) -> str:
        return str(self.directory)

    def write(
        self,
        step: int,
        state: dict[str, Any],
        *,
        process_group: Any = None,
        asynchronous: bool = False,
        no_dist: bool = True,
    ) -> Future[Any] | None:
        """This writer's part of the checkpoint of ``step`` (DCP files and, from the
        coordinating rank, ``.metadata``). ``asynchronous``: ``dcp.async_save`` (state
        must be staged already); its future completes when the files are written."""
        import torch.distributed.checkpoint as dcp

        # read back with dcp.load, which unpickles: only a directory no other user can
        # write to (docs/security.md)
        private_dir(self.directory, "checkpoint directory")
        path = str(private_dir(self.path(step), "checkpoint"))
        with quiet():
            if asynchronous:
                fut: Future[Any] = dcp.async_save(  # type: ignore[assignment,attr-defined]
                    state, checkpoint_id=path, process_group=process_group
                )
                return fut
            if no_dist:
                dcp.save(state, checkpoint_id=path, no_dist=True)  # type: ignore[attr-defined]
            else:
                dcp.save(state, checkpoint_id=path, process_group=process_group)  # type: ignore[attr-defined]
        return None

    def write_rank_meta(self, step: int, rank: int, meta: dict[str, Any]) -> None:
        """Writer ``rank``'s process state and checksums beside its DCP files (synced):
        with every rank's and DCP's ``.metadata``, the checkpoint is complete."""
        _write_json(self.path(step) / f"leto-rank{rank}.json", meta)

    def publish(self, step: int, meta: dict[str, Any], *, keep: int = 1) -> None:
        """Every writer finished (in one process): ``leto.json`` last (the checkpoint is
        durable), then all but the ``keep`` newest durable checkpoints are removed."""
        path = self.path(step)
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"cannot publish {path}: its DCP metadata is missing")
        _write_json(path / META, meta)
        steps = self.durable_steps()
        if len(steps) > keep:
            self.prune(steps[-keep])

    def prune(self, keep_from: int | None, *, newer: bool = False) -> None:
        """Remove the checkpoints before ``keep_from`` (complete or not) and, ``newer``,
        those after it (a fresh job: a former run's)."""
        if keep_from is None or not self.directory.is_dir():
            return
        for d in self.directory.iterdir():
            n = d.name.removeprefix("step-")
            if d.name.startswith("step-") and n.isdigit():
                if int(n) < keep_from or (newer and int(n) > keep_from):
                    shutil.rmtree(d, ignore_errors=True)

    def abort(self, step: int) -> None:
        """A checkpoint that never became durable: its partial files are removed."""
        path = self.path(step)
        if path.is_dir() and read_meta(path) is None:
            shutil.rmtree(path, ignore_errors=True)

    def durable_steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        out = []
        for d in self.directory.iterdir():
            n = d.name.removeprefix("step-")
            if d.name.startswith("step-") and n.isdigit() and read_meta(d) is not None:
                out.append(int(n))
        return sorted(out)

    def latest(self) -> int | None:
        steps = self.durable_steps()
        return steps[-1] if steps else None

    def read(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        path, meta = self.durable(step)
        return load_all(path), meta

    def durable(self, step: int) -> tuple[Path, dict[str, Any]]:
        """The durable checkpoint of ``step``: its directory (in a private checkpoint
        directory) and metadata, not loaded (a sharded one is, each rank its shard)."""
        path = self.path(step)
        meta = read_meta(path)
        if meta is None:
            raise CheckpointError(f"no complete checkpoint of step {step} in {path}")
        try:
            private_dir(self.directory, "checkpoint directory")
        except InsecurePathError as e:
            raise CheckpointError(str(e)) from None
        return path, meta


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(obj))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def read_meta(path: Path) -> dict[str, Any] | None:
    """A complete checkpoint's ``leto.json`` (one process wrote it), or its writers'
    ``leto-rank<r>.json`` combined (every rank of the world size they name, beside DCP's
    ``.metadata``); ``None`` while it is incomplete or not leto's."""
    if not (path / ".metadata").is_file():
        return None
    try:
        if (path / META).is_file():
            out: dict[str, Any] = json.loads((path / META).read_text())
            return out
        first = path / "leto-rank0.json"
        if not first.is_file():
            return None
        r0 = json.loads(first.read_text())
        ranks = [r0]
        for r in range(1, int(r0["world_size"])):
            f = path / f"leto-rank{r}.json"
            if not f.is_file():
                return None
            ranks.append(json.loads(f.read_text()))
        return {
            "step": r0["step"],
            "world_size": r0["world_size"],
            "chunk_numel": r0.get("chunk_numel"),
            "checksums": {str(r): m["checksums"] for r, m in enumerate(ranks)},
            "process_states": {str(r): m["ps"] for r, m in enumerate(ranks)},
        }
    except FileNotFoundError:
        # removed while read: another rank's publish pruned this older checkpoint (a
        # new user's trial saw a rank fail its own save listing the checkpoints then)
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({e})") from None


DCPCheckpointer = CheckpointStore
