"""The keeper's segments by device: a handle in every reply, host memory as memfd, GPU
memory through the CUDA provider (refused in one line where there is no CUDA), and a
segment never handed out on another device than it was made on."""

from __future__ import annotations

import os

import pytest
import torch

from leto.backends.gloo.keeper import Keeper, spawn_keeper
from leto.backends.gloo.keeper_client import KeeperClient, KeeperError
from leto.backends.gloo.memory_provider import Handle

NO_CUDA = not torch.cuda.is_available()


def test_a_host_segment_comes_with_its_memfd_handle() -> None:
    k = Keeper("kdev", 0)
    wire, created = k.alloc("leto.param", 64)
    assert created and wire == {"kind": "memfd", "name": "leto.param", "nbytes": 64, "fields": {}}
    handle = Handle.from_wire(wire, [k.segments["leto.param"][0]])  # what a trainer rebuilds
    assert (handle.kind, handle.nbytes) == ("memfd", 64)
    assert k.alloc("leto.param", 64) == (wire, False)
    assert k.device_of("leto.param") == "cpu" and k.handles == {}


def test_a_segment_is_not_handed_out_on_another_device_or_a_bad_one() -> None:
    k = Keeper("kdev2", 0)
    k.alloc("leto.param", 64)
    with pytest.raises(ValueError, match="'leto.param' is in cpu memory, cuda requested"):
        k.alloc("leto.param", 64, "cuda")
    with pytest.raises(ValueError, match="bad device 'tpu' for segment 'leto.grad'"):
        k.alloc("leto.grad", 64, "tpu")
    assert list(k.segments) == ["leto.param"]  # nothing made by a refusal


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal on a machine without CUDA")
def test_gpu_memory_is_refused_in_one_line_without_cuda(tag: str) -> None:
    h = spawn_keeper(0, "kdev3", tag=tag)
    try:
        h.admit(0, os.getpid())
        c = KeeperClient(h.socket_name, generation=0, device="cuda")
        flags = c.alloc("gloo.status", 8, "cpu")  # flags stay in host memory
        assert flags.device.type == "cpu" and flags.numel() == 8
        with pytest.raises(KeeperError, match="keeper refused alloc: no CUDA here") as e:
            c.alloc("leto.param", 64)
        assert "\n" not in str(e.value)
        assert h.listing() == {"gloo.status": 8}  # the keeper carried on, nothing made
        c.close()
    finally:
        h.stop()


def test_an_attachment_gets_every_segment_by_its_handle(tag: str) -> None:
    h = spawn_keeper(0, "kdev4", tag=tag)
    try:
        h.admit(0, os.getpid())
        c = KeeperClient(h.socket_name, generation=0)
        c.alloc("a", 16).fill_(7)
        c.alloc("b", 32).fill_(9)
        c.close()
        c2 = KeeperClient(h.socket_name, generation=0)
        assert c2.open() == {"a": 16, "b": 32}
        assert c2._handles == {}  # host segments: descriptors, no GPU handle
        assert c2.alloc("a", 16).tolist() == [7] * 16 and c2.alloc("b", 32).tolist() == [9] * 32
        c2.close()
    finally:
        h.stop()
