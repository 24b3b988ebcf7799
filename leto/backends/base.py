"""The backend interface: the few operations the core's effects need from a machine.

The protocol core (:mod:`leto.core`) decides *what* happens; an engine
(:mod:`leto.backends.fake.engine`) turns each of the core's effects into tensor work;
a backend supplies the machine underneath:

* **retained memory** (the keeper): per rank, named segments that outlive the
  trainer process (``allocator(rank)`` maps them, create-or-attach;
  ``unmap``; ``memory_lost``; ``reset_memory`` after a loss);
* **node host memory** (the node agent's :class:`NodeStore`): tier-1 parity,
  replicated process state and the tier-2 snapshot; it survives its ranks and
  dies with its node;
* **fencing**: ``fence(generation)`` and ``check_writer(rank, generation)``,
  which refuses a write from a process of an older generation;
* **collectives**: an asynchronous gradient ``all_reduce`` (sum, with a
  :class:`Work` handle, as ``torch.distributed`` with ``async_op=True``),
  ``spmd`` to run a parity program (reduce / all-reduce / broadcast through a
  :class:`leto.retained.parity.Collective`) on a group of ranks, ``barrier``,
  ``abort`` of a generation's collectives and ``rebuild`` of the communicator;
* **shadows**: ``spawn_shadow`` (warm), ``reclaim_shadow`` (cold),
  ``promote_shadow`` (it becomes the rank's trainer), ``kill``;
* **liveness**: ``alive(rank)``.

The recovery coordinator's record (the core's state, with COMMIT records) lives
in the backend too (:class:`ProtocolRecord`), outside every trainer.

``leto.backends.fake`` implements it for N simulated ranks in one process. The gloo
backend (:mod:`leto.backends.gloo`: a process per rank, retained memory in memfd
segments its keepers own) does not go through this interface: each rank's process
carries out the core's effects itself, with its keeper, its node's agent and the
coordinator in the roles above (docs/gloo.md). No NCCL (CUDA) backend is built.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from leto.core.chunk import NONE
from leto.core.erasure import Topology

if TYPE_CHECKING:  # torch is imported by the backends that need it, not by this module
    import torch

    from leto.core import events as ev
    from leto.core.cluster import ClusterModel, ClusterState, Effect
    from leto.retained.layout import Allocator
    from leto.retained.parity import Collective

__all__ = [
    "Backend",
    "BackendError",
    "CollectiveError",
    "ProtocolRecord",
    "FencedError",
    "NodeStore",
    "ProcState",
    "Snapshot",
    "Work",
]

T = TypeVar("T")


class BackendError(RuntimeError):
    """A backend operation failed."""


class FencedError(BackendError):
    """A write from a process of an old generation: the keeper refused it."""


class CollectiveError(BackendError):
    """A collective could not complete (a member is missing, or it was aborted)."""


class ProcState(enum.Enum):
    """A rank's trainer process, as the backend's liveness check sees it."""

    ALIVE = "alive"
    HUNG = "hung"
    DEAD = "dead"


class Work(Protocol):
    """A pending collective (``torch.distributed``'s ``Work`` with ``async_op=True``)."""

    def wait(self) -> torch.Tensor:
        """Block until the collective completes; the result (a tensor the caller owns)."""
        ...


@dataclass
class Snapshot:
    """A node's tier-2 snapshot: its ranks' chunk data at ``step``, and what it needs.

    ``data`` holds the node's members' bytes one after the other (each rank's
    params, then every state buffer), zero padded to the largest node, so every
    node's snapshot has one size (the rotated parity needs it). ``checksums``
    and ``process_states`` cover *every* rank (small, replicated on every
    node), so a lost node's snapshot is complete once its bytes are decoded.
    """

    step: int
    data: torch.Tensor  # uint8
    checksums: dict[int, list[int]]  # rank -> per-chunk checksum at ``step``
    process_states: dict[int, str]  # rank -> process state JSON at ``step``
    share: torch.Tensor | None = None  # this node's rotated parity share (None: one node)


@dataclass
class NodeStore:
    """A node's host memory, held by its agent: outlives its ranks, dies with the node.

    * ``parity[c]``: tier-1 parity of chunk ``c`` (sum of the members' bytes mod 256),
      ``parity_versions[c][m]``: the version of member ``m``'s chunk it encodes,
      ``parity_checksums[c][m]``: that chunk's checksum (to verify a decode);
    * ``gparity``: gradient parity, ``gparity_versions[m]`` (``NONE``: nothing encoded);
    * ``process_states[rank][step]``: each member's process state (JSON) after ``step``;
    * ``pending[rank]``: the prepare record of the step in flight (JSON: RNG and
      sampler state after its compute, the gradient present mask and checksums);
    * ``snapshot``: the node's tier-2 snapshot.
    """

    parity: list[torch.Tensor] | None = None
    parity_versions: list[list[int]] = field(default_factory=list)
    parity_checksums: list[list[int]] = field(default_factory=list)
    gparity: torch.Tensor | None = None
    gparity_versions: list[int] = field(default_factory=list)
    process_states: dict[int, dict[int, str]] = field(default_factory=dict)
    pending: dict[int, str] = field(default_factory=dict)
    snapshot: Snapshot | None = None

    def reset_grad_parity(self, members: int) -> None:
        if self.gparity is not None:
            self.gparity.zero_()
        self.gparity_versions = [NONE] * members


class ProtocolRecord:
    """The protocol's record: the core model, its state, the COMMIT log (the gloo
    backend keeps the same in its coordinator, :mod:`leto.backends.gloo.coordinator`).

    Held by the backend (in a real deployment: the agents' replicated store), never
    by a trainer, so the decision of a step survives any trainer's death.
    ``step`` is pure (it returns the next state and the effects); ``adopt`` makes a
    state current once its effects were carried out.
    """

    def __init__(self, model: ClusterModel, state: ClusterState | None = None) -> None:
        self.model = model
        self.state = model.initial() if state is None else state
        self.commits: list[int] = []

    def step(self, event: ev.Event) -> tuple[ClusterState, tuple[Effect, ...]]:
        return self.model.step(self.state, event)

    def adopt(self, state: ClusterState) -> None:
        self.state = state

    def record_commit(self, step: int) -> None:
        self.commits.append(step)


class Backend(abc.ABC):
    """What the engine needs from a machine; see the module docstring."""

    name: str = "abstract"

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.generation = 0
        self.record: ProtocolRecord | None = None

    # --- topology -------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def nodes(self) -> int:
        return self.topology.nodes

    def node_of(self, rank: int) -> int:
        return self.topology.node_of(rank)

    def ranks_of(self, node: int) -> tuple[int, ...]:
        return self.topology.ranks_of(node)

    # --- retained memory (the keeper) ------------------------------------------------

    @abc.abstractmethod
    def allocator(self, rank: int) -> Allocator:
        """Map ``rank``'s retained segments: create-or-attach by name."""

    @abc.abstractmethod
    def unmap(self, rank: int) -> None:
        """The rank's trainer dropped its mapping (the memory stays with the keeper)."""

    @abc.abstractmethod
    def memory_lost(self, rank: int) -> bool:
        """Has the keeper lost ``rank``'s retained memory (and not re-created it)?"""

    @abc.abstractmethod
    def reset_memory(self, rank: int) -> None:
        """After a loss: the keeper hands out fresh memory for ``rank`` (to rebuild)."""

    @abc.abstractmethod
    def node_store(self, node: int) -> NodeStore:
        """The host memory of ``node``'s agent."""

    # --- fencing ----------------------------------------------------------------------

    @abc.abstractmethod
    def fence(self, generation: int) -> None:
        """Refuse every write from a generation older than ``generation`` from now on."""

    @abc.abstractmethod
    def check_writer(self, rank: int, generation: int) -> None:
        """Raise :class:`FencedError` if a process of ``generation`` may not write ``rank``."""

    # --- collectives --------------------------------------------------------------------

    @abc.abstractmethod
    def all_reduce(self, rank: int, tensor: torch.Tensor, *, tag: Any) -> Work:
        """Start a sum all-reduce of ``tensor`` over every rank; ``tag`` names the call."""

    @abc.abstractmethod
    def spmd(self, members: Sequence[int], fn: Callable[[Collective], T]) -> list[T]:
        """Run ``fn`` on every member of a group (group ranks 0..len-1); results by member."""

    @abc.abstractmethod
    def barrier(self, generation: int) -> None:
        """Every live rank of ``generation`` reaches this point."""

    @abc.abstractmethod
    def abort(self, generation: int) -> None:
        """Abort every collective of ``generation`` (waiters fail instead of hanging)."""

    @abc.abstractmethod
    def rebuild(self, generation: int) -> None:
        """Form the communicator of ``generation`` with every rank."""

    # --- shadows and liveness -------------------------------------------------------

    @abc.abstractmethod
    def spawn_shadow(self, rank: int, factory: Callable[[], Any]) -> None:
        """Start (or re-warm) ``rank``'s standby trainer; ``factory`` builds its objects."""

    @abc.abstractmethod
    def reclaim_shadow(self, rank: int) -> None:
        """The shadow gives its memory back to the active trainer (it goes cold)."""

    @abc.abstractmethod
    def promote_shadow(self, rank: int, generation: int) -> Any:
        """The shadow becomes ``rank``'s trainer of ``generation``; returns its objects."""

    @abc.abstractmethod
    def kill(self, rank: int) -> None:
        """End ``rank``'s trainer process (e.g. a stale one after a fence)."""

    @abc.abstractmethod
    def alive(self, rank: int) -> ProcState:
        """Liveness of ``rank``'s trainer (exit status, heartbeat)."""
