"""On a GPU only: keeper-owned GPU memory in separate processes, ranks sharing one GPU
over gloo, and the device checksum on a large segment.

Skipped with a reason without CUDA; ``tests/gpu/run_device.sh`` runs this on a lent
GPU. Never yet run on one when written (``docs/gpu.md`` says what has been). No
conftest fixture is used (the script runs pytest with ``--noconftest``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from leto.backends.gloo.memory_provider import bytes_checksum

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA here: tests/gpu needs a GPU (bash tests/gpu/run_device.sh on one)",
    ),
]

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, *args: str, timeout: float = 180) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter; its last stdout line is a JSON object."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


KEEPER = textwrap.dedent(
    """
    import json, os, signal, socket, subprocess, sys
    import torch
    from leto.backends.gloo.cuda_memory import CudaIpcProvider
    from leto.backends.gloo.memory_provider import bytes_checksum
    from leto.backends.gloo.wire import Conn

    OPENER = '''
    import socket, sys, time
    import torch
    from leto.backends.gloo.cuda_memory import CudaIpcProvider
    from leto.backends.gloo.memory_provider import Handle
    from leto.backends.gloo.wire import Conn
    conn = Conn(socket.socket(fileno=int(sys.argv[1])))
    msg, fds = conn.recv(timeout=120)
    t = CudaIpcProvider("cuda").open(Handle.from_wire(msg, fds))
    t.add_(1)
    torch.cuda.synchronize()
    conn.send({"ptr": t.data_ptr()})
    time.sleep(600)
    '''
    p = CudaIpcProvider("cuda")
    n = 64 << 20
    h = p.allocate("kept", n)
    p.view(h).fill_(41)
    torch.cuda.synchronize()
    mine, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", OPENER, str(theirs.fileno())],
                             pass_fds=[theirs.fileno()])
    theirs.close()
    conn = Conn(mine)
    conn.send(*h.to_wire())
    conn.recv(timeout=120)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    v = p.view(h)
    result = {
        "killed": child.returncode,
        "all_42": bool((v == 42).all().item()),
        "digest": p.digest(h),
        "host_digest": bytes_checksum(v.cpu()),
    }
    p.release(h)
    print(json.dumps(result))
    """
)


def test_keeper_process_keeps_gpu_memory_a_sigkilled_opener_wrote() -> None:
    before = set(os.listdir("/dev/shm"))
    r = run_python(KEEPER)
    assert r["killed"] == -9
    assert r["all_42"] is True  # the opener's write, kept after its SIGKILL
    assert r["digest"] == r["host_digest"]
    # torch's IPC reference-counter files (docs/gpu.md): expected to fail until the
    # keeper uses the driver's VMM export instead
    assert set(os.listdir("/dev/shm")) - before == set()


RANK = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.distributed as dist
    from leto.retained.parity import TorchDistCollective
    rank, world, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    c = TorchDistCollective()
    g = torch.Generator().manual_seed(rank)
    truth = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g).cuda()
    parity = truth.clone()
    c.all_reduce_sum(parity)  # parity = sum of every rank's bytes, mod 256, on the GPU
    others = torch.zeros_like(truth)
    for r in range(world):
        x = truth.clone() if r == rank else torch.empty_like(truth)
        c.broadcast(x, r)
        if r != rank:
            others.add_(x)
    rebuilt = parity - others  # this rank's bytes, as if lost, from the others and parity
    torch.cuda.synchronize()
    print(json.dumps({"rank": rank, "device": str(parity.device),
                      "rebuilt": bool(torch.equal(rebuilt, truth))}))
    dist.destroy_process_group()
    """
)


def test_ranks_share_one_gpu_with_gloo_collectives_on_cuda_tensors(tmp_path: Path) -> None:
    world = 3
    init = f"file://{tmp_path / 'rdzv'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), str(world), init],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
    results = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert [r["rank"] for r in results] == list(range(world))
    assert all(r["device"].startswith("cuda") for r in results)
    assert all(r["rebuilt"] is True for r in results)


def test_device_checksum_of_a_large_segment_equals_the_host_one() -> None:
    from leto.backends.gloo.cuda_memory import CudaIpcProvider

    p = CudaIpcProvider("cuda")
    h = p.allocate("large", (512 << 20) + 3)
    v = p.view(h)
    g = torch.Generator(device=v.device).manual_seed(7)
    v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, device=v.device, generator=g))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    on_device = p.digest(h)
    t1 = time.perf_counter()
    on_host = bytes_checksum(v.cpu())
    t2 = time.perf_counter()
    print(f"checksum of {v.numel() >> 20} MiB: device {t1 - t0:.3f} s, host {t2 - t1:.3f} s")
    assert on_device == on_host
    v[12345] ^= 1
    assert p.digest(h) != on_host
    p.release(h)
