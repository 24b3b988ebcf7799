"""The memory provider contract: host memfd and CUDA IPC pass the same tests.

A keeper allocates, another process opens the handle it received over a socket
(JSON plus descriptors, :mod:`leto.backends.gloo.wire`), and the memory outlives that
process when it is SIGKILLed. The CUDA parameter skips with a reason without a GPU
(``tests/gpu/run_device.sh`` runs it on one). No fixture of ``conftest.py`` is used,
so the GPU script can run this file with ``--noconftest``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from leto.backends.gloo.memory_provider import (
    Handle,
    HostMemfdProvider,
    MemoryProvider,
    ProviderError,
    bytes_checksum,
)
from leto.backends.gloo.wire import Conn

ROOT = Path(__file__).resolve().parents[2]
NO_CUDA = "no CUDA here: the CUDA IPC provider needs a GPU (tests/gpu/run_device.sh runs it)"


def make_provider(kind: str) -> MemoryProvider:
    if kind == "memfd":
        return HostMemfdProvider(prefix="leto-test")
    from leto.backends.gloo.cuda_memory import CudaIpcProvider

    return CudaIpcProvider("cuda")


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


@pytest.fixture(
    params=[
        "memfd",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
        ),
    ]
)
def provider(request: pytest.FixtureRequest) -> Iterator[MemoryProvider]:
    before = shm_entries()
    yield make_provider(request.param)
    if request.param == "memfd":  # CUDA: torch's IPC counter files, see tests/gpu
        assert shm_entries() - before == set()


def pattern(n: int, a: int, b: int, device: torch.device) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * a + b) % 256).to(torch.uint8).to(device)


def test_allocation_is_zero_filled_sized_and_on_the_device(provider: MemoryProvider) -> None:
    h = provider.allocate("zeros", 4099)
    for t in (provider.view(h), provider.open(h)):
        assert t.dtype == torch.uint8 and t.shape == (4099,)
        assert t.device.type == provider.device.type
        assert int(t.count_nonzero()) == 0
    provider.release(h)


def test_a_write_through_one_mapping_is_seen_through_the_other(provider: MemoryProvider) -> None:
    h = provider.allocate("alias", 1 << 16)
    opened = provider.open(h)
    opened.copy_(pattern(1 << 16, 3, 1, provider.device))
    assert torch.equal(provider.view(h).cpu(), pattern(1 << 16, 3, 1, torch.device("cpu")))
    provider.view(h)[5] = 200
    assert int(opened[5]) == 200
    provider.release(h)


def test_digest_agrees_between_device_and_host(provider: MemoryProvider) -> None:
    h = provider.allocate("digest", 1001)  # a 1-byte tail: read as a zero-padded word
    g = torch.Generator().manual_seed(3)
    host = torch.randint(0, 256, (1001,), dtype=torch.uint8, generator=g)
    provider.open(h).copy_(host.to(provider.device))
    assert provider.digest(h) == bytes_checksum(host) == bytes_checksum(provider.view(h).cpu())
    provider.view(h)[1000] ^= 1  # a flipped bit in the tail changes it
    assert provider.digest(h) != bytes_checksum(host)
    provider.release(h)


def test_handle_crosses_the_wire_as_json(provider: MemoryProvider) -> None:
    h = provider.allocate("wire", 64)
    msg, fds = h.to_wire()
    again = Handle.from_wire(json.loads(json.dumps(msg)), fds)
    assert again == h
    assert len(fds) == (1 if h.kind == "memfd" else 0)
    provider.release(h)


def test_bad_requests_are_refused_in_one_line(provider: MemoryProvider) -> None:
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ProviderError, match="bad size"):
            provider.allocate("bad", bad)  # type: ignore[arg-type]
    h = provider.allocate("once", 8)
    with pytest.raises(ProviderError, match="already allocated"):
        provider.allocate("once", 8)
    provider.release(h)
    with pytest.raises(ProviderError, match="'once' was released"):
        provider.open(h)
    with pytest.raises(ProviderError, match="not held here"):
        provider.release(h)
    with pytest.raises(ProviderError, match="kind"):
        Handle.from_wire({"kind": "pickle", "name": "x", "nbytes": 8, "fields": {}}, [])
    with pytest.raises(ProviderError, match="malformed"):
        Handle.from_wire({"kind": h.kind, "name": "x", "nbytes": 8, "fields": {"a": [1]}}, [])


OPENER = textwrap.dedent(
    """
    import socket, sys, time
    import torch
    from leto.backends.gloo.memory_provider import Handle, HostMemfdProvider, bytes_checksum
    from leto.backends.gloo.wire import Conn

    kind, fd = sys.argv[1], int(sys.argv[2])
    conn = Conn(socket.socket(fileno=fd))
    msg, fds = conn.recv(timeout=120)
    h = Handle.from_wire(msg, fds)
    if kind == "memfd":
        p = HostMemfdProvider()
    else:
        from leto.backends.gloo.cuda_memory import CudaIpcProvider
        p = CudaIpcProvider("cuda")
    t = p.open(h)
    seen = bytes_checksum(t)
    n = t.numel()
    t.copy_(((torch.arange(n) * 7 + 5) % 256).to(torch.uint8).to(t.device))
    if t.is_cuda:
        torch.cuda.synchronize()
    conn.send({"seen": seen, "wrote": bytes_checksum(t), "device": str(t.device)})
    time.sleep(600)
    """
)


def test_memory_outlives_a_sigkilled_opener(provider: MemoryProvider) -> None:
    n = 3 << 20
    h = provider.allocate("outlives", n)
    provider.view(h).copy_(pattern(n, 3, 1, provider.device))
    if provider.device.type == "cuda":
        torch.cuda.synchronize()
    mine, theirs = socket.socketpair()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    kind = "memfd" if h.kind == "memfd" else "cuda"
    child = subprocess.Popen(
        [sys.executable, "-c", OPENER, kind, str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
        env=env,
    )
    theirs.close()
    try:
        conn = Conn(mine)
        conn.send(*h.to_wire())
        reply, _ = conn.recv(timeout=120)
        assert reply["seen"] == bytes_checksum(pattern(n, 3, 1, torch.device("cpu")))
        assert reply["device"].split(":")[0] == provider.device.type
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
        want = pattern(n, 7, 5, torch.device("cpu"))
        assert torch.equal(provider.view(h).cpu(), want)
        assert provider.digest(h) == reply["wrote"] == bytes_checksum(want)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        mine.close()
    provider.release(h)


# --- the CUDA handle's serialisation, checked without a GPU ------------------------------


class FakeCudaStorage:
    """What ``_share_cuda_`` returns, as torch.multiprocessing's reduce_tensor reads it."""

    share = (0, b"\x01\xfe" * 32, 4096, 512, b"/torch_7_123_0", 3, b"\x09" * 64, True)

    def _share_cuda_(self) -> tuple[object, ...]:
        return self.share


def test_cuda_handle_fields_reach_new_shared_cuda_as_torch_sent_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from leto.backends.gloo import cuda_memory

    fields = cuda_memory.cuda_ipc_fields(FakeCudaStorage())  # type: ignore[arg-type]
    h = Handle("cuda-ipc", "w", 4096, fields)
    msg, fds = h.to_wire()
    got = Handle.from_wire(json.loads(json.dumps(msg)), fds)
    seen: list[tuple[object, ...]] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.UntypedStorage, "_new_shared_cuda", classmethod(lambda cls, *a: seen.append(a))
    )
    cuda_memory.open_cuda_ipc(got.fields)
    assert seen == [FakeCudaStorage.share]  # same order, same bytes, same types
    no_event = dict(got.fields, event="")
    cuda_memory.open_cuda_ipc(no_event)
    assert seen[1][6] is None


def test_cuda_provider_and_handles_refused_without_what_they_need() -> None:
    from leto.backends.gloo import cuda_memory

    with pytest.raises(ProviderError, match="without device, handle"):
        cuda_memory.open_cuda_ipc({"offset": 0})
    with pytest.raises(ProviderError, match="not a memfd handle"):
        HostMemfdProvider().open(Handle("cuda-ipc", "x", 8, {}))
    why = "on a CUDA device, not cpu" if torch.cuda.is_available() else "no CUDA here"
    with pytest.raises(ProviderError, match=why):
        cuda_memory.CudaIpcProvider("cpu")


def test_cuda_provider_opens_a_foreign_handle_as_a_view_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the glue around _new_shared_cuda, with a host storage standing in for the GPU's
    from leto.backends.gloo import cuda_memory

    shared = torch.UntypedStorage(64)
    opened: list[dict[str, object]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_memory, "open_cuda_ipc", lambda f: opened.append(f) or shared)
    p = cuda_memory.CudaIpcProvider("cuda")
    assert p.device == torch.device("cuda", 0)
    fields = {"handle": "ab", "offset": 0, "pid": os.getpid() + 1}
    t = p.open(Handle("cuda-ipc", "w", 64, fields))
    t[3] = 77
    assert shared[3] == 77 and t.data_ptr() == shared.data_ptr()  # a view, no copy
    assert p.open(Handle("cuda-ipc", "w", 64, fields)) is t and len(opened) == 1
    with pytest.raises(ProviderError, match="has 64 bytes, 32 expected"):
        p.open(Handle("cuda-ipc", "v", 32, dict(fields, offset=64)))
    with pytest.raises(ProviderError, match="not held here any more"):
        p.open(Handle("cuda-ipc", "u", 64, dict(fields, pid=os.getpid())))
