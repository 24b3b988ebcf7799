"""Hostile input (issue 25): what another program sends to a running job's ports and sockets.

One job (1 node x 2 ranks) trains while a thread of this test, the "attacker",
sends it each frame that used to end it: an unauthenticated hello and an HTTP
request to the coordinator's TCP port, an oversized length prefix and JSON
nested too deep (to the coordinator, a keeper and the agent), a process posing
as a trainer with a false pid, a keeper hello and a fence word reopened
read-write. Each must close its own connection only: the job carries on, sees no
failure, and ends bitwise equal to the same job left alone. The unit tests below
check the pieces (frames, proofs, private directories) on their own.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from jobs import TRAIN, digests_equal, explain
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # imported before the job

from leto.backends.gloo import auth
from leto.backends.gloo.harness import JobResult, run_local
from leto.backends.gloo.procs import free_port, parent_of, processes_with
from leto.backends.gloo.wire import MAX_DEPTH, Conn, WireError, too_deep
from leto.private import InsecurePathError, check_tree, private_dir

STEPS = 300  # 15-30 ms a step here: the attacks (about half a second) land mid-training
EXTRA = ["--quiet", "--hang-timeout", "3", "--heartbeat", "0.25"]


def _run(run_dir: Path, attack: Callable[[Path, int], None] | None = None) -> JobResult:
    port = free_port()
    env = {"TOPO": "1x2", "STEPS": str(STEPS)}
    thread = None
    if attack is not None:
        thread = threading.Thread(target=attack, args=(run_dir, port), daemon=True)
        thread.start()
    res = run_local(TRAIN, nnodes=1, nproc=2, run_dir=run_dir, env=env, extra=EXTRA, port=port)
    if thread is not None:
        thread.join(30)
    assert not res.leftovers, f"processes left running after the job: {res.leftovers}"
    return res


# --- the attacker ----------------------------------------------------------------------


def _frame(body: bytes) -> bytes:
    return struct.pack("!I", len(body)) + body


def _until_closed(sock: socket.socket, timeout: float = 5.0) -> tuple[bool, list[Any]]:
    """Read until the peer closes: (closed within ``timeout``, the frames it sent)."""
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    closed = False
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            closed = True
            break
        if not chunk:
            closed = True
            break
        data += chunk
    frames = []
    while len(data) >= 4:
        (n,) = struct.unpack_from("!I", data)
        frames.append(json.loads(data[4 : 4 + n]))
        data = data[4 + n :]
    sock.close()
    return closed, frames


def _tcp(host: str, port: int, payload: bytes) -> tuple[bool, list[Any]]:
    s = socket.create_connection((host, port), timeout=5)
    s.sendall(payload)
    return _until_closed(s)


def _unix(name: str, payload: bytes) -> tuple[bool, list[Any]]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + name)
    s.sendall(payload)
    return _until_closed(s)


def _abstract(fragment: str) -> str:
    """An abstract socket's name, as every user can list it (``/proc/net/unix``)."""
    with open("/proc/net/unix") as f:
        for line in f:
            name = line.split()[-1]
            if name.startswith("@") and fragment in name:
                return name[1:]
    raise LookupError(fragment)


def _listening_on(port: int) -> list[str]:
    """The local addresses of the sockets listening on TCP ``port`` (hex, /proc/net)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    out.append(local.rsplit(":", 1)[0])
    return out


def _wait_for(run_dir: Path, event: str, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    path = run_dir / "events.jsonl"
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                if rec["event"] == event:
                    return dict(rec)
        time.sleep(0.02)
    raise TimeoutError(f"no {event} in {path}")


SEEN: dict[str, Any] = {}


def _attack(run_dir: Path, port: int) -> None:
    """Everything at once, while the job trains; what came back goes into SEEN."""
    try:
        _wait_for(run_dir, "training_started")
        SEEN["started_at"] = time.time()
        _attack_all(run_dir, port)
        SEEN["finished_at"] = time.time()
        SEEN["seconds"] = SEEN["finished_at"] - SEEN["started_at"]
    except BaseException as e:  # noqa: BLE001 - reported by the tests
        SEEN["error"] = f"{type(e).__name__}: {e}"


def _attack_all(run_dir: Path, port: int) -> None:
    store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
    info = json.loads(store.get("leto/job"))
    job = info["job"]
    host, cport = info["coordinator"].rsplit(":", 1)
    SEEN["store_listens_on"] = _listening_on(port)
    SEEN["coordinator_listens_on"] = _listening_on(int(cport))

    # the coordinator's TCP port (from the issue: each of these made node 0's agent exit 1)
    c = int(cport)
    SEEN["tcp_hello"] = _tcp(host, c, _frame(b'{"t":"node_hello","node":"x"}'))
    SEEN["tcp_http"] = _tcp(host, c, b"GET / HTTP/1.0\r\n\r\n")
    SEEN["tcp_length"] = _tcp(host, c, struct.pack("!I", 0xFFFFFFFF) + b"x" * 100)
    SEEN["tcp_nested"] = _tcp(host, c, _frame(b"[" * 2000 + b"]" * 2000))
    forged = {"t": "node_hello", "node": 1, "nonce": "00", "proof": "ab" * 32}
    SEEN["tcp_forged"] = _tcp(host, c, _frame(json.dumps(forged).encode()))

    # a keeper's socket (its name is public): bad frames, a false writer, its fence word
    keeper = _abstract(f"leto-{job}-keeper0-")
    SEEN["keeper_length"] = _unix(keeper, struct.pack("!I", 0xFFFFFFF0) + b"x" * 100)
    SEEN["keeper_nested"] = _unix(keeper, _frame(b"[" * 100_000 + b"]" * 100_000))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + keeper)
    k = Conn(s)
    k.send({"op": "hello", "generation": 0, "role": "writer"})
    SEEN["keeper_writer"], _ = k.recv(timeout=5)
    k.send({"op": "alloc", "name": "leto.param", "nbytes": 1 << 40})
    SEEN["keeper_alloc"], _ = k.recv(timeout=5)
    k.send({"op": "hello", "generation": 0, "role": "shadow"})  # allowed: and the keeper lives
    SEEN["keeper_shadow"], fds = k.recv(timeout=5)
    SEEN["fence_rw"] = []
    for fd in fds:
        try:
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                os.pwrite(rw, struct.pack("<q", 99), 0)
                SEEN["fence_rw"].append("written")
            except OSError as e:
                SEEN["fence_rw"].append(e.errno)
            finally:
                os.close(rw)
        finally:
            os.close(fd)
    k.close()

    # the agent's socket: bad frames, and a process posing as one of its trainers
    agent = _abstract(f"leto-{job}-agent0-")
    SEEN["agent_length"] = _unix(agent, struct.pack("!I", 0xFFFFFFF0))
    SEEN["agent_nested"] = _unix(agent, _frame(b"[" * 100_000 + b"]" * 100_000))
    trainer = _a_trainer(str(run_dir))
    hello = {"t": "hello", "role": "trainer", "rank": 0, "local_rank": 0, "node": 0}
    ask = {"t": "node_segment", "name": "t1.parity", "nbytes": 1 << 40, "id": 1}
    SEEN["agent_posing"] = _unix(
        agent,
        _frame(json.dumps({**hello, "pid": trainer}).encode()) + _frame(json.dumps(ask).encode()),
    )
    SEEN["agent_posing_pid"] = trainer
    SEEN["agent_stranger"] = _unix(
        agent, _frame(json.dumps(hello).encode()) + _frame(json.dumps(ask).encode())
    )


def _a_trainer(tag: str) -> int:
    """The pid of a process the agent forked (from its zygote): what a poser would claim."""
    pids = processes_with(tag)
    me = os.getpid()
    agent = next(p for p in pids if parent_of(p) == me)
    zygote = next(p for p in pids if parent_of(p) == agent and _comm(p).startswith("leto zygote"))
    return next(p for p in pids if parent_of(p) == zygote)


def _comm(pid: int) -> str:
    """The process's name (leto.backends.gloo.title: "leto zygote 0")."""
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


@pytest.fixture(scope="module")
def attacked(session_dir: Path) -> JobResult:
    SEEN.clear()
    return _run(session_dir / "attacked", _attack)


@pytest.fixture(scope="module")
def left_alone(session_dir: Path) -> JobResult:
    res = _run(session_dir / "left-alone")
    assert res.ok and res.digests, explain(res)
    return res


# --- the job ---------------------------------------------------------------------------


def test_job_under_attack_carries_on_bitwise_equal(
    attacked: JobResult, left_alone: JobResult
) -> None:
    assert "error" not in SEEN, SEEN.get("error")
    assert attacked.ok and attacked.codes == {0: [0]}, explain(attacked)
    done = attacked.of("training_done")[0]
    assert SEEN["finished_at"] < done["t"], (
        f"the attacks ({SEEN['seconds']:.2f} s) outlasted training"
    )
    assert attacked.of("failure") == [] and attacked.recoveries == [], "an attack was a failure"
    assert digests_equal(attacked, left_alone)


def test_store_and_coordinator_listen_on_the_endpoint_only(attacked: JobResult) -> None:
    loopback = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
    assert SEEN["store_listens_on"] == [loopback], SEEN["store_listens_on"]
    assert SEEN["coordinator_listens_on"] == [loopback], SEEN["coordinator_listens_on"]


def _refused(attacked: JobResult, key: str) -> list[Any]:
    """The connection was closed by the job, after at most a challenge and a reject."""
    closed, frames = SEEN[key]
    assert closed, f"{key}: the connection stayed open"
    assert attacked.ok
    return frames


def test_unauthenticated_hello_is_refused(attacked: JobResult) -> None:
    frames = _refused(attacked, "tcp_hello")
    assert frames[0]["t"] == "challenge" and len(frames) == 1
    whys = [e["why"] for e in attacked.of("connection_refused")]
    assert any("not a leto node's hello" in w for w in whys), whys


def test_http_request_to_the_coordinator_is_refused(attacked: JobResult) -> None:
    _refused(attacked, "tcp_http")
    whys = [e["why"] for e in attacked.of("connection_refused")]
    assert any("frame of 1195725856 bytes" in w for w in whys), whys  # b"GET "


def test_oversized_length_prefix_to_the_coordinator_is_refused(attacked: JobResult) -> None:
    _refused(attacked, "tcp_length")
    whys = [e["why"] for e in attacked.of("connection_refused")]
    assert any(f"frame of {0xFFFFFFFF} bytes" in w for w in whys), whys


def test_deeply_nested_json_to_the_coordinator_is_refused(attacked: JobResult) -> None:
    _refused(attacked, "tcp_nested")
    whys = [e["why"] for e in attacked.of("connection_refused")]
    assert any(f"nested more than {MAX_DEPTH} deep" in w for w in whys), whys


def test_hello_with_a_forged_proof_is_rejected(attacked: JobResult) -> None:
    frames = _refused(attacked, "tcp_forged")
    assert [f["t"] for f in frames] == ["challenge", "reject"]
    assert "authentication failed" in frames[1]["why"]


def test_oversized_length_prefix_to_a_keeper_closes_only_that_connection(
    attacked: JobResult,
) -> None:
    assert _refused(attacked, "keeper_length") == []
    assert SEEN["keeper_shadow"]["ok"], "the keeper stopped serving"


def test_deeply_nested_json_to_a_keeper_closes_only_that_connection(attacked: JobResult) -> None:
    assert _refused(attacked, "keeper_nested") == []
    assert SEEN["keeper_shadow"]["ok"], "the keeper stopped serving"


def test_keeper_takes_the_writer_from_the_kernel_not_the_hello(attacked: JobResult) -> None:
    assert SEEN["keeper_writer"]["ok"] is False
    assert "not the trainer admitted" in SEEN["keeper_writer"]["why"]
    assert SEEN["keeper_alloc"]["ok"] is False  # no memory for a refused writer


def test_fence_word_cannot_be_reopened_writable(attacked: JobResult) -> None:
    import errno

    assert SEEN["fence_rw"] == [errno.EPERM]


def test_malformed_frames_to_the_agent_close_only_that_connection(attacked: JobResult) -> None:
    assert _refused(attacked, "agent_length") == []
    assert _refused(attacked, "agent_nested") == []


def test_process_posing_as_a_trainer_is_refused(attacked: JobResult) -> None:
    """Its hello claims a trainer's pid; the kernel says otherwise: closed, no memory."""
    assert _refused(attacked, "agent_posing") == []  # no reply to its node_segment request
    assert SEEN["agent_posing_pid"] != os.getpid()
    assert _refused(attacked, "agent_stranger") == []  # claims nothing; not the zygote's child


# --- the pieces ------------------------------------------------------------------------


def _pair() -> tuple[socket.socket, Conn]:
    a, b = socket.socketpair()
    return a, Conn(b)


@pytest.mark.parametrize(
    "body, why",
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested more than"),
        (b'{"a":' * 65 + b"1" + b"}" * 65, "nested more than"),
        (b'{"n":' + b"9" * 5000 + b"}", "not a leto message"),  # int() digit limit
        (b'{"s":"\xff"}', "not a leto message"),
        (b"GET / HTTP/1.0\r\n\r\n", "not a leto message"),
    ],
)
def test_wire_refuses_hostile_bodies_with_a_wire_error(body: bytes, why: str) -> None:
    a, c = _pair()
    a.sendall(_frame(body))
    with pytest.raises(WireError, match=why):
        c.recv(timeout=5)
    a.close()
    c.close()


def test_wire_depth_check_ignores_brackets_in_strings() -> None:
    deep_string = json.dumps({"s": "[" * 10_000 + '"{' * 100, "v": [[[1]]]}).encode()
    assert not too_deep(deep_string)
    assert json.loads(deep_string)["v"] == [[[1]]]
    assert too_deep(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1))
    assert not too_deep(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH)
    assert not too_deep(b"[[]]" * 1000)


def test_wire_small_max_frame_and_drain_keeps_the_good_messages() -> None:
    a, c = _pair()
    c.max_frame = 64
    a.sendall(_frame(b'{"ok":1}') + _frame(b'{"x":"' + b"y" * 100 + b'"}'))
    assert c.feed()
    got, bad = c.drain()
    assert [m for m, _ in got] == [{"ok": 1}]
    assert bad is not None and "max 64" in str(bad)
    a.close()
    c.close()


def test_wire_refuses_descriptors_without_messages() -> None:
    a, c = _pair()
    r, w = os.pipe()
    try:
        for _ in range(3):  # 3 x 30 descriptors, and never a frame to claim them
            a.sendmsg(
                [b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("30i", *[r] * 30))]
            )
        with pytest.raises(WireError, match="file descriptors sent without"):
            for _ in range(3):
                c.recv(timeout=1)
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        c.close()


def test_proofs_bind_the_secret_the_role_the_node_and_both_nonces() -> None:
    key, other = auth.new_secret(), auth.new_secret()
    p = auth.proof(key, "node", 1, "ns", "nc")
    assert auth.verify(key, "node", 1, "ns", "nc", p)
    assert not auth.verify(other, "node", 1, "ns", "nc", p)
    assert not auth.verify(key, "coordinator", 1, "ns", "nc", p)  # not replayable as the other
    assert not auth.verify(key, "node", 2, "ns", "nc", p)
    assert not auth.verify(key, "node", 1, "ns2", "nc", p)
    assert not auth.verify(key, "node", 1, "ns", "nc2", p)
    assert not auth.verify(key, "node", 1, "ns", None, p)
    assert not auth.verify(key, "node", 1, "ns", "nc", None)
    assert not auth.verify(key, "node", 1, "ns", "nc", ["x"])


def test_secret_file_is_private_and_refused_otherwise(tmp_path: Path) -> None:
    d = private_dir(tmp_path / "run", "run directory")
    assert auth.read_secret(d) is None
    key = auth.new_secret()
    path = auth.write_secret(d, key)
    assert auth.read_secret(d) == key
    assert os.stat(path).st_mode & 0o777 == 0o600
    os.chmod(path, 0o644)
    with pytest.raises(auth.SecretError, match="read or written by other users"):
        auth.read_secret(d)


def test_secret_from_the_environment_is_taken_out_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.ENV, "short")
    with pytest.raises(auth.SecretError, match="shorter"):
        auth.from_environment()
    monkeypatch.setenv(auth.ENV, "x" * 32)
    assert auth.from_environment() == b"x" * 32
    assert auth.ENV not in os.environ  # the keepers and trainers do not inherit it
    assert auth.from_environment() is None


def test_private_dir_is_created_0700_and_checked(tmp_path: Path) -> None:
    d = private_dir(tmp_path / "a" / "b", "run directory")
    assert os.stat(d).st_mode & 0o777 == 0o700
    assert private_dir(d, "run directory") == d  # an existing one of ours is fine
    os.chmod(d, 0o777)
    with pytest.raises(InsecurePathError, match=r"can be written by other users \(mode 777\)"):
        private_dir(d, "checkpoint directory")
    os.chmod(d, 0o700)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # no sticky bit: anyone could move our directory away
    with pytest.raises(InsecurePathError, match="every user may write to"):
        private_dir(shared / "ckpt", "checkpoint directory")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory another user's")
def test_private_dir_and_tree_refuse_another_users(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(InsecurePathError, match="belongs to uid 65534"):
        private_dir(theirs, "checkpoint directory")
    ours = private_dir(tmp_path / "ckpt", "checkpoint directory")
    (ours / "step-0").mkdir()
    meta = ours / "step-0" / ".metadata"
    meta.write_bytes(b"pickle")
    check_tree(ours, "checkpoint directory")
    os.chown(meta, 65534, 65534)  # another user's .metadata: dcp.load would unpickle it
    with pytest.raises(InsecurePathError, match=r"\.metadata belongs to uid 65534"):
        check_tree(ours, "checkpoint directory")
    link = tmp_path / "link"
    link.symlink_to(ours)
    os.lchown(link, 65534, 65534)
    with pytest.raises(InsecurePathError, match="belongs to uid 65534"):
        private_dir(link, "checkpoint directory")


def test_refused_run_directory_is_a_one_line_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o777)
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    out = subprocess.run(
        [sys.executable, "-m", "leto.cli", "launch", "--run-dir", str(run), str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    err = out.stderr.strip()
    assert len(err.splitlines()) == 1 and "can be written by other users" in err, err


def test_unproven_connections_are_bounded_in_number_and_time() -> None:
    """A flood of silent connections to the coordinator: at most UNPROVEN_MAX wait for
    their proof (the oldest is closed for a newer one), none longer than UNPROVEN_SECONDS."""
    from leto.backends.gloo import agent as A
    from leto.backends.gloo import routing as R

    ag = A.Agent(A.AgentOptions(script="x.py", script_args=[], quiet=True))
    ag.listener = socket.create_server(("127.0.0.1", 0))
    clients = [
        socket.create_connection(ag.listener.getsockname()) for _ in range(R.UNPROVEN_MAX + 1)
    ]
    try:
        for _ in clients:
            ag.routing.accept_link()
        assert len(ag.unproven) == R.UNPROVEN_MAX
        first, _ = _until_closed(clients[0], timeout=2)
        assert first, "the oldest waiting connection was not closed"
        ag.routing.expire_unproven(time.monotonic() + R.UNPROVEN_SECONDS + 1)
        assert ag.unproven == {} and ag.refusals == R.UNPROVEN_MAX + 1
        for c in clients[1:]:
            closed, frames = _until_closed(c, timeout=2)
            assert closed and [f["t"] for f in frames] == ["challenge"]
    finally:
        for c in clients:
            c.close()
        ag.listener.close()
