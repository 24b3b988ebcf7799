"""Run a gloo job on this machine: one ``leto launch`` process per node, on 127.0.0.1.

Used by the tests, the gloo demo and anyone who wants "N nodes" on one host::

    res = run_local("train.py", nnodes=2, nproc=2, run_dir="runs/a",
                    faults=[{"kind": "crash", "rank": 1, "step": 3, "phase": "backward"}])
    res.ok, res.digests, res.recoveries, res.events

A node whose agent dies while the job runs (a ``lose_node`` fault, or a test that
SIGKILLs it) is started again with the same arguments, as a replacement (spare)
node would be by a cluster scheduler (``respawn_lost_nodes``; node 0 too, with
``rdzv``, where the coordinator fails over to another node's agent); with ``spares=N``,
node 0 starts N spare agents (``--spares``) that take lost nodes' places instead
(``spare_agents=N``: N spare agents started here, ``--spare``, codes -1, -2, ...); ``rdzv``
replaces ``--rdzv-endpoint 127.0.0.1:PORT`` (``--rdzv-backend etcd`` and its flags). Everything the job
started is gone when :func:`run_local` returns (it kills what is left and says so).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .eventlog import read_events
from .procs import free_port, processes_with, tie_to_parent

__all__ = ["JobResult", "run_local"]


@dataclass
class JobResult:
    run_dir: Path
    codes: dict[int, list[int]]  # node -> exit codes of its agents, in order
    events: list[dict[str, Any]]
    seconds: float
    output: dict[int, list[str]] = field(default_factory=dict)
    leftovers: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.codes.get(0)) and self.codes[0][-1] == 0

    @property
    def digests(self) -> dict[str, Any] | None:
        for e in self.events:
            if e["event"] == "training_done":
                out: dict[str, Any] = e["digests"]
                return out
        return None

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "recovery_end"]

    def of(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]

    @property
    def error(self) -> str | None:
        for e in self.events:
            if e["event"] == "job_failed":
                return str(e.get("error"))
        return None

    def text(self, node: int = 0) -> str:
        return "".join(self.output.get(node, []))


def _cmd(
    script: str,
    node: int,
    nnodes: int,
    nproc: int,
    port: int,
    run_dir: Path,
    faults: Any,
    extra: list[str],
    script_args: list[str],
    rdzv: list[str] | None = None,
) -> list[str]:
    cmd = [
        sys.executable, "-m", "leto.cli", "launch",
        "--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--node-rank", str(node),
        *(rdzv or ["--rdzv-endpoint", f"127.0.0.1:{port}"]), "--run-dir", str(run_dir),
    ]  # fmt: skip
    if faults:
        cmd += ["--faults", json.dumps(faults)]
    return cmd + list(extra) + [script, *script_args]


def run_local(
    script: str,
    *,
    nnodes: int = 1,
    nproc: int = 2,
    run_dir: str | os.PathLike[str],
    faults: list[dict[str, Any]] | None = None,
    extra: list[str] | None = None,
    script_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 180.0,
    respawn_lost_nodes: bool = True,
    port: int | None = None,
    kill_node_after: tuple[int, float] | None = None,
    spares: int = 0,
    rdzv: list[str] | None = None,
    spare_agents: int = 0,
    late_spare: Callable[[Path], bool] | None = None,
) -> JobResult:
    """Run the job to its end; see the module docstring. ``late_spare``: one more spare
    agent (code ``-spare_agents - 1``) started once it says so of the run directory."""
    run = Path(run_dir).resolve()
    run.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    full_env = tie_to_parent({**os.environ, **(env or {})})  # agents die with this process
    procs: dict[int, subprocess.Popen[str]] = {}
    # nodes 0..nnodes-1, and the spare agents started here (-1, -2, ...)
    agents = [*range(nnodes), *range(-1, -spare_agents - 1, -1)]
    late = -spare_agents - 1 if late_spare is not None else None
    if late is not None:
        agents.append(late)
    codes: dict[int, list[int]] = {n: [] for n in agents}
    output: dict[int, list[str]] = {n: [] for n in agents}
    logs: dict[int, Any] = {}

    def start(n: int) -> None:
        path = run / f"agent{n}.{len(codes[n])}.out"
        logs[n] = open(path, "w+")  # noqa: SIM115
        more = [*(extra or []), *(["--spares", str(spares)] if n == 0 and spares else [])]
        cmd = _cmd(
            script, max(n, 0), nnodes, nproc, port, run, faults, more, script_args or [], rdzv
        )
        if n < 0:  # a spare agent: no node rank until it takes a lost node's place
            i = cmd.index("--node-rank")
            cmd[i : i + 2] = ["--spare"]
        procs[n] = subprocess.Popen(
            cmd,
            stdout=logs[n],
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            # a process group of its own, in this session: a session per node would be a
            # scheduler autogroup per node, which skews the nodes' ranks (leto.bench.gloojob)
            process_group=0,
        )

    def collect(n: int) -> None:
        logs[n].flush()
        logs[n].seek(0)
        output[n].append(logs[n].read())
        logs[n].close()

    t0 = time.monotonic()
    start(0)
    time.sleep(0.2)
    for n in agents[1:]:
        if n != late:
            start(n)
    killed = False
    deadline = t0 + timeout
    try:
        while procs:
            if (
                late is not None
                and late_spare is not None
                and not codes[late]
                and late not in procs
            ):
                if late_spare(run):
                    start(late)
            if kill_node_after and not killed and time.monotonic() - t0 > kill_node_after[1]:
                n = kill_node_after[0]
                if n in procs:
                    procs[n].send_signal(signal.SIGKILL)
                killed = True
            for n, p in list(procs.items()):
                code = p.poll()
                if code is None:
                    continue
                codes[n].append(code)
                collect(n)
                del procs[n]
                node0_running = 0 in procs
                # with etcd the coordinator fails over: a SIGKILLed node 0 is replaced too
                failover = rdzv is not None and code == -signal.SIGKILL and bool(procs)
                if (
                    ((n > 0 and code != 0 and node0_running) or (n == 0 and failover))
                    and respawn_lost_nodes
                    and len(codes[n]) < 4
                ):
                    start(n)  # a replacement node joins the running job
            if time.monotonic() > deadline:
                for p in procs.values():
                    p.send_signal(signal.SIGKILL)
                for n, p in procs.items():
                    codes[n].append(p.wait())
                    collect(n)
                procs.clear()
                break
            time.sleep(0.05)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    leftovers = processes_with(str(run))
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    ev = run / "events.jsonl"
    events = read_events(ev) if ev.exists() else []
    return JobResult(run, codes, events, time.monotonic() - t0, output, leftovers)
