"""torchrun's flags in ``leto launch`` (docs/launch.md): every flag of the installed
torch's own torchrun parser is in leto's table, and ``leto launch`` does what the table
says with it: accepts it (the agent is started, with the setting it translates to), or
refuses it in one line giving the table's reason. The docs' table is the table."""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.run import get_args_parser

from leto.adapters.console import ShownRanks
from leto.adapters.torchrun_flags import BY_NAME, REFUSED, markdown_table
from leto.backends.gloo.procs import free_port
from leto.cli import main

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = sorted(
    s for a in get_args_parser()._actions for s in a.option_strings if s not in ("-h", "--help")
)


def test_every_torchrun_flag_is_in_the_table() -> None:
    missing = [s for s in TORCHRUN if s not in BY_NAME]
    assert not missing, f"torchrun flags with no row in leto.adapters.torchrun_flags: {missing}"
    assert len(TORCHRUN) > 40  # the parser was read (torch 2.13 has 59 spellings)


def test_the_docs_table_is_the_table() -> None:
    doc = (ROOT / "docs" / "launch.md").read_text()
    m = re.search(r"<!-- the table.*?-->\n(.*?)<!-- end of the table -->", doc, re.S)
    assert m is not None, "docs/launch.md has no table between its markers"
    assert m.group(1) == markdown_table(), "run: python -m leto.adapters.torchrun_flags"
    assert "docs/launch.md" in (ROOT / "README.md").read_text()


class Started(Exception):
    """Raised by the stand-in agent: ``leto launch`` accepted its flags."""

    def __init__(self, opts: Any, env: dict[str, str], stdout: Any) -> None:
        self.opts, self.env, self.stdout = opts, env, stdout


class StandInAgent:
    def __init__(self, opts: Any) -> None:
        self.opts = opts

    def run(self) -> int:
        raise Started(self.opts, dict(os.environ), sys.stdout)


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A working directory with train.py, the agent replaced by a stand-in, and the
    environment restored afterwards (``leto launch`` sets the trainers' variables)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    monkeypatch.setattr("leto.backends.gloo.agent.Agent", StandInAgent)
    monkeypatch.setattr("leto.adapters.launch._reachable", lambda *a: True)
    saved = dict(os.environ)
    yield tmp_path
    os.environ.clear()
    os.environ.update(saved)


def launch(
    argv: list[str], capsys: pytest.CaptureFixture[str], script: str = "train.py"
) -> Started | str:
    """``leto launch ARGV SCRIPT``: what the agent was started with, or the one line it
    was refused with."""
    try:
        code = main(["launch", "--quiet", *argv, script])
    except Started as s:
        return s
    except SystemExit as e:
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert code == 2, (argv, code, err)
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("leto launch: error: "), lines[0]
    return lines[0].removeprefix("leto launch: error: ")


def _context(name: str) -> tuple[list[str], str]:
    """The flag's example with what it needs on this machine (a free port; etcd's
    members for --local-addr, reached by a stand-in), and the script."""
    row = BY_NAME[name]
    port = str(free_port())
    endpoint = f"127.0.0.1:{port}"
    words = [name, *row.example]
    if row.flag == "--master-port":
        return [name, port], "train.py"
    if row.flag == "--rdzv-endpoint":
        return [name, endpoint], "train.py"
    if row.flag == "--master-addr":
        return [*words, "--master-port", port], "train.py"
    if row.flag == "--nnodes":
        return [*words, "--node-rank", "0", "--rdzv-endpoint", endpoint], "train.py"
    if row.flag == "--local-addr":
        etcd = ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", "j"]
        return [*etcd, *words], "train.py"
    return words, "train" if row.flag == "-m" else "train.py"


# what each accepted flag's example turns into, in the agent's options or the trainers'
# environment (flags absent here: accepted as torchrun's, nothing of leto's to check)
EXPECT: dict[str, Callable[[Started], bool]] = {
    "--nproc-per-node": lambda s: s.opts.nproc_per_node == len(os.sched_getaffinity(0)),
    "--rdzv-backend": lambda s: s.opts.etcd == (),
    "--rdzv-id": lambda s: s.env["TORCHELASTIC_RUN_ID"] == "job-7",
    "--rdzv-conf": lambda s: s.opts.rdzv_timeout == 90.0,
    "--max-restarts": lambda s: s.env["TORCHELASTIC_MAX_RESTARTS"] == "2",
    "--role": lambda s: s.env["ROLE_NAME"] == "trainer",
    "--log-dir": lambda s: s.opts.run_dir == "logs",
    "--redirects": lambda s: s.opts.echo is False,
    "--tee": lambda s: s.opts.echo is True,
    "--local-ranks-filter": lambda s: s.opts.echo is True,
    "--master-addr": lambda s: (s.opts.rdzv_host, s.opts.node_rank) == ("127.0.0.1", 0),
    "--master-port": lambda s: s.opts.rdzv_host == "127.0.0.1" and s.opts.rdzv_port > 0,
    "--local-addr": lambda s: s.opts.rdzv_id == "j",
}


@pytest.mark.parametrize("name", TORCHRUN)
def test_leto_launch_does_what_the_table_says(
    name: str, here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    row = BY_NAME[name]
    argv, script = _context(name)
    got = launch(argv, capsys, script)
    if row.verdict == REFUSED:
        assert got == row.refusal(), got
        assert "\n" not in row.leto and row.leto, row
        return
    assert isinstance(got, Started), f"{name} {row.example} refused: {got}"
    check = EXPECT.get(row.flag)
    assert check is None or check(got), (name, got.opts, {k: got.env.get(k) for k in got.env})


def test_the_trainers_see_torchruns_variables(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    got = launch([], capsys)
    assert isinstance(got, Started)
    uuid.UUID(got.env["TORCHELASTIC_RUN_ID"])  # one node, no --rdzv-id: a fresh uuid
    assert got.env["ROLE_NAME"] == "default"
    assert (got.env["TORCHELASTIC_RESTART_COUNT"], got.env["TORCHELASTIC_MAX_RESTARTS"]) == (
        "0",
        "0",
    )
    port = free_port()
    got = launch(["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"], capsys)
    assert isinstance(got, Started) and got.env["TORCHELASTIC_RUN_ID"] == "none"  # as torchrun


@pytest.mark.parametrize(
    ("flags", "shown"),
    [
        (["--local-ranks-filter", "0,2"], {0, 2}),
        (["--redirects", "0:3,2:3"], {1, 3}),
        (["--redirects", "3", "--tee", "1:3"], {1}),
        (["-r", "3", "-t", "0:3", "--local-ranks-filter", "0,1"], {0}),
    ],
)
def test_which_ranks_the_console_shows(
    flags: list[str], shown: set[int], here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    got = launch(["--nproc-per-node", "4", *flags], capsys)
    assert isinstance(got, Started)
    assert isinstance(got.stdout, ShownRanks) and got.stdout.shown == shown
    assert sys.stdout is not got.stdout  # put back when the agent returned


def test_shown_ranks_drops_only_the_hidden_ranks_lines(tmp_path: Path) -> None:
    with open(tmp_path / "out", "w") as f:
        s = ShownRanks(f, frozenset({1}), nproc=2)  # local rank 1: global ranks 1, 3
        s.write("[rank 0] a\n[rank 1] b\n[rank 2] c\n[rank 3] d\n")
        s.write("leto[node 0]: step 3\n[rank 10] e\n")
        s.flush()
        s.pid = -1  # a process forked from the agent: everything, untouched
        s.write("[rank 0] f\n")
    assert (tmp_path / "out").read_text() == (
        "[rank 1] b\n[rank 3] d\nleto[node 0]: step 3\n[rank 0] f\n"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nproc-per-node", "gpu"], "--nproc-per-node gpu: leto trains on CPU only today"),
        (["--nproc-per-node", "xpu"], "so it starts no rank per XPU"),
        (["--nproc-per-node", "many"], "--nproc-per-node 'many' is not a number of ranks"),
        (["--nproc-per-node", "2000"], "--nproc-per-node must be at most 1024"),
        (["--rdzv-backend", "etcd-v2"], "leto's etcd rendezvous speaks etcd's v3 API"),
        (["--rdzv-conf", "last_call_timeout=5"], "'last_call_timeout': leto's rendezvous reads"),
        (["--rdzv-conf", "join_timeout"], "is not KEY=VALUE"),
        (["--rdzv-conf", "join_timeout=nan"], "--rdzv-conf join_timeout must be a finite"),
        (["--rdzv-conf", "join_timeout=5", "--rdzv-timeout", "6"], "disagree: give one"),
        (["--master-port", "70000"], "--master-port '70000' is not a port in 1..65535"),
        (["--master-addr", "::1"], "--master-addr: ::1 has no IPv4 address"),
        (["--master-port", "29400", "--rdzv-endpoint", "127.0.0.1:29400"], "give one"),
        (["--log-dir", "a", "--run-dir", "b"], "--log-dir and --run-dir name two directories"),
        (["--redirects", "1"], "stdout and stderr share one pipe"),
        (["--redirects", "3", "--tee", "2"], "shows only the stderr of local rank 0"),
        (["--redirects", "5:3"], "local rank 5 is not in 0..0"),
        (["--tee", "x"], "--tee 'x' is not 0-3, or LOCAL_RANK:0-3"),
        (["--local-ranks-filter", "1"], "--local-ranks-filter '1' is not a list of local ranks"),
        (["--role", "a b"], "--role 'a b' is not 1-64 letters"),
        (["--rdzv-id", "a/b"], "--rdzv-id 'a/b' is not 1-64 letters"),
        (["--start-method", "spawn"], "a spawned trainer would start cold"),
        (["--start-method", "thread"], "is not one of fork, spawn, forkserver"),
        (["--event-log-handler", "console"], "leto calls no torchrun event handler"),
    ],
)
def test_a_value_leto_cannot_take_is_refused_in_one_line(
    flags: list[str], message: str, here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    got = launch(flags, capsys)
    assert isinstance(got, str) and message in got, got
    assert sorted(os.listdir(here)) == ["train.py"]  # nothing made: no leto-runs/


def test_help_says_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag, default in [
        ("--heartbeat", "0.5"),
        ("--hang-timeout", "10"),
        ("--collective-timeout", "30"),
        ("--rdzv-timeout", "60"),
    ]:
        assert re.search(rf"{flag} S ((?! --[a-z]).)*\(default {default}\b", out), flag
    assert "--monitor-interval" in out and "leto's agent polls nothing" in out
