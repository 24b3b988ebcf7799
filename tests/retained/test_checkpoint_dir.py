"""The disk checkpoint is read back with dcp.load, which unpickles its metadata: a
checkpoint directory another user could have written is refused, never loaded; and a
checkpoint is loaded only once it is durable (published)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from leto.retained.checkpoint import CheckpointError, DCPCheckpointer


def _saved(tmp_path: Path) -> DCPCheckpointer:
    ck = DCPCheckpointer(tmp_path / "ckpt")
    ck.write(0, {"x": torch.arange(4.0)})
    ck.publish(0, {"step": 0})
    return ck


def test_a_checkpoint_is_written_private_and_read_back(tmp_path: Path) -> None:
    ck = _saved(tmp_path)
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o700
    state, meta = ck.read(0)
    assert meta == {"step": 0}
    assert torch.equal(state["x"], torch.arange(4.0))


def test_only_a_published_checkpoint_is_durable(tmp_path: Path) -> None:
    ck = _saved(tmp_path)
    ck.write(2, {"x": torch.ones(4)})  # a writer finished; not durable yet
    assert ck.latest() == 0
    with pytest.raises(CheckpointError, match="no complete checkpoint of step 2"):
        ck.read(2)
    ck.abort(2)
    assert not (tmp_path / "ckpt" / "step-2").exists()
    ck.write(3, {"x": torch.ones(4)})
    ck.publish(3, {"step": 3})
    assert ck.latest() == 3 and ck.durable_steps() == [3]  # the older one is removed


def test_a_checkpoint_others_can_write_is_refused_before_loading(tmp_path: Path) -> None:
    ck = _saved(tmp_path)
    step = tmp_path / "ckpt" / "step-0"
    os.chmod(step / ".metadata", 0o666)  # as if planted by another user
    with pytest.raises(CheckpointError, match="checkpoint"):
        ck.read(0)
    os.chmod(step / ".metadata", 0o600)
    os.chmod(tmp_path / "ckpt", 0o777)
    with pytest.raises(CheckpointError, match="checkpoint directory"):
        ck.read(0)


def test_a_checkpoint_pruned_while_it_is_listed_is_no_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank lists the checkpoints while another's publish removes an older one: its
    files vanish between the look and the read. That checkpoint is gone, not unreadable
    (a new user's trial: a rank failed its own save with "unreadable checkpoint
    metadata ... No such file"); a file that is there but corrupt still is an error."""
    from leto.retained.checkpoint import read_meta

    step = tmp_path / "step-0"
    step.mkdir()
    (step / ".metadata").write_bytes(b"")
    (step / "leto-rank0.json").write_text('{"step": 0, "world_size": 1, "checksums": [], "ps": {}}')
    real = Path.read_text

    def vanished(self: Path, *a: object, **k: object) -> str:
        if self.name == "leto-rank0.json":
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return real(self, *a, **k)  # type: ignore[arg-type]

    with monkeypatch.context() as m:
        m.setattr(Path, "read_text", vanished)
        assert read_meta(step) is None
    (step / "leto-rank0.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable checkpoint metadata"):
        read_meta(step)
