"""The disk checkpoint is read back with dcp.load, which unpickles its metadata: a
checkpoint directory another user could have written is refused, never loaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from leto.retained.checkpoint import CheckpointError, DCPCheckpointer


def test_a_checkpoint_is_written_private_and_read_back(tmp_path: Path) -> None:
    ck = DCPCheckpointer(tmp_path / "ckpt")
    t = {"x": torch.arange(4.0)}
    ck.save(0, t, {"step": 0})
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o700
    out = {"x": torch.zeros(4)}
    assert ck.load(0, out) == {"step": 0}
    assert torch.equal(out["x"], t["x"])


def test_a_checkpoint_others_can_write_is_refused_before_loading(tmp_path: Path) -> None:
    ck = DCPCheckpointer(tmp_path / "ckpt")
    ck.save(0, {"x": torch.arange(4.0)}, {"step": 0})
    step = tmp_path / "ckpt" / "step-0"
    os.chmod(step / ".metadata", 0o666)  # as if planted by another user
    with pytest.raises(CheckpointError, match="checkpoint"):
        ck.load(0, {"x": torch.zeros(4)})
    os.chmod(step / ".metadata", 0o600)
    os.chmod(tmp_path / "ckpt", 0o777)
    with pytest.raises(CheckpointError, match="checkpoint directory"):
        ck.load(0, {"x": torch.zeros(4)})
