"""Fixtures of the test-host tests: namespaces made and removed (``netns.py``), and the
real-process guard of ``tests/gloo``: no process of the test's tag and no new
``/dev/shm`` entry left behind, and every run directory's trace replayed."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "gloo"))  # jobs.py, scripts/
from jobs import STEPS_2x2, assert_trace, explain, guard, job, shm_entries  # noqa: E402
from netns import Hosts, namespaces, unavailable  # noqa: E402

from leto.backends.gloo.harness import JobResult  # noqa: E402


@functools.cache
def _why_not() -> str | None:
    return unavailable()


@pytest.fixture
def make_hosts() -> Iterator[Callable[[int], Hosts]]:
    """``make_hosts(n)``: n test hosts, removed after the test (skipped with the reason
    where namespaces cannot be made); the test fails if any namespace is left."""
    why = _why_not()
    if why is not None:
        pytest.skip(f"test hosts unavailable: {why}")
    made: list[Hosts] = []

    def make(n: int) -> Hosts:
        h = Hosts(n)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()
    left = [ns for h in made for ns in [h.bridge, *h.names] if ns in namespaces()]
    assert not left, f"namespaces left after the test: {left}"


@pytest.fixture
def tag(tmp_path: Path) -> Iterator[str]:
    """A string in the command line of every process the test starts (its tmp path)."""
    before = shm_entries()
    t = str(tmp_path)
    yield t
    guard(t, before)
    for log in sorted(tmp_path.rglob("events.jsonl")):
        assert_trace(log.parent)


@pytest.fixture(scope="session")
def ref(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    """The failure-free 2 x 2 job on 127.0.0.1 that the jobs on test hosts are compared with."""
    res = job(tmp_path_factory.mktemp("ref") / "ref-2x2", nnodes=2, nproc=2, steps=STEPS_2x2)
    assert res.ok and res.digests, explain(res)
    return res
