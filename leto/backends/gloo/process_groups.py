"""One rank's gloo communicators: formed per generation, torn down at every recovery.

A generation's communicator is the whole job's process group plus, on every rank and in
the same order, one group per node (tier 1: the node's parity), one per local rank
across nodes (tier 2: the snapshot's cross-node code) and, with ``checkpoint_async``,
one more of every rank for the checkpoint's background writer (its DCP collectives run
on a thread of their own, and must never interleave with training's on a group they
share). A recovery tears them down (a
broken gloo group cannot be reused) and the next generation forms them anew, behind an
abortable barrier so that a recovery restarting meanwhile is not stuck in gloo's own
rendezvous.

**Devices.** With ``backend = "nccl"`` every group is made for two backends at once
(``"cpu:gloo,cuda:nccl"``): collectives on CUDA tensors run over NCCL, those on host
tensors (the protocol's small exchanges) over gloo, on the same group objects, so
nothing else of the executor changes. A recovery aborts the NCCL communicators first
(:func:`abort_nccl`: a collective hung on a dead peer returns; NCCL has no timeout of
its own that frees a stuck kernel), then destroys the groups as for gloo. NCCL's own
error handling is set to abort a failed communicator and raise, never to end the
process (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``). With gloo and
state on a GPU, gloo reduces only host tensors: tier 1's and tier 2's collectives run
through host copies (:meth:`ProcessGroups.parity`, :class:`~leto.retained.parity.HostStaged`).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from leto.retained.parity import HostStaged, TorchDistCollective

from .channel import Aborted, AgentChannel

__all__ = [
    "FORM_TIMEOUT_S",
    "GroupsHost",
    "ProcessGroups",
    "abort_nccl",
    "group_backend",
    "reset_group_count",
    "set_timeout",
]

FORM_TIMEOUT_S = 5.0  # the most a generation's communicator may take to form


def reset_group_count() -> None:
    """torch names each group by a per-process count of the groups made (the default
    group too), which ``destroy_process_group`` resets but a failed
    ``init_process_group`` leaves one higher: a rank whose formation of a generation
    failed would name the next generation's groups differently from a fresh process
    (a promoted shadow) and never meet it in the store. Torch's private counter, kept
    here alone (tests/gloo/test_process_groups.py fails when torch changes it)."""
    from torch.distributed import distributed_c10d

    distributed_c10d._world.group_count = 0


def set_timeout(timeout: timedelta, group: Any) -> None:
    """The collective timeout of a formed ``group`` (torch has no public API for it:
    ``_set_pg_timeout``, kept here alone; tests/gloo/test_process_groups.py fails
    when torch changes it)."""
    from torch.distributed import distributed_c10d

    distributed_c10d._set_pg_timeout(timeout, group)


def group_backend(backend: str) -> str:
    """The backend string of a generation's groups for leto's ``backend`` setting."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"


def abort_nccl(groups: list[Any]) -> int:
    """Abort the NCCL communicators of ``groups`` (a collective blocked on a dead peer
    returns with an error), before they are destroyed; the number aborted. torch's
    per-device backend of a group (``ProcessGroup._get_backend``) has no public API:
    kept here alone (tests/gloo/test_process_groups.py fails when torch changes it)."""
    n = 0
    for g in groups:
        try:
            backend = g._get_backend(torch.device("cuda"))
        except (RuntimeError, ValueError):
            continue  # no backend for CUDA tensors in this group
        if backend.name() == "nccl":  # gloo serves CUDA tensors too where NCCL is absent
            backend.abort()
            n += 1
    return n


class GroupsHost(Protocol):
    """What :class:`ProcessGroups` reads of its rank's session."""

    @property
    def spec(self) -> dict[str, Any]: ...
    @property
    def cfg(self) -> Any: ...
    @property
    def store(self) -> Any: ...
    @property
    def ch(self) -> AgentChannel: ...
    @property
    def rank(self) -> int: ...
    @property
    def W(self) -> int: ...
    @property
    def node(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def nproc(self) -> int: ...
    @property
    def nnodes(self) -> int: ...
    def _log(self, event: str, **kw: Any) -> None: ...


class ProcessGroups:
    """The communicators of the generation ``pg_gen`` (None: none formed)."""

    def __init__(self, session: GroupsHost) -> None:
        self.session = session
        self.pg_gen: int | None = None
        self.node_group: Any = None
        self.cross_group: Any = None
        self.ckpt_group: Any = None  # the asynchronous checkpoint's writer's (or None)
        self.teardown: threading.Thread | None = None  # the last generation's (destroy)
        cfg = getattr(session, "cfg", None)  # None: a test of destroy alone
        self.backend = group_backend(str(getattr(cfg, "backend", "gloo")))
        device = getattr(cfg, "torch_device", torch.device("cpu"))
        # gloo reduces host tensors only: a layout on a GPU stages its parity collectives
        # (LETO_STAGE_COLLECTIVES=1: the same copies on a CPU, as the tests run them)
        self.stage_always = os.environ.get("LETO_STAGE_COLLECTIVES") == "1"
        self.stage = self.backend == "gloo" and (device.type != "cpu" or self.stage_always)

    def parity(self, group: Any) -> TorchDistCollective | HostStaged:
        """The collective that tier 1's and tier 2's codes run over ``group``."""
        coll = TorchDistCollective(group)
        return HostStaged(coll, always=self.stage_always) if self.stage else coll

    def init(self, gen: int) -> None:
        """Form generation ``gen``'s communicators (nothing if they are formed already)."""
        session = self.session
        if self.pg_gen == gen and dist.is_initialized():
            return
        self.destroy()
        t = time.perf_counter()
        base = f"leto/{session.spec['job']}/pg/{gen}"
        # An abortable barrier first: gloo's own rendezvous blocks (up to the collective
        # timeout) on a peer that never comes; here every rank polls, and a recovery that
        # restarts meanwhile (a peer died or hangs) interrupts the wait at once. It has
        # no deadline of its own: a peer still held in an earlier generation's formation
        # comes when that fails, and a deadline here, as long as that one, made the two
        # expire together and miss each other (the recovery's timeout bounds the wait).
        session.store.set(f"{base}/here/{session.rank}", "1")
        keys = [f"{base}/here/{q}" for q in range(session.W)]
        while not session.store.check(keys):
            if session.ch.aborted_since(gen):
                raise Aborted(f"generation {gen} was aborted while its communicator formed")
            time.sleep(0.005)
        t_barrier = time.perf_counter()
        prefix = dist.PrefixStore(base, session.store)  # type: ignore[attr-defined]
        # Formed with a short timeout: gloo's connection of the ranks cannot be
        # interrupted, and a peer that died after it passed the barrier above (its key
        # set) would hold this rank there for the whole collective timeout while the
        # next generation's barrier waited for it. Every rank is at this point when
        # the barrier passes, so forming takes milliseconds; the collectives then get
        # the collective timeout.
        reset_group_count()  # every rank names this generation's groups alike
        collective = timedelta(seconds=float(session.spec["collective_timeout"]))
        form = min(collective, timedelta(seconds=FORM_TIMEOUT_S))
        if self.backend != "gloo":
            # a failed or timed-out NCCL collective aborts its communicator and raises in
            # the caller (the recovery takes over), never tears the process down
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        dist.init_process_group(
            self.backend, store=prefix, rank=session.rank, world_size=session.W, timeout=form
        )
        # new_group's stubs say ProcessGroup; a rank outside a group gets NON_GROUP_MEMBER
        groups: list[dist.ProcessGroup | int | None] = [dist.group.WORLD]
        # every rank creates every group, in the same order (gloo: tier-1 groups of each
        # node, then tier-2 groups of each local rank across nodes)
        for n in range(session.nnodes):
            g = dist.new_group(
                list(range(n * session.nproc, (n + 1) * session.nproc)), timeout=form
            )
            groups.append(g)
            if n == session.node:
                self.node_group = g
        self.cross_group = None
        if session.nnodes >= 2:
            for lr in range(session.nproc):
                g = dist.new_group(
                    [n * session.nproc + lr for n in range(session.nnodes)], timeout=form
                )
                groups.append(g)
                if lr == session.local_rank:
                    self.cross_group = g
        self.ckpt_group = None
        if getattr(session.cfg, "checkpoint_async", False) and session.cfg.checkpoint_dir:
            self.ckpt_group = dist.new_group(list(range(session.W)), timeout=form)
            groups.append(self.ckpt_group)
        for g in groups:
            if g is not None and g is not dist.GroupMember.NON_GROUP_MEMBER:
                set_timeout(collective, g)
        self.pg_gen = gen
        session._log(
            "process_group",
            generation=gen,
            backend=self.backend,
            staged=self.stage,
            ms=round((time.perf_counter() - t) * 1e3, 3),
            barrier_ms=round((t_barrier - t) * 1e3, 3),
        )

    def destroy(self) -> None:
        """Leave this generation's communicators at once; their teardown runs on a
        thread of its own (:attr:`teardown`) while the recovery goes on to the next
        generation's rendezvous.

        A gloo group's teardown (its worker threads joined, its connections closed) takes
        10-40 ms a group here, in its destructor, which runs where its last reference is
        dropped; ``dist.destroy_process_group`` only unregisters the groups when this
        method still holds them, and the thread then drops them (the destructors release
        the GIL). The thread is not a daemon: a process that exits meanwhile waits for
        it, since a group destroyed during interpreter exit aborts the process."""
        old = [g for g in (self.node_group, self.cross_group, self.ckpt_group) if g is not None]
        if dist.is_initialized():
            old.append(dist.group.WORLD)
            if self.backend != "gloo":
                abort_nccl(old)
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group is torn down regardless
                pass
        self.pg_gen = None
        self.node_group = None
        self.cross_group = None
        self.ckpt_group = None
        if old:
            self.teardown = threading.Thread(
                target=old.clear, name="leto-pg-teardown", daemon=False
            )
            self.teardown.start()
