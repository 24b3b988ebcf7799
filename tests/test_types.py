"""``mypy --strict`` over all of leto (pyproject.toml's configuration).

The parts of the gloo and fake backends receive narrow interfaces (Protocols, or the
objects they use as arguments), not their owners: only the checker makes that narrow,
since at run time each part still holds the owner. A part that reads a member its
Protocol does not declare, or an owner that no longer provides one, fails here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mypy(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_leto_is_clean_under_mypy_strict() -> None:
    res = mypy("leto")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


def test_a_part_that_reads_past_its_narrow_view_is_rejected(tmp_path: Path) -> None:
    # a checker's test includes a case it must reject: a part reads a member its
    # Protocol does not declare, and an owner lacks one the Protocol declares
    part = tmp_path / "part.py"
    part.write_text(
        "from leto.backends.fake.host import RanksHost\n"
        "\n"
        "def world(host: RanksHost) -> int:\n"
        "    return host.W\n"
        "\n"
        "def peek(host: RanksHost) -> object:\n"
        "    return host.state\n"
        "\n"
        "class Owner:\n"
        "    W = 2\n"
        "\n"
        "world(Owner())\n"
    )
    res = mypy("--strict", "--follow-imports=silent", str(part))
    out = res.stdout
    assert res.returncode == 1, out
    assert '"RanksHost" has no attribute "state"' in out, out
    assert 'Argument 1 to "world" has incompatible type "Owner"; expected "RanksHost"' in out, out
    assert "part.py:4" not in out, out  # a member it declares is fine
