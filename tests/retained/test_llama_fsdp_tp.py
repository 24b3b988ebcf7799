"""The torchtitan-shaped Llama of ``examples/llama_fsdp_tp.py`` on FSDP2 + TP (a 2 x 2
``("dp", "tp")`` mesh, 4 processes over gloo): retained by leto it trains bitwise as
without leto (fp32 and bf16 mixed precision), its DCP checkpoint has torch's keys and
bytes, and it resumes on 4 x 1 and 1 x 4 meshes and on 2 processes (2 x 1, 1 x 2) bitwise as plain FSDP2 resuming from the
same checkpoint; the example's command prints the same losses and state with and
without leto."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from dtensor_cases import spawn_ranks
from llama_cases import (
    bitwise_worker,
    cut_worker,
    first_worker,
    resume_worker,
    save_worker,
    two_ranks_worker,
)

ROOT = Path(__file__).resolve().parents[2]


def _all_true(res: dict[int, dict[str, Any]], world: int = 4) -> None:
    assert sorted(res) == list(range(world))
    for rank, out in sorted(res.items()):
        assert "error" not in out, f"rank {rank}: {out['error']}"
        for case, checks in out.items():
            assert checks and all(checks.values()), f"rank {rank} {case}: {checks}"


@pytest.mark.slow
def test_retained_llama_trains_bitwise_as_plain_fsdp2_tp_in_fp32_and_bf16() -> None:
    _all_true(spawn_ranks(bitwise_worker))


@pytest.mark.slow
def test_steps_cut_at_every_phase_and_at_random_phases_end_bitwise_as_plain() -> None:
    _all_true(spawn_ranks(cut_worker))


@pytest.mark.slow
def test_a_retained_checkpoint_has_torchs_fqn_keys_and_bytes(tmp_path: Path) -> None:
    _all_true(spawn_ranks(functools.partial(save_worker, root=str(tmp_path))))


@pytest.mark.slow
def test_a_2x2_checkpoint_resumes_retained_on_4x1_and_1x4_bitwise(tmp_path: Path) -> None:
    res = spawn_ranks(functools.partial(resume_worker, root=str(tmp_path)))
    _all_true(res)
    assert all(sorted(out) == ["1x4", "4x1"] for out in res.values())


@pytest.mark.slow
def test_a_checkpoint_of_4_processes_resumes_retained_on_2_bitwise(tmp_path: Path) -> None:
    _all_true(spawn_ranks(functools.partial(first_worker, root=str(tmp_path))))
    res = spawn_ranks(functools.partial(two_ranks_worker, root=str(tmp_path)), world=2)
    _all_true(res, world=2)
    assert all(sorted(out) == ["1x2", "2x1"] for out in res.values())


COMMAND = "torchrun --nproc-per-node 4 examples/llama_fsdp_tp.py --steps 3"


def run_example(*extra: str) -> list[str]:
    """The example's command, run as written (torchrun is torch's module here)."""
    args = COMMAND.split()[1:]
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args, *extra],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # this checkout's leto
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return re.findall(r"^(step \d+ loss .*|state digest \w+)", out.stdout, re.M)


@pytest.mark.slow
def test_the_example_command_prints_the_same_losses_and_state_with_and_without_leto() -> None:
    leto, plain = run_example(), run_example("--plain")
    assert len(leto) == 4 and leto[-1].startswith("state digest"), leto
    assert leto == plain
