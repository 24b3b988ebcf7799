"""Any other ``torch.optim.Optimizer``, transactional: :class:`WholeStepOptimizer`
replays its step from a retained copy of every chunk (the before copy), and the probe
that finds its parameter-shaped state, or refuses it (:class:`UnsupportedOptimizerError`).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from .checksum import checksum_chunks
from .layout import (
    Allocator,
    ChecksumError,
    ChunkStateError,
    ChunkStatus,
    InMemorySegments,
    RetainedLayout,
)
from .optim_base import RetainedOptimizer, _Plan
from .views import aliases, copy_in

__all__ = ["WholeStepOptimizer", "UnsupportedOptimizerError", "NONE_VERSION"]


class UnsupportedOptimizerError(TypeError):
    """An optimizer leto cannot make transactional; the message names it and says why."""


_REFUSED: dict[type, str] = {
    torch.optim.LBFGS: (
        "its step takes a closure that re-runs forward and backward several times, so it "
        "is not a function of one step's retained gradients"
    ),
    torch.optim.SparseAdam: "it needs sparse gradients, and leto retains dense ones",
}


def _refuse(optimizer: torch.optim.Optimizer, why: str) -> UnsupportedOptimizerError:
    return UnsupportedOptimizerError(
        f"optimizer: {type(optimizer).__name__} cannot be retained by leto: {why}"
    )


def _probe_shapes(optimizer: torch.optim.Optimizer) -> list[tuple[int, ...]]:
    """One small shape per rank of tensor among the optimizer's parameters (0-d left out:
    a 0-d state cannot be told from a scalar, and travels as one)."""
    dims = sorted({p.dim() for g in optimizer.param_groups for p in g["params"]} - {0})
    return [tuple(range(2, 2 + d)) for d in dims]


def _probe_run(
    optimizer: torch.optim.Optimizer, hp: dict[str, Any], shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Two steps of a shallow copy of ``optimizer`` on one seeded probe parameter."""
    g = torch.Generator().manual_seed(0)
    x = nn.Parameter(torch.randn(shape, generator=g).to(dtype))
    probe = copy.copy(optimizer)
    probe.param_groups = [{**hp, "params": [x]}]
    probe.state = defaultdict(dict)
    for _ in range(2):
        x.grad = torch.randn(shape, generator=g).to(dtype)
        probe.step()
    st = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in probe.state[x].items()}
    return x.detach().clone(), st


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return bool(a == b)


def _probe_states(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The state entries of ``optimizer`` that have the parameter's shape (retained buffers).

    Runs a shallow copy of the optimizer (its class, hyper-parameters and step, user
    subclasses included) twice on a probe parameter per group and tensor rank: a step
    that fails is refused with its error, one whose two runs differ is refused as not
    deterministic (a replay would not reproduce it).
    """
    for cls, why in _REFUSED.items():
        if isinstance(optimizer, cls):
            raise _refuse(optimizer, why)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    dtype = params[0].dtype if params else torch.float32
    names: list[str] = []
    for g in optimizer.param_groups:
        hp = {k: v for k, v in g.items() if k != "params"}
        for shape in _probe_shapes(optimizer):
            try:
                (x1, s1), (x2, s2) = (_probe_run(optimizer, hp, shape, dtype) for _ in range(2))
            except Exception as e:
                raise _refuse(optimizer, f"its step fails on a probe parameter ({e})") from e
            if (
                not _same(x1, x2)
                or s1.keys() != s2.keys()
                or not all(_same(s1[k], s2[k]) for k in s1)
            ):
                raise _refuse(optimizer, "its step is not deterministic (two runs differ)")
            for k, v in s1.items():
                if isinstance(v, torch.Tensor) and v.shape == shape and k not in names:
                    names.append(k)
    return tuple(names)


_BEFORE_MAGIC = 0x4C45544F42454652  # "LETOBEFR"
NONE_VERSION = -1  # the before copy holds no valid step
_RETAINED = object()  # in a replayed state: "this entry is the retained buffer's view"


class _BeforeCopy:
    """Every chunk's bytes (params + states) at the step before the one being applied.

    Two segments next to the layout's, from the same allocator (so a new process
    attaches to them): ``{prefix}.before`` (the bytes, one row per data buffer) and
    ``{prefix}.before.header`` (int64: magic, version, then the checksum of each chunk,
    the layout's own checksum of the chunk at that version). The version is written
    last and cleared first, so a half-written copy is never taken for valid.
    """

    def __init__(self, layout: RetainedLayout, alloc: Allocator | None) -> None:
        alloc = alloc or InMemorySegments(layout.device)
        rows = len(layout.data_buffers())
        total = layout.param_buffer.numel()
        nbytes = rows * total * layout.param_buffer.element_size()
        data = alloc(f"{layout.prefix}.before", nbytes).view(layout.dtype)
        self.rows = list(data.view(rows, total).unbind(0))
        self.header = alloc(f"{layout.prefix}.before.header", 8 * (2 + layout.n_chunks)).view(
            torch.int64
        )

    def version(self) -> int:
        """The step the copy holds (``NONE_VERSION`` if none is valid)."""
        if int(self.header[0]) != _BEFORE_MAGIC:
            return NONE_VERSION
        return int(self.header[1])

    def save(self, layout: RetainedLayout, version: int) -> None:
        """Copy every chunk, which must be clean at ``version``, with its checksum."""
        self.header[1] = NONE_VERSION
        with torch.no_grad():
            for dst, src in zip(self.rows, layout.data_buffers(), strict=True):
                dst.copy_(src)
        self.header[2:] = layout.records.stored_checksums()
        self.header[0] = _BEFORE_MAGIC
        self.header[1] = version

    def bad_chunks(self, layout: RetainedLayout) -> list[int]:
        """The chunks whose copy fails its checksum."""
        n = layout.n_chunks
        sums = checksum_chunks(
            self.rows, n, [self.version()] * n, algorithm=layout.checksum_algorithm
        )
        return [int(i) for i in (sums != self.header[2:]).nonzero().flatten().tolist()]


class WholeStepOptimizer(RetainedOptimizer):
    """Any ``torch.optim.Optimizer`` (a subclass with its own ``step`` too), transactional.

    The generic path, for what has no chunked version. An opaque step cannot be cut
    into chunks, but it can be replayed: at ``begin`` every chunk's bytes at the step
    before are copied into retained memory (the *before copy*, checksummed); the first
    ``apply_chunk`` runs the wrapped optimizer's own ``step()`` once, on a scratch copy
    of those bytes, with a scratch copy of the retained gradients (parameters absent
    from the step get ``.grad = None``, as torch.optim expects); each ``apply_chunk(i)`` then writes chunk
    i of the result. The chunk transactions are the chunked path's (one undo slot,
    chunk by chunk, parity in between); a new process that rolls a step forward replays
    it from the before copy, and a deterministic step gives the same bytes again.

    Scalar and other small state (step counters, Adafactor's factored moments) is
    process state: the replay computes it, ``end()`` commits it; until then
    ``state`` is the step before's, so a rolled-back step needs nothing restored
    but its chunks. Parameter-shaped state entries (see
    :func:`~leto.retained.optim.required_states`) live in the layout's state buffers.

    Cost per step, against the chunked path: one copy of params + states into the
    before copy, one into scratch (and of the gradients), the step itself, one copy
    out; memory: the before copy (retained) and the scratch (not).

    ``param_groups`` and ``state`` are the wrapped optimizer's own objects, so LR
    schedulers bound to either work.
    """

    def __init__(
        self,
        layout: RetainedLayout,
        inner: torch.optim.Optimizer,
        *,
        alloc: Allocator | None = None,
        adopt: bool = True,
        verify: bool = False,
    ) -> None:
        if isinstance(inner, RetainedOptimizer):
            raise TypeError("inner optimizer is already retained")
        for cls, why in _REFUSED.items():
            if isinstance(inner, cls):
                raise _refuse(inner, why)
        self._init_retained(layout, verify)
        params = [p for g in inner.param_groups for p in g["params"]]
        torch.optim.Optimizer.__init__(self, params, dict(inner.defaults))
        self.inner = inner
        self.param_groups = inner.param_groups
        self.state = inner.state
        self.defaults = inner.defaults
        self._param_indices()
        self._before = _BeforeCopy(layout, alloc)
        self._scratch: list[torch.Tensor] | None = None  # params + states, then the step's
        self._scratch_grad = torch.empty(0)
        if adopt and self.state:  # e.g. Adagrad's initial sums: into retained memory
            self._adopt_state(clone_rest=True)
            self.layout.seal_all(self.version)

    def _kind(self) -> str:
        return f"WholeStepOptimizer[{type(self.inner).__name__}]"

    def _make_plan(self, plan: _Plan) -> None:
        lay, prev = self.layout, plan.step - 1
        fresh = all(
            lay.chunk_status(i) is ChunkStatus.CLEAN and lay.chunk_version(i) == prev
            for i in range(lay.n_chunks)
        )
        if fresh:
            self._before.save(lay, prev)
            plan.copied = True
        elif self._before.version() != prev:
            raise ChunkStateError(
                f"begin({plan.step}): {self._kind()} replays a step from the copy of every "
                f"chunk at step {prev}, and the retained copy is at {self._before.version()}"
            )

    def _apply(self, plan: _Plan, i: int) -> None:
        if plan.next is None:
            self._replay(plan)
        assert self._scratch is not None
        a, b = self.layout.geometry.chunk_range(i)
        for dst, src in zip(self.layout.chunk_data(i), self._scratch, strict=True):
            dst.copy_(src[a:b])

    def _replay(self, plan: _Plan) -> None:
        """Run the wrapped step on a scratch copy of the before copy; keep its result."""
        lay = self.layout
        if not plan.copied:
            bad = self._before.bad_chunks(lay)
            if bad:
                raise ChecksumError(
                    f"the retained copy of step {plan.step - 1} fails its checksum in chunks "
                    f"{bad}: step {plan.step} cannot be replayed (roll back)"
                )
        if self._scratch is None:
            self._scratch = [torch.empty_like(b) for b in lay.data_buffers()]
            self._scratch_grad = torch.empty_like(lay.grad_buffer)
        with torch.no_grad():
            for dst, src in zip(self._scratch, self._before.rows, strict=True):
                dst.copy_(src)
            # a step may change its gradients in place (a subclass that clips them):
            # the retained ones must stay the step's, for the next replay
            self._scratch_grad.copy_(lay.grad_buffer)
        sparam = self._scratch[0]
        sstate = dict(zip(lay.states, self._scratch[1:], strict=True))
        saved_state = {p: dict(st) for p, st in self.state.items()}
        saved_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        for p, st in self.state.items():
            idx = lay.index_of(p)
            for k, v in st.items():
                if k in sstate and isinstance(v, torch.Tensor):
                    st[k] = lay.geometry.view_in(sstate[k], idx)
                else:
                    st[k] = v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        live = [(p.data, p.grad) for p in lay.params]
        try:
            for idx, p in enumerate(lay.params):
                p.data = lay.geometry.view_in(sparam, idx)
                p.grad = (
                    lay.geometry.view_in(self._scratch_grad, idx) if plan.present[idx] else None
                )
            # the class's step: an instance may route its own ``step`` to leto's (the
            # user's loop calls ``optimizer.step()`` on the object it built)
            type(self.inner).step(self.inner)
            for idx, p in enumerate(lay.params):
                view = lay.geometry.view_in(sparam, idx)
                if not aliases(p.data, view):  # the optimizer replaced .data
                    view.copy_(p.data)
            nxt: dict[torch.Tensor, dict[str, Any]] = {}
            for p, st in self.state.items():
                idx = lay.index_of(p)
                entry: dict[str, Any] = {}
                for k, v in st.items():
                    if k in sstate and isinstance(v, torch.Tensor):
                        view = lay.geometry.view_in(sstate[k], idx)
                        if not aliases(v, view):
                            copy_in(v, view, f"state {k!r} of {lay.slots[idx].name!r}")
                        entry[k] = _RETAINED
                    else:
                        entry[k] = v
                nxt[p] = entry
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        finally:
            for p, (data, grad) in zip(lay.params, live, strict=True):
                p.data = data
                p.grad = grad
            self.state.clear()
            self.state.update(saved_state)
            for g, saved in zip(self.param_groups, saved_groups, strict=True):
                g.update(saved)
        plan.next = (nxt, groups)

    def _commit(self, plan: _Plan) -> None:
        if plan.next is None:  # every chunk was written before this process began the step
            self._replay(plan)
        nxt, groups = plan.next
        for p, entry in nxt.items():
            idx = self.layout.index_of(p)
            self.state[p] = {
                k: self.layout.state_view(k, idx) if v is _RETAINED else v for k, v in entry.items()
            }
        for g, new in zip(self.param_groups, groups, strict=True):
            g.update(new)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._require_idle("load_state_dict")
        self.inner.load_state_dict(state_dict)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._adopt_state(clone_rest=True)
        self.layout.seal_all(self.version)
        self.layout.derive_params()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()
