"""Micro-batches of the step function, and the step in flight replayed in parallel.

With ``micro_batches = k`` (>= 2) a rank's share of a step is split into ``k``
micro-batches (:func:`micro`: ``[i::k]`` of the share, as the share is ``[r::W]`` of the
global batch), ``step_fn`` runs on each and its backward accumulates into ``.grad``
in order, ``g = ((g0 + g1) + g2) ...``; the step's loss is the micro-batches' losses
added in the same order.

After a recovery every rank says once, at its next compute, whether it computes its
share from its start (``fresh``: a promoted rank, or a survivor whose compute the
recovery did not keep) and a digest of its retained chunks' checksums (the same
parameters on every rank: data-parallel replicas). The core's
:func:`leto.core.replay.replay_plan` then names, for exactly one fresh rank (the
owner), which rank computes each of its micro-batches; each computes its own from the
same parameters with ``torch.autograd.grad`` (a survivor's own ``.grad``, of its kept
compute, is left alone), the results are gathered at the owner, and the owner adds
them in the micro-batch order into its ``.grad``: bitwise its own backward passes'
sum (PROTOCOL.md, "The step in flight, replayed in parallel").

A micro-batch must draw no random numbers (the lost rank's RNG stream at each
micro-batch's start is lost with it): with the replay on, every micro-batch is checked
to leave torch's CPU generator as it found it, and one that does not is refused with
the setting named.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from leto.core.replay import ReplayPlan, replay_plan
from leto.retained.process_state import shard

from .collective import coll, wait_or_abort

__all__ = ["DrewRandom", "micro", "params_digest", "Replayer"]


class DrewRandom(RuntimeError):
    """A micro-batch drew random numbers while the parallel replay is on."""


def micro(share: Any, k: int) -> list[Any]:
    """The ``k`` micro-batches of a rank's share, in order."""
    return [shard(share, i, k) for i in range(k)]


def params_digest(checksums: Sequence[int]) -> int:
    """A 63-bit digest of a rank's retained chunks' checksums (alike on replicas)."""
    h = hashlib.blake2b(b"".join(int(c).to_bytes(8, "little", signed=True) for c in checksums))
    return int.from_bytes(h.digest()[:8], "little") >> 1


def _check_rng(before: torch.Tensor, i: int) -> None:
    if not torch.equal(before, torch.get_rng_state()):
        raise DrewRandom(
            f"micro-batch {i} drew random numbers (dropout?): the parallel replay of a lost "
            "share needs micro-batches that draw none; set parallel_replay = false"
        )


def accumulate(
    model: torch.nn.Module,
    step_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    mbs: Sequence[Any],
    *,
    check_rng: bool,
    after_forward: Callable[[int], None] = lambda i: None,
    before_backward: Callable[[int], None] = lambda i: None,
) -> torch.Tensor:
    """The failure-free compute of ``k`` micro-batches: forward, backward into
    ``.grad`` (accumulated in order); the losses added in order (detached)."""
    total: torch.Tensor | None = None
    for i, mb in enumerate(mbs):
        before = torch.get_rng_state() if check_rng else None
        loss: Any = step_fn(model, mb)
        after_forward(i)
        before_backward(i)
        loss.backward()
        if before is not None:
            _check_rng(before, i)
        lv = loss.detach()
        total = lv if total is None else total + lv
    assert total is not None
    return total


class Replayer:
    """One rank's side of the parallel replay (see the module docstring)."""

    def __init__(self) -> None:
        self.exchanged: int | None = None  # the resumed generation of the last exchange
        self.last: ReplayPlan | None = None  # the plan of the last exchange

    def due(self, resumed: int | None) -> bool:
        """A recovery resumed since this rank's last exchange."""
        return resumed is not None and resumed != self.exchanged

    def exchange(
        self,
        resumed: int,
        fresh: bool,
        digest: int,
        world: int,
        k: int,
        aborted: Callable[[], bool],
    ) -> ReplayPlan | None:
        """Every rank's word (fresh, digest), gathered; the core's plan."""
        mine = torch.tensor([int(fresh), digest], dtype=torch.int64)
        out = torch.zeros(world * 2, dtype=torch.int64)
        work = coll(dist.all_gather_into_tensor, out, mine, async_op=True)
        wait_or_abort(work, aborted, "the ranks said who computes afresh")
        words = out.view(world, 2).tolist()
        self.exchanged = resumed
        same = len({d for _, d in words}) == 1
        self.last = replay_plan([bool(f) for f, _ in words], same, k)
        return self.last

    @staticmethod
    def compute(
        plan: ReplayPlan,
        rank: int,
        model: torch.nn.Module,
        params: Sequence[torch.nn.Parameter],
        step_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        mbs: Sequence[Any],
        width: int,
        dtype: torch.dtype,
        offsets: Sequence[tuple[int, int]],
    ) -> torch.Tensor:
        """This rank's micro-batches of the owner's share: one row each (gradients
        flat, then a presence flag per parameter, then the loss); ``.grad`` untouched."""
        mine = plan.of(rank)
        rows = -(-plan.micro_batches // plan.world)  # ceil: the most any rank computes
        out = torch.zeros(rows, width, dtype=dtype)
        n = width - len(params) - 1
        for j, i in enumerate(mine):
            before = torch.get_rng_state()
            loss = step_fn(model, mbs[i])
            grads = torch.autograd.grad(loss, list(params), allow_unused=True)
            _check_rng(before, i)
            row = out[j]
            for p, (g, (off, numel)) in enumerate(zip(grads, offsets, strict=True)):
                if g is not None:
                    row[off : off + numel].copy_(g.reshape(-1))
                    row[n + p] = 1
            row[-1] = loss.detach()
        return out

    @staticmethod
    def gather(
        plan: ReplayPlan, rank: int, rows: torch.Tensor, aborted: Callable[[], bool]
    ) -> list[torch.Tensor] | None:
        """Every rank's rows, at the owner (None elsewhere)."""
        owner = plan.owner
        into = [torch.empty_like(rows) for _ in range(plan.world)] if rank == owner else None
        work = coll(dist.gather, rows, into, dst=owner, async_op=True)
        wait_or_abort(work, aborted, "the replayed micro-batches were gathered")
        return into

    @staticmethod
    def add_in_order(
        plan: ReplayPlan,
        gathered: list[torch.Tensor],
        params: Sequence[torch.nn.Parameter],
        offsets: Sequence[tuple[int, int]],
    ) -> torch.Tensor:
        """The owner: each parameter's ``.grad`` as its own backward passes would have
        accumulated it (micro-batch 0 stored, each next one added, in order; a
        micro-batch that left a parameter without gradient adds nothing to it); the
        losses added in the same order."""
        n = gathered[0].shape[1] - len(params) - 1
        seen: dict[int, int] = {}  # rank -> rows of it read so far
        rows = []
        for i in plan.order:
            c = plan.computers[i]
            rows.append(gathered[c][seen.get(c, 0)])
            seen[c] = seen.get(c, 0) + 1
        total: torch.Tensor | None = None
        for p, (prm, (off, numel)) in enumerate(zip(params, offsets, strict=True)):
            acc: torch.Tensor | None = None
            for row in rows:
                if row[n + p] == 0:
                    continue
                g = row[off : off + numel].view_as(prm)
                if acc is None:
                    acc = g.clone()
                else:
                    acc.add_(g)
            prm.grad = acc
        for row in rows:
            lv = row[-1].clone()
            total = lv if total is None else total + lv
        assert total is not None
        return total
