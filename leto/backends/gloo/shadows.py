"""A node's shadows: one per local rank, the script run up to ``leto.wrap`` with a
meta-device skeleton, connected and waiting (warm), so that a failed trainer is
replaced by promoting it in milliseconds. A promoted shadow is replaced in the
background once the recovery that promoted it has resumed training: building the
replacement (the script up to ``leto.wrap``: the model, its initialisation, the data)
costs CPU in proportion to the model, which the recovery's ranks would otherwise
share with it on the critical path (a failure of the same rank meanwhile is promoted
from a cold start, as without shadows). A rank whose skeleton cannot be built runs
degraded (its replacement starts cold, on demand); while the trainers' memory is over
``shadow_memory_budget`` the shadows are killed (cold) and re-warmed under 90 % of
it."""

from __future__ import annotations

import sys
import time
from typing import Protocol

from . import messages as M
from . import procs as P
from .node_tables import NodeTables
from .records import Proc

__all__ = ["Shadows", "ShadowsHost"]


class ShadowChildren(Protocol):
    """What the shadows use of the node's processes: spawn, kill, and tell a keeper."""

    def spawn(
        self, lr: int, role: str, promote_gen: int | None = None, *, cold: bool = False
    ) -> None: ...

    def kill(self, p: Proc, *, wait: float = 5.0) -> None: ...

    def keeper(self, lr: int, op: str, *args: int) -> None: ...


class ShadowRouting(Protocol):
    """Where the shadows' messages go: to a process, to the coordinator."""

    def send_proc(self, p: Proc, msg: M.Message) -> None: ...

    def to_coord(self, msg: M.Message) -> None: ...


class ShadowsHost(NodeTables, Protocol):
    """What the shadows use of their agent: its options, the node's ranks, their trainers,
    shadows and keepers (the tables held in place), the generation (a promotion's fence
    moves it on) and whether the shadows' memory was reclaimed, and the agent's state."""

    generation: int
    reclaimed: bool

    @property
    def recovering(self) -> bool: ...

    @property
    def children(self) -> ShadowChildren: ...

    @property
    def routing(self) -> ShadowRouting: ...


class Shadows:
    """Ensure, promote, degrade and reclaim the node's shadows."""

    def __init__(self, agent: ShadowsHost) -> None:
        self.agent = agent
        self.after_recovery: set[int] = set()  # local ranks to re-warm once training resumes

    def promote(self, lr: int, gen: int) -> None:
        a = self.agent
        sh = a.shadow.get(lr)
        a.children.keeper(lr, "fence", max(gen, a.generation))
        a.generation = max(gen, a.generation)
        if sh is not None and sh.status == "warm" and sh.conn is not None:
            self.promote_now(sh, gen, warm=not sh.cold_start)
            return
        if sh is not None:  # still starting: promote it the moment it is warm
            sh.promote_gen = gen
            sh.promote_started = time.monotonic()
            sh.promote_warm = False
            return
        a.children.spawn(lr, "shadow", promote_gen=gen)

    def promote_now(self, sh: Proc, gen: int, *, warm: bool) -> None:
        a = self.agent
        lr = sh.local_rank
        if not warm and sh.promote_started == 0.0:
            sh.promote_started = time.monotonic()
        if warm:
            sh.promote_started = time.monotonic()
        sh.promote_gen = gen
        sh.promote_warm = warm
        a.shadow[lr] = None
        a.shadow_state[lr] = "spawning"
        old = a.trainer.get(lr)
        if old is not None and old is not sh:
            a.children.kill(old)
        a.trainer[lr] = sh
        sh.role = "trainer"
        sh.status = "promoting"
        sh.hb = time.monotonic()
        sh.progress_t = sh.hb
        a.children.keeper(lr, "admit", gen, sh.pid)
        h = a.keepers[lr]
        promote = M.Promote(
            gen=gen, keeper_pid=h.pid, keeper_socket=h.socket_name, nodes=a.o.nnodes, node=a.node
        )
        a.routing.send_proc(sh, promote)
        if a.recovering:  # the replacement warms in the background, after the recovery
            self.after_recovery.add(lr)
        else:
            self.ensure(lr)

    def resumed(self) -> None:
        """Training resumed: warm the replacements of the shadows the recovery promoted."""
        todo, self.after_recovery = sorted(self.after_recovery), set()
        for lr in todo:
            self.ensure(lr)

    def ensure(self, lr: int, *, force: bool = False) -> None:
        """A shadow for ``lr`` if it has none (not while shadows are reclaimed, unless the
        coordinator needs one to promote: ``force``). Without shadows (``--no-shadows``,
        or a rank whose skeleton could not be built) only ``force`` starts one, cold."""
        a = self.agent
        starting = any(sp["lr"] == lr and sp["role"] == "shadow" for sp in a.spawns.values())
        on_demand = not a.o.shadows or lr in a.degraded
        if (
            a.shadow.get(lr) is None
            and not starting
            and not a.complete
            and not a.stop
            and (force or not (a.reclaimed or on_demand))
        ):
            a.children.spawn(lr, "shadow", cold=on_demand)

    def degrade(self, lr: int, rank: int, why: str) -> None:
        """The shadow of ``lr`` could not be built: say so now; its rank runs without one."""
        a = self.agent
        a.degraded[lr] = why
        print(
            f"leto[node {a.node}]: warning: the shadow of rank {rank} could not be built "
            f"({why}); the job runs degraded: a failure of rank {rank} is recovered by a "
            "cold start",
            file=sys.stderr,
            flush=True,
        )

    def reclaim(self, lr: int, reason: str) -> None:
        a = self.agent
        sh = a.shadow.get(lr)
        if sh is None or sh.promote_gen is not None:
            return
        a.children.kill(sh, wait=2.0)
        a.shadow[lr] = None
        a.shadow_state[lr] = "cold"
        a.routing.to_coord(M.Shadow(rank=a.rank(lr), state="cold", reason=reason))

    def needed(self, lr: int) -> None:
        """The coordinator needs a shadow of ``lr`` (to promote it): one, even cold."""
        a = self.agent
        sh = a.shadow.get(lr)
        if sh is not None and sh.status == "warm":  # (its report may have been refused)
            a.routing.to_coord(M.Shadow(rank=sh.rank, state="warm"))
            return
        a.asked.add(lr)
        self.ensure(lr, force=True)

    def on_warm(self, p: Proc, now: float) -> None:
        """A shadow is warm: promote it if it was started for that, else report it."""
        a = self.agent
        p.status = "warm"
        p.hb = now
        lr = p.local_rank
        if p.promote_gen is not None:
            self.promote_now(p, p.promote_gen, warm=False)
            return
        a.shadow_state[lr] = "warm"
        a.shadow_failures[lr] = 0
        a.asked.discard(lr)
        a.routing.to_coord(
            M.Shadow(rank=p.rank, state="warm", ms=round((now - p.spawned) * 1e3, 1))
        )
        if a.reclaimed:
            self.reclaim(lr, "trainer memory still above the budget")

    def on_promoted(self, p: Proc, now: float) -> None:
        """A promoted shadow runs as the trainer of its rank."""
        a = self.agent
        if p.promote_gen is None:
            return  # not a process this agent promoted
        p.status = "running"
        ms = round((now - p.promote_started) * 1e3, 1)
        a.say(
            f"rank {p.rank}: {'warm' if p.promote_warm else 'cold'} shadow promoted in {ms:.0f} ms"
        )
        a.routing.to_coord(
            M.Promoted(rank=p.rank, gen=p.promote_gen, warm=p.promote_warm, ms=ms, pid=p.pid)
        )

    def budget(self, budget: int) -> None:
        """Shadows go cold while the trainers' memory is over ``budget`` bytes, and warm
        again once it is under 90 % of it (and no recovery is under way)."""
        a = self.agent
        each = [P.rss_bytes(p.pid) for p in a.trainer.values() if p is not None]
        used = sum(each)
        if not a.reclaimed and used > budget:
            a.reclaimed = True
            why = f"trainers use {used >> 20} MiB > budget {budget >> 20} MiB"
            a.say(f"shadows go cold: {why}")
            for lr in a.local_ranks:
                self.reclaim(lr, why)
        elif (
            a.reclaimed
            and not a.recovering
            and all(p is not None and p.dead_at is None for p in a.trainer.values())
            # a trainer killed but not yet reaped reads as 0 (a zombie has no RSS):
            # its memory is not free for a shadow, its exit is about to be handled
            and all(b > 0 for b in each)
            and used < 0.9 * budget
        ):
            a.reclaimed = False
            a.say(f"shadows re-warm: trainers use {used >> 20} MiB")
            for lr in a.local_ranks:
                # not a second shadow where one is already starting (e.g. the one
                # the coordinator asked for, to promote)
                self.ensure(lr)
