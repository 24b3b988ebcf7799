"""Where one rank's state lives: retained segments of its keeper, node segments of its agent.

A trainer owns no memory of its own that a recovery needs: its parameters, gradients
and optimizer state are views into memfd segments its keeper holds (they outlive the
trainer), and its node's tier-1 blocks and tier-2 snapshot slots are segments the node
agent holds (they outlive the node's trainers and keepers). :class:`RankMemory` binds
the session's optimizer to the former (fresh, or attached after a restart) and maps the
latter. A shadow keeps a skeleton of the model (:func:`to_meta`) until it is promoted.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Protocol

import torch
from torch import nn

from leto.retained.layout import RetainedLayout, ShapeMismatchError
from leto.retained.optim import RetainedOptimizer, retain
from leto.retained.recovery import IntegrityError
from leto.retained.shard import FullParams, ShardPlan, retain_shard

from . import messages as M
from . import segments
from .channel import AgentChannel
from .collective import ALL_GATHER, coll
from .keeper_client import KeeperClient
from .parity_block import TIER1, ParityBlock, node_blocks, tier1_bytes, tier1_name

__all__ = ["MemoryHost", "RankMemory", "buffers_to", "materialize", "to_meta"]

_STATUS = "gloo.status"  # keeper segment: int64 [lost flag]


def to_meta(model: nn.Module) -> None:
    """Release the parameters' memory: the shadow keeps a skeleton of the same objects.

    A parameter is swapped for a meta-device one in place (``swap_tensors``: the
    optimizer and the module keep the same object). ``swap_tensors`` refuses a tensor
    that has weak references (RNN modules keep them in ``_flat_weight_refs``): such a
    parameter keeps its object and its device, and its ``.data`` becomes one element
    broadcast to its shape, so its storage is released all the same and attaching the
    retained state later rebinds ``.data`` (the module sees the same object).
    """
    for p in model.parameters():
        if p.device.type == "meta" or _is_placeholder(p):
            continue
        if weakref.getweakrefcount(p):
            p.data = torch.empty((), dtype=p.dtype, device=p.device).expand(p.shape)
        else:
            torch.utils.swap_tensors(  # type: ignore[no-untyped-call]
                p, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            )


def _is_placeholder(p: torch.Tensor) -> bool:
    """A skeleton parameter of :func:`to_meta` that kept its device (no storage of its own)."""
    return p.numel() > 1 and p.untyped_storage().nbytes() < p.numel() * p.element_size()


def buffers_to(model: nn.Module, device: torch.device) -> None:
    """Move the model's buffers (running statistics, ...) to ``device``; its parameters
    are left alone (binding them to the retained memory puts them on its device)."""
    for m in model.modules():
        for k, b in m._buffers.items():
            if b is not None and b.device != device:
                m._buffers[k] = b.to(device)


def materialize(model: nn.Module) -> None:
    """Give skeleton parameters (uninitialised) CPU memory; buffers are left alone."""
    for p in model.parameters():
        if p.device.type == "meta":
            torch.utils.swap_tensors(  # type: ignore[no-untyped-call]
                p, nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
            )
        elif _is_placeholder(p):
            p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device)


class MemoryHost(Protocol):
    """What :class:`RankMemory` reads of its rank's session, and the state it binds there."""

    ropt: RetainedOptimizer | None
    full: FullParams | None
    parity: list[ParityBlock]
    gparity: ParityBlock | None

    @property
    def keeper(self) -> KeeperClient | None: ...
    @property
    def cfg(self) -> Any: ...
    @property
    def model(self) -> nn.Module: ...
    @property
    def user_optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def members(self) -> int: ...
    @property
    def layout(self) -> RetainedLayout: ...
    @property
    def ch(self) -> AgentChannel: ...
    @property
    def replica(self) -> bool: ...
    @property
    def rank(self) -> int: ...
    @property
    def W(self) -> int: ...
    def _fatal(self, message: str) -> None: ...


class RankMemory:
    """Binds a session to its keeper's and its node agent's segments (see the module docstring)."""

    def __init__(self, session: MemoryHost) -> None:
        self.session = session
        self.status: torch.Tensor | None = None
        #: sharded state: the names of each of the user's optimizer's groups' parameters
        #: (its groups hold this rank's pieces once bound), for the checkpoint
        self.shard_groups: list[list[str]] = []
        # a warm shadow's mapping of its node's tier-1 segment (its name, descriptor and
        # bytes), made before any promotion (:meth:`premap_node`)
        self.premapped: tuple[str, int, torch.Tensor] | None = None
        #: the retained segments' prefix: ``leto``, or, sharded state resharded in place
        #: to a world of W ranks, ``leto.wW`` (the old world's segments are of another size)
        self.prefix = "leto"

    def _status_seg(self) -> torch.Tensor:
        if self.status is None:
            assert self.session.keeper is not None
            self.status = self.session.keeper.alloc(_STATUS, 8, "cpu").view(torch.int64)
        return self.status

    def status_lost(self, lost: bool) -> None:
        """Mark the keeper's memory lost (a restart must rebuild it) or whole again."""
        self._status_seg()[0] = 1 if lost else 0

    def bind(self, *, attach: bool) -> None:
        session = self.session
        assert session.keeper is not None
        if not attach:
            materialize(session.model)  # a skeleton has no values: garbage until repaired
        device = getattr(session.cfg, "torch_device", torch.device("cpu"))
        buffers_to(session.model, device)  # the parameters: bound to the retained memory
        if session.cfg.shard:
            self._bind_shard(attach=attach)
            return
        session.ropt = retain(
            session.model,
            session.user_optimizer,
            chunk_numel=int(session.cfg.chunk_size),
            alloc=session.keeper.alloc,
            attach=attach,
            # verify_chunks is done once per step, for every chunk, before the vote
            # (during the gradient all-reduce, so a corrupt chunk stops the step
            # before its commit); checking each chunk again at its undo copy would
            # read the whole state a second time for nothing
            verify=False,
            master_weights=bool(session.cfg.master_weights),
            checksum_algorithm=getattr(session.cfg, "checksum_algorithm", None),
        )

    def _bind_shard(self, *, attach: bool) -> None:
        """Sharded state (``shard = true``): this rank's shard retained, the model's
        parameters views of a flat tensor of this process, filled by the all-gather
        (:meth:`gather_params`) after every step and every recovery."""
        session = self.session
        assert session.keeper is not None
        named = list(session.model.named_parameters())
        name_of = {id(p): n for n, p in named}
        self.shard_groups = [
            [name_of[id(p)] for p in g["params"]] for g in session.user_optimizer.param_groups
        ]
        self.rebind_shard(attach=attach, values=not attach)

    def rebind_shard(self, *, attach: bool, values: bool, groups: bool = False) -> None:
        """This rank's shard of the world it is in now (:meth:`_bind_shard`); ``groups``:
        the optimizer's groups hold another plan's pieces (resharded in place)."""
        session = self.session
        assert session.keeper is not None
        named = list(session.model.named_parameters())
        plan = ShardPlan(
            named,
            session.W,
            int(session.cfg.chunk_size),
            master_weights=bool(session.cfg.master_weights),
        )
        session.full = FullParams(plan, named, values=values)
        session.ropt = retain_shard(
            session.model,
            session.user_optimizer,
            plan,
            session.rank,
            alloc=session.keeper.alloc,
            attach=attach,
            prefix=self.prefix,
            checksum_algorithm=getattr(session.cfg, "checksum_algorithm", None),
            groups=self.shard_groups if groups else None,
        )
        if groups:  # tier 1 of the new shard's geometry, mapped at its rebuild
            session.parity, session.gparity = [], None

    def gather_params(self) -> None:
        """Sharded state: every rank's shard of the parameters into the model's (a
        collective of every rank); nothing without sharding."""
        session = self.session
        if session.full is None:
            return
        coll(ALL_GATHER, session.full.flat, session.full.gather_input(session.layout))
        session.full.derive()  # master weights in a model of mixed dtypes: its bf16 parameters

    def ensure_layout(self) -> bool:
        """Attach to the retained state, or create it fresh if the keeper lost it.

        Returns True if the memory was lost (the rank must be rebuilt).
        """
        session = self.session
        assert session.keeper is not None
        if session.ropt is not None:
            return bool(self._status_seg()[0])
        have = session.keeper.open()  # the listing, and every segment's descriptor with it
        if session.cfg.shard and f"leto.w{session.W}.super" in have:
            self.prefix = f"leto.w{session.W}"  # resharded in place to this world
        try:
            if f"{self.prefix}.super" in have:
                try:
                    self.bind(attach=True)
                except ShapeMismatchError as e:
                    session._fatal(
                        f"the script's model does not match the retained state: {e}. "
                        "Every process of a rank must build the same model (shapes, names, dtype)."
                    )
                return bool(self._status_seg()[0])
        finally:
            session.keeper.close_opened()
        self.status_lost(True)  # until the rebuild completes, a restart sees LOST
        self.bind(attach=False)
        return True

    def node_memory(self) -> None:
        """Map this node's tier-1 blocks (one segment, :func:`tier1_name`; created empty
        by the agent): the one a warm shadow mapped before its promotion
        (:meth:`premap_node`), or asked for now."""
        session = self.session
        lay = session.layout
        if not session.cfg.tier1:
            return
        item = 0 if session.replica else lay.dtype.itemsize  # replicas: the records only
        cbytes = (1 + len(lay.states)) * lay.chunk_numel * item
        gbytes = lay.numel * item
        name = tier1_name(cbytes, lay.n_chunks, gbytes)
        size = tier1_bytes(session.members, cbytes, lay.n_chunks, gbytes)
        early, self.premapped = self.premapped, None
        if early is not None and (early[0] != name or early[2].numel() != size):
            os.close(early[1])  # a segment of another geometry: not this layout's
            early = None
        _, fd, base = early if early is not None else self._map(name, size)
        try:
            blocks = node_blocks(fd, base, session.members, cbytes, lay.n_chunks, gbytes)
        except BaseException:
            os.close(fd)
            raise
        *session.parity, session.gparity = blocks

    def _map(self, name: str, nbytes: int) -> tuple[str, int, torch.Tensor]:
        """The node's tier-1 segment ``name`` of ``nbytes`` (made by the agent on first
        ask): its name, its descriptor (kept open for the blocks' locks), its mapping."""
        fd = self.segment(name, nbytes)
        try:
            return name, fd, segments.as_tensor(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise

    def premap_node(self) -> int:
        """A warm shadow maps its node's tier-1 segment, once a rank of the node has made
        it, before any promotion, so a promoted rank does not map it while the recovery
        waits for its report (:meth:`node_memory` takes it). The segment lives as long as
        the node's agent, and its bytes and records are read through the mapping when
        used, so a mapping made early is the one a promotion would make. Returns the
        number of segments mapped so far (0 or 1)."""
        session = self.session
        if not session.cfg.tier1:
            return 0
        if self.premapped is None:
            reply, _ = session.ch.request(M.NodeListing())
            sizes = dict(zip(reply.get("names", []), reply.get("sizes", []), strict=True))
            names = sorted(n for n in sizes if n.startswith(TIER1 + "."))
            if names:
                self.premapped = self._map(names[0], int(sizes[names[0]]))
        return int(self.premapped is not None)

    def segment(self, name: str, nbytes: int) -> int:
        """A descriptor of the node agent's segment ``name`` (created on first ask)."""
        reply, fds = self.session.ch.request(M.NodeSegment(name=name, nbytes=nbytes))
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise IntegrityError(
                f"the agent sent no segment {name} of {nbytes} bytes "
                f"({reply.get('why', 'no reason given')})"
            )
        return fds[0]
