"""The world of an elastic data-parallel job across node losses (``spec/Elastic.tla``).

Theory of operation: a job started with ``--nnodes MIN:MAX`` has a *world*, its member
nodes in rank order (node ``members[i]`` holds rank ``i``; ranks stay dense). A member
lost (:class:`LoseNode`) is awaited (phase AWAITING): a spare in the pool takes its rank
(:class:`Replace`, its replica decoded from the survivors'); when the spare timeout
passes with the pool empty, the job goes on without the lost members if at least MIN
are left (:class:`Shrink`: the others keep their order and are renumbered densely),
else it stops in one line (:class:`Stop`). A spare that joins while the world is below
MAX, at a step boundary, joins the world as its last rank (:class:`Grow`, its replica
copied from a member). Every world change starts a new generation. The world changes
only between committed steps: a recovery of the protocol model (``leto.core.cluster``)
ends with every survivor at the committed step first, and this machine takes it from
there.

Why the schedule is part of the state: the data a step trains on depends on the world
size it runs with (:mod:`leto.core.accumulation`), so the run a shrunk-and-grown job is
bitwise equal to is the failure-free run of the same *world-size schedule*
(``schedule[s-1]`` the world size of step ``s``), which a job can be told to follow
(``schedule_at``), not the failure-free run of the starting world.

:func:`decide` is the one place that says which world event comes next (the coordinator
feeds it; its clock says only whether the spare timeout passed). Pure: no IO, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import attrs

from leto.core.errors import ProtocolError
from leto.core.table import Table

__all__ = [
    "Finish",
    "Grow",
    "LoseNode",
    "Replace",
    "Shrink",
    "SpareJoins",
    "Stop",
    "Train",
    "World",
    "WorldEvent",
    "WorldPhase",
    "decide",
    "schedule_at",
    "start",
    "step",
]


class WorldPhase(enum.Enum):
    RUNNING = "running"
    AWAITING = "awaiting"  # a member was lost: a spare, a shrink or a stop comes next
    STOPPED = "stopped"
    DONE = "done"


def _node(_inst: object, attr: attrs.Attribute[str], value: str) -> None:
    if type(value) is not str or not value:
        raise ValueError(f"{attr.name} must be a non-empty node name, got {value!r}")


@attrs.frozen
class Train:
    """One committed step, trained by the world as it is."""


@attrs.frozen
class LoseNode:
    node: str = attrs.field(validator=_node)


@attrs.frozen
class SpareJoins:
    node: str = attrs.field(validator=_node)


@attrs.frozen
class Replace:
    """Spare ``spare`` takes lost member ``node``'s rank."""

    node: str = attrs.field(validator=_node)
    spare: str = attrs.field(validator=_node)


@attrs.frozen
class Shrink:
    """The spare timeout passed with the pool empty: go on without the lost members."""


@attrs.frozen
class Stop:
    """The spare timeout passed with the pool empty and fewer than MIN left."""


@attrs.frozen
class Grow:
    """Spare ``spare`` joins the world as its last rank."""

    spare: str = attrs.field(validator=_node)


@attrs.frozen
class Finish:
    """Every step was trained."""


WorldEvent = Train | LoseNode | SpareJoins | Replace | Shrink | Stop | Grow | Finish

_LIVE = (WorldPhase.RUNNING, WorldPhase.AWAITING)

# Replace's row says AWAITING; its handler leaves AWAITING for RUNNING once no lost
# member is left (two members lost wait for two spares).
TABLE: Table[WorldPhase] = Table.build(
    "world",
    [
        (WorldPhase.RUNNING, (Train, Grow), None),
        (_LIVE, LoseNode, WorldPhase.AWAITING),
        (_LIVE, SpareJoins, None),
        (WorldPhase.AWAITING, Replace, None),
        (WorldPhase.AWAITING, Shrink, WorldPhase.RUNNING),
        (WorldPhase.AWAITING, Stop, WorldPhase.STOPPED),
        (WorldPhase.RUNNING, Finish, WorldPhase.DONE),
    ],
)


@attrs.frozen
class World:
    """The state of :data:`TABLE`'s machine (``Elastic.tla``'s variables, ``hist``
    aside: a backend's replicas are checked bitwise, not modelled)."""

    lo: int
    hi: int
    max_step: int
    members: tuple[str, ...]
    pool: tuple[str, ...] = ()  # in the order the spares joined
    lost: frozenset[str] = frozenset()
    phase: WorldPhase = WorldPhase.RUNNING
    gen: int = 0
    schedule: tuple[int, ...] = ()  # the world size of each committed step

    def __attrs_post_init__(self) -> None:
        # the world's size is the machine's invariant (checked, not enforced here)
        if not 1 <= self.lo <= self.hi or self.max_step < 0:
            raise ValueError(
                f"--nnodes {self.lo}:{self.hi}, {self.max_step} steps: need 1 <= MIN <= MAX, steps >= 0"
            )
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"a node holds two ranks in {self.members}")

    @property
    def left(self) -> int:
        """Members still up."""
        return len(self.members) - len(self.lost)


def start(lo: int, hi: int, members: tuple[str, ...], max_step: int) -> World:
    """The world a job starts with (``leto.core.elastic.world_at_close`` sized it)."""
    if not 1 <= lo <= len(members) <= hi:
        raise ValueError(
            f"a world of {len(members)} nodes for --nnodes {lo}:{hi}: need 1 <= MIN <= nodes <= MAX"
        )
    return World(lo=lo, hi=hi, max_step=max_step, members=tuple(members))


def _refuse(s: World, e: WorldEvent, why: str) -> ProtocolError:
    return ProtocolError(TABLE.machine, s.phase, e, why)


def _train(s: World, e: Train) -> World:
    if len(s.schedule) >= s.max_step:
        raise _refuse(s, e, f"all {s.max_step} steps were trained")
    return attrs.evolve(s, schedule=(*s.schedule, len(s.members)))


def _lose(s: World, e: LoseNode) -> World:
    if e.node not in s.members or e.node in s.lost:
        raise _refuse(s, e, f"{e.node} is not a member that is up")
    return attrs.evolve(s, lost=s.lost | {e.node})


def _join(s: World, e: SpareJoins) -> World:
    if e.node in s.members or e.node in s.pool:
        raise _refuse(s, e, f"{e.node} is a member or already in the pool")
    return attrs.evolve(s, pool=(*s.pool, e.node))


def _replace(s: World, e: Replace) -> World:
    if e.node not in s.lost or e.spare not in s.pool:
        raise _refuse(s, e, f"{e.node} is not lost or {e.spare} is not in the pool")
    if s.left == 0:
        raise _refuse(s, e, "no member is left to copy a replica from")
    lost = s.lost - {e.node}
    return attrs.evolve(
        s,
        members=tuple(e.spare if m == e.node else m for m in s.members),
        pool=tuple(p for p in s.pool if p != e.spare),
        lost=lost,
        phase=WorldPhase.AWAITING if lost else WorldPhase.RUNNING,
        gen=s.gen + 1,
    )


def _shrink(s: World, e: Shrink) -> World:
    if s.pool:
        raise _refuse(s, e, f"spares {list(s.pool)} wait in the pool: they replace")
    if s.left < s.lo:
        raise _refuse(s, e, f"{s.left} nodes would be left, fewer than MIN {s.lo}")
    kept = tuple(m for m in s.members if m not in s.lost)
    return attrs.evolve(s, members=kept, lost=frozenset(), gen=s.gen + 1)


def _stop(s: World, e: Stop) -> World:
    if (s.pool and s.left) or s.left >= s.lo:
        raise _refuse(s, e, "a spare can replace, or enough nodes are left to shrink")
    return s


def _grow(s: World, e: Grow) -> World:
    if e.spare not in s.pool or len(s.members) >= s.hi:
        raise _refuse(s, e, f"{e.spare} is not in the pool, or the world is at MAX {s.hi}")
    return attrs.evolve(
        s,
        members=(*s.members, e.spare),
        pool=tuple(p for p in s.pool if p != e.spare),
        gen=s.gen + 1,
    )


def _finish(s: World, e: Finish) -> World:
    if len(s.schedule) != s.max_step:
        raise _refuse(s, e, f"{len(s.schedule)} of {s.max_step} steps were trained")
    return s


_HANDLERS: dict[type, Callable[[World, WorldEvent], World]] = {
    Train: _train,  # type: ignore[dict-item]
    LoseNode: _lose,  # type: ignore[dict-item]
    SpareJoins: _join,  # type: ignore[dict-item]
    Replace: _replace,  # type: ignore[dict-item]
    Shrink: _shrink,  # type: ignore[dict-item]
    Stop: _stop,  # type: ignore[dict-item]
    Grow: _grow,  # type: ignore[dict-item]
    Finish: _finish,  # type: ignore[dict-item]
}


def step(s: World, e: WorldEvent) -> World:
    """The world after ``e``; an illegal ``e`` raises :class:`ProtocolError` (``s``, a
    frozen value, unchanged)."""
    phase = TABLE.next(s.phase, e)
    out = _HANDLERS[type(e)](s, e)
    if isinstance(e, Replace):
        return out
    return attrs.evolve(out, phase=phase)


def decide(s: World, timed_out: bool) -> WorldEvent | None:
    """The world event the coordinator makes next, or None (training goes on, or the
    spare timeout has not passed). ``timed_out``: the spare timeout passed since the
    first member still awaited was lost. A lost member takes the pool's first spare
    (the lower lost name first, as ``SparePool.assign``); a spare in the pool while the
    world is below MAX grows it at the step boundary."""
    if s.phase is WorldPhase.AWAITING:
        if s.left == 0:
            return Stop()  # no replica left to copy: beyond this model (the checkpoint)
        if s.pool:
            return Replace(min(s.lost), s.pool[0])
        if not timed_out:
            return None
        return Shrink() if s.left >= s.lo else Stop()
    if s.phase is WorldPhase.RUNNING and s.pool and len(s.members) < s.hi:
        return Grow(s.pool[0])
    return None


def schedule_at(changes: dict[int, int], start_size: int, steps: int) -> tuple[int, ...]:
    """The world-size schedule of a failure-free job of ``start_size`` nodes whose world
    becomes ``changes[s]`` nodes from step ``s`` on (the reference a shrunk and grown
    job is compared with): ``schedule[s-1]`` is step ``s``'s world size."""
    if start_size < 1 or any(k < 1 or v < 1 for k, v in changes.items()):
        raise ValueError(f"world sizes and steps are >= 1: {start_size}, {changes}")
    out, size = [], start_size
    for s in range(1, steps + 1):
        size = changes.get(s, size)
        out.append(size)
    return tuple(out)
