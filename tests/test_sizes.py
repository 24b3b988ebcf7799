"""Sizes that keep the parts readable: no module of leto over 1,000 lines and no class
over 30 methods. A part that grows past them is split by the state it owns, not by
method (spec/CHANGING.md). A Protocol is not counted: its members are the declarations
of what a part reads of its owner (its width is that part's dependency, not code)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "leto"
MAX_LINES = 1000
MAX_METHODS = 30


def too_big(path: Path, source: str) -> list[str]:
    out = []
    lines = source.count("\n") + (not source.endswith("\n") and bool(source))
    if lines > MAX_LINES:
        out.append(f"{path}: {lines} lines (at most {MAX_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and not any(
            ast.unparse(b).endswith("Protocol") for b in node.bases
        ):
            methods = sum(isinstance(x, ast.FunctionDef | ast.AsyncFunctionDef) for x in node.body)
            if methods > MAX_METHODS:
                out.append(
                    f"{path}: class {node.name} has {methods} methods (at most {MAX_METHODS})"
                )
    return out


def test_no_module_or_class_of_leto_is_too_big() -> None:
    found = [x for p in sorted(PKG.rglob("*.py")) for x in too_big(p, p.read_text())]
    assert found == []


def test_the_size_check_rejects_a_big_class_and_a_long_module() -> None:
    # a checker's test includes a case it must reject
    big = "class Big:\n" + "".join(f"    def m{i}(self) -> None: ...\n" for i in range(31))
    assert too_big(Path("big.py"), big) == ["big.py: class Big has 31 methods (at most 30)"]
    long = "x = 0\n" * 1001
    assert too_big(Path("long.py"), long) == ["long.py: 1001 lines (at most 1000)"]
    proto = "class Host(Protocol):\n" + "".join(
        f"    def m{i}(self) -> None: ...\n" for i in range(40)
    )
    assert too_big(Path("host.py"), proto) == []
    ok = "class Small:\n" + "".join(f"    def m{i}(self) -> None: ...\n" for i in range(30))
    assert too_big(Path("ok.py"), ok) == []
