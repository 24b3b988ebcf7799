"""On a GPU only: a real gloo job whose retained state lives in keeper GPU memory.

Two ranks share the one GPU (``device = "cuda"``; gloo collectives on CUDA tensors,
tier 1's reduces through host copies), each rank's keeper holding its segments as
CUDA IPC memory: killed at every phase of a step, and with a keeper's memory lost, the
job ends bitwise its failure-free run on the GPU; a flipped bit in GPU memory is caught
by the device checksum. ``tests/gloo/test_device_path.py`` runs the same path on a CPU.
Skipped with a reason without CUDA; no conftest fixture is used (``--noconftest``).
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gloo"))
from jobs import LOOP_POINTS, digests_equal, explain, job, kills  # noqa: E402

from leto.backends.gloo.harness import JobResult  # noqa: E402
from leto.backends.gloo.keeper import spawn_keeper  # noqa: E402
from leto.backends.gloo.keeper_client import KeeperClient  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA here: tests/gpu needs a GPU (bash tests/gpu/run_device.sh on one)",
    ),
]

GPU = {"DEVICE": "cuda", "TIER2": "0"}
STEPS = len(LOOP_POINTS) + 3


@functools.cache
def where() -> Path:
    return Path(tempfile.mkdtemp(prefix="leto-gpu-job-"))


@functools.cache
def ref() -> JobResult:
    """The failure-free job on the GPU (made once, by the first test that needs it)."""
    res = job(where() / "ref", steps=STEPS, env=GPU)
    assert res.ok and res.digests, explain(res)
    (done,) = res.of("training_done")
    assert {m["device"] for m in done["memory"].values()} == {"cuda:0"}, done["memory"]
    assert {m["checksum"] for m in done["memory"].values()} == {"fletcher"}
    return res


def test_a_keeper_process_holds_gpu_memory_a_sigkilled_trainer_wrote() -> None:
    h = spawn_keeper(0, f"gpuk{os.getpid()}")
    try:
        h.admit(0, os.getpid())
        c = KeeperClient(h.socket_name, generation=0, device="cuda")
        t = c.alloc("leto.param", 1 << 20)
        assert t.device.type == "cuda"
        t.fill_(5)
        torch.cuda.synchronize()
        digest = h.digests(["leto.param"])["leto.param"]
        c.close()
        c2 = KeeperClient(h.socket_name, generation=0, device="cuda")
        c2.open()
        assert int(c2.alloc("leto.param", 1 << 20).sum().item()) == 5 << 20
        assert h.digests(["leto.param"])["leto.param"] == digest
        c2.close()
    finally:
        h.stop()


def test_killed_at_every_phase_on_the_gpu_is_bitwise() -> None:
    faults = kills(LOOP_POINTS) + [
        {"kind": "lose_memory", "rank": 1, "step": STEPS - 1, "phase": "finish"}
    ]
    res = job(where() / "kills", steps=STEPS, faults=faults, env=GPU, timeout=240)
    assert res.ok, explain(res)
    assert len(res.recoveries) == len(faults)
    assert digests_equal(res, ref()), "not bitwise equal to the failure-free run on the GPU"


def test_a_flipped_bit_in_gpu_memory_is_caught() -> None:
    faults = [{"kind": "corrupt", "rank": 0, "step": 3, "phase": "forward", "chunk": 1}]
    res = job(where() / "flip", steps=STEPS, faults=faults, env=GPU)
    assert res.ok, explain(res)
    assert "fail their checksums at PREPARE of step 3" in res.of("failure")[0]["traceback"]
    assert digests_equal(res, ref()), "not bitwise equal to the failure-free run on the GPU"


def test_settings_a_gpu_refuses_name_the_setting() -> None:
    from leto.adapters.config import Config
    from leto.errors import ConfigError

    for data, field in [
        ({"backend": "fake", "device": "cuda"}, "device"),
        ({"backend": "gloo", "device": "cuda", "shard": True, "tier1_code": "parity"}, "shard"),
        ({"backend": "gloo", "device": "cuda", "checksum": "xxh3"}, "checksum"),
    ]:
        with pytest.raises(ConfigError) as e:
            Config.from_dict(data)
        assert e.value.field == field
