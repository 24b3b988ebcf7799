"""A process's title (``leto.backends.gloo.title``), in a process of its own: with
``setproctitle`` the command line shows it and the environment stays readable; without
it, only the kernel's 15-character name is set. ``test_processes.py`` checks a real job's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from leto.backends.gloo.title import title

JOB = "d4bf4d9e90a3f48c"
PROBE = """
import json, os, sys
from leto.backends.gloo import title
if sys.argv[1] == "without":
    title._spt = None
title.set_title("trainer rank 12", "d4bf4d9e90a3f48c")
read = lambda name: open(f"/proc/self/{name}", "rb").read()
print(json.dumps({
    "cmdline": read("cmdline").rstrip(b"\\0").decode(errors="replace"),
    "comm": read("comm").decode().strip(),
    "environ_intact": b"LETO_TITLE_PROBE=1" in read("environ").split(b"\\0"),
    "spt_noenv_left": "SPT_NOENV" in os.environ,
}))
"""


def _probe(how: str) -> dict[str, object]:
    env = {**os.environ, "LETO_TITLE_PROBE": "1"}
    env.pop("SPT_NOENV", None)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, how, "x" * 200],  # room for the title
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(json.loads(out))


def test_the_title_names_the_process_and_keeps_its_command() -> None:
    assert title("agent node 0", JOB, "run dir /r") == "leto agent node 0 job d4bf4d9e (run dir /r)"
    assert title("zygote node 1", "", "") == "leto zygote node 1"
    got = _probe("with")
    assert got["cmdline"].startswith(f"leto trainer rank 12 job {JOB[:8]} (-c "), got
    assert got["comm"] == "leto trainer 12"
    assert got["environ_intact"] and not got["spt_noenv_left"], got


def test_without_setproctitle_only_the_name_is_set() -> None:
    got = _probe("without")
    assert not got["cmdline"].startswith("leto"), got  # the command line as it was
    assert got["comm"] == "leto trainer 12"


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["/v/bin/python3", "-m", "leto.cli", "launch", "t.py"], "leto launch t.py"),
        (["/v/bin/python", "/v/bin/leto", "launch", "t.py"], "leto launch t.py"),
        (["python", "-m", "mypkg.train"], "-m mypkg.train"),
    ],
)
def test_the_command_is_shown_without_its_interpreter(
    argv: list[str], shown: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "orig_argv", argv)
    assert title("agent node 0") == f"leto agent node 0 ({shown})"
