"""The subnormal mode (``torch.set_flush_denormal``) is the thread's own, and a thread
starts with its creator's: the mode at ``leto.wrap`` is the one every step and every
recovery computes in. A recovery beside the compute takes it on its own thread (whose
creator, the channel's reader, predates the script's call); a mode changed after
``leto.wrap`` is refused in one line at the next step, since a promoted shadow would
compute its recovery in the mode its script had at ``leto.wrap``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from jobs import explain, job
from torch import nn

from leto.backends.gloo.runtime import GlooSession
from leto.backends.gloo.transaction import StepTransaction
from leto.retained.process_state import flush_denormal_on


@pytest.fixture
def float_mode() -> Iterator[None]:
    """The test's thread back in the default mode (no flushing) afterwards."""
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def test_the_probe_reads_the_threads_own_mode(float_mode: None) -> None:
    assert not flush_denormal_on()
    assert torch.set_flush_denormal(True), "this CPU cannot flush subnormals"
    assert flush_denormal_on()
    seen: list[bool] = []
    t = threading.Thread(target=lambda: seen.append(flush_denormal_on()))
    t.start()
    t.join()
    assert seen == [True]  # a new thread starts with its creator's mode
    torch.set_flush_denormal(False)
    assert not flush_denormal_on()


def test_a_recovery_beside_the_compute_computes_in_the_steps_mode(float_mode: None) -> None:
    # the steps ran flushed (the session's mode at wrap); the abort is seen on a thread
    # that does not flush (the channel's reader, started before the script's call)
    seen: list[bool] = []
    sent: list[Any] = []

    def follow(**_: Any) -> None:
        seen.append(flush_denormal_on())  # where a roll forward would compute

    s = SimpleNamespace(
        model=nn.Linear(2, 2),
        flush_denormal=True,
        rank=0,
        gen=0,
        groups=SimpleNamespace(destroy=lambda: None),
        ch=SimpleNamespace(mark=lambda *a: None, send=sent.append),
        follower=SimpleNamespace(_follow=follow),
    )
    txn = StepTransaction(s)  # type: ignore[arg-type]
    txn._computing = True
    txn._abort_seen()
    rec = txn._rec
    assert rec is not None and rec.done.wait(10), "the recovery thread did not end"
    assert rec.error is None, rec.error
    assert seen == [True] and len(sent) == 1


def test_a_mode_changed_after_wrap_is_refused_in_one_line(float_mode: None) -> None:
    s = SimpleNamespace(flush_denormal=False)
    GlooSession.check_float_mode(s)  # type: ignore[arg-type]  # unchanged: nothing said
    torch.set_flush_denormal(True)
    with pytest.raises(RuntimeError) as e:
        GlooSession.check_float_mode(s)  # type: ignore[arg-type]
    msg = str(e.value)
    assert "\n" not in msg and "turned subnormal flushing on after leto.wrap" in msg, msg
    s.flush_denormal = True
    GlooSession.check_float_mode(s)  # type: ignore[arg-type]


def test_a_script_that_changes_the_mode_after_wrap_ends_in_one_line(tag: str) -> None:
    res = job(Path(tag) / "run", steps=4, env={"FLUSH_AFTER_WRAP": "1"}, timeout=90)
    assert not res.ok, explain(res)
    (failed,) = res.of("job_failed")
    # the script raises at its first step after wrap: where every rank's ready reached
    # the coordinator first, the same exception 3 times in a row ends the job; where
    # this rank raised before (a race of the ranks' start), it failed before training
    # started: either way, one line with the fix
    assert (
        "3 times in a row" in failed["error"] or "failed before training started" in failed["error"]
    ), failed
    assert (
        "torch.set_flush_denormal() turned subnormal flushing on after leto.wrap"
        in (failed["error"])
    ), failed
    assert res.error is not None and "\n" not in res.error
