"""Every command the README shows runs, exactly as written, and does what it says.

The commands are read from the README's ``sh`` blocks (a trailing ``# comment`` is
not part of the command). Each one must have a check below, and each check must
belong to a command the README still shows: a command added to the README without a
test here, or a test left behind by a removed command, fails
:func:`test_every_readme_command_has_a_check`.

Commands run in a scratch directory that mirrors the repository root (``examples``,
``spec`` linked in), so their relative paths resolve as they do for a user and the
files they write (``leto-runs/``) stay out of the checkout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

SETUP = 'python3 -m venv .venv && . .venv/bin/activate && pip install "torch==2.13.0" -e ".[dev]"'
TESTS = "python -m pytest -q"


def readme_commands(text: str | None = None) -> list[str]:
    """The commands of the README's ``sh`` blocks, in order."""
    text = README.read_text() if text is None else text
    out: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            cmd = re.sub(r"\s+#.*$", "", line).strip()
            if cmd and not cmd.startswith("#"):
                out.append(cmd)
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("PYTHONPATH", None)
    return env


def _scratch(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    for name in ("examples", "spec"):
        (root / name).symlink_to(ROOT / name)
    return root


def run(cmd: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def _ok(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p.stdout


# --------------------------------------------------------------------- the checks


def check_setup(cmd: str, tmp_path: Path) -> None:
    # a fresh copy of the project (what git tracks, and new files it does not ignore)
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    copy = tmp_path / "fresh"
    for f in files:
        src = ROOT / f
        (copy / f).parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():  # as git checks it out
            os.symlink(os.readlink(src), copy / f)
        elif src.is_file():
            shutil.copy2(src, copy / f)
    env = _env()
    env["PATH"] = os.pathsep.join(
        p for p in env["PATH"].split(os.pathsep) if not p.startswith(str(ROOT))
    )
    env.pop("VIRTUAL_ENV", None)
    p = subprocess.run(
        ["bash", "-c", cmd], cwd=copy, env=env, capture_output=True, text=True, timeout=1200
    )
    _ok(p)
    leto = copy / ".venv" / "bin" / "leto"
    out = subprocess.run([str(leto), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "demo" in out.stdout
    torch_v = subprocess.run(
        [str(copy / ".venv" / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert torch_v.stdout.startswith("2.13.0"), torch_v


def check_tests(cmd: str, tmp_path: Path) -> None:
    # The test command cannot run itself; CI runs it as written, after the set-up.
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert cmd in [line.strip() for line in ci]


def check_demo(cmd: str, tmp_path: Path) -> None:
    out = _ok(run(cmd, _scratch(tmp_path)))
    assert re.search(r"bitwise equal to the failure-free run .*: YES", out), out[-3000:]


def check_demo_json(cmd: str, tmp_path: Path) -> None:
    res = json.loads(_ok(run(cmd, _scratch(tmp_path))))
    assert res["bitwise_equal"] is True
    assert res["every_failure_recovered"] is True
    assert res["failures_injected"] == res["failures_planned"] >= 16
    assert len(res["recovery_seconds"]) == res["failures_injected"]
    if "--backend fake" not in cmd:  # the fake demo's result names no backend
        assert res["backend"] == "gloo", res["backend"]
        _check_gloo_demo(res)
        # the faulted run is a behaviour of the TLA+ spec, event by event (TraceLeto.tla):
        # it found a reconcile that released gradients its node's parity still named
        from leto.cli import main

        faulted = res["run_dirs"]["with_failures"]
        assert main(["spec", "trace", faulted, "--tlc"]) == 0, faulted


def _check_gloo_demo(res: dict[str, Any]) -> None:
    """What the gloo demo's result must show beyond bitwise equality: every kind of
    recovery, a restarted recovery, tier 1 as replicas (gloo's default)."""
    from leto.adapters import gloo_demo

    plan = gloo_demo.fault_plan(
        steps=gloo_demo.STEPS, n_chunks=gloo_demo.n_chunks_of(4096), nodes=2, per_node=2
    )
    assert res["error"] is None and res["failures_planned"] == len(plan)
    assert res["params_equal"] and res["optimizer_state_equal"]
    # one entry per failure; the two failures of the restarted recovery share its end
    secs = res["recovery_seconds"]
    assert res["failures_injected"] > res["recoveries"] and res["recovery_restarts"] >= 1
    assert all(isinstance(x, float) and 0 < x < 60 for x in secs)
    assert {"forward", "tier1", "tier2"} <= set(res["recoveries_by_kind"])
    assert res["topology"] == "2x2"
    assert res["tier1_kind"] == "replica", res["tier1_kind"]
    assert res["copied_from_replicas"] >= res["chunks_repaired_tier1"] >= 1
    assert res["chunks_repaired_from_parity"] == 0


def check_spec(cmd: str, tmp_path: Path) -> None:
    """The check CI runs: TLC on MCLetoSmall.cfg (every invariant and Progress) and the
    liveness configuration, the core's checker reaching every 'sometimes' property,
    every mutant caught on both sides. (TLC on MCLeto.cfg, ``leto spec check --full``,
    takes minutes: a documented soak run, docs/testing.md.)"""
    from leto.core.verify import MUTANTS

    out = _ok(run(cmd, _scratch(tmp_path)))
    assert "violations: 0" in out, out[-2000:]
    main = re.search(r"TLC MCLetoSmall\.cfg: (\d+) distinct states, violations none", out)
    assert main is not None and int(main.group(1)) > 10_000, out[-2000:]
    live = re.search(r"TLC MCLetoLiveness\.cfg: (\d+) distinct states, violations none", out)
    assert live is not None and int(live.group(1)) > 5_000, out[-2000:]
    # the side modules (Replay.tla, Mesh.tla): each config passes or is caught as it must
    from leto.spec.cli import SIDE_SPECS

    side = re.findall(
        r"^  TLC (\w+\.tla) (\S+): \d+ distinct states, .*\((.*?): (ok|FAILED), ", out, re.M
    )
    assert len(side) == sum(map(len, SIDE_SPECS.values())), out[-3000:]
    assert all(verdict == "ok" for *_, verdict in side), side
    assert "unreached 'sometimes' properties: none" in out, out[-2000:]
    assert "reached where forbidden (leto.core.verify.NEVER): none" in out, out[-2000:]
    # the core's explicit-state check, every configuration (its one run in the tests)
    core = re.search(r"core checker: (\d+) states over (\d+) configs", out)
    assert core is not None and int(core.group(1)) > 100_000, out[-2000:]
    from leto.core.verify import CHECK_CONFIGS

    assert int(core.group(2)) == len(CHECK_CONFIGS), out[-2000:]
    assert f"mutants caught: {len(MUTANTS)}/{len(MUTANTS)}" in out, out[-2000:]
    # each by the invariant (or property) PROTOCOL.md names for it, under TLC
    from test_tlc import MUTANTS as TLC_INVARIANTS

    from leto.spec.cli import TEMPORAL_MUTANTS

    tlc_by = dict(re.findall(r"^\s+(\w+): core \[.*\]; tlc \['(\w+)'\]$", out, re.M))
    assert tlc_by == {**TLC_INVARIANTS, **TEMPORAL_MUTANTS}, out[-2000:]
    # and by the core's checker, each by the invariant test_core_checker expects
    from test_core_checker import EXPECTED_CATCH

    core_by = dict(re.findall(r"^\s+(\w+): core \[(.*)\]; tlc ", out, re.M))
    assert set(core_by) == {m.value for m in MUTANTS}, out[-2000:]
    for m in MUTANTS:
        assert f"'{EXPECTED_CATCH[m]}'" in core_by[m.value].split(", "), (m, core_by)


def check_simulate(cmd: str, tmp_path: Path) -> None:
    out = _ok(run(cmd, _scratch(tmp_path)))
    assert re.search(r"^leto\s+\d+\.\d+%", out, flags=re.M), out


def check_example_fake(cmd: str, tmp_path: Path) -> None:
    out = _ok(run(cmd, _scratch(tmp_path)))
    assert "step 20" in out, out


def check_launch_then_report(cmd: str, tmp_path: Path) -> None:
    """`leto launch ... --run-dir leto-runs/gpt`, then the README's `leto report` of it."""
    root = _scratch(tmp_path)
    out = _ok(run(cmd, root))
    assert "step 20" in out, out
    events = root / "leto-runs" / "gpt" / "events.jsonl"
    assert events.is_file()
    report = next(c for c in readme_commands() if c.startswith("leto report"))
    rep = _ok(run(report, root))
    assert "status: ok" in rep, rep
    assert (root / "leto-runs" / "gpt" / "timeline.png").is_file()


def check_report(cmd: str, tmp_path: Path) -> None:
    pass  # run by check_launch_then_report, on the run directory the launch wrote


ETCD_NODE0 = (
    "leto launch --nnodes 2 --nproc-per-node 2 --node-rank 0 --rdzv-backend etcd "
    "--rdzv-endpoint 127.0.0.1:12379,127.0.0.1:22379,127.0.0.1:32379 --rdzv-id gpt-etcd "
    "--run-dir leto-runs/etcd examples/gpt.py --config examples/gloo.toml --steps 10"
)
ETCD_NODE1 = ETCD_NODE0.replace("--node-rank 0", "--node-rank 1")


def check_etcd_launch(cmd: str, tmp_path: Path) -> None:
    """Node 0's and node 1's commands, run together against a 3-member etcd cluster
    started on the README's ports: the job completes, its COMMITs recorded in etcd."""
    sys.path.insert(0, str(ROOT / "tests" / "gloo"))
    from etcd import EtcdCluster

    ports = [
        int(p.rsplit(":", 1)[1]) for p in cmd.split("--rdzv-endpoint ")[1].split()[0].split(",")
    ]
    root = _scratch(tmp_path)
    cluster = EtcdCluster(tmp_path / "etcd", client_ports=ports)
    try:
        procs = [
            subprocess.Popen(
                ["bash", "-c", c],
                cwd=root,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for c in (ETCD_NODE0, ETCD_NODE1)
        ]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
        cluster.stop()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    events = [json.loads(line) for line in (root / "leto-runs" / "etcd" / "events.jsonl").open()]
    (record,) = [e for e in events if e["event"] == "commit_record"]
    assert record["backend"] == "etcd" and record["commits"] == 10, record
    assert any(e["event"] == "training_done" and e["step"] == 10 for e in events)


def check_etcd_node1(cmd: str, tmp_path: Path) -> None:
    pass  # run by check_etcd_launch, with node 0's command


CHECKS: dict[str, Callable[[str, Path], None]] = {
    SETUP: check_setup,
    TESTS: check_tests,
    "leto demo": check_demo,
    "leto demo --json": check_demo_json,
    "leto demo --backend fake --json": check_demo_json,
    "leto spec check": check_spec,
    "leto simulate --gpus 131072 --days 30": check_simulate,
    "python examples/gpt.py --config examples/fake.toml --steps 20": check_example_fake,
    "leto launch --nproc-per-node 2 --run-dir leto-runs/gpt examples/gpt.py "
    "--config examples/gloo-1node.toml --steps 20": check_launch_then_report,
    "leto report leto-runs/gpt": check_report,
    ETCD_NODE0: check_etcd_launch,
    ETCD_NODE1: check_etcd_node1,
}


def test_every_readme_command_has_a_check() -> None:
    cmds = readme_commands()
    assert len(cmds) >= 5
    assert set(cmds) == set(CHECKS), (
        f"README commands without a check: {sorted(set(cmds) - set(CHECKS))}; "
        f"checks of commands the README no longer shows: {sorted(set(CHECKS) - set(cmds))}"
    )


def test_the_extractor_reads_blocks_and_drops_comments() -> None:
    text = "x\n```sh\nleto a --b   # why\n\n# note\nleto c\n```\n```python\nleto d\n```\n"
    assert readme_commands(text) == ["leto a --b", "leto c"]


@pytest.mark.slow
@pytest.mark.parametrize("cmd", list(CHECKS))
def test_readme_command_runs_as_written(cmd: str, tmp_path: Path) -> None:
    if cmd not in readme_commands():
        pytest.fail(f"the README no longer shows {cmd!r}: remove its check")
    CHECKS[cmd](cmd, tmp_path)
