"""The coordinator's replica check: data-parallel replicas must agree (docs/loop.md,
"Replicas agree").

Every rank's FINISH of a checked step carries the digest of what replicas hold alike;
when every rank finished the step they are compared (:mod:`leto.core.agreement`). A
split with a majority is repaired in place where :func:`~leto.core.agreement.repair_plan`
allows it: each minority rank's agent discards its memory and process state
(:class:`~.messages.Discard`), the core is told ``LoseMemory`` (a failure of kind
``diverged``), and the recovery copies the rank from a majority member of its node. Any
other split ends the job (or restarts it from its checkpoint: the core's GAVE_UP), in
one line naming the ranks, the step and why no repair. The end of the job compares the
retained buffers' digests once more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from leto.core import restart
from leto.core.agreement import Disagreement, ReplicaRepair, disagreement, repair_plan

from . import messages as M
from .eventlog import EventLog

__all__ = ["ReplicaChecks"]


class ReplicaChecks:
    """The digests the ranks sent, the checks that agreed and the repairs made."""

    def __init__(
        self,
        node_of: Sequence[int],
        log: EventLog,
        *,
        send: Callable[[int, M.Message], None],
        lose: Callable[[dict[str, Any], float], None],
        fail: Callable[..., None],
    ) -> None:
        self.node_of = tuple(node_of)
        self.log = log
        self.send = send  # a message to one node's agent
        self.lose = lose  # a failure record for the recovery (the core's LoseMemory)
        self.fail = fail  # the job ends: its line and ending
        self.digests: dict[int, dict[int, str]] = {}  # step -> rank -> digest
        self.agreed = 0  # steps whose replicas were compared and agreed
        self.repairs = 0  # ranks repaired in place from the majority
        self.repaired: dict[int, int] = {}  # rank -> the step of its repair

    @property
    def world(self) -> int:
        return len(self.node_of)

    def add(self, step: int, rank: int, digest: str) -> None:
        self.digests.setdefault(step, {})[rank] = digest

    def check(self, step: int, *, tier1_replicas: bool, now: float) -> None:
        """Every rank finished ``step``: its replicas' digests must agree."""
        digests = self.digests.pop(step, {})
        for old in [s for s in self.digests if s < step]:
            del self.digests[old]  # steps a recovery cut short: left unchecked
        if len(digests) < self.world:
            return
        split = disagreement(step, digests)
        if split is None:
            self.agreed += 1
            return
        plan = repair_plan(
            split, self.node_of, tier1_replicas=tier1_replicas, repaired=self.repaired
        )
        if isinstance(plan, ReplicaRepair):
            self._repair(split, plan, now)
            return
        self._log(split)
        self.fail(split.line(plan), ending=restart.Ending.GAVE_UP)

    def check_end(self, step: int, kept: dict[int, str]) -> bool:
        """The job's end: the retained buffers of every replica (``kept``) agree; False
        (the job failed, in one line) if they do not."""
        if not self.agreed or len(kept) != self.world:
            return True
        split = disagreement(step, kept)
        if split is None:
            return True
        self._log(split)
        self.fail(split.line())
        return False

    def _repair(self, split: Disagreement, plan: ReplicaRepair, now: float) -> None:
        self._log(split, repair=[list(x) for x in plan.sources])
        for rank, source in plan.sources:
            # the agent first: the fence of the recovery that follows finds it done
            self.send(self.node_of[rank], M.Discard(rank=rank, source=source, step=split.step))
            self.lose(
                {
                    "kind": "diverged",
                    "rank": rank,
                    "detected_by": "replica check",
                    "detail": (
                        f"its retained state differs from the majority's after step "
                        f"{split.step}: discarded, copied from rank {source}"
                    ),
                },
                now,
            )
            self.repaired[rank] = split.step
            self.repairs += 1

    def _log(self, split: Disagreement, **more: Any) -> None:
        self.log.write(
            "replicas_disagree", step=split.step, groups=[list(g) for g in split.groups], **more
        )
