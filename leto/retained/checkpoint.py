"""Tier 3: the disk checkpoint behind both erasure tiers.

:class:`DCPCheckpointer` writes every rank's retained buffers (params and optimizer
state, flat) with ``torch.distributed.checkpoint`` and the small process state as a
JSON file beside them (``leto.json``), so nothing is unpickled from our own data
(DCP's own metadata file is its format). Loading fills the retained buffers in
place. :class:`MemoryCheckpointer` keeps the same in memory, for tests.

The protocol model fixes the checkpoint at step 0 (``Ckpt = 0`` in
``spec/PROTOCOL.md``): leto writes it when training starts.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from leto.private import InsecurePathError, check_tree, private_dir

__all__ = ["Checkpointer", "CheckpointError", "DCPCheckpointer", "MemoryCheckpointer"]


class CheckpointError(RuntimeError):
    """The checkpoint is missing, incomplete, or does not fit the retained state."""


class Checkpointer(Protocol):
    def save(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None: ...

    def load(self, step: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Fill ``tensors`` in place from the checkpoint of ``step``; its JSON metadata."""
        ...

    def describe(self) -> str: ...


class MemoryCheckpointer:
    """Checkpoints kept in this process (for tests)."""

    def __init__(self) -> None:
        self._saved: dict[int, tuple[dict[str, torch.Tensor], str]] = {}

    def save(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self._saved[step] = ({k: v.detach().clone() for k, v in tensors.items()}, json.dumps(meta))

    def load(self, step: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        if step not in self._saved:
            raise CheckpointError(f"no checkpoint of step {step} in memory")
        saved, meta = self._saved[step]
        for k, t in tensors.items():
            if k not in saved or saved[k].shape != t.shape:
                raise CheckpointError(
                    f"the checkpoint of step {step} has no tensor {k!r} of shape {tuple(t.shape)}"
                )
            t.copy_(saved[k])
        out: dict[str, Any] = json.loads(meta)
        return out

    def describe(self) -> str:
        return "memory"


class DCPCheckpointer:
    """``torch.distributed.checkpoint`` under ``directory/step-<n>/``, plus ``leto.json``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def _path(self, step: int) -> Path:
        return self.directory / f"step-{step}"

    def save(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        # read back with dcp.load, which unpickles its metadata: only a directory no
        # other user can write to (docs/security.md)
        private_dir(self.directory, "checkpoint directory")
        path = private_dir(self._path(step), "checkpoint")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            warnings.filterwarnings("ignore", message=".*existing checkpoint.*overwriting.*")
            dcp.save(  # type: ignore[attr-defined]
                {k: v.detach() for k, v in tensors.items()}, checkpoint_id=str(path)
            )
        tmp = path / "leto.json.tmp"
        tmp.write_text(json.dumps(meta))
        tmp.replace(path / "leto.json")  # last: the checkpoint is complete

    def load(self, step: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        path = self._path(step)
        meta_file = path / "leto.json"
        if not meta_file.is_file():
            raise CheckpointError(f"no complete checkpoint of step {step} in {path}")
        try:
            private_dir(self.directory, "checkpoint directory")
            check_tree(path, "checkpoint")  # before dcp.load unpickles anything in it
        except InsecurePathError as e:
            raise CheckpointError(str(e)) from None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            try:
                dcp.load(tensors, checkpoint_id=str(path))  # type: ignore[attr-defined]
            except Exception as e:  # noqa: BLE001 - DCP raises several types
                raise CheckpointError(f"cannot load the checkpoint in {path}: {e}") from e
        out: dict[str, Any] = json.loads(meta_file.read_text())
        return out

    def describe(self) -> str:
        return str(self.directory)
