"""One rank's process state: what a step leaves besides its retained bytes.

The optimizer's scalars, the LR scheduler, the sampler's position, the RNG, the
model's persistent buffers (BatchNorm's running statistics) and the user's loop's own
objects (a ``GradScaler``) as one JSON text per step. The node agent
keeps each rank's texts (it outlives the trainer) and its pending prepare record; a
recovery reads them back (:meth:`RankState.node_state`) to roll a rank forward or back.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from torch import nn

from leto.retained.agreement import replica_digest
from leto.retained.layout import RetainedLayout
from leto.retained.optim import RetainedOptimizer
from leto.retained.process_state import (
    capture_buffers,
    restore_buffers,
    scheduler_state,
    step_scheduler,
)
from leto.retained.shard import FullParams

from . import messages as M
from .channel import AgentChannel

__all__ = ["LoopState", "RankState", "StateHost"]


class LoopState(Protocol):
    """What :class:`RankState` keeps of the user's own loop (:mod:`.step`)."""

    def state(self) -> dict[str, Any]: ...
    def load_state(self, state: dict[str, Any] | None) -> None: ...
    def replay(self, pending: dict[str, Any] | None) -> None: ...


class StateHost(Protocol):
    """What :class:`RankState` reads of its rank's session, and the state it loads there."""

    rng: dict[str, Any] | None
    sampler_state: dict[str, Any] | None

    @property
    def ropt(self) -> RetainedOptimizer | None: ...
    @property
    def full(self) -> FullParams | None: ...
    @property
    def layout(self) -> RetainedLayout: ...
    @property
    def scheduler(self) -> Any: ...
    @property
    def model(self) -> nn.Module: ...
    @property
    def loop(self) -> LoopState | None: ...
    @property
    def step_fn(self) -> Any: ...
    @property
    def ch(self) -> AgentChannel: ...
    @property
    def cfg(self) -> Any: ...
    @property
    def rank(self) -> int: ...
    @property
    def W(self) -> int: ...


class RankState:
    """This rank's process state, as JSON, loaded, sent to and read back from its agent."""

    def __init__(self, session: StateHost) -> None:
        self.session = session
        self._asked: int | None = None  # a GetState sent by prefetch, its reply not read

    def to_json(self, step: int) -> str:
        session = self.session
        assert session.ropt is not None
        return json.dumps(
            {
                "step": step,
                "optimizer": session.ropt.process_state(),
                "scheduler": scheduler_state(session.scheduler),
                "sampler": session.sampler_state,
                "rng": session.rng,
                "buffers": capture_buffers(session.model),
                "extra": session.loop.state() if session.loop is not None else None,
            }
        )

    def replica_digest(self, step: int) -> str | None:
        """What every data-parallel replica holds alike after ``step`` (its chunks'
        checksums, the optimizer's scalars and hyper-parameters, the scheduler), as one
        digest, when ``replica_check`` makes a check due; None where the ranks are no
        replicas (sharded: each holds its own shard) or no check is due."""
        session = self.session
        every = int(getattr(session.cfg, "replica_check", 0) or 0)
        if not every or step % every or session.W < 2 or session.full is not None:
            return None
        assert session.ropt is not None
        return replica_digest(
            session.layout, session.ropt.process_state(), scheduler_state(session.scheduler)
        )

    def replicated(self) -> dict[str, Any]:
        """The process state replicas hold alike (what :meth:`replica_digest` covers
        besides the chunks): the optimizer's scalars and hyper-parameters, the
        scheduler's state."""
        session = self.session
        assert session.ropt is not None
        return {
            "optimizer": session.ropt.process_state(),
            "scheduler": scheduler_state(session.scheduler),
        }

    def adopt(self, state: dict[str, Any]) -> None:
        """A majority member's :meth:`replicated` state, in place of this rank's own
        (it diverged); its data position, RNG and the rest stay its own."""
        session = self.session
        assert session.ropt is not None
        session.ropt.load_process_state(state["optimizer"])
        if session.scheduler is not None:
            session.scheduler.load_state_dict(state["scheduler"])

    def replay_scheduler(self, pending: dict[str, Any] | None) -> None:
        """A roll-forward's stand-in for what followed step ``V``'s apply on a rank that
        did not finish it: the scheduler's step (the user's loop: :mod:`.step`)."""
        session = self.session
        if session.loop is not None and session.step_fn is None:
            session.loop.replay(pending)
        else:
            step_scheduler(session.scheduler, (pending or {}).get("metric"))

    def send(self, step: int) -> None:
        session = self.session
        session.ch.send(M.ProcessState(rank=session.rank, step=step, json=self.to_json(step)))

    def load(self, text: str) -> None:
        session = self.session
        ps = json.loads(text)
        self.adopt(ps)  # the optimizer's and the scheduler's, then this rank's own
        session.rng = ps["rng"]
        session.sampler_state = ps["sampler"]
        if "buffers" in ps:  # absent in the process state of an older leto
            restore_buffers(session.model, ps["buffers"])
        if session.loop is not None:
            session.loop.load_state(ps.get("extra"))

    def prefetch(self) -> None:
        """Ask the agent for this rank's node state now; the next :meth:`node_state`
        takes that reply. A reconcile asks as it begins, so the round trip runs beside
        its first collective: nothing this rank sends before its settle changes what the
        agent keeps for it (its process state is sent after)."""
        self.drop_prefetch()
        self._asked = self.session.ch.ask(M.GetState(rank=self.session.rank))

    def drop_prefetch(self) -> None:
        """The reconcile that prefetched is over: its reply, if unread, is stale."""
        if self._asked is not None:
            self.session.ch.forget(self._asked)
            self._asked = None

    def node_state(self, of: int | None = None) -> tuple[dict[int, str], dict[str, Any] | None]:
        """(step -> process state kept by the node agent, the pending prepare record) of
        this rank, or of rank ``of`` of the same node."""
        if of is not None and of != self.session.rank:
            reply, _ = self.session.ch.request(M.GetState(rank=of))
            return self._parse(reply)
        rid, self._asked = self._asked, None
        if rid is None:
            reply, _ = self.session.ch.request(M.GetState(rank=self.session.rank))
        else:
            reply, _ = self.session.ch.answer(rid, M.GetState.TAG)
        return self._parse(reply)

    @staticmethod
    def _parse(reply: dict[str, Any]) -> tuple[dict[int, str], dict[str, Any] | None]:
        hist = {int(k): v for k, v in reply.get("ps", {}).items()}
        pend = reply.get("pending")
        return hist, (json.loads(pend) if pend else None)
