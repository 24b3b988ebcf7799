"""Stop points inside a step's forward and backward: a recovery is noticed within a layer.

A survivor learns of a recovery (the coordinator's ``abort``, on the agent channel's
reader thread) while it computes the step in flight. Checked only at the step's safe
points (after the forward, after the backward), it would finish that compute first,
and the whole job would wait for it: the time until training runs again would grow
with the model (a step's compute is proportional to its parameters), though nothing
of the retained state is touched. So the step's compute stops at the next layer:

* before the forward of every module that holds parameters (a forward pre-hook);
* before the backward of every such module (a hook on its output's gradient,
  registered by a forward hook, so nothing is kept on the parameters themselves,
  which attaching the retained state may replace).

A stop hands over to ``pause`` (the step transaction's :meth:`~.transaction.
StepTransaction.paused`), which returns for the compute to go on (a recovery runs
beside it on another thread; or it ended and the core judged that the compute stands
as the rank's compute after it: :func:`leto.core.reconcile.keeps_compute`), waits
there (the recovery is about to write what the compute reads), or raises (the
compute is void). Without ``pause`` a stop raises ``exc``, as a safe
point does, and the step is void. Either is safe: the forward and backward write
nothing but private tensors (the gradients enter retained memory after the
all-reduce, PREPARE after that), so a void step is run again after the recovery
from its process state, and a kept one reads only bytes the recovery left as they
were. Each stop point passed also calls ``tick`` (the session's: progress that the
agent's hang check sees, so a forward or backward longer than the hang timeout is not
taken for a hang while its layers go by). The hooks check only while
:meth:`StopPoints.armed` (the step function's
forward and backward): a forward outside it (an evaluation, the user's own loop) is
never stopped, nor is anything the recovery itself runs (disarmed while ``pause``
runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["StopPoints"]


class StopPoints:
    """Raise ``exc`` inside ``model``'s forward/backward once ``stopped()`` is true."""

    def __init__(self, model: nn.Module, stopped: Callable[[], bool], exc: type[Exception]) -> None:
        self.stopped = stopped
        self.exc = exc
        self.on = False
        self.pause: Callable[[], None] | None = None  # carries the recovery out, or raises
        self.tick: Callable[[], None] | None = None  # called at every stop point passed
        for mod in model.modules():
            if next(mod.parameters(recurse=False), None) is not None:
                mod.register_forward_pre_hook(self._before)
                mod.register_forward_hook(self._after)

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        before, self.on = self.on, True
        try:
            yield
        finally:
            self.on = before

    def check(self) -> None:
        if not self.on:
            return
        if self.tick is not None:
            self.tick()  # a layer went by: progress for the agent's hang check
        if not self.stopped():
            return
        if self.pause is None:
            raise self.exc("a recovery started: the step in flight stops here")
        self.on = False  # nothing the recovery runs is stopped
        try:
            self.pause()
        finally:
            self.on = True

    def _before(self, module: nn.Module, args: Any) -> None:
        self.check()

    def _after(self, module: nn.Module, args: Any, out: Any) -> None:
        if not self.on:
            return
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._grad)  # type: ignore[no-untyped-call]
                return

    def _grad(self, grad: torch.Tensor) -> None:
        self.check()
