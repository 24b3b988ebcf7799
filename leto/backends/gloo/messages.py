"""Every message of the gloo backend's protocol, one frozen class per kind.

A message is one JSON object tagged by ``"t"`` (:mod:`.wire` frames it). Each kind is
a frozen, slotted class here: its fields validate in the constructor (an int is an
int and not a bool, counters and ranks are not negative, strings are bounded), its
``ROUTE`` names the endpoints it travels between, ``to_wire()`` is the JSON object
and :func:`decode` is the one way back: the tag picks the class from :data:`TAGS`,
and anything else (an unknown tag, an unknown or missing field, a field of the wrong
type) is a :class:`~.wire.WireError` of one line naming the kind and the field. So a
bad message from a peer is a bad frame: it closes that one connection, never the
process that reads it.

Fields whose default is None are left off the wire while they are None (the JSON
keeps the shape it had before these classes existed).

Endpoints: a **trainer** (or shadow) process, its node's **agent**, the job's
**coordinator** (in node 0's agent, or the elected one's), a **node** (another node's agent on its TCP
link to the coordinator) and a **spare** (a spare agent in the job's pool, on its TCP
link: it hears only its :class:`Pooled`, its :class:`Assign` and the job's end, a
:class:`Fail` or :class:`Complete`; once assigned it is a node). Messages between
trainers and the coordinator pass through the agent, which decodes them on arrival and
forwards them typed.

Not here, and why:

* the keeper's requests and replies (``{"op": ...}``, :mod:`.keeper`,
  :mod:`.keeper_client`) and the zygote's (``{"op": "spawn"|"spawned"|"exited"}``,
  :mod:`.zygote`): separate request/reply protocols keyed by ``"op"``, each between
  one process and its own helper; left as they are for now (they are the next to type);
* the agent's replies to a trainer's requests (``{"re": id, "ok": ...}``): matched by
  id, not by tag, by the channel that asked;
* the event log's records (:mod:`.eventlog`): written to a file for people and for
  :mod:`leto.spec.trace`, never read by a peer;
* the status board (:mod:`.board`): fixed-size binary words in shared memory.

Two wire tags were renamed so that each tag has one meaning: the node's hello to the
coordinator is ``node_hello`` (a trainer's hello to its agent is ``hello``), and the
coordinator's order to promote a rank's shadow is ``promote_rank`` (the agent's order
to the shadow itself is ``promote``), and the coordinator's call for reports is
``call_reports`` (a trainer's answer is ``report``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, ClassVar

import attrs

from leto.core.reconcile import Repair

from .wire import MAX_FRAME, WireError

__all__ = ["TAGS", "End", "Message", "decode"]

MAX_TEXT = 4 << 20  # a traceback, a reason: bounded
MAX_NAME = 256  # a phase, a kind, a segment name


class End(enum.Enum):
    """An endpoint of the protocol."""

    TRAINER = "trainer"  # a trainer or shadow process
    AGENT = "agent"  # its node's agent
    COORDINATOR = "coordinator"  # the job's coordinator, in node 0's (or the elected) agent
    NODE = "node"  # another node's agent, on its TCP link to the coordinator
    SPARE = "spare"  # a pooled spare agent (no node rank yet), on its TCP link to it


# --- validators ------------------------------------------------------------------


def _int(_inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
    if type(v) is not int:
        raise TypeError(f"{a.name}: an int, not {type(v).__name__}")


def _nat(inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
    _int(inst, a, v)
    if v < 0:
        raise ValueError(f"{a.name}: {v} is negative")


def _step(inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
    """A step, or -1 for none."""
    _int(inst, a, v)
    if v < -1:
        raise ValueError(f"{a.name}: {v} is below -1")


def _bool(_inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
    if type(v) is not bool:
        raise TypeError(f"{a.name}: a bool, not {type(v).__name__}")


def _number(_inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
    if type(v) not in (int, float):
        raise TypeError(f"{a.name}: a number, not {type(v).__name__}")


def _text(limit: int) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
        if not isinstance(v, str):
            raise TypeError(f"{a.name}: a string, not {type(v).__name__}")
        if len(v) > limit:
            raise ValueError(f"{a.name}: {len(v)} characters (max {limit})")

    return check


def _of(*kinds: type) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
        if not isinstance(v, kinds):
            want = " or ".join(k.__name__ for k in kinds)
            raise TypeError(f"{a.name}: a {want}, not {type(v).__name__}")

    return check


def _ints(_inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
    if not isinstance(v, list) or any(type(x) is not int for x in v):
        raise TypeError(f"{a.name}: a list of ints")


def _runs(_inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
    if not isinstance(v, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p) and p[1] >= 1
        for p in v
    ):
        raise TypeError(f"{a.name}: runs [[value, count], ...], each count 1 or more")


def _one_of(*names: str) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
        if v not in names:
            raise ValueError(f"{a.name}: {str(v)[:40]!r} is not one of {', '.join(names)}")

    return check


def _repairs(_inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
    """A list of the plan's repairs, each in :meth:`leto.core.reconcile.Repair.wire`'s
    shape."""
    if not isinstance(v, list):
        raise TypeError(f"{a.name}: a list, not {type(v).__name__}")
    for x in v:
        if not isinstance(x, dict):
            raise TypeError(f"{a.name}: a repair is a dict, not {type(x).__name__}")
        Repair.from_wire(x)  # ValueError: what is wrong with it


def _opt(check: Callable[[Any, attrs.Attribute[Any], Any], None]) -> Any:
    return attrs.validators.optional(check)


NAME = _text(MAX_NAME)
# the failures an agent reports (M.Failure); the coordinator's own never travel
AGENT_FAILURES = ("crash", "exception", "hang", "keeper_lost")
TEXT = _text(MAX_TEXT)
LONG = _text(MAX_FRAME)  # composed of other texts (a reason and a traceback): the frame's bound


def _f(check: Any, default: Any = attrs.NOTHING) -> Any:
    """A required field (no default) or an optional one."""
    return attrs.field(validator=check, default=default)


# --- the messages ------------------------------------------------------------------


class Message:
    """A protocol message: its ``TAG`` on the wire and its ``ROUTE`` (from -> to)."""

    __slots__ = ()
    TAG: ClassVar[str]
    ROUTE: ClassVar[tuple[End, ...]]

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": self.TAG}
        for a in attrs.fields(type(self)):  # type: ignore[arg-type]
            v = getattr(self, a.name)
            if v is None and a.default is None:
                continue
            out[a.name] = v
        return out


T, A, C, N, S = End.TRAINER, End.AGENT, End.COORDINATOR, End.NODE, End.SPARE


# trainer -> agent (the agent's own business)


@attrs.frozen
class Hello(Message):
    """A process's first message on the agent's socket (its status board rides along)."""

    TAG = "hello"
    ROUTE = (T, A)
    pid: int | None = _f(_opt(_nat), None)  # checked against the kernel's word
    role: str | None = _f(_opt(NAME), None)
    rank: int | None = _f(_opt(_nat), None)
    local_rank: int | None = _f(_opt(_nat), None)
    node: int | None = _f(_opt(_nat), None)
    incarnation: int | None = _f(_opt(_nat), None)


@attrs.frozen
class Heartbeat(Message):
    TAG = "hb"
    ROUTE = (T, A)
    phase: str = _f(NAME)
    step: int = _f(_step)
    progress: int = _f(_int)


@attrs.frozen
class Warm(Message):
    """A shadow is ready to be promoted."""

    TAG = "warm"
    ROUTE = (T, A)


@attrs.frozen
class Error(Message):
    """The process raised: its traceback (a death follows)."""

    TAG = "error"
    ROUTE = (T, A)
    traceback: str = _f(TEXT)
    phase: str | None = _f(_opt(NAME), None)
    step: int | None = _f(_opt(_step), None)


@attrs.frozen
class Exit(Message):
    TAG = "exit"
    ROUTE = (T, A)
    code: int = _f(_int)


@attrs.frozen
class ProcessState(Message):
    """A rank's process state after ``step`` (JSON text), kept by its agent."""

    TAG = "ps"
    ROUTE = (T, A)
    rank: int = _f(_nat)
    step: int = _f(_step)
    json: str = _f(_of(str))


@attrs.frozen
class Pending(Message):
    """A rank's prepare record (JSON text, "" for none), kept by its agent."""

    TAG = "pending"
    ROUTE = (T, A)
    rank: int = _f(_nat)
    json: str = _f(_of(str))


@attrs.frozen
class GetState(Message):
    """Request: the rank's kept process states and prepare record."""

    TAG = "get_state"
    ROUTE = (T, A)
    rank: int = _f(_nat)
    id: int = _f(_nat, 0)  # filled in by the channel


@attrs.frozen
class NodeSegment(Message):
    """Request: the node's segment ``name`` of ``nbytes`` (its descriptor in the reply)."""

    TAG = "node_segment"
    ROUTE = (T, A)
    name: str = _f(NAME)
    nbytes: int = _f(_nat)
    id: int = _f(_nat, 0)  # filled in by the channel


@attrs.frozen
class NodeListing(Message):
    """Request: the node's segments made so far, each name with its size (no
    descriptors): a warm shadow maps its node's tier-1 segment before any promotion."""

    TAG = "node_listing"
    ROUTE = (T, A)
    id: int = _f(_nat, 0)  # filled in by the channel


@attrs.frozen
class SnapshotSlot(Message):
    """Request: which tier-2 slot to write the snapshot of ``step`` into (-1: just ask)."""

    TAG = "snapshot_slot"
    ROUTE = (T, A)
    step: int = _f(_step)
    id: int = _f(_nat, 0)  # filled in by the channel


@attrs.frozen
class ClaimFault(Message):
    """Request: claim the fault ``fault`` of the plan (it fires once per job); the reply's
    ``first`` is True for the one claim that fires it. The agent claims it where the job's
    claims outlive any one node (the TCPStore on c10d, etcd with ``--rdzv-backend etcd``)."""

    TAG = "claim_fault"
    ROUTE = (T, A)
    fault: str = _f(NAME)
    id: int = _f(_nat, 0)  # filled in by the channel


# agent -> trainer (the agent's own business)


@attrs.frozen
class StoreAt(Message):
    """The job's TCPStore moved (a new coordinator serves it, ``--rdzv-backend etcd``):
    connect there before the next use."""

    TAG = "store_at"
    ROUTE = (A, T)
    host: str = _f(NAME)
    port: int = _f(_nat)


# trainer -> coordinator (through the agent)


@attrs.frozen
class Ready(Message):
    TAG = "ready"
    ROUTE = (T, A, C)
    rank: int = _f(_nat)
    gen: int = _f(_nat)
    n_chunks: int = _f(_nat)
    chunk_numel: int = _f(_nat)
    tier1: bool = _f(_bool)
    tier1_kind: str = _f(NAME)
    tier2: bool = _f(_bool)
    tier2_interval: int = _f(_nat)
    checkpoint: bool = _f(_bool)
    snapshot: dict[str, Any] | None = _f(_opt(_of(dict)), None)
    tier2_parity: int = _f(_nat, 1)
    start: int = _f(_nat, 0)  # the step the job starts at (> 0: resumed from a checkpoint)
    shard: bool = _f(_bool, False)  # shard = true: shrinks only 2 nodes to 1, never grows


@attrs.frozen
class Vote(Message):
    """Step ``step``'s gradients are sealed: the rank votes to commit it. ``pending``
    (its prepare record) stays with the agent."""

    TAG = "vote"
    ROUTE = (T, A, C)
    rank: int = _f(_nat)
    step: int = _f(_nat)
    gen: int = _f(_nat)
    pending: str | None = _f(_opt(_of(str)), None)


@attrs.frozen
class Finished(Message):
    """The rank applied step ``step``; ``ps`` (its process state) stays with the agent;
    ``replica``: the digest of its retained state, which every data-parallel replica
    must share (:mod:`leto.core.agreement`), when a check is due."""

    TAG = "finished"
    ROUTE = (T, A, C)
    rank: int = _f(_nat)
    step: int = _f(_nat)
    gen: int = _f(_nat)
    loss: float | None = _f(_opt(_number), None)
    ps: str | None = _f(_opt(_of(str)), None)
    replica: str | None = _f(_opt(_of(str)), None)


@attrs.frozen
class SnapshotDone(Message):
    TAG = "snapshot_done"
    ROUTE = (T, A, C)
    rank: int = _f(_nat)
    step: int = _f(_nat)
    gen: int = _f(_nat)
    meta: dict[str, Any] | None = _f(_opt(_of(dict)), None)


@attrs.frozen
class CheckpointStaged(Message):
    """The rank staged its state of ``step`` for an asynchronous checkpoint (``checkpoint_async``:
    a copy in its own host buffers, written in the background): sent at the step boundary,
    before the rank's next vote, so that with every rank's the coordinator feeds
    ``BeginCheckpoint`` while the model has every rank idle at ``step``."""

    TAG = "ckpt_staged"
    ROUTE = (T, A, C)
    rank: int = _f(_nat)
    step: int = _f(_nat)
    gen: int = _f(_nat)


@attrs.frozen
class CheckpointWritten(Message):
    """The rank's part of the disk checkpoint of ``step`` is written (its DCP files, its
    process state beside them): the protocol's ``WriteShard``."""

    TAG = "ckpt_written"
    ROUTE = (T, A, C)
    rank: int = _f(_nat)
    step: int = _f(_nat)
    gen: int = _f(_nat)


@attrs.frozen
class Stopped(Message):
    """The rank stopped at a safe point (``reason``: a collective failed, "" if asked)."""

    TAG = "stopped"
    ROUTE = (T, A, C)
    rank: int = _f(_nat)
    gen: int = _f(_nat)
    reason: str = _f(TEXT, "")


@attrs.frozen
class Kept(Message):
    """The rank's compute of step ``step``, paused by the recovery that ended in
    generation ``gen``, goes on: the core kept it (:func:`leto.core.reconcile.keeps_compute`)."""

    TAG = "kept"
    ROUTE = (T, A, C)
    rank: int = _f(_nat)
    step: int = _f(_nat)
    gen: int = _f(_nat)


@attrs.frozen
class Replayed(Message):
    """The rank computed micro-batches ``micro_batches`` of rank ``owner``'s share of
    step ``step`` (the step in flight replayed in parallel after the recovery that ended
    in generation ``gen``; :mod:`leto.core.replay`)."""

    TAG = "replayed"
    ROUTE = (T, A, C)
    rank: int = _f(_nat)
    step: int = _f(_nat)
    gen: int = _f(_nat)
    owner: int = _f(_nat)
    micro_batches: list[int] = _f(_ints, attrs.Factory(list))


@attrs.frozen
class Report(Message):
    """A trainer's answer to :class:`CallReports`: the truth of its retained state
    (chunk versions, undo copies, sealed gradients, and from a node's first rank its
    node's parity records), each row of chunks as runs ``[[value, count], ...]``
    (:mod:`leto.core.runs`: O(runs), not O(chunks), at every one of a thousand ranks)."""

    TAG = "report"
    ROUTE = (T, A, C)
    gen: int = _f(_nat)
    rank: int = _f(_nat)
    data: list[list[int]] | None = _f(_opt(_runs), None)
    undo: list[list[int]] | None = _f(_opt(_runs), None)
    grad: int | None = _f(_opt(_int), None)
    lost: bool | None = _f(_opt(_bool), None)
    pg_ms: float | None = _f(_opt(_number), None)
    node_par: list[list[Any]] | None = _f(_opt(_of(list)), None)  # runs of records
    node_gpar: list[int] | None = _f(_opt(_ints), None)


@attrs.frozen
class Reconciled(Message):
    TAG = "reconciled"
    ROUTE = (T, A, C)
    rank: int = _f(_nat)
    gen: int = _f(_nat)
    summary: dict[str, Any] = _f(_of(dict), attrs.Factory(dict))
    snapshot: dict[str, Any] | None = _f(_opt(_of(dict)), None)


@attrs.frozen
class Rebuilt(Message):
    TAG = "rebuilt"
    ROUTE = (T, A, C)
    rank: int = _f(_nat)
    gen: int = _f(_nat)


@attrs.frozen
class Done(Message):
    """The rank ran every step: its final digest; ``memory``: where its retained state
    lived (``device``, the chunks' ``checksum``, whether parity collectives were
    ``staged`` through host copies)."""

    TAG = "done"
    ROUTE = (T, A, C)
    rank: int = _f(_nat)
    step: int = _f(_nat)
    gen: int = _f(_nat)
    digest: dict[str, Any] | str | None = _f(_opt(_of(dict, str)), None)
    memory: dict[str, Any] | None = _f(_opt(_of(dict)), None)


@attrs.frozen
class Fatal(Message):
    """An error no recovery can help: the job stops."""

    TAG = "fatal"
    ROUTE = (T, A, C)
    rank: int = _f(_nat)
    error: str = _f(LONG)


@attrs.frozen
class Promoted(Message):
    """A shadow runs as its rank's trainer: the trainer tells its agent, the agent the
    coordinator (with how: ``warm``, how long it took, and the process's ``pid``)."""

    TAG = "promoted"
    ROUTE = (T, A, C)
    rank: int = _f(_nat)
    gen: int = _f(_nat)
    warm: bool | None = _f(_opt(_bool), None)
    ms: float | None = _f(_opt(_number), None)
    pid: int | None = _f(_opt(_nat), None)


@attrs.frozen
class Unprotected(Message):
    """The script runs without ``leto.wrap`` (``detail``: how it was seen): the
    trainer tells its agent, which says so on its console, and the coordinator."""

    TAG = "unprotected"
    ROUTE = (T, A, C)
    rank: int = _f(_nat)
    detail: str = _f(NAME)


# agent -> coordinator


@attrs.frozen
class Failure(Message):
    """A failure the agent saw (``kind``: crash, exception, hang, keeper_lost; the
    coordinator's own, such as ``diverged``, a replica check's, never travel: see
    :data:`.recovery_driver.FAULT_OF`)."""

    TAG = "failure"
    ROUTE = (A, C)
    kind: str = _f(_one_of(*AGENT_FAILURES))
    rank: int = _f(_nat)
    detected_by: str = _f(NAME)
    detail: str | None = _f(_opt(LONG), None)
    traceback: str | None = _f(_opt(LONG), None)
    in_phase: str | None = _f(_opt(NAME), None)
    at_step: int | None = _f(_opt(_step), None)
    ms_since_heartbeat: float | None = _f(_opt(_number), None)
    pid: int | None = _f(_opt(_nat), None)


@attrs.frozen
class Shadow(Message):
    """A rank's shadow changed state (warm, cold, failed)."""

    TAG = "shadow"
    ROUTE = (A, C)
    rank: int = _f(_nat)
    state: str = _f(NAME)
    ms: float | None = _f(_opt(_number), None)
    reason: str | None = _f(_opt(LONG), None)
    degraded: str | None = _f(_opt(LONG), None)


@attrs.frozen
class Fenced(Message):
    """The node killed the stale processes and fenced its keepers at ``gen``."""

    TAG = "fenced"
    ROUTE = (A, C)
    node: int = _f(_nat)
    gen: int = _f(_nat)
    killed: list[dict[str, int]] = _f(_of(list), attrs.Factory(list))


@attrs.frozen
class Started(Message):
    """The agent started a process of its node (``role``: agent, zygote, keeper, trainer
    or shadow; ``rank`` for the last three): its pid goes to the event log."""

    TAG = "started"
    ROUTE = (A, C)
    role: str = _f(NAME)
    pid: int = _f(_nat)
    rank: int | None = _f(_opt(_nat), None)
    incarnation: int | None = _f(_opt(_nat), None)


@attrs.frozen
class NodeFinished(Message):
    TAG = "node_finished"
    ROUTE = (A, C)
    node: int = _f(_nat)


# the handshake of a node's TCP link (see .auth)


@attrs.frozen
class Challenge(Message):
    TAG = "challenge"
    ROUTE = (C, N)
    nonce: str = _f(NAME)


@attrs.frozen
class NodeHello(Message):
    TAG = "node_hello"
    ROUTE = (N, C)
    node: int = _f(_nat)
    nonce: str = _f(NAME)
    proof: str = _f(NAME)


@attrs.frozen
class Welcome(Message):
    TAG = "welcome"
    ROUTE = (C, N)
    spare: bool = _f(_bool)
    gen: int = _f(_nat)
    proof: str = _f(NAME)


@attrs.frozen
class Reject(Message):
    TAG = "reject"
    ROUTE = (C, N)
    why: str = _f(TEXT)


# the spare pool (``leto launch --spare``): a spare proves the job's secret like a node
# (see .auth), waits in the pool, and is assigned the place of a lost node


@attrs.frozen
class SpareHello(Message):
    """A spare agent's answer to the challenge: it has no node rank yet."""

    TAG = "spare_hello"
    ROUTE = (S, C)
    nonce: str = _f(NAME)
    proof: str = _f(NAME)


@attrs.frozen
class Pooled(Message):
    """The spare is in the pool as ``spare_id`` (the coordinator's proof rides along)."""

    TAG = "pooled"
    ROUTE = (C, S)
    spare_id: int = _f(_nat)
    proof: str = _f(NAME)


@attrs.frozen
class Assign(Message):
    """Take the place of the lost ``node`` at generation ``gen``: from now on the spare's
    link is that node's, and it proceeds as a replacement node started by hand (a
    :class:`Go` with ``spare=True`` follows). ``at_start``: the place is one of the job's
    first nodes (``--nnodes MIN:MAX``: a :class:`Go` with ``spare=False`` follows);
    ``nnodes``: the job's world, in nodes (an elastic job's is fixed at its start)."""

    TAG = "assign"
    ROUTE = (C, S)
    node: int = _f(_nat)
    gen: int = _f(_nat)
    nnodes: int | None = _f(_opt(_nat), None)
    at_start: bool = _f(_bool, False)


@attrs.frozen
class Go(Message):
    """Every node has joined (or this one is a spare): start the processes."""

    TAG = "go"
    ROUTE = (C, A)
    spare: bool = _f(_bool)


# coordinator -> agents (and on to the trainers)


@attrs.frozen
class Fail(Message):
    """The job ends with ``error``; with ``restart`` (from 1), every node's agent starts
    the job again, as that restart (``--max-restarts``), from the latest disk checkpoint
    (a world change is carried out in place: :class:`Reshape`)."""

    TAG = "fail"
    ROUTE = (C, A)
    error: str = _f(LONG)
    restart: int | None = _f(_opt(_nat), None)


@attrs.frozen
class Commit(Message):
    TAG = "commit"
    ROUTE = (C, A, T)
    step: int = _f(_nat)
    gen: int = _f(_nat)


@attrs.frozen
class Tier2(Message):
    """The tier-2 snapshot of ``step`` is complete: it is current."""

    TAG = "t2"
    ROUTE = (C, A, T)
    step: int = _f(_nat)
    gen: int = _f(_nat)


@attrs.frozen
class Complete(Message):
    TAG = "complete"
    ROUTE = (C, A, T)


@attrs.frozen
class Abort(Message):
    TAG = "abort"
    ROUTE = (C, A, T)
    gen: int = _f(_nat)


@attrs.frozen
class Fence(Message):
    TAG = "fence"
    ROUTE = (C, A)
    gen: int = _f(_nat)
    kill: list[int] = _f(_ints, attrs.Factory(list))


@attrs.frozen
class Discard(Message):
    """``rank``'s retained state differs from its replicas' after ``step``: its agent kills
    its trainer and its keeper (the memory is gone: the protocol's ``LoseMemory``); the
    recovery copies the rank's chunks and its optimizer's and scheduler's state from
    ``source``, a rank of the agreeing majority on the same node (the lowest such: every
    rank of the node that was not discarded is one)."""

    TAG = "discard"
    ROUTE = (C, A)
    rank: int = _f(_nat)
    source: int = _f(_nat)
    step: int = _f(_nat)


@attrs.frozen
class NeedShadow(Message):
    TAG = "need_shadow"
    ROUTE = (C, A)
    rank: int = _f(_nat)


@attrs.frozen
class PromoteRank(Message):
    """Promote the shadow of ``rank`` (the agent tells the shadow: :class:`Promote`)."""

    TAG = "promote_rank"
    ROUTE = (C, A)
    rank: int = _f(_nat)
    gen: int = _f(_nat)
    warm: bool = _f(_bool)


@attrs.frozen
class Promote(Message):
    """A shadow becomes its rank's trainer, with its keeper (it may be a new one), in a
    world of ``nodes`` nodes as ``node``'s local rank ``rank`` has it now (a world changed
    in place since the shadow started: the nodes after a lost one renumbered)."""

    TAG = "promote"
    ROUTE = (A, T)
    gen: int = _f(_nat)
    keeper_pid: int = _f(_nat)
    keeper_socket: str = _f(NAME)
    nodes: int | None = _f(_opt(_nat), None)
    node: int | None = _f(_opt(_nat), None)


@attrs.frozen
class CallReports(Message):
    """Every trainer reports its retained state (:class:`Report`) for generation ``gen``."""

    TAG = "call_reports"
    ROUTE = (C, A, T)
    gen: int = _f(_nat)


@attrs.frozen
class Reconcile(Message):
    """Carry out the core's plan: ``kind`` and ``target``, the repairs (each a run of
    ``count`` chunks from ``chunk``, expanded by the receiver through the core), the
    snapshot."""

    TAG = "reconcile"
    ROUTE = (C, A, T)
    gen: int = _f(_nat)
    kind: str = _f(NAME)
    target: int = _f(_nat)
    repairs: list[dict[str, Any]] = _f(_repairs, attrs.Factory(list))
    retake_t2: bool = _f(_bool, True)
    snapshot: dict[str, Any] | None = _f(_opt(_of(dict)), None)
    # ranks discarded because they diverged: their tier-1 records describe the diverged
    # bytes, so a copy from the majority is checked against the source's checksums only
    diverged: list[int] = _f(_ints, attrs.Factory(list))


@attrs.frozen
class Rebuild(Message):
    TAG = "rebuild"
    ROUTE = (C, A, T)
    gen: int = _f(_nat)


@attrs.frozen
class Resume(Message):
    TAG = "resume"
    ROUTE = (C, A, T)
    gen: int = _f(_nat)
    step: int = _f(_nat)
    t2: int | None = _f(_opt(_nat), None)


@attrs.frozen
class Reshape(Message):
    """The world changes in place (:mod:`leto.core.reshape`): each trainer rolls to
    ``step`` (the committed step), takes its rank in a world of ``nodes`` nodes (the old
    world's nodes ``lost_nodes`` are gone: each node after one is renumbered, and its ranks
    with it, :func:`leto.core.reshape.renumbered`; every other rank keeps its number),
    forms generation ``gen``'s groups, re-encodes tier 2 over them and says ``ready``
    again; it keeps its process and its retained state. ``grow``: nodes joined last;
    their ranks' state is copied from rank 0's (a live replica)."""

    TAG = "reshape"
    ROUTE = (C, A, T)
    gen: int = _f(_nat)
    step: int = _f(_nat)
    nodes: int = _f(_nat)
    grow: bool = _f(_bool, False)  # new nodes joined last: rank 0's state copied to them
    lost_nodes: list[int] = _f(_ints, attrs.Factory(list))  # the old world's, lost (shrink)
    # sharded state: the tier-2 snapshot of ``step`` (its record, as a Reconcile's) to
    # reshard from (docs/gloo.md, "Sharded state")
    snapshot: dict[str, Any] | None = _f(_opt(_of(dict)), None)


KINDS: tuple[type[Message], ...] = (
    Hello,
    Heartbeat,
    Warm,
    Error,
    Exit,
    ProcessState,
    Pending,
    GetState,
    NodeSegment,
    NodeListing,
    SnapshotSlot,
    ClaimFault,
    StoreAt,
    Ready,
    Vote,
    Finished,
    SnapshotDone,
    CheckpointStaged,
    CheckpointWritten,
    Stopped,
    Kept,
    Replayed,
    Report,
    Reconciled,
    Rebuilt,
    Done,
    Fatal,
    Promoted,
    Unprotected,
    Failure,
    Shadow,
    Fenced,
    Started,
    NodeFinished,
    Challenge,
    NodeHello,
    Welcome,
    Reject,
    SpareHello,
    Pooled,
    Assign,
    Go,
    Fail,
    Commit,
    Tier2,
    Complete,
    Abort,
    Fence,
    Discard,
    NeedShadow,
    PromoteRank,
    Promote,
    CallReports,
    Reconcile,
    Rebuild,
    Resume,
    Reshape,
)
TAGS: dict[str, type[Message]] = {k.TAG: k for k in KINDS}


def decode(obj: Any) -> Message:
    """The message ``obj`` (a decoded JSON object) is; :class:`WireError` if none."""
    if not isinstance(obj, dict):
        raise WireError(f"not a message: a {type(obj).__name__}")
    tag = obj.get("t")
    kind = TAGS.get(tag) if isinstance(tag, str) else None
    if kind is None:
        raise WireError(f"unknown message kind {str(tag)[:40]!r}")
    names = {a.name for a in attrs.fields(kind)}  # type: ignore[arg-type]
    extra = sorted(str(k)[:40] for k in obj if k != "t" and k not in names)
    if extra:
        raise WireError(f"{tag}: unknown field {extra[0]!r}")
    try:
        return kind(**{k: v for k, v in obj.items() if k != "t"})
    except (TypeError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise WireError(f"{tag}: {first[:200]}") from None
