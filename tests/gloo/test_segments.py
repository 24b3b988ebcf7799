"""Rung (a): memfd segments, fd passing, the keeper, fencing; no leak after SIGKILL."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from leto.backends.gloo import segments
from leto.backends.gloo.keeper import Keeper, spawn_keeper
from leto.backends.gloo.keeper_client import FencedError, KeeperClient, KeeperError
from leto.backends.gloo.procs import memfd_holders
from leto.backends.gloo.procs import processes_with as tagged_pids
from leto.backends.gloo.wire import MAX_FRAME, Conn, WireError
from leto.retained.layout import LayoutError, RetainedLayout

# --- wire ------------------------------------------------------------------------------


def test_wire_roundtrip_with_fds() -> None:
    a, b = socket.socketpair()
    ca, cb = Conn(a), Conn(b)
    fd = segments.create("t", 16)
    ca.send({"op": "x", "v": [1, 2.5, "s"]}, [fd])
    ca.send({"op": "y"})
    msg, fds = cb.recv(timeout=5)
    assert msg == {"op": "x", "v": [1, 2.5, "s"]} and len(fds) == 1
    assert os.fstat(fds[0]).st_size == 16
    os.close(fds[0])
    assert cb.recv(timeout=5) == ({"op": "y"}, [])
    os.close(fd)
    ca.close()
    with pytest.raises(WireError, match="closed"):
        cb.recv(timeout=5)
    cb.close()


@pytest.mark.parametrize(
    "raw, why",
    [
        (struct.pack("!I", 5) + b"nope!", "not a leto message"),
        (struct.pack("!I", 2) + b"[]", "not an object"),
        (struct.pack("!I", MAX_FRAME + 1), "max"),
    ],
)
def test_wire_refuses_garbage(raw: bytes, why: str) -> None:
    a, b = socket.socketpair()
    a.sendall(raw)
    with pytest.raises(WireError, match=why):
        Conn(b).recv(timeout=5)
    a.close()
    b.close()


def test_segment_is_anonymous_private_and_fixed_size() -> None:
    before = set(os.listdir("/dev/shm"))
    fd = segments.create("leto-test", 4096)
    assert os.fstat(fd).st_mode & 0o777 == 0o600
    assert set(os.listdir("/dev/shm")) == before  # nothing named anywhere
    with pytest.raises(OSError):
        os.ftruncate(fd, 1)  # sealed: a mapping can never be cut short
    t = segments.as_tensor(fd)
    t.fill_(9)
    os.close(fd)  # the mapping keeps the memory
    assert int(t.sum()) == 9 * 4096


# --- keeper ----------------------------------------------------------------------------


def test_keeper_state_machine_fences_and_admits() -> None:
    k = Keeper("unit", 0)
    k.admit(0, 100)
    assert k.may_write(0, 100) is None
    assert "not the trainer admitted" in (k.may_write(0, 101) or "")
    k.fence(1)
    assert "fenced" in (k.may_write(0, 100) or "")
    assert "not the trainer admitted" in (k.may_write(1, 100) or "")
    k.admit(1, 100)
    assert k.may_write(1, 100) is None
    with pytest.raises(ValueError):
        k.fence(0)
    fd, created = k.alloc("a", 8)
    assert created and k.alloc("a", 8) == (fd, False)
    with pytest.raises(ValueError, match="has 8 bytes"):
        k.alloc("a", 16)


def test_keeper_process_retains_state_across_trainers(tag: str) -> None:
    h = spawn_keeper(0, "job1", tag=tag)
    try:
        h.admit(0, os.getpid())
        model = torch.nn.Linear(4, 3)
        c = KeeperClient(h.socket_name, generation=0)
        lay = RetainedLayout.create(model, chunk_numel=8, alloc=c.alloc)
        want = lay.param_buffer.clone()
        c.close()
        del lay
        # a new "process" (connection) attaches to the same bytes on a meta skeleton
        with torch.device("meta"):
            skel = torch.nn.Linear(4, 3)
        c2 = KeeperClient(h.socket_name, generation=0)
        lay2 = RetainedLayout.attach(skel, alloc=c2.alloc)
        assert torch.equal(lay2.param_buffer, want)
        assert skel.weight.data_ptr() == lay2.param_view(0).data_ptr()  # a view, no copy
        assert set(h.listing()) >= {"leto.param", "leto.grad", "leto.header", "leto.super"}
        c2.close()
    finally:
        h.stop()


def test_an_attachment_maps_every_segment_after_one_round_trip(tag: str) -> None:
    h = spawn_keeper(0, "job1o", tag=tag)
    try:
        h.admit(0, os.getpid())
        c = KeeperClient(h.socket_name, generation=0)
        lay = RetainedLayout.create(torch.nn.Linear(4, 3), chunk_numel=8, alloc=c.alloc)
        want = lay.param_buffer.clone()
        c.close()
        c2 = KeeperClient(h.socket_name, generation=0)
        calls: list[object] = []
        real = c2._call

        def counted(msg: dict[str, object]) -> tuple[dict[str, object], list[int]]:
            calls.append(msg["op"])
            return real(msg)

        c2._call = counted  # type: ignore[method-assign]
        have = c2.open()
        assert have == h.listing() and calls == ["open"]
        with torch.device("meta"):
            skel = torch.nn.Linear(4, 3)
        lay2 = RetainedLayout.attach(skel, alloc=c2.alloc)
        assert torch.equal(lay2.param_buffer, want) and calls == ["open"]  # no more asked
        # a size the keeper does not have is asked for, and refused as before
        c2.open()
        with pytest.raises(KeeperError, match="has .* bytes"):
            c2.alloc("leto.param", have["leto.param"] + 8)
        assert calls[-1] == "alloc"
        left = [fd for fd, _ in c2._opened.values()]
        assert left
        c2.close_opened()  # the descriptors no alloc took
        for fd in left:
            with pytest.raises(OSError):
                os.fstat(fd)
        c2.close()
        shadow = KeeperClient(h.socket_name, generation=0, role="shadow")
        with pytest.raises(FencedError, match="shadow may not map"):
            shadow.open()
        shadow.close()
    finally:
        h.stop()


def test_fencing_refuses_old_generation_and_other_pids(tag: str) -> None:
    h = spawn_keeper(1, "job2", tag=tag)
    try:
        h.admit(0, os.getpid())
        c = KeeperClient(h.socket_name, generation=0)
        t = c.alloc("x", 64)
        c.check_writer()
        h.fence(1)
        with pytest.raises(FencedError, match="generation 0 is fenced"):
            c.alloc("x", 64)
        with pytest.raises(FencedError, match="fenced"):
            c.check_writer()  # the fence word a stale trainer checks before writing
        with pytest.raises(FencedError):
            KeeperClient(h.socket_name, generation=0, patience=0.1)
        with pytest.raises(FencedError, match="not the trainer admitted"):
            KeeperClient(h.socket_name, generation=1, patience=0.1)  # not admitted yet
        shadow = KeeperClient(h.socket_name, generation=1, role="shadow")
        with pytest.raises(FencedError, match="shadow"):
            shadow.alloc("x", 64)
        h.admit(1, os.getpid())
        c.readmit(1)
        t2 = c.alloc("x", 64)
        t2[0] = 5
        assert int(t[0]) == 5  # same memory
        c.check_writer()
        with pytest.raises(KeeperError, match="has 64 bytes"):
            c.alloc("x", 65)
        c.close()
        shadow.close()
    finally:
        h.stop()


def _gone(fragment: str, timeout: float = 5.0) -> bool:
    """No process holds a descriptor or mapping of the memfd any more: it is freed."""
    deadline = time.monotonic() + timeout
    while memfd_holders(fragment) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not memfd_holders(fragment)


def test_sigkill_of_the_keeper_frees_its_memory(tag: str) -> None:
    job = "job3-" + hashlib.sha1(tag.encode()).hexdigest()[:10]
    h = spawn_keeper(0, job, tag=tag)
    h.admit(0, os.getpid())
    c = KeeperClient(h.socket_name, generation=0)
    t = c.alloc("big", 8 << 20)
    t.fill_(1)
    assert set(memfd_holders(f"leto-{job}-r0-big")) == {h.pid, os.getpid()}
    del t
    c.close()
    assert memfd_holders(f"leto-{job}-r0-big") == [h.pid]  # the keeper alone holds it
    os.kill(h.pid, signal.SIGKILL)
    h.proc.wait()
    h.close()
    assert _gone(f"leto-{job}"), "the keeper's memory outlived it"


def test_sigkill_of_the_owner_takes_the_keeper_and_its_memory(tag: str) -> None:
    """The agent (here a stand-in process) is SIGKILLed: its keeper dies, memory is freed."""
    job = "job4-" + hashlib.sha1(tag.encode()).hexdigest()[:10]
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from leto.backends.gloo.keeper import spawn_keeper
        from leto.backends.gloo.keeper_client import KeeperClient
        h = spawn_keeper(0, {job!r}, tag={tag!r})
        h.admit(0, os.getpid())
        c = KeeperClient(h.socket_name, generation=0)
        c.alloc("big", 8 << 20).fill_(1)
        print(h.pid, flush=True)
        time.sleep(60)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", script, tag], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    keeper_pid = int(owner.stdout.readline())
    assert memfd_holders(f"leto-{job}-r0-big") == [keeper_pid]
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 5
    while keeper_pid in tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert keeper_pid not in tagged_pids(tag)
    assert _gone(f"leto-{job}"), "the memory outlived its owner"


def test_attach_to_an_empty_keeper_is_a_clear_error(tag: str) -> None:
    h = spawn_keeper(0, "job5", tag=tag)
    try:
        h.admit(0, os.getpid())
        c = KeeperClient(h.socket_name, generation=0)
        with pytest.raises(LayoutError, match="no complete retained layout"):
            RetainedLayout.attach(torch.nn.Linear(2, 2), alloc=c.alloc)
        c.close()
    finally:
        h.stop()


# --- hostile peers (issue 25) --------------------------------------------------------------


def test_fence_word_cannot_be_reopened_writable() -> None:
    """The trainer's read-only descriptor, reopened read-write through /proc: no write,
    no writable mapping; the keeper's own mapping still moves the fence."""
    import errno
    import mmap

    k = Keeper("unit-seal", 0)
    ro = k.readonly_fence_fd()
    rw = os.open(f"/proc/self/fd/{ro}", os.O_RDWR)
    try:
        with pytest.raises(PermissionError) as e:
            os.pwrite(rw, struct.pack("<q", 99), 0)
        assert e.value.errno == errno.EPERM
        with pytest.raises(PermissionError):
            mmap.mmap(rw, 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        seen = mmap.mmap(ro, 8, mmap.MAP_SHARED, mmap.PROT_READ)
        k.fence(7)
        assert struct.unpack_from("<q", seen)[0] == 7
        seen.close()
    finally:
        os.close(rw)
        os.close(ro)


def _raw(name: str, payload: bytes) -> bytes:
    """Send ``payload`` to socket ``name``; what came back before the keeper closed it."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + name)
    s.sendall(payload)
    s.settimeout(5)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    s.close()
    return out


def test_keeper_survives_malformed_frames(tag: str) -> None:
    h = spawn_keeper(0, "job-hostile", tag=tag)
    try:
        nested = b"[" * 100_000 + b"]" * 100_000
        for payload in [
            struct.pack("!I", 0xFFFFFFF0),  # an oversized length prefix
            struct.pack("!I", len(nested)) + nested,  # RecursionError in json, once
            struct.pack("!I", 5) + b"nope!",
            b"GET / HTTP/1.0\r\n\r\n",
        ]:
            assert _raw(h.socket_name, payload) == b""  # closed, no reply
            assert h.alive()
        # a request that parses but makes no sense is refused, the connection kept
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\0" + h.socket_name)
        c = Conn(s)
        c.send({"op": "hello", "generation": 1e999, "role": "writer"})
        reply, _ = c.recv(timeout=5)
        assert reply["ok"] is False and reply["error"] == "bad_request"
        c.close()
        h.admit(0, os.getpid())
        k = KeeperClient(h.socket_name, generation=0, keeper_pid=h.pid)
        assert k.alloc("x", 8).numel() == 8
        k.close()
    finally:
        h.stop()


def test_keeper_client_checks_the_server(tag: str) -> None:
    h = spawn_keeper(0, "job-server", tag=tag)
    try:
        h.admit(0, os.getpid())
        with pytest.raises(KeeperError, match=f"not the expected pid {h.pid + 1}"):
            KeeperClient(h.socket_name, generation=0, keeper_pid=h.pid + 1)
    finally:
        h.stop()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another user")
def test_other_users_are_refused_on_both_sides(tag: str) -> None:
    """Another user's process connecting to a keeper is closed at once; a server of
    another user (one that bound a name a dead keeper left free) is refused."""
    h = spawn_keeper(0, "job-uid", tag=tag)
    try:
        probe = textwrap.dedent(
            f"""
            import os, socket, struct
            os.setgid(65534); os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\\0" + {h.socket_name!r})
            body = b'{{"op":"hello","generation":0,"role":"shadow"}}'
            s.settimeout(5)
            try:
                s.sendall(struct.pack("!I", len(body)) + body)
                print(len(s.recv(100)))
            except (BrokenPipeError, ConnectionResetError):
                print(0)  # closed before it could even send
            """
        )
        out = subprocess.run(
            [sys.executable, "-c", probe, tag], capture_output=True, text=True, timeout=30
        )
        assert out.stdout.strip() == "0", out.stderr  # closed without a reply
        server = textwrap.dedent(
            """
            import os, socket, sys, time
            os.setgid(65534); os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind("\\0leto-test-squatter-" + str(os.getppid())); s.listen()
            print("ready", flush=True)
            time.sleep(30)
            """
        )
        squatter = subprocess.Popen(
            [sys.executable, "-c", server, tag], stdout=subprocess.PIPE, text=True
        )
        try:
            assert squatter.stdout is not None and squatter.stdout.readline() == "ready\n"
            with pytest.raises(KeeperError, match="runs as uid 65534"):
                KeeperClient(f"leto-test-squatter-{os.getpid()}", generation=0)
        finally:
            squatter.kill()
            squatter.wait()
        assert h.alive()
    finally:
        h.stop()


def test_an_alloc_reply_with_other_than_one_descriptor_closes_them_all() -> None:
    c = object.__new__(KeeperClient)  # no keeper: the reply is given
    c._opened, c._handles, c.device = {}, {}, "cpu"
    r1, w1 = os.pipe()
    c._call = lambda msg: ({"ok": True}, [r1, w1])  # type: ignore[method-assign]
    with pytest.raises(KeeperError, match="sent 2 descriptors for 'x'"):
        c.alloc("x", 64)
    for fd in (r1, w1):
        with pytest.raises(OSError):
            os.fstat(fd)  # closed: none leaks
