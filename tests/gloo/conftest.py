"""Fixtures for the real-process tests: every test must leave no process and no shm behind.

Every process a test starts carries the test's unique tag (its tmp path) in its
command line: keepers get ``--tag``, agents and launchers have it in ``--run-dir``,
and trainers are forked from an agent (same command line). After the test the
guard waits briefly, then fails if any such process is alive (and kills it, so one
failure does not cascade) or if a new entry appeared in ``/dev/shm``. Then every run
directory the test left under its tag is replayed through the core's model (``leto
spec trace``): :func:`jobs.job` checks its own job at once, this catches the others
(the demo's, a job started by hand).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # jobs.py
from etcd import EtcdCluster  # noqa: E402
from jobs import STEPS_1x2, STEPS_2x2, assert_trace, explain, guard, job, shm_entries  # noqa: E402

from leto.backends.gloo.harness import JobResult  # noqa: E402


@pytest.fixture
def tag(tmp_path: Path) -> Iterator[str]:
    """A string unique to this test, found in the command line of every process it starts."""
    before = shm_entries()
    t = str(tmp_path)
    yield t
    guard(t, before)
    for log in sorted(tmp_path.rglob("events.jsonl")):
        assert_trace(log.parent)


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory for jobs shared by several tests (guarded once, at the end)."""
    before = shm_entries()
    d = tmp_path_factory.mktemp("shared-jobs")
    yield d
    guard(str(d), before)


@pytest.fixture(scope="session")
def ref_2x2(session_dir: Path) -> JobResult:
    """The failure-free 2 nodes x 2 ranks job (c10d) that 2 x 2 jobs are compared with."""
    res = job(session_dir / "ref-2x2", nnodes=2, nproc=2, steps=STEPS_2x2)
    assert res.ok and res.digests, explain(res)
    return res


@pytest.fixture(scope="session")
def ref_1x2(session_dir: Path) -> JobResult:
    """The failure-free 1 node x 2 ranks job that 1 x 2 jobs are compared with."""
    res = job(session_dir / "ref-1x2", steps=STEPS_1x2)
    assert res.ok and res.digests, explain(res)
    return res


@pytest.fixture
def etcd_cluster(tag: str, tmp_path: Path) -> Iterator[EtcdCluster]:
    """A 3-member etcd cluster on 127.0.0.1 of this test's own (fails if etcd is missing)."""
    cluster = EtcdCluster(tmp_path / "etcd")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def etcd_shared(session_dir: Path) -> Iterator[EtcdCluster]:
    """One 3-member cluster for the tests that kill no member (each its own job id)."""
    cluster = EtcdCluster(session_dir / "etcd")
    try:
        yield cluster
    finally:
        cluster.stop()
