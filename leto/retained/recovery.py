"""The recovery executor: per-rank functions that carry out the core's reconcile plan
on one rank's retained memory.

The core (:mod:`leto.core.reconcile`) decides where every rank resumes and how each
chunk gets there; every backend carries that out through these functions and only
supplies what is its own: where the process-state history and the prepare record
live (the fake backend's node store, the gloo agent), how parity bytes move (an
in-process group, a ``torch.distributed`` group). Nothing here knows a backend.

The rules, each the executor's side of a rule of ``spec/PROTOCOL.md``:

* :func:`observe` -- what a rank's memory reports to the model per chunk: a chunk whose
  bytes fail their checksum but whose undo copy holds is TORN (it rolls forward from
  the undo copy like a chunk torn mid-write); one with neither is LOST;
* :func:`settle` -- bring a rank to the plan's target: finish a chunk whose parity was
  written but whose undo copy was not yet released; put a damaged written chunk back
  to its undo copy; undo a step beyond the target that had begun; roll every chunk
  behind the target forward with the retained gradients of the target and the
  process state of the step before it;
* :func:`decode_chunk`, :func:`decode_grads` -- tier 1: one member's chunk (or its
  gradients) rebuilt from the node's parity and the other members' bytes at the
  versions the parity records, then checked against the checksums recorded with it;
* :func:`carry_out` -- the plan itself, in its order, over a backend's
  :class:`RepairOps` (the one interpreter of a plan);
* :func:`bytes_at`, :func:`free_undo`, :func:`seal_checked`, :func:`check_resumable`.

The tier-1 functions are SPMD: every member of the node calls them with its own
``coll`` (its rank in the node group is ``coll.rank``), as a ``torch.distributed``
group runs them on gloo and an in-process group runs them on the fake backend.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch

from leto.core.chunk import LOST, NONE, TORN
from leto.core.reconcile import Plan, Repair, RepairKind
from leto.core.recovery import Kind
from leto.retained.layout import ChunkStatus, RetainedLayout
from leto.retained.optim import RetainedOptimizer
from leto.retained.parity import Collective, as_bytes, decode

__all__ = [
    "IntegrityError",
    "ReconcileSummary",
    "RepairOps",
    "Settled",
    "bytes_at",
    "carry_out",
    "check_resumable",
    "decode_chunk",
    "decode_grads",
    "deferrable",
    "free_undo",
    "intact_at",
    "layout_of",
    "named_buffers",
    "observe",
    "packed",
    "seal_checked",
    "seal_rebuilt_grads",
    "settle",
    "unpack_into",
]


class IntegrityError(RuntimeError):
    """Real state disagrees with the protocol's (a checksum, a version, a record)."""


def layout_of(ropt: RetainedOptimizer | None, who: str) -> RetainedLayout:
    """The retained layout a rank's optimizer is bound to (an error if none is)."""
    if ropt is None:
        raise IntegrityError(f"{who} has no retained state bound")
    return ropt.layout


def observe(lay: RetainedLayout, bad: set[int] | None = None) -> tuple[list[int], list[int]]:
    """The model's ``data`` and ``undo`` values of every chunk of ``lay``.

    ``bad``: the chunks whose bytes failed their checksum (None: check them here).
    """
    bad = set(lay.verify()) if bad is None else bad
    data: list[int] = []
    undo: list[int] = []
    versions = lay.records.versions()
    for c, st in enumerate(lay.chunk_statuses()):
        u = lay.undo.version(c) if st is not ChunkStatus.CLEAN else NONE
        if u != NONE and not lay.undo.verify(c):
            u = NONE
        if st is ChunkStatus.TORN or c in bad:
            d = TORN if u != NONE else LOST  # damaged new bytes: back to the undo copy
        else:
            d = versions[c]
        data.append(d)
        undo.append(u)
    return data, undo


def deferrable(lay: RetainedLayout) -> list[int]:
    """The chunks whose checksums a recovery's report may leave to the next PREPARE.

    A CLEAN chunk's bytes change only by what no header records (silent corruption),
    and every PREPARE reads every chunk before its vote (``verify_chunks``), as between
    failures: no committed step is computed from bytes that fail their checksum. What
    the recovery itself reads to write new bytes is checked before: chunks not CLEAN
    (a step was applying them), and CLEAN chunks behind the rank's newest version or
    one step behind its sealed gradients (a roll forward reads them). A layout marked
    suspect (a pass found a chunk failing and no recovery has ended since) defers
    nothing. PROTOCOL.md, "Which bytes a report reads".
    """
    if lay.suspect or lay.n_chunks == 0:
        return []
    ahead = lay.prepared_step - 1
    versions = lay.records.versions()
    top = max(versions)
    if top == ahead:
        return []
    st = lay.chunk_statuses()
    return [c for c, v in enumerate(versions) if v == top and st[c] is ChunkStatus.CLEAN]


def grads_deferrable(lay: RetainedLayout, deferred: Collection[int]) -> bool:
    """Whether a recovery's report may leave the sealed gradients' checksums unread too.

    When every chunk is deferred and at the gradients' step (the step they were sealed
    for is fully applied on this rank), the rank's own settle never reads them (a roll
    forward reads the gradients of the step after its chunks'); only a repair of
    another member of its node may (a gradient copy or decode from them), and the
    executor reads them before that (PROTOCOL.md, "Which bytes a report reads").
    """
    ps = lay.prepared_step
    return ps >= 0 and len(deferred) == lay.n_chunks > 0 and lay.chunk_version(0) == ps


def intact_at(lay: RetainedLayout, data: list[int]) -> dict[int, int]:
    """The chunks :func:`observe` found CLEAN with their checksums holding (``data``: its
    values), with their versions. A reconcile to step ``t`` writes no chunk CLEAN at ``t``
    unless the plan repairs or restores it, so its check before resuming need not read
    the others again (:func:`check_resumable`'s ``intact``)."""
    st = lay.chunk_statuses()
    return {c: data[c] for c in range(lay.n_chunks) if data[c] >= 0 and st[c] is ChunkStatus.CLEAN}


def bytes_at(lay: RetainedLayout, c: int, version: int) -> list[torch.Tensor]:
    """Chunk ``c``'s bytes at ``version``: its data, or its undo copy."""
    st = lay.chunk_status(c)
    if st is not ChunkStatus.TORN and lay.chunk_version(c) == version:
        return lay.chunk_data(c)
    if st is not ChunkStatus.CLEAN and lay.undo.version(c) == version:
        return lay.undo_data(c)
    raise IntegrityError(f"chunk {c} cannot produce version {version} (it is {st.value})")


def free_undo(lay: RetainedLayout) -> None:
    """Before every chunk is overwritten: torn chunks back to their undo copy, the undo
    copies of applied ones released."""
    for c, st in enumerate(lay.chunk_statuses()):
        if st is ChunkStatus.TORN:
            lay.undo.restore(c)
        elif st is ChunkStatus.APPLIED:
            lay.undo.release(c)


def seal_checked(
    lay: RetainedLayout, step: int, expected: list[int], source: str, who: str
) -> None:
    """Seal every chunk at ``step`` and check it against ``expected`` checksums."""
    for c in range(lay.n_chunks):
        lay.seal_chunk(c, step)
        if lay.stored_checksum(c) != int(expected[c]):
            raise IntegrityError(
                f"{who} chunk {c}: the bytes restored from the {source} fail their checksum"
            )


def named_buffers(lay: RetainedLayout) -> list[tuple[str, torch.Tensor]]:
    """The data buffers by name (``param``, ``state.<name>``): a checkpoint's keys."""
    return [("param", lay.param_buffer)] + [("state." + s, lay.state_buffer(s)) for s in lay.states]


def packed(lay: RetainedLayout) -> torch.Tensor:
    """The data buffers' bytes (parameters, then each optimizer state), one copy."""
    return torch.cat([as_bytes(b) for b in lay.data_buffers()])


def unpack_into(lay: RetainedLayout, flat: torch.Tensor) -> None:
    """Write :func:`packed` bytes back into the data buffers."""
    off = 0
    with torch.no_grad():
        for buf in lay.data_buffers():
            b = as_bytes(buf)
            b.copy_(flat[off : off + b.numel()])
            off += b.numel()


@attrs.frozen
class Settled:
    """What :func:`settle` did on one rank."""

    forward: int  # chunks rolled forward to the target
    back: int  # chunks of a begun step beyond the target put back to their undo copy
    dropped: bool  # gradients prepared for a step beyond the target were dropped
    rng: Any = None  # rolled forward: the RNG and sampler state after the target
    sampler: Any = None
    buffers: Any = None  # rolled forward: the module buffers after the target's forward


def settle(
    lay: RetainedLayout,
    ropt: RetainedOptimizer,
    target: int,
    *,
    history: Mapping[int, str],
    pending: Mapping[str, Any] | None,
    load_ps: Callable[[str], None],
    step_scheduler: Callable[[], None],
    who: str,
    on_applied: Callable[[int], None] | None = None,
) -> Settled:
    """Bring one rank to ``target`` (PROTOCOL.md, the reconcile plan).

    ``history``: the rank's process states by step (JSON); ``pending``: its prepare
    record (the step, RNG and sampler after it, the present mask, the module buffers
    after its forward where the backend keeps them). ``on_applied(c)``:
    called after each chunk rolled forward, and for a chunk found written at the target
    with its undo copy still held (a backend keeps its tier 1 up to date from the undo
    copy; a no-op where its tier 1 already holds the chunk at the target).
    """
    dropped = lay.prepared_step > target
    back = 0
    versions = lay.records.versions()
    for c, st in enumerate(lay.chunk_statuses()):
        if st is ChunkStatus.CLEAN:
            continue
        if st is ChunkStatus.APPLIED and versions[c] == target:
            if lay.records.verify_chunk(c):
                # written, the undo copy not yet released: finish that. A stop between the
                # write and the tier-1 update (an abort's safe point) left the backend's
                # tier 1 a step behind: it follows now, from the undo copy (a no-op where
                # the update was done)
                if on_applied is not None:
                    on_applied(c)
                lay.undo.release(c)
            else:  # observed TORN: back to the undo copy, then forward again below
                lay.undo.restore(c)
        elif lay.undo.version(c) == target:
            lay.undo.restore(c)  # a step beyond the target had begun: undo it
            back += 1
    statuses = lay.chunk_statuses()
    behind = [
        c
        for c, v in enumerate(lay.records.versions())
        if statuses[c] is not ChunkStatus.CLEAN or v != target
    ]
    if not behind and target in history:
        load_ps(history[target])
        lay.clear_prepared()
        return Settled(0, back, dropped)
    if target - 1 not in history or pending is None or int(pending["step"]) != target:
        raise IntegrityError(
            f"{who}: no process state of step {target - 1} or prepare record of step "
            f"{target} to roll forward from"
        )
    if lay.prepared_step != target:
        if behind:
            raise IntegrityError(f"{who}: the gradients of step {target} are missing")
        lay.seal_grads(target, pending["present"])  # nothing to write: only the mask
    load_ps(history[target - 1])
    if behind:
        ropt.roll_forward(on_applied=on_applied)
    else:
        ropt.begin(target)
        ropt.end()
    step_scheduler()
    lay.clear_prepared()
    return Settled(
        len(behind), back, dropped, pending["rng"], pending["sampler"], pending.get("buffers")
    )


def check_resumable(
    lay: RetainedLayout,
    ropt: RetainedOptimizer | None,
    target: int,
    who: str,
    intact: Collection[int] = (),
) -> None:
    """Every chunk clean at ``target`` and its checksum holding, the optimizer there too.

    ``intact``: chunks whose checksums this recovery already checked (:func:`intact_at`)
    and nothing wrote since; their bytes are not read a second time.
    """
    lay.clear_prepared()
    why = lay.unresumable(target, intact)
    if why is None and (ropt is None or ropt.version != target):
        why = f"the optimizer is not at step {target}"
    if why is not None:
        raise IntegrityError(f"{who} would resume on wrong state: {why}")


def load_pending(text: str | None) -> dict[str, Any] | None:
    """A prepare record as stored (JSON text), or None."""
    return json.loads(text) if text else None


def decode_chunk(
    coll: Collective,
    lay: RetainedLayout,
    c: int,
    *,
    lost: int,
    version: int,
    versions: list[int],
    checksum: int,
    parity: torch.Tensor | None,
    who: str,
) -> None:
    """Tier 1, on every member of a node: member ``lost``'s chunk ``c`` at ``version``.

    ``versions``: the version of each member the parity encodes; ``checksum``: the one
    recorded for member ``lost`` with it; ``parity``: the bytes, on the node's member 0.
    """
    me = coll.rank
    if versions[lost] != version:
        raise IntegrityError(
            f"{who} chunk {c}: the parity encodes version {versions[lost]}, the plan "
            f"expects {version}"
        )
    data = lay.chunk_data(c) if me == lost else bytes_at(lay, c, versions[me])
    decode(coll, data, lost, 0, parity if me == 0 else None)
    if me == lost:
        lay.seal_chunk(c, version)
        if lay.stored_checksum(c) != checksum:
            raise IntegrityError(
                f"{who} chunk {c}: the bytes rebuilt from tier-1 parity fail the checksum "
                "recorded with the parity"
            )


def decode_grads(
    coll: Collective,
    lay: RetainedLayout,
    *,
    lost: int,
    step: int,
    versions: list[int],
    parity: torch.Tensor | None,
    pending: Mapping[str, Any] | None,
    who: str,
) -> None:
    """Tier 1, on every member of a node: member ``lost``'s gradients of ``step``.

    ``versions``: the step of each member's gradients the gradient parity encodes
    (NONE: none); ``pending``: member ``lost``'s prepare record (its present mask and
    gradient checksums), read on that member only.
    """
    me = coll.rank
    if versions[lost] != step:
        raise IntegrityError(f"{who}: the gradient parity is of step {versions[lost]}, not {step}")
    if me == lost:
        data = lay.grad_buffer
    elif versions[me] == NONE:
        data = torch.zeros_like(lay.grad_buffer)
    else:
        if lay.prepared_step != versions[me] or lay.grads.verify(versions[me]):
            raise IntegrityError(
                f"node member {me}: its gradients of step {versions[me]} are not intact"
            )
        data = lay.grad_buffer
    decode(coll, data, lost, 0, parity if me == 0 else None)
    if me == lost:
        seal_rebuilt_grads(lay, step, pending, "rebuilt from parity", who)


def seal_rebuilt_grads(
    lay: RetainedLayout, step: int, pending: Mapping[str, Any] | None, how: str, who: str
) -> None:
    """Gradients of ``step`` rebuilt (from parity, or copied from a replica): sealed with
    the present mask of the prepare record and checked against its checksums."""
    if pending is None or int(pending["step"]) != step:
        raise IntegrityError(f"{who}: no prepare record of step {step} to rebuild from")
    lay.seal_grads(step, pending["present"])
    if lay.grads.checksums() != pending["grad_checksums"]:
        raise IntegrityError(f"{who}: gradients {how} fail their checksums")


@attrs.frozen
class ReconcileSummary:
    """What :func:`carry_out` did, counted for the ranks its ``ops`` carries out (every
    rank on the fake backend; this rank on gloo)."""

    chunks_repaired_tier1: int = 0
    grads_repaired_tier1: int = 0
    chunks_rolled_forward: int = 0
    chunks_rolled_back: int = 0
    chunks_restored: int = 0
    tier1_from_replicas: int = 0  # of the tier-1 repairs, those copied from a replica
    dropped: bool = False  # a rank dropped gradients prepared beyond the target

    def counts(self) -> dict[str, int]:
        """The counts, by name (the gloo ``Reconciled`` message's summary)."""
        return {
            "chunks_repaired_tier1": self.chunks_repaired_tier1,
            "grads_repaired_tier1": self.grads_repaired_tier1,
            "chunks_rolled_forward": self.chunks_rolled_forward,
            "chunks_rolled_back": self.chunks_rolled_back,
            "chunks_restored": self.chunks_restored,
            "tier1_from_replicas": self.tier1_from_replicas,
        }


class RepairOps(Protocol):
    """What a backend provides to carry out a reconcile plan (:func:`carry_out`):
    memory, collectives and process state, nothing of the plan's order.

    Tier-1 operations are SPMD where the backend is (gloo: every member of the node
    calls them, in the same order); each returns how many of the repairs it counts
    (its own ranks') it carried out.
    """

    @property
    def copies_from_settled(self) -> bool:
        """Tier 1 as replicas: a lost chunk is copied from a member already settled at
        the target (else parity: decoded from the members as the parity recorded them,
        before any settles)."""
        ...

    def ranks(self) -> Sequence[int]:
        """The ranks this executor settles."""
        ...

    def repairs(self, plan: Plan) -> Sequence[Repair]:
        """The plan's chunk-level repairs this executor carries out, in the plan's order."""
        ...

    def check_sources(self, repairs: Sequence[Repair]) -> None:
        """Read what the repairs read that the report left unchecked (or raise)."""
        ...

    def restore_snapshot(self, target: int) -> int:
        """Restore the tier-2 snapshot of ``target``; the chunks restored."""
        ...

    def restore_checkpoint(self, target: int) -> int:
        """Restore the disk checkpoint of ``target``; the chunks restored."""
        ...

    def rebuild_chunks(self, repairs: Sequence[Repair], target: int) -> int:
        """Rebuild the ``TIER1`` repairs' chunks from tier 1 (parity: at each repair's
        version; replicas: from a settled member at ``target``)."""
        ...

    def rebuild_grads(self, repairs: Sequence[Repair]) -> int:
        """Rebuild the ``GRAD_TIER1`` repairs' gradients from tier 1."""
        ...

    def forget_grad_parity(self) -> None:
        """The node's gradient parity is lost from here until it is written afresh."""
        ...

    def settle(self, rank: int, target: int) -> Settled:
        """Bring ``rank`` to ``target`` (:func:`settle`)."""
        ...

    def finish(self) -> None:
        """After every settle (gloo replicas: discarded ranks adopt the majority's state)."""
        ...


def carry_out(plan: Plan, ops: RepairOps) -> ReconcileSummary:
    """Carry out the core's reconcile ``plan`` through ``ops``: the one interpreter of a
    plan, for every backend.

    A tier-2 or checkpoint plan forgets the gradient parity and restores. Otherwise,
    with tier 1 as parity: every chunk and gradient repair in the plan's order (parity
    decodes from the members' bytes at the versions it records, so before any settle),
    the gradient parity forgotten, every rank settled. With tier 1 as replicas: 1. the
    gradients the plan asks for; 2. the ranks that lost no chunk settle at the target;
    3. every lost chunk is copied from a settled member; 4. the ranks that lost chunks
    settle. SPMD backends run this on every member, so the collectives come in one order.
    """
    target = plan.target
    if target is None:
        raise IntegrityError("a reconcile plan without a target (the checkpoint fallback)")
    if plan.kind in (Kind.TIER2, Kind.CKPT):
        ops.forget_grad_parity()
        restore = ops.restore_snapshot if plan.kind is Kind.TIER2 else ops.restore_checkpoint
        return ReconcileSummary(chunks_restored=restore(target))
    repairs = ops.repairs(plan)
    ops.check_sources(repairs)
    chunks = [x for x in repairs if x.what is RepairKind.TIER1]
    grads = [x for x in repairs if x.what is RepairKind.GRAD_TIER1]
    n_chunks = n_grads = 0
    settled: list[Settled] = []
    if ops.copies_from_settled:
        n_grads = ops.rebuild_grads(grads)
        ops.forget_grad_parity()
        lost = {x.rank for x in chunks}
        settled += [ops.settle(r, target) for r in ops.ranks() if r not in lost]
        if chunks:
            n_chunks = ops.rebuild_chunks(chunks, target)
        settled += [ops.settle(r, target) for r in ops.ranks() if r in lost]
    else:
        for x in repairs:
            if x.what is RepairKind.TIER1:
                n_chunks += ops.rebuild_chunks((x,), target)
            elif x.what is RepairKind.GRAD_TIER1:
                n_grads += ops.rebuild_grads((x,))
        ops.forget_grad_parity()
        settled = [ops.settle(r, target) for r in ops.ranks()]
    ops.finish()
    return ReconcileSummary(
        chunks_repaired_tier1=n_chunks,
        grads_repaired_tier1=n_grads,
        chunks_rolled_forward=sum(d.forward for d in settled),
        chunks_rolled_back=sum(d.back for d in settled),
        tier1_from_replicas=n_chunks + n_grads if ops.copies_from_settled else 0,
        dropped=any(d.dropped for d in settled),
    )
