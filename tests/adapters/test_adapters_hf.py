"""leto.hf without a job: its TrainingArguments are one process to Accelerate under a
launcher's environment, and what the Trainer cannot keep leto's guarantees for is
refused before training (the kill test: tests/gloo/test_hf_trainer.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
transformers = pytest.importorskip("transformers")

LAUNCHED = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


def _args(tmp_path: Path, **kw: Any) -> Any:
    from leto.hf import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw)


def _trainer(tmp_path: Path, **kw: Any) -> Any:
    from leto.hf import Trainer

    return Trainer(model=_model(), args=_args(tmp_path, **kw))


def _model() -> Any:
    config = transformers.GPT2Config(
        vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def test_arguments_are_one_process_under_a_launcher(tmp_path: Path) -> None:
    """In a process of its own: a process group's rendezvous (at a port where nothing
    listens) would hang, not fail."""
    code = f"""
import os, torch.distributed as dist
from leto.hf import TrainingArguments
args = TrainingArguments(output_dir={str(tmp_path)!r}, use_cpu=True, report_to="none")
assert args.distributed_state.num_processes == 1 and args.world_size == 1
assert not dist.is_initialized()
assert not args.should_save and not args.should_log  # rank 1: rank 0 saves and logs
assert {{k: os.environ[k] for k in {LAUNCHED!r}}} == {LAUNCHED!r}  # put back
assert args.save_only_model  # leto retains the rest
print("ok")
"""
    env = {**os.environ, **LAUNCHED, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_plain_arguments_are_refused(tmp_path: Path) -> None:
    from leto.hf import Trainer

    class Spread:  # what a plain TrainingArguments holds once Accelerate formed a group
        num_processes = 2

    args = _args(tmp_path)
    args.distributed_state = Spread()
    with pytest.raises(ValueError, match="leto.hf.TrainingArguments"):
        Trainer(model=_model(), args=args)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"save_only_model": False}, "save_only_model=False"),
        ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "reduce_lr_on_plateau"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
    ],
)
def test_what_leto_cannot_keep_is_refused(tmp_path: Path, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _trainer(tmp_path, **kw)


def test_resume_from_an_hf_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="leto launch --resume"):
        _trainer(tmp_path).train(resume_from_checkpoint=str(tmp_path))


def test_import_leto_does_not_import_transformers() -> None:
    code = "import sys, leto; leto.wrap; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
