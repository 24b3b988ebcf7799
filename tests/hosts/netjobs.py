"""Run a gloo job with each node's ``leto launch`` on a test host of its own.

Node ``i`` runs in host ``i`` and a spare agent (``--spare``) in host ``nnodes + k``;
node 0's rendezvous endpoint is its host's address. The trainers' gloo pairs bind to
``eth0`` (``GLOO_SOCKET_IFNAME``): this machine's name resolves to 127.0.0.1, which in a
namespace is that namespace's own loopback, as it would be on a cluster whose hosts file
says so. :meth:`NetJob.wait_for` watches the coordinator's event log, so a test can act
(cut a link) at a point of the run; :meth:`NetJob.finish` waits for the agents and gives
the same :class:`JobResult` as ``run_local``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobs import TRAIN, assert_trace, left_after
from netns import Hosts

from leto.backends.gloo.eventlog import read_events
from leto.backends.gloo.harness import JobResult
from leto.backends.gloo.procs import tie_to_parent

PORT = 29400


class NetJob:
    def __init__(
        self,
        hosts: Hosts,
        run_dir: Path,
        *,
        nnodes: int,
        nproc: int,
        steps: int,
        spares: int = 0,
        env: dict[str, str] | None = None,
        extra: list[str] | None = None,
        rdzv: list[str] | None = None,
    ) -> None:
        assert len(hosts.names) >= nnodes + spares, "a host per node and per spare"
        self.run_dir = run_dir.resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.hosts = hosts
        e = {"TOPO": f"{nnodes}x{nproc}", "STEPS": str(steps), **(env or {})}
        self.env = tie_to_parent({**os.environ, "GLOO_SOCKET_IFNAME": "eth0", **e})
        self.base = [
            sys.executable, "-m", "leto.cli", "launch", "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc),
            *(rdzv or ["--rdzv-endpoint", f"{hosts.addrs[0]}:{PORT}"]),
            "--run-dir", str(self.run_dir), "--quiet", "--hang-timeout", "3",
            "--heartbeat", "0.25", *(extra or []),
        ]  # fmt: skip
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.logs: dict[int, Any] = {}
        self.t0 = time.monotonic()
        self.start(0, ["--node-rank", "0"])
        time.sleep(0.2)
        for n in range(1, nnodes):
            self.start(n, ["--node-rank", str(n)])
        for k in range(spares):
            self.start(nnodes + k, ["--spare"])

    def start(self, host: int, role: list[str], key: int | None = None) -> None:
        """An agent on test host ``host``, kept as ``key`` (default: the host's index;
        another key for a second agent on one host)."""
        k = host if key is None else key
        self.logs[k] = open(self.run_dir / f"host{k}.out", "w+")  # noqa: SIM115
        cmd = [*self.base[:4], *role, *self.base[4:], TRAIN]
        self.procs[k] = self.hosts.popen(
            host, cmd, stdout=self.logs[k], stderr=subprocess.STDOUT, env=self.env
        )

    def events(self) -> list[dict[str, Any]]:
        ev = self.run_dir / "events.jsonl"
        return read_events(ev) if ev.exists() else []

    def wait_for(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float = 60.0
    ) -> tuple[dict[str, Any], float]:
        """The first event that ``pred`` accepts, and when it was seen (monotonic)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events():
                if pred(e):
                    return e, time.monotonic()
            if 0 in self.procs and self.procs[0].poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no such event within {timeout} s:\n{self.tail()}")

    def tail(self) -> str:
        out = []
        for h, f in self.logs.items():
            f.flush()
            out.append(f"--- host {h}\n" + (self.run_dir / f"host{h}.out").read_text()[-2000:])
        return "\n".join(out)

    def finish(self, timeout: float) -> JobResult:
        """Wait for every agent (up to ``timeout`` s from the start; then SIGKILL them)."""
        deadline = self.t0 + timeout
        codes: dict[int, list[int]] = {}
        for h, p in self.procs.items():
            try:
                codes[h] = [p.wait(max(0.1, deadline - time.monotonic()))]
            except subprocess.TimeoutExpired:
                p.kill()
                codes[h] = [p.wait()]
        output = {}
        for h, f in self.logs.items():
            f.seek(0)
            output[h] = [f.read()]
            f.close()
        leftovers = left_after(str(self.run_dir))  # a cut-off node's processes may still be dying
        for pid in leftovers:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        res = JobResult(
            self.run_dir, codes, self.events(), time.monotonic() - self.t0, output, leftovers
        )
        assert not res.leftovers, f"processes left running after the job: {res.leftovers}"
        assert_trace(res.run_dir)
        return res

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in self.logs.values():
            if not f.closed:
                f.close()
