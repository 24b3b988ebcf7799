"""Run test files without pytest (a lent machine may lack it): a stand-in ``pytest``
module with the few parts these files use (``mark.skipif``/``parametrize``, ``param``,
``fixture(params=...)``, ``raises``, ``FixtureRequest``, the ``tmp_path`` and ``monkeypatch`` arguments),
and a junit XML of the results as pytest writes it, for :mod:`run_parts`.

    python tests/gpu/plain_runner.py JUNIT.xml FILE...

Only what those files use is here; a file using more fails loudly (an unknown
argument), never passes silently.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import itertools
import re
import shutil
import sys
import tempfile
import traceback
import types
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class Skipped(Exception):
    pass


class MarkDecorator:
    def __init__(self, name: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None):
        self.name, self.args, self.kwargs = name, args, kwargs or {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and inspect.isfunction(args[0]):
            args[0].__dict__.setdefault("_marks", []).append(self)  # used as a decorator
            return args[0]
        return MarkDecorator(self.name, args, kwargs)


class _Marks:
    def __getattr__(self, name: str) -> MarkDecorator:
        return MarkDecorator(name)


class ParameterSet:
    def __init__(self, values: tuple[Any, ...], marks: list[MarkDecorator]):
        self.values, self.marks = values, marks


def param(*values: Any, marks: Any = ()) -> ParameterSet:
    return ParameterSet(values, list(marks) if isinstance(marks, list | tuple) else [marks])


def fixture(params: list[Any] | None = None) -> Callable[[Any], Any]:
    def deco(fn: Any) -> Any:
        fn._fixture_params = params if params is not None else [None]
        return fn

    return deco


class FixtureRequest:
    def __init__(self, param: Any) -> None:
        self.param = param


_ABSENT = object()


class MonkeyPatch:
    """``setattr`` undone after the test (the one method of pytest's these files use)."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def setattr(self, target: Any, name: str, value: Any) -> None:
        # the attribute as the target itself holds it (a class's own dict: no descriptor
        # unwrapped, an inherited one absent and deleted again afterwards)
        own = vars(target) if isinstance(target, type) else {name: getattr(target, name)}
        self._undo.append((target, name, own.get(name, _ABSENT)))
        setattr(target, name, value)

    def undo(self) -> None:
        for target, name, old in reversed(self._undo):
            if old is _ABSENT:
                delattr(target, name)
            else:
                setattr(target, name, old)
        self._undo.clear()


@contextlib.contextmanager
def raises(exc: type[BaseException], match: str | None = None) -> Iterator[None]:
    try:
        yield
    except exc as e:
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(f"{e!r} does not match {match!r}") from None
        return
    raise AssertionError(f"DID NOT RAISE {exc.__name__}")


def skip(reason: str = "") -> None:
    raise Skipped(reason)


def stand_in() -> types.ModuleType:
    m = types.ModuleType("pytest")
    m.__dict__.update(mark=_Marks(), param=param, fixture=fixture, raises=raises)
    m.__dict__.update(FixtureRequest=FixtureRequest, MonkeyPatch=MonkeyPatch, skip=skip)
    return m


def as_set(v: Any) -> ParameterSet:
    return v if isinstance(v, ParameterSet) else ParameterSet((v,), [])


def cases(fn: Any, fixtures: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], list[Any]]]:
    """(id, arguments, marks) of every case of ``fn``; fixture values are produced later."""
    axes: list[list[tuple[str, dict[str, Any], list[Any]]]] = []
    for mk in reversed(fn.__dict__.get("_marks", [])):
        if mk.name != "parametrize":
            continue
        names = [n.strip() for n in mk.args[0].split(",")]
        axis = []
        for v in mk.args[1]:
            ps = as_set(v) if len(names) == 1 or isinstance(v, ParameterSet) else None
            ps = ps or ParameterSet(tuple(v), [])
            axis.append(
                ("-".join(map(str, ps.values)), dict(zip(names, ps.values, strict=True)), ps.marks)
            )
        axes.append(axis)
    for name in inspect.signature(fn).parameters:
        if name in fixtures:
            axis = []
            for v in fixtures[name]._fixture_params:
                ps = as_set(v)
                axis.append((str(ps.values[0]), {name: ("fixture", ps.values[0])}, ps.marks))
            axes.append(axis)
    for combo in itertools.product(*axes):
        args: dict[str, Any] = {}
        marks: list[Any] = []
        for _, a, m in combo:
            args.update(a)
            marks += m
        yield "-".join(c[0] for c in combo), args, marks


def skip_reason(marks: list[Any]) -> str | None:
    for mk in marks:
        if mk.name == "skipif" and mk.args and mk.args[0]:
            return str(mk.kwargs.get("reason", ""))
    return None


def run_case(fn: Any, args: dict[str, Any], fixtures: dict[str, Any]) -> None:
    call: dict[str, Any] = {}
    gens = []
    tmp: list[str] = []
    patches = MonkeyPatch()
    try:
        for name in inspect.signature(fn).parameters:
            if name in args and isinstance(args[name], tuple) and args[name][:1] == ("fixture",):
                got = fixtures[name](FixtureRequest(args[name][1]))
                if inspect.isgenerator(got):
                    gens.append(got)
                    got = next(got)
                call[name] = got
            elif name in args:
                call[name] = args[name]
            elif name == "monkeypatch":
                call[name] = patches
            elif name == "tmp_path":
                tmp.append(tempfile.mkdtemp(prefix="leto-plain-"))
                call[name] = Path(tmp[-1])
            else:
                raise TypeError(f"plain_runner has no fixture {name!r}")
        fn(**call)
        for g in gens:
            next(g, None)  # the fixture's teardown (its checks) runs
    finally:
        patches.undo()
        for d in tmp:
            shutil.rmtree(d, ignore_errors=True)


def main(junit: str, files: list[str]) -> int:
    sys.modules["pytest"] = stand_in()
    suite = ET.Element("testsuite")
    failed = 0
    for f in files:
        paths = sorted(Path(f).glob("test_*.py")) if Path(f).is_dir() else [Path(f)]
        for path in paths:
            sys.path.insert(0, str(path.parent))
            spec = importlib.util.spec_from_file_location(path.stem, path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            pm = getattr(mod, "pytestmark", [])
            module_marks = pm if isinstance(pm, list) else [pm]
            fixtures = {k: v for k, v in vars(mod).items() if hasattr(v, "_fixture_params")}
            tests = [(k, v) for k, v in vars(mod).items() if k.startswith("test_") and callable(v)]
            for name, fn in tests:
                for cid, args, marks in cases(fn, fixtures):
                    case = ET.SubElement(suite, "testcase", classname=path.stem)
                    case.set("name", f"{name}[{cid}]" if cid else name)
                    why = skip_reason(module_marks + fn.__dict__.get("_marks", []) + marks)
                    if why is not None:
                        ET.SubElement(case, "skipped", message=why)
                        continue
                    try:
                        run_case(fn, args, fixtures)
                    except Skipped as e:
                        ET.SubElement(case, "skipped", message=str(e))
                    except BaseException as e:  # noqa: BLE001 - a test's failure, reported
                        failed += 1
                        bad = ET.SubElement(case, "failure", message=f"{type(e).__name__}: {e}")
                        bad.text = traceback.format_exc()
                        print(bad.text, file=sys.stderr)
    ET.ElementTree(suite).write(junit)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
