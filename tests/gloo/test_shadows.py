"""A promoted shadow's replacement warms once training resumed, not during the recovery."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from leto.backends.gloo.records import Proc
from leto.backends.gloo.shadows import Shadows


class _Children:
    def __init__(self) -> None:
        self.spawned: list[tuple[int, str]] = []

    def keeper(self, lr: int, op: str, *args: Any) -> None:
        pass

    def kill(self, p: Proc, **kw: Any) -> None:
        pass

    def spawn(self, lr: int, role: str, **kw: Any) -> None:
        self.spawned.append((lr, role))


def _agent(*, recovering: bool) -> Any:
    warm = Proc(pid=11, pidfd=-1, role="shadow", local_rank=0, rank=0, incarnation=2,
                spawned=0.0, log_path="", conn=object(), status="warm")  # fmt: skip
    a = SimpleNamespace(
        shadow={0: warm},
        shadow_state={0: "warm"},
        trainer={0: None},
        children=_Children(),
        keepers={0: SimpleNamespace(pid=5, socket_name="k0")},
        routing=SimpleNamespace(send_proc=lambda p, msg: None),
        recovering=recovering,
        generation=0,
        node=0,
        spawns={},
        o=SimpleNamespace(shadows=True, nnodes=1),
        degraded={},
        complete=False,
        stop=False,
        reclaimed=False,
    )
    a.shadows = Shadows(a)
    return a


def test_the_replacement_waits_for_the_recovery_to_resume() -> None:
    a = _agent(recovering=True)
    a.shadows.promote(0, 1)
    assert a.trainer[0].pid == 11 and a.trainer[0].role == "trainer"
    assert a.children.spawned == []  # not while the recovery runs
    a.recovering = False
    a.shadows.resumed()
    assert a.children.spawned == [(0, "shadow")]
    a.shadows.resumed()  # once
    assert a.children.spawned == [(0, "shadow")]


def test_outside_a_recovery_the_replacement_starts_at_once() -> None:
    a = _agent(recovering=False)
    a.shadows.promote(0, 1)
    assert a.children.spawned == [(0, "shadow")]
