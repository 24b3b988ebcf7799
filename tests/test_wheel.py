"""The spec tooling works from an installed wheel, not only from a source checkout:
the TLA+ spec ships as package data and `leto spec check` finds it there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_spec_check_runs_from_an_installed_wheel(tmp_path: Path) -> None:
    # built from a copy: setuptools writes build/ and *.egg-info into the tree it builds
    src = tmp_path / "src"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
        text=True, check=True,
    ).stdout.split()  # fmt: skip
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / f).is_symlink():  # as git checks it out
            os.symlink(os.readlink(ROOT / f), src / f)
        elif (ROOT / f).is_file():
            shutil.copy2(ROOT / f, src / f)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(src)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    (wheel,) = wheels.glob("leto-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for f in ("Leto.tla", "MCLeto.cfg", "MCLetoSmall.cfg", "PROTOCOL.md"):
        assert f"leto/spec/files/{f}" in names, f
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = (
        "import sys, leto.spec; print(leto.spec.__file__, file=sys.stderr); "
        "from leto.spec.cli import SPEC_DIR; print(SPEC_DIR, file=sys.stderr); "
        "from leto.cli import main; "
        "sys.exit(main(['spec', 'check', '--json', '--config', 'MCLetoSmall.cfg', "
        "'--skip-core', '--skip-mutants']))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert str(target) in p.stderr  # the installed copy ran, not the checkout
    out = json.loads(p.stdout)
    assert out["violations"] == 0 and out["tlc"]
