"""Every test module can be collected beside the others: pytest imports them by their
basename (no package ``__init__``), so two of one name anywhere under tests/ stop the
whole run at collection (``import file mismatch``), as a second test_exclusion.py did."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _clashes(paths: list[Path]) -> list[str]:
    names = Counter(p.name for p in paths if p.name != "conftest.py")
    return sorted(n for n, k in names.items() if k > 1)


def test_no_two_test_modules_share_a_name() -> None:
    modules = [p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts]
    assert len(modules) > 100  # the tree was read
    assert _clashes(modules) == []


def test_the_check_sees_a_clash() -> None:
    assert _clashes([Path("a/test_x.py"), Path("b/test_x.py"), Path("b/conftest.py"),
                     Path("c/conftest.py")]) == ["test_x.py"]  # fmt: skip
