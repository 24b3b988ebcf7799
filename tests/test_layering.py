"""The architecture as a test: layers import only downwards, and nothing imports in a cycle.

Every ``import`` in ``leto/`` counts, at module level, inside a function (an import
hidden in a function body still couples the layers) or under ``if TYPE_CHECKING:`` (an
annotation naming its owner couples a part to the whole owner as much as a runtime
import: a part gets the narrow interface it uses, a Protocol or its arguments). Layers,
lowest first::

    core  <  retained  <  backends  <  adapters  <  bench, sim, testing, cli

``leto/core`` imports no torch and nothing of leto outside the core.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "leto"

# the layer of each top-level part of leto; a module imports only its own layer or lower
LAYER = {
    "core": 0,
    "errors": 0,
    "argcheck": 0,
    "private": 0,
    "jobs": 0,  # which records of a run directory's event log are one job's
    "retained": 1,
    "backends": 2,
    "adapters": 3,
    "spec.location": 0,  # a path, nothing else
    "spec.trace": 1,  # the core model over an event log: no torch, no backend
    "spec.state_record": 1,  # the core model's state as JSON (a compacted trace starts there)
    "spec.tlc": 3,
    "spec": 4,
    "bench": 4,
    "sim": 4,
    "testing": 4,
    "hf": 4,  # `from leto.hf import Trainer`: the adapter's names, imported on demand
    "cli": 5,
    "__init__": 5,
    "__main__": 5,
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_module(name: str) -> bool:
    path = PKG.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports_of(path: Path) -> set[str]:
    """Every module of leto that ``path`` imports (absolute or relative, anywhere)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "leto")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "leto":
                continue
            # `from leto.core import events` imports the submodule leto.core.events
            subs = [mod + "." + a.name for a in node.names if is_module(mod + "." + a.name)]
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(mod)  # a name defined in mod itself
    return out


def graph() -> nx.DiGraph:
    g = nx.DiGraph()
    mods = {module_name(p): p for p in PKG.rglob("*.py")}
    for name, path in mods.items():
        g.add_node(name)
        for dep in imports_of(path):
            target = dep
            while target not in mods and "." in target:
                target = target.rpartition(".")[0]
            if target in mods and target != name:
                g.add_edge(name, target)
    return g


def layer(module: str) -> int:
    parts = module.split(".")
    if ".".join(parts[1:3]) in LAYER:
        return LAYER[".".join(parts[1:3])]
    return LAYER[parts[1] if len(parts) > 1 else "__init__"]


def violations(g: nx.DiGraph) -> list[str]:
    out = []
    for a, b in g.edges:
        parents = {b} | {b.rpartition(".")[0]}
        if a in parents or b == "leto":
            continue  # a package's own __init__
        if layer(a) < layer(b):
            out.append(f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})")
    return sorted(out)


def test_every_part_of_leto_has_a_layer() -> None:
    parts = {p.name.removesuffix(".py") for p in PKG.iterdir() if p.suffix == ".py" or p.is_dir()}
    parts.discard("__pycache__")
    parts.discard("data")
    assert parts <= set(LAYER), sorted(parts - set(LAYER))


def test_layers_import_only_downwards() -> None:
    assert violations(graph()) == []


def test_no_import_cycles() -> None:
    cycles = list(nx.simple_cycles(graph()))
    assert cycles == [], cycles[:5]


def test_the_walker_sees_a_part_importing_its_owner_for_its_annotations(tmp_path: Path) -> None:
    # a checker's test includes a case it must reject: a part that names its owner in
    # an annotation (under TYPE_CHECKING) while the owner imports the part
    fake_root = tmp_path / "repo"
    pkg = fake_root / "leto" / "backends"
    pkg.mkdir(parents=True)
    for f in ("leto/__init__.py", "leto/backends/__init__.py"):
        (fake_root / f).write_text("")
    (pkg / "owner.py").write_text("from .part import Part\n")
    (pkg / "part.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .owner import Owner\n"
    )
    globals()["ROOT"], globals()["PKG"] = fake_root, fake_root / "leto"
    try:
        cycles = list(nx.simple_cycles(graph()))
    finally:
        globals()["ROOT"], globals()["PKG"] = ROOT_REAL, PKG_REAL
    assert [sorted(c) for c in cycles] == [["leto.backends.owner", "leto.backends.part"]]


def test_the_core_imports_nothing_but_the_core() -> None:
    for path in (PKG / "core").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for n in names:
                assert n.split(".")[0] not in ("torch", "numpy", "time", "random", "os"), (
                    f"{path.name} imports {n}"
                )
                if n.startswith("leto"):
                    assert n.startswith("leto.core"), f"{path.name} imports {n}"


@pytest.mark.parametrize(
    "source,edge",
    [
        ("from leto.adapters.config import ConfigError\n", "leto.adapters.config"),
        ("def f():\n    import leto.adapters.api\n", "leto.adapters.api"),
    ],
)
def test_the_walker_sees_a_backend_importing_an_adapter(
    tmp_path: Path, source: str, edge: str
) -> None:
    # a checker's test includes a case it must reject: a planted upward import
    fake_root = tmp_path / "repo"
    pkg = fake_root / "leto"
    (pkg / "backends").mkdir(parents=True)
    (pkg / "adapters").mkdir()
    for f in ("__init__.py", "backends/__init__.py", "adapters/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "adapters" / "config.py").write_text("")
    (pkg / "adapters" / "api.py").write_text("")
    (pkg / "backends" / "bad.py").write_text(source)
    globals()["ROOT"], globals()["PKG"] = fake_root, pkg
    try:
        bad = violations(graph())
    finally:
        globals()["ROOT"], globals()["PKG"] = ROOT_REAL, PKG_REAL
    assert bad == [f"leto.backends.bad (layer 2) imports {edge} (layer 3)"]


ROOT_REAL, PKG_REAL = ROOT, PKG
