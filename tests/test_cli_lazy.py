"""The ``leto`` command: subcommand modules are imported only when that subcommand runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from leto.cli import SUBCOMMANDS, main

# Runs leto.cli.main(argv) in a fresh interpreter; prints the exit code and whether
# torch (or the demo's module, which needs torch) got imported.
PROBE = """
import json, sys
from leto.cli import main
try:
    code = main(json.loads(sys.argv[1]))
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules,
                  "demo": "leto.adapters.demo" in sys.modules}))
"""


def _probe(argv: list[str]) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    "argv",
    [["--help"], [], ["spec", "--help"], ["report", "--help"], ["simulate", "--help"]],
)
def test_commands_that_need_no_torch_do_not_import_it(argv: list[str]) -> None:
    result = _probe(argv)
    assert result == {"code": 0 if argv else 2, "torch": False, "demo": False}


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name, _, help_ in SUBCOMMANDS:
        assert name in out and help_ in out
    assert "in-place failure recovery" in out and "CPU" in out  # what leto is, not a cut
    assert "Each subcommand lives" not in out  # internal docstring


def test_a_subcommand_gets_its_options_and_an_unknown_one_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0
    assert "--backend" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["nosuch"])
    assert exc.value.code == 2
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err
