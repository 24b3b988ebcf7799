"""A retained layout in keeper-provided memory, across real processes, on any device.

The test process plays the keeper: it allocates every segment a trainer asks for from
a memory provider and sends the handle over a socket (create-or-attach by name, as
:mod:`leto.backends.gloo.keeper` does for memfd segments). A trainer process retains
a model and Adam in that memory, trains, reports and is SIGKILLed; a shadow process
then attaches to the same handles (no copy: its parameters are views of the keeper's
memory), finds every chunk's checksum intact and the trainer's exact bytes, and
catches a bit the keeper flipped. ``memfd`` runs here; ``cuda`` runs the same on a GPU
(``tests/gpu/run_device.sh``) and skips with a reason elsewhere. No conftest fixture
is used (the GPU script runs this file with ``--noconftest``).
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from leto.backends.gloo.memory_provider import Handle, HostMemfdProvider, MemoryProvider
from leto.backends.gloo.wire import Conn

ROOT = Path(__file__).resolve().parents[2]
NO_CUDA = "no CUDA here: keeper-owned GPU memory needs a GPU (tests/gpu/run_device.sh runs it)"
STEPS = 6

COMMON = textwrap.dedent(
    """
    import hashlib, socket, sys, time
    import torch
    from torch import nn
    from leto.backends.gloo.memory_provider import Handle, HostMemfdProvider
    from leto.backends.gloo.wire import Conn
    from leto.retained import retain

    kind, fd = sys.argv[1], int(sys.argv[2])
    dev = torch.device("cuda" if kind == "cuda" else "cpu")
    conn = Conn(socket.socket(fileno=fd))
    if kind == "memfd":
        provider = HostMemfdProvider()
    else:
        from leto.backends.gloo.cuda_memory import CudaIpcProvider
        provider = CudaIpcProvider("cuda")
    opened = {}

    def alloc(name, nbytes):
        conn.send({"op": "alloc", "name": name, "nbytes": nbytes})
        msg, fds = conn.recv(timeout=120)
        opened[name] = provider.open(Handle.from_wire(msg, fds))
        return opened[name]

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4)).to(dev)

    def digest(m):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        h = hashlib.sha256()
        for p in m.parameters():
            h.update(p.detach().cpu().numpy().tobytes())
        return h.hexdigest()
    """
)

TRAINER = COMMON + textwrap.dedent(
    """
    m = model()
    opt = retain(m, torch.optim.Adam(m.parameters(), lr=1e-2), chunk_numel=512, alloc=alloc)
    g = torch.Generator().manual_seed(1)
    for _ in range(int(sys.argv[3])):
        x = torch.randn(16, 32, generator=g).to(dev)
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()
    conn.send({"op": "done", "params": digest(m), "bad": opt.layout.verify()})
    time.sleep(600)
    """
)

SHADOW = COMMON + textwrap.dedent(
    """
    m = model()
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()  # nothing of this process's own init may survive the attach
    opt = retain(
        m, torch.optim.Adam(m.parameters(), lr=1e-2), chunk_numel=512, alloc=alloc, attach=True
    )
    seg = opened["leto.param"]
    views = all(
        seg.data_ptr() <= p.data_ptr() < seg.data_ptr() + seg.numel() for p in m.parameters()
    )
    conn.send({"op": "attached", "params": digest(m), "bad": opt.layout.verify(), "views": views,
               "device": str(seg.device)})
    conn.recv(timeout=120)  # the keeper flipped a bit
    conn.send({"op": "checked", "bad": opt.layout.verify()})
    conn.recv(timeout=120)  # the keeper flipped it back
    conn.send({"op": "checked", "bad": opt.layout.verify()})
    """
)


class StubKeeper:
    """Create-or-attach by name over a provider (the keeper's ``alloc``)."""

    def __init__(self, provider: MemoryProvider) -> None:
        self.provider = provider
        self.handles: dict[str, Handle] = {}
        self.lock = threading.Lock()

    def handle(self, name: str, nbytes: int) -> tuple[dict[str, object], list[int]]:
        with self.lock:
            h = self.handles.get(name)
            if h is None:
                h = self.provider.allocate(name, nbytes)
                self.handles[name] = h
        if h.nbytes != nbytes:
            return {"why": f"{name} has {h.nbytes} bytes, {nbytes} asked"}, []
        return h.to_wire()

    def close(self) -> None:
        for h in self.handles.values():
            self.provider.release(h)


def start(script: str, kind: str, *args: str) -> tuple[subprocess.Popen[bytes], socket.socket]:
    mine, theirs = socket.socketpair()
    child = subprocess.Popen(
        [sys.executable, "-c", script, kind, str(theirs.fileno()), *args],
        pass_fds=[theirs.fileno()],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    theirs.close()
    return child, mine


class Talk:
    """The keeper's side of one child: its allocations served until it says ``op``."""

    def __init__(self, keeper: StubKeeper, sock: socket.socket) -> None:
        self.conn = Conn(sock)
        self.keeper = keeper

    def until(self, op: str) -> dict[str, object]:
        while True:
            msg, _ = self.conn.recv(timeout=300)
            if msg.get("op") == "alloc":
                self.conn.send(*self.keeper.handle(msg["name"], msg["nbytes"]))
                continue
            assert msg.get("op") == op, msg
            return msg


def sync(provider: MemoryProvider) -> None:
    """The keeper's writes are done before it tells another process to read them."""
    if provider.device.type == "cuda":
        torch.cuda.synchronize(provider.device)


def reference_digest(device: torch.device) -> str:
    from torch import nn

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4)).to(device)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(16, 32, generator=g).to(device)
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()
    h = hashlib.sha256()
    for p in m.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize(
    "kind",
    [
        "memfd",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
        ),
    ],
)
def test_shadow_attaches_to_what_a_sigkilled_trainer_left(kind: str) -> None:
    provider: MemoryProvider
    if kind == "memfd":
        provider = HostMemfdProvider(prefix="leto-test")
    else:
        from leto.backends.gloo.cuda_memory import CudaIpcProvider

        provider = CudaIpcProvider("cuda")
    keeper = StubKeeper(provider)
    children: list[subprocess.Popen[bytes]] = []
    try:
        trainer, sock = start(TRAINER, kind, str(STEPS))
        children.append(trainer)
        done = Talk(keeper, sock).until("done")
        assert done["bad"] == []
        assert done["params"] == reference_digest(provider.device)  # bitwise plain Adam
        trainer.send_signal(signal.SIGKILL)
        assert trainer.wait(timeout=30) == -signal.SIGKILL

        shadow, sock = start(SHADOW, kind)
        children.append(shadow)
        talk = Talk(keeper, sock)
        attached = talk.until("attached")
        assert attached["device"].split(":")[0] == provider.device.type  # type: ignore[union-attr]
        assert attached["views"] is True  # the shadow's parameters are the keeper's memory
        assert attached["bad"] == []
        assert attached["params"] == done["params"]

        seg = provider.view(keeper.handles["leto.param"])
        seg[100] ^= 4  # a flipped bit in the keeper's memory
        sync(provider)
        talk.conn.send({"op": "flipped"})
        caught = talk.until("checked")["bad"]
        assert isinstance(caught, list) and len(caught) == 1
        seg[100] ^= 4
        sync(provider)
        talk.conn.send({"op": "restored"})
        assert talk.until("checked")["bad"] == []
        assert shadow.wait(timeout=60) == 0
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait(timeout=30)
        keeper.close()
