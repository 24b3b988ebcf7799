"""The reconcile plan: where every rank resumes, and how each chunk gets there.

Pure function of what survived. For every chunk it asks which versions the rank can
produce from its own memory (the chunk, or its undo copy), rebuilds missing chunks and
gradients from tier-1 parity (single parity per node: one missing member per node and
chunk), and then picks, in order:

1. the committed step V, if every chunk reaches it (holds V, or holds V-1 and the rank
   has the gradients of V: roll forward) -- no committed work is ever dropped here;
2. the tier-2 snapshot step, if the snapshot survived (every rank restores it; the
   committed steps after it are recomputed: at most K);
3. otherwise the disk checkpoint (the caller reports what was lost and why).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

from leto.core.chunk import LOST, NONE, is_uniform, producible, repeated, uniform_row
from leto.core.recovery import Kind


def _positive(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


class RepairKind(str, enum.Enum):
    """What one repair of the plan does. A ``str`` whose value is the name the event
    log, the gloo wire and the TLC traces carry (``"tier1"``, ...): they are unchanged,
    and a repair built from that name (:func:`repair_kind`) equals the member. It prints
    as that name too, so messages naming a repair read as before."""

    TIER1 = "tier1"  # a chunk rebuilt from tier 1 (parity decode, or a replica's copy)
    GRAD_TIER1 = "grad-tier1"  # a rank's gradients rebuilt from tier 1
    FORWARD = "forward"  # restore the undo copy if torn, then re-apply the committed step
    SNAPSHOT = "snapshot"  # the rank restores the tier-2 snapshot
    CHECKPOINT = "checkpoint"  # the rank restores the disk checkpoint

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def repair_kind(what: str | RepairKind) -> RepairKind:
    """``what`` as a :class:`RepairKind` (its name on the wire accepted)."""
    return what if type(what) is RepairKind else RepairKind(what)


@attrs.frozen
class Repair:
    """One step of the plan, in execution order; with ``count > 1``, a run of chunks.

    A run is the plan's summary of ``count`` chunk-level repairs (:meth:`expand`: the
    same repair of chunks ``chunk``, ``chunk + 1``, ..., in that order): a rank whose
    chunks are all alike rolls forward, or is rebuilt from tier 1, in one repair, so a
    plan costs O(ranks + what differs), not O(ranks x chunks). The chunk-by-chunk
    plan (``plan(..., compress=False)``) stays the reference;
    :func:`leto.core.aggregate.check_refinement` checks on every state the checker
    reaches that the runs expand to it exactly."""

    what: RepairKind = attrs.field(converter=repair_kind)
    rank: int
    chunk: int  # -1 for a rank's gradient block or whole-rank operations
    version: int
    count: int = attrs.field(default=1, validator=_positive)

    @property
    def chunks(self) -> range:
        """The chunks this repair covers (``range(-1, 0)`` for a whole-rank one)."""
        return range(self.chunk, self.chunk + self.count)

    def expand(self) -> tuple[Repair, ...]:
        """The chunk-level repairs this one stands for, in order."""
        if self.count == 1:
            return (self,)
        return tuple(Repair(self.what, self.rank, c, self.version) for c in self.chunks)

    def wire(self) -> dict[str, str | int]:
        """This repair as a message carries it (JSON): the one shape on every wire and in
        every record (:meth:`from_wire` reads it back)."""
        return {
            "what": self.what.value,
            "rank": self.rank,
            "chunk": self.chunk,
            "version": self.version,
            "count": self.count,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, object]) -> Repair:
        """A repair from :meth:`wire`'s shape; ValueError, in one line, names what is
        wrong with it."""
        keys = ("what", "rank", "chunk", "version", "count")
        if set(d) != set(keys):
            raise ValueError(f"a repair has the fields {', '.join(keys)}, not {sorted(d)}")
        what = d["what"]
        if not isinstance(what, str):
            raise ValueError(f"a repair's what is a name, not {what!r}")
        nums: list[int] = []
        for k in keys[1:]:
            v = d[k]
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"a repair's {k} is an integer, not {v!r}")
            nums.append(v)
        rank, chunk, version, count = nums
        return cls(what, rank, chunk, version, count)


def expand_repairs(repairs: Iterable[Repair]) -> tuple[Repair, ...]:
    """Every run of ``repairs`` expanded: the chunk-by-chunk plan's repairs."""
    return tuple(x for run in repairs for x in run.expand())


def _append(out: list[Repair], x: Repair) -> None:
    """Append ``x``, extending the last repair's run where ``x`` continues it."""
    last = out[-1] if out else None
    if (
        last is not None
        and last.chunk >= 0
        and (last.what, last.rank, last.version) == (x.what, x.rank, x.version)
        and x.chunk == last.chunk + last.count
    ):
        out[-1] = Repair(last.what, last.rank, last.chunk, last.version, last.count + x.count)
    else:
        out.append(x)


@attrs.frozen
class Plan:
    target: int | None  # None: fall back to the disk checkpoint
    kind: Kind
    repairs: tuple[Repair, ...]
    reason: str  # one line: why this plan (what was lost)

    @property
    def fallback(self) -> bool:
        return self.target is None


@attrs.frozen
class Survivors:
    """What the reconcile plan reads: the retained state after the failures."""

    groups: tuple[tuple[int, ...], ...]  # tier-1 groups: ranks of each node
    data: tuple[tuple[int, ...], ...]
    undo: tuple[tuple[int, ...], ...]
    grad: tuple[int, ...]
    par: tuple[tuple[tuple[int, ...], ...] | None, ...]  # node -> chunk -> member -> version
    gpar: tuple[tuple[int, ...] | None, ...]  # node -> member -> gradient step
    committed: int
    t2: int
    t2_intact: bool


# What a rank can produce, chunk by chunk: one set for a rank whose chunks are all alike
# (a shared uniform row: the plan reads it once), else one set per chunk.
Cells = frozenset[int] | list[frozenset[int]]


def _local(s: Survivors, compress: bool) -> list[Cells]:
    out: list[Cells] = []
    for d, u in zip(s.data, s.undo, strict=True):
        if compress and d and is_uniform(d, d[0]) and is_uniform(u, u[0]):
            out.append(producible(d[0], u[0]))
        else:
            out.append([producible(x, y) for x, y in zip(d, u, strict=True)])
    return out


def _per_chunk(p: Cells, n: int) -> list[frozenset[int]]:
    return [p] * n if isinstance(p, frozenset) else p


def _alike(par: tuple[tuple[int, ...], ...]) -> bool:
    return par is repeated(par[0], len(par)) or par.count(par[0]) == len(par)


def plan(s: Survivors, *, compress: bool = True) -> Plan:
    """The plan for ``s``. ``compress=False`` reads every chunk on its own and plans one
    repair per chunk (the reference the compressed reading is checked against); the
    compressed reading plans a rank whose chunks are all alike, and a node whose members
    and parity are, once for all chunks, and writes consecutive chunks' repairs as one
    run (:class:`Repair` ``count``): O(ranks + nodes + what differs) instead of
    O(ranks x chunks). The two agree: the same target, kind and reason, and the runs
    expand to the chunk-by-chunk repairs (:func:`expand_repairs`)."""
    V = s.committed
    add: Callable[[list[Repair], Repair], None] = _append if compress else list.append
    prod = _local(s, compress)
    n_chunks = len(s.data[0]) if s.data else 0
    repairs: list[Repair] = []
    # Tier 1 for chunks: a node's parity rebuilds one missing member per chunk.
    for n, members in enumerate(s.groups):
        par = s.par[n]
        if par is None:
            continue
        alike = all(isinstance(prod[m], frozenset) for m in members) and _alike(par)
        if not alike:
            for m in members:
                prod[m] = _per_chunk(prod[m], n_chunks)
        for c in range(1 if alike else n_chunks):
            cells = [prod[m] if alike else prod[m][c] for m in members]  # type: ignore[index]
            missing = [r for r, got in zip(members, cells, strict=True) if not got]
            if len(missing) != 1:
                continue
            others_ok = all(
                par[c][i] in got
                for i, (m, got) in enumerate(zip(members, cells, strict=True))
                if m != missing[0]
            )
            if others_ok:
                r = missing[0]
                version = par[c][members.index(r)]
                if alike:
                    prod[r] = frozenset((version,))
                    repairs.append(Repair(RepairKind.TIER1, r, 0, version, n_chunks))
                else:
                    row = prod[r]
                    assert isinstance(row, list)
                    row[c] = frozenset((version,))
                    add(repairs, Repair(RepairKind.TIER1, r, c, version))
    # Gradients: held locally, or rebuilt from the node's gradient parity.
    grads = list(s.grad)
    for n, members in enumerate(s.groups):
        gp = s.gpar[n]
        if gp is None:
            continue
        missing = [r for r in members if grads[r] == LOST]
        if len(missing) == 1 and all(
            grads[m] == gp[i] for i, m in enumerate(members) if m != missing[0]
        ):
            r = missing[0]
            if gp[members.index(r)] == V and V > 0:
                grads[r] = V
                repairs.append(Repair(RepairKind.GRAD_TIER1, r, -1, V))

    def cells_of(r: int) -> Sequence[frozenset[int]]:
        p = prod[r]
        return (p,) if isinstance(p, frozenset) else p

    def chunks_where(r: int, pred: Callable[[frozenset[int]], bool]) -> Sequence[int]:
        p = prod[r]
        if isinstance(p, frozenset):
            return range(n_chunks if pred(p) else 0)
        return [c for c, got in enumerate(p) if pred(got)]

    reaches = True
    forward = False
    for r in range(len(s.data)):
        for got in cells_of(r):
            if V in got:
                continue
            if V - 1 in got and V > 0 and grads[r] == V:
                forward = True
                continue
            reaches = False
    if reaches:
        used_tier1 = any(x.what in (RepairKind.TIER1, RepairKind.GRAD_TIER1) for x in repairs)
        dropped = any(g == V + 1 for g in s.grad)
        rolled: list[Repair] = []
        for r in range(len(s.data)):
            behind = chunks_where(r, lambda got: V not in got)
            if isinstance(behind, range):
                if behind:
                    rolled.append(Repair(RepairKind.FORWARD, r, 0, V, len(behind)))
                continue
            for c in behind:
                add(rolled, Repair(RepairKind.FORWARD, r, c, V))
        if used_tier1:
            kind = Kind.TIER1
        elif forward:
            kind = Kind.FORWARD
        elif dropped:
            kind = Kind.BACK
        else:
            kind = Kind.INPLACE
        return Plan(
            target=V,
            kind=kind,
            repairs=tuple(repairs + rolled),
            reason=f"every chunk reaches committed step {V}",
        )
    lost: list[str] = []
    for r in range(len(s.data)):
        gone = chunks_where(r, lambda got: not got)
        if n_chunks > 1 and len(gone) == n_chunks:
            lost.append(f"rank {r} (all {n_chunks} chunks)")
        else:
            lost += [f"rank {r} chunk {c}" for c in gone]
    what = ", ".join(lost) or "gradients of the committed step"
    if s.t2_intact:
        return Plan(
            target=s.t2,
            kind=Kind.TIER2,
            repairs=tuple(Repair(RepairKind.SNAPSHOT, r, -1, s.t2) for r in range(len(s.data))),
            reason=f"beyond tier 1 ({what}); restoring the tier-2 snapshot of step {s.t2}",
        )
    return Plan(
        target=None,
        kind=Kind.CKPT,
        repairs=tuple(Repair(RepairKind.CHECKPOINT, r, -1, 0) for r in range(len(s.data))),
        reason=f"beyond tier 1 and tier 2 ({what}; tier-2 snapshot lost)",
    )


def reencoded_parity(
    groups: Sequence[Sequence[int]], n_chunks: int, version: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Tier-1 parity of every node encoding every member's chunks at ``version``."""
    return tuple(repeated(uniform_row(version, len(members)), n_chunks) for members in groups)


def empty_grad_parity(groups: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(NONE for _ in members) for members in groups)


# Repairs that write none of a rank's chunks: its retained gradients only, which a
# step's compute neither reads nor writes (they enter retained memory at Reduce).
_GRADIENTS_ONLY = frozenset({RepairKind.GRAD_TIER1})


def keeps_compute(plans: Sequence[Plan], rank: int, begun_at: int) -> bool:
    """Whether ``rank``'s compute of step ``begun_at + 1``, begun before a recovery (and
    carried on beside it, or paused in it), stands as its ``Compute`` after the
    recovery's ``Resume``
    (PROTOCOL.md, "A compute kept across a recovery").

    ``plans``: every plan the rank carried out since the compute began (one per
    generation that reached its reconcile; none: nothing to judge, so no). The compute
    read the rank's chunks at ``begun_at``; ``Compute`` after ``Resume`` reads them at the
    target. The two are the same bytes when every plan resumes at ``begun_at`` and none
    writes a chunk of ``rank``: no tier-1 rebuild or roll forward of it, no tier-2 or
    checkpoint restore (each writes every chunk). A rank whose chunk was rebuilt had lost
    it: its compute may have read the damage, so it is computed again.
    """
    if not plans:
        return False
    for p in plans:
        if p.target != begun_at or p.kind in (Kind.TIER2, Kind.CKPT):
            return False
        if any(x.rank == rank and x.what not in _GRADIENTS_ONLY for x in p.repairs):
            return False
    return True


def writes_no_chunk(plan: Plan) -> bool:
    """Whether carrying ``plan`` out leaves every chunk's bytes as they are (PROTOCOL.md,
    "Gradient parity during a reconcile"): an INPLACE plan, whose every chunk of every
    rank already holds the target (no repair, no roll forward or back; the executor may
    release an undo copy, or restore a chunk and roll it forward to the same bytes).
    So the chunks' checksums at the reconcile's end are those at its start, and an
    executor may gather them at the start, in the collective that orders the release of
    the node's gradients, instead of after the settle."""
    return plan.kind is Kind.INPLACE and not plan.repairs
