"""A script under ``leto launch`` that never calls ``leto.wrap``: told so while it runs.

``leto launch`` gives a script what ``torchrun`` gives (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``: the job's TCPStore), so a plain torchrun script
runs, unprotected: a failure ends the job, and until this module it heard so only at
its end. A trainer watches its script from its start until ``leto.wrap`` (gloo) is
called, for two signs, whichever comes first:

* the script forms its own process group (``torch.distributed.init_process_group``:
  the rendezvous of every rank, a DDP script's first collective; DDP's own are made in
  C++, out of Python's sight). The function is wrapped in this process only, and only
  until ``leto.wrap``, which puts torch's own back; leto's own calls pass through;
* :data:`WAIT_S` seconds after its start, nothing the script has loaded refers to leto
  (its ``__main__`` and the modules imported since it began: a script that will call
  ``leto.wrap`` has imported it). A process group formed by a script that does refer
  to leto is no sign either: it may call ``leto.wrap`` next.

The first sign goes to the agent (:class:`.messages.Unprotected`), which says so in one
line on its console and passes it on to the event log. Only trainers watch: a shadow
runs the same script.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

__all__ = ["WAIT_S", "ShadowGroups", "Watch"]

WAIT_S = 3.0
_FORMS = ("init_process_group",)  # the functions that form the default process group


class Watch:
    """One trainer's watch for a script that does not call ``leto.wrap``; ``tell`` is
    called once, with how it was seen, on the first sign."""

    def __init__(self, tell: Callable[[str], None], wait_s: float = WAIT_S) -> None:
        self.tell = tell
        self.before = frozenset(sys.modules)  # what the process had loaded for itself
        self.done = False  # told, or leto.wrap was called
        self._lock = threading.Lock()
        self._originals: list[tuple[types.ModuleType, str, Any]] = []
        self._timer = threading.Timer(wait_s, self._timed)
        self._timer.daemon = True
        self._timer.name = "leto-unwrapped"

    def start(self) -> None:
        self._originals = _replace_forms(self._watched)
        self._timer.start()

    def wrapped(self) -> None:
        """``leto.wrap`` was called: no more watching, torch's functions as they were."""
        with self._lock:
            self.done = True
        self._timer.cancel()
        for module, name, fn in self._originals:
            setattr(module, name, fn)
        self._originals.clear()

    def refers_to_leto(self) -> bool:
        """Does the script's ``__main__``, or a module loaded since it began, hold leto
        (the package, a module or a function or class of it)?"""
        main = sys.modules.get("__main__")
        mods = [m for k, m in list(sys.modules.items()) if k not in self.before]
        for m in [main, *mods]:
            if m is None or getattr(m, "__name__", "").partition(".")[0] == "leto":
                continue
            for v in list(getattr(m, "__dict__", {}).values()):
                if isinstance(v, types.ModuleType):
                    name = v.__name__
                elif isinstance(v, (types.FunctionType, type)):
                    name = str(getattr(v, "__module__", "") or "")
                else:
                    continue
                if name.partition(".")[0] == "leto":
                    return True
        return False

    def _watched(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            caller = str(sys._getframe(1).f_globals.get("__name__", ""))
            if not self.done and not caller.startswith("leto.") and not self.refers_to_leto():
                self._seen("it formed its own process group")
            return fn(*args, **kwargs)

        return call

    def _timed(self) -> None:
        if not self.done and not self.refers_to_leto():
            self._seen(f"it has run {self._timer.interval:g} s and refers to leto nowhere")

    def _seen(self, how: str) -> None:
        with self._lock:
            if self.done:
                return
            self.done = True
        try:
            self.tell(how)
        except Exception:  # noqa: BLE001 - a notice never stops the script
            pass


class ShadowGroups:
    """A shadow runs its rank's script up to ``leto.wrap``, beside the rank's trainer. A
    script that forms its own process group before it (a torchrun script keeps its
    ``init_process_group``) must not join the job's rendezvous as a second process of
    the rank (it held the trainers' rendezvous: a job that hung at its start): in a
    shadow the call forms a group of the shadow's own on torch's fake backend, of the
    rank and world size it will have, so ``dist.get_rank()`` and a
    ``DistributedSampler`` work as in the trainer. ``leto.wrap`` puts torch's function
    back (:meth:`wrapped`); a promoted shadow's communicators replace the fake group."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._originals: list[tuple[types.ModuleType, str, Any]] = []

    def start(self) -> None:
        self._originals = _replace_forms(self._alone)

    def wrapped(self) -> None:
        for module, name, fn in self._originals:
            setattr(module, name, fn)
        self._originals.clear()

    def _alone(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            caller = str(sys._getframe(1).f_globals.get("__name__", ""))
            if caller.startswith("leto."):
                return fn(*args, **kwargs)
            return fn("fake", store=fake_store(), rank=self.rank, world_size=self.world)

        return call


def fake_store() -> Any:
    """torch's fake backend and its store (``torch.testing._internal``: a private module,
    kept here alone; tests/gloo/test_processes.py fails when torch changes it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def _replace_forms(
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> list[tuple[types.ModuleType, str, Any]]:
    """torch's functions that form the default process group, each replaced by
    ``wrap(it)``; what was replaced, to put back."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    out = []
    for module in (dist, distributed_c10d):
        for name in _FORMS:
            fn = getattr(module, name, None)
            if fn is not None:
                out.append((module, name, fn))
                setattr(module, name, wrap(fn))
    return out
