"""A 3-member etcd cluster whose members run on test hosts of their own (``netns.py``):
member ``i`` on host ``on[i]`` (beside a node, or alone), at that host's address (client port 2379, peer port
2380), killed with the test process (``PR_SET_PDEATHSIG`` survives ``ip netns exec``,
which execs etcd in place) and by :meth:`Hosts.close`."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

from etcd import etcd_executable, member_command
from netns import Hosts

from leto.backends.gloo.procs import die_with_parent

HEALTH = r"""
import json, sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[1])
for url in sys.argv[2:]:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                if json.loads(r.read()).get("health") == "true":
                    break
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            sys.exit(f"{url} not healthy")
        time.sleep(0.05)
"""


class EtcdOnHosts:
    def __init__(self, hosts: Hosts, on: list[int], root: Path) -> None:
        exe = etcd_executable()
        self.hosts, self.on = hosts, on
        self.addrs = [hosts.addrs[h] for h in on]
        initial = ",".join(f"m{i}=http://{a}:2380" for i, a in enumerate(self.addrs))
        token = f"leto-hosts-{os.getpid()}-{hosts.base}"
        root.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen[str]] = []
        for i, a in enumerate(self.addrs):
            with open(root / f"m{i}.log", "w") as log:
                cmd = member_command(
                    exe, f"m{i}", root / f"m{i}", f"http://{a}:2379", f"http://{a}:2380",
                    initial, token,
                )  # fmt: skip
                self.procs.append(
                    hosts.popen(
                        on[i], cmd, stdout=log, stderr=subprocess.STDOUT,
                        preexec_fn=functools.partial(die_with_parent, os.getpid()),
                    )
                )  # fmt: skip
        urls = [f"http://{a}:2379/health" for a in self.addrs]
        got = hosts.run(on[0], [sys.executable, "-c", HEALTH, "30", *urls], timeout=40)
        if got.returncode != 0:
            self.stop()
            raise RuntimeError(f"etcd on test hosts: {got.stderr.strip()}")

    @property
    def endpoint_flag(self) -> str:
        return ",".join(f"{a}:2379" for a in self.addrs)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
