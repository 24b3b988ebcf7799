"""One rank's process state: what a step leaves besides its retained bytes.

The optimizer's scalars, the LR scheduler, the sampler's position, the RNG, the
model's persistent buffers (BatchNorm's running statistics) and the user's loop's own
objects (a ``GradScaler``) as one JSON text per step. The node agent
keeps each rank's texts (it outlives the trainer) and its pending prepare record; a
recovery reads them back (:meth:`RankState.node_state`) to roll a rank forward or back.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from leto.retained.agreement import replica_digest
from leto.retained.process_state import (
    capture_buffers,
    restore_buffers,
    scheduler_state,
    step_scheduler,
)

from . import messages as M

if TYPE_CHECKING:
    from .runtime import GlooSession

__all__ = ["RankState"]


class RankState:
    """This rank's process state, as JSON, loaded, sent to and read back from its agent."""

    def __init__(self, session: GlooSession) -> None:
        self.s = session
        self._asked: int | None = None  # a GetState sent by prefetch, its reply not read

    def to_json(self, step: int) -> str:
        s = self.s
        assert s.ropt is not None
        return json.dumps(
            {
                "step": step,
                "optimizer": s.ropt.process_state(),
                "scheduler": scheduler_state(s.scheduler),
                "sampler": s.sampler_state,
                "rng": s.rng,
                "buffers": capture_buffers(s.model),
                "extra": s.loop.state() if s.loop is not None else None,
            }
        )

    def replica_digest(self, step: int) -> str | None:
        """What every data-parallel replica holds alike after ``step`` (its chunks'
        checksums, the optimizer's scalars and hyper-parameters, the scheduler), as one
        digest, when ``replica_check`` makes a check due; None where the ranks are no
        replicas (sharded: each holds its own shard) or no check is due."""
        s = self.s
        every = int(getattr(s.cfg, "replica_check", 0) or 0)
        if not every or step % every or s.W < 2 or s.full is not None:
            return None
        assert s.ropt is not None
        return replica_digest(s.layout, s.ropt.process_state(), scheduler_state(s.scheduler))

    def replicated(self) -> dict[str, Any]:
        """The process state replicas hold alike (what :meth:`replica_digest` covers
        besides the chunks): the optimizer's scalars and hyper-parameters, the
        scheduler's state."""
        s = self.s
        assert s.ropt is not None
        return {"optimizer": s.ropt.process_state(), "scheduler": scheduler_state(s.scheduler)}

    def adopt(self, state: dict[str, Any]) -> None:
        """A majority member's :meth:`replicated` state, in place of this rank's own
        (it diverged); its data position, RNG and the rest stay its own."""
        s = self.s
        assert s.ropt is not None
        s.ropt.load_process_state(state["optimizer"])
        if s.scheduler is not None:
            s.scheduler.load_state_dict(state["scheduler"])

    def replay_scheduler(self, pending: dict[str, Any] | None) -> None:
        """A roll-forward's stand-in for what followed step ``V``'s apply on a rank that
        did not finish it: the scheduler's step (the user's loop: :mod:`.step`)."""
        s = self.s
        if s.loop is not None and s.step_fn is None:
            s.loop.replay(pending)
        else:
            step_scheduler(s.scheduler, (pending or {}).get("metric"))

    def send(self, step: int) -> None:
        s = self.s
        s.ch.send(M.ProcessState(rank=s.rank, step=step, json=self.to_json(step)))

    def load(self, text: str) -> None:
        s = self.s
        ps = json.loads(text)
        self.adopt(ps)  # the optimizer's and the scheduler's, then this rank's own
        s.rng = ps["rng"]
        s.sampler_state = ps["sampler"]
        if "buffers" in ps:  # absent in the process state of an older leto
            restore_buffers(s.model, ps["buffers"])
        if s.loop is not None:
            s.loop.load_state(ps.get("extra"))

    def prefetch(self) -> None:
        """Ask the agent for this rank's node state now; the next :meth:`node_state`
        takes that reply. A reconcile asks as it begins, so the round trip runs beside
        its first collective: nothing this rank sends before its settle changes what the
        agent keeps for it (its process state is sent after)."""
        self.drop_prefetch()
        self._asked = self.s.ch.ask(M.GetState(rank=self.s.rank))

    def drop_prefetch(self) -> None:
        """The reconcile that prefetched is over: its reply, if unread, is stale."""
        if self._asked is not None:
            self.s.ch.forget(self._asked)
            self._asked = None

    def node_state(self, of: int | None = None) -> tuple[dict[int, str], dict[str, Any] | None]:
        """(step -> process state kept by the node agent, the pending prepare record) of
        this rank, or of rank ``of`` of the same node."""
        if of is not None and of != self.s.rank:
            reply, _ = self.s.ch.request(M.GetState(rank=of))
            return self._parse(reply)
        rid, self._asked = self._asked, None
        if rid is None:
            reply, _ = self.s.ch.request(M.GetState(rank=self.s.rank))
        else:
            reply, _ = self.s.ch.answer(rid, M.GetState.TAG)
        return self._parse(reply)

    @staticmethod
    def _parse(reply: dict[str, Any]) -> tuple[dict[int, str], dict[str, Any] | None]:
        hist = {int(k): v for k, v in reply.get("ps", {}).items()}
        pend = reply.get("pending")
        return hist, (json.loads(pend) if pend else None)
