"""The agent's account of a trainer's exit (children.Children.finalize_exit): a trainer
that said it was done, in a complete job, ended; one whose status is unknown before
that died."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

from leto.backends.gloo.children import Children
from leto.backends.gloo.records import Proc


def _agent(complete: bool) -> tuple[Any, Proc, list[Any]]:
    sent: list[Any] = []
    finished: list[bool] = []
    r, w = os.pipe()
    os.close(w)
    p = Proc(
        pid=4242, pidfd=r, role="trainer", local_rank=0, rank=0, incarnation=0,
        spawned=0.0, log_path="",
    )  # fmt: skip
    a = SimpleNamespace(
        by_pid={p.pid: p},
        unclaimed_boards={},
        trainer={0: p},
        stop=False,
        complete=complete,
        supervisor=SimpleNamespace(check_node_finished=lambda: finished.append(True)),
        say=lambda text: None,
        shadows=SimpleNamespace(ensure=lambda lr: None),
        routing=SimpleNamespace(to_coord=sent.append, drop_conn=lambda c: None),
        recovering=False,
    )
    a.finished = finished
    return a, p, sent


@pytest.mark.parametrize("code", [0, None])
def test_a_done_trainer_of_a_complete_job_ended_whatever_its_status(code: int | None) -> None:
    a, p, sent = _agent(complete=True)
    p.phase, p.exited, p.dead_at = "done", code, 1.0
    Children(a).finalize_exit(p)  # type: ignore[arg-type]
    assert p.done and sent == [] and a.finished == [True]


def test_an_unknown_status_before_the_end_is_a_death() -> None:
    a, p, sent = _agent(complete=True)
    p.phase, p.exited, p.dead_at, p.hb = "forward", None, 1.0, 0.9
    p.status = "running"  # it called leto.wrap (its Ready): it trains
    Children(a).finalize_exit(p)  # type: ignore[arg-type]
    assert not p.done and [m.kind for m in sent] == ["crash"]
    assert sent[0].detail == "exit status unknown"


@pytest.mark.parametrize("code", [0, None])
def test_a_script_that_ended_before_leto_wrap_is_told_so_whatever_its_status(
    code: int | None,
) -> None:
    # None: the zygote's status came too late (a busy machine); the script still ended
    # while starting, before its Ready
    a, p, sent = _agent(complete=False)
    p.phase, p.exited, p.dead_at, p.hb = "startup", code, 1.0, 0.9
    Children(a).finalize_exit(p)  # type: ignore[arg-type]
    status = "exit code 0" if code == 0 else "exit status unknown"
    assert [m.detail for m in sent] == [
        f"the script ended ({status}) without calling leto.wrap with backend='gloo': "
        "`leto launch` runs scripts wrapped by leto"
    ]
