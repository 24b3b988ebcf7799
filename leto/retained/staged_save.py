"""Asynchronous disk checkpoints: the state staged in host buffers, written beside training.

A checkpoint written synchronously stalls the training loop for the whole DCP save. An
asynchronous one stalls it only while the state is *staged*: every tensor of the DCP
state dict copied into a host buffer this process owns (:class:`HostStage`; the
buffers are kept and reused by the next checkpoint, so staging allocates once). The
retained state goes on changing after that copy; the write reads the copy only.

:class:`BackgroundSave` then runs the write (a DCP save) on a thread of its own, and
only when it has completed, and the save was not cancelled meanwhile, its ``finish``
(the writer's metadata, its report that feeds the protocol's ``WriteShard``). A save
that failed, or that was cancelled (a recovery began: its generation is over), runs
``abort`` instead (its partial files removed), never ``finish``: a checkpoint
becomes durable only from writes that completed. The cancel and the finish exclude
each other (one lock): after :meth:`BackgroundSave.cancel` returns, ``finish`` has
either run to its end already or never will; and ``abort`` runs after a cancel even
when this writer's part completed, since a peer's part may not have (``abort``
removes only a checkpoint that is not complete).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BackgroundSave", "HostStage"]

WRITER_THREAD = "leto-ckpt-writer"


class HostStage:
    """Host buffers this process owns, one per tensor of a state dict (by its key path),
    kept from one checkpoint to the next."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, ...], torch.Tensor] = {}

    def drop(self) -> None:
        """Forget the buffers (a write that may still read them was abandoned)."""
        self._buffers = {}

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` (nested dicts and lists): every tensor copied into its
        host buffer, everything else deep-copied."""
        return self._copy(state, ())

    def _copy(self, obj: Any, path: tuple[str, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            buf = self._buffers.get(path)
            src = obj.detach()
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, device="cpu")
                self._buffers[path] = buf
            buf.copy_(src)
            return buf
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, str(k))) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._copy(v, (*path, str(i))) for i, v in enumerate(obj)]
        return copy.deepcopy(obj)


class BackgroundSave:
    """One checkpoint's write on a thread: ``write``, then ``finish`` if it completed and
    was not cancelled, else ``abort`` (see the module docstring)."""

    def __init__(
        self,
        step: int,
        write: Callable[[], object],
        finish: Callable[[], None],
        abort: Callable[[], None],
    ) -> None:
        self.step = step
        self._write = write
        self._finish = finish
        self._abort = abort
        self._lock = threading.Lock()
        self.cancelled = False
        self.completed = False  # finish ran
        self._ended = False  # the thread is past its finish or abort
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=WRITER_THREAD, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        ok = False
        try:
            self._write()
            ok = True
        except BaseException as e:  # noqa: BLE001 - a broken group or disk: aborted below
            self.error = e
        with self._lock:
            self._ended = True
            if ok and not self.cancelled:
                try:
                    self._finish()
                    self.completed = True
                    return
                except BaseException as e:  # noqa: BLE001
                    self.error = e
            self._try_abort()

    def _try_abort(self) -> None:
        try:
            self._abort()
        except OSError:
            pass

    def cancel(self) -> None:
        """The save must not finish (its generation is over); returns at once (after a
        ``finish`` under way, if one is). A save whose thread has ended already runs
        ``abort`` here (it removes only what never became complete: another writer may
        have died before finishing its part)."""
        with self._lock:
            self.cancelled = True
            if self._ended:
                self._try_abort()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; whether the save completed (``finish`` ran)."""
        self.thread.join(timeout)
        return self.completed

    @property
    def running(self) -> bool:
        return self.thread.is_alive()
