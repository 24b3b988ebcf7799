"""Chunked optimizers: an optimizer step applied chunk by chunk over a RetainedLayout.

The math is torch's own: every chunk calls ``torch.optim.sgd.sgd`` /
``torch.optim.adam.adam`` (the functional implementations ``torch.optim.SGD``,
``Adam`` and ``AdamW`` use) on 1-D slices of the flat buffers. Those updates are
elementwise, so running them slice by slice computes, element for element, the
same operations as one call on the whole tensor. Result:

* ``foreach=False`` (torch's single-tensor path, the CPU default) and
  ``foreach=True``: **bitwise** equal to ``torch.optim.X`` with the same
  hyper-parameters (tested over 200 steps with an LR scheduler, any chunk size).
* ``fused=True``: torch's fused CPU kernel has a vectorised body and a scalar
  tail that round differently, so where a slice ends changes low bits: **within
  1e-6 relative** over 200 steps, not bitwise (tested).

Adjacent parameters of one chunk that share a parameter group and per-parameter
state (Adam's step count, SGD's "momentum initialised") are updated by a single
call over their merged range: with the usual single group, one call per chunk,
whatever the number of parameters. The padding between them is zero in params,
grads and states and stays zero under these updates.

The transaction API (driven by the core's chunk transactions)::

    opt.prepare(v + 1)          # PREPARE: gradients sealed in retained memory
    opt.begin(v + 1)            # APPLY starts: per-step scalars fixed (lr, step counts)
    for i in range(layout.n_chunks):
        opt.save_undo(i)        # chunk i: CLEAN -> TORN (old bytes kept)
        opt.apply_chunk(i)      # TORN -> APPLIED (new bytes + checksum + version)
        ...                     # parity update from layout.undo_data(i), layout.chunk_data(i)
        opt.finish_chunk(i)     # APPLIED -> CLEAN (undo released)
    opt.end()                   # process state moves to v + 1

``step()`` runs exactly that. Per-step scalars (Adam's step count, momentum
initialised, LR and the other hyper-parameters) are process state: they change
only in ``end()``, so a step that is rolled back needs nothing restored but the
chunks, and ``process_state()`` (JSON-able, no tensors) is everything a new
process needs besides the retained buffers to resume, roll forward or roll back.

``state_dict()``/``load_state_dict()`` keep torch's meaning (the full state, for
disk checkpoints: the retained state tensors appear as views); they are not the
retained path. A torch-format state dict can be loaded (it is copied into the
retained buffers).

Master weights (``retain(..., master_weights=True)``): the math runs on the layout's
float32 buffers whatever the parameters' dtype (a bf16 parameter's update, state and
gradient are float32), and ``end()`` -- like loading a step's state -- writes the
model's bf16/fp16 parameters as the cast of the new master weights
(:meth:`~leto.retained.layout.RetainedLayout.derive_params`).

Any other ``torch.optim.Optimizer`` runs through :class:`WholeStepOptimizer`: the
same API, but the step is one unit (the first ``apply_chunk`` runs the whole
torch step and seals every chunk), so it needs an undo copy of *every* chunk (a
second copy of params + states) and cannot interleave chunks with parity work.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.adam import adam as _torch_adam
from torch.optim.optimizer import _get_scalar_dtype
from torch.optim.sgd import sgd as _torch_sgd

from .checksum import checksum_chunks
from .layout import (
    Allocator,
    ChecksumError,
    ChunkStateError,
    ChunkStatus,
    InMemorySegments,
    LayoutError,
    RetainedLayout,
)
from .views import aliases, copy_in

__all__ = [
    "RetainedOptimizer",
    "ChunkedOptimizer",
    "ChunkedSGD",
    "ChunkedAdam",
    "ChunkedAdamW",
    "WholeStepOptimizer",
    "UnsupportedOptimizerError",
    "check_supported",
    "required_states",
    "is_chunkable",
    "to_retained",
    "retain",
    "bind_layout",
    "PROCESS_STATE_FORMAT",
]

PROCESS_STATE_FORMAT = 1


# ------------------------------------------------------------- JSON encoding


def _enc(v: Any, where: str) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tuple):
        return {"tuple": [_enc(x, where) for x in v]}
    if isinstance(v, list):
        return [_enc(x, where) for x in v]
    if isinstance(v, torch.Tensor) and v.dim() == 0:
        return {
            "tensor": v.item(),
            "dtype": str(v.dtype).removeprefix("torch."),
            "device": str(v.device),
        }
    if isinstance(v, torch.Tensor) and not v.is_complex() and v.layout is torch.strided:
        # small state that is not parameter-shaped (Adafactor's factored moments):
        # a float list is exact for every real dtype
        return {
            "tensor": v.tolist(),
            "shape": list(v.shape),
            "dtype": str(v.dtype).removeprefix("torch."),
            "device": str(v.device),
        }
    raise LayoutError(f"{where}: {type(v).__name__} is not serialisable as process state")


def _dec(v: Any) -> Any:
    if isinstance(v, list):
        return [_dec(x) for x in v]
    if isinstance(v, dict):
        if "tuple" in v:
            return tuple(_dec(x) for x in v["tuple"])
        if "tensor" in v:
            t = torch.tensor(v["tensor"], dtype=getattr(torch, v["dtype"]), device=v["device"])
            return t.reshape(v["shape"]) if "shape" in v else t
        raise LayoutError(f"cannot decode process state value {v!r}")
    return v


@dataclass
class _Plan:
    """What ``begin(step)`` fixed for one step."""

    step: int
    present: list[bool]
    groups: list[dict[str, Any]]
    keys: list[Hashable | None] = field(default_factory=list)  # per param; None: not stepped
    copied: bool = False  # WholeStepOptimizer: this process wrote the before copy
    next: Any = None  # WholeStepOptimizer: the replayed step's state and groups


class RetainedOptimizer(torch.optim.Optimizer):
    """What every retained optimizer shares: the transaction API and process state.

    Subclasses: :class:`ChunkedOptimizer` (per-chunk math) and
    :class:`WholeStepOptimizer` (fallback). Not instantiated directly.
    """

    layout: RetainedLayout
    version: int
    _plan: _Plan | None

    def _init_retained(self, layout: RetainedLayout, verify: bool) -> None:
        self.layout = layout
        self.version = layout.base_version()
        self._plan = None
        self._verify = verify
        self._step_supports_amp_scaling = False  # GradScaler: unscale, then call step()

    def _param_indices(self) -> dict[int, int]:
        """layout index -> group index, for every optimized parameter."""
        out: dict[int, int] = {}
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                idx = self.layout.index_of(p)
                if idx in out:
                    raise LayoutError(
                        f"parameter {self.layout.slots[idx].name!r} is in two parameter groups"
                    )
                out[idx] = g
        return out

    # ------------------------------------------------------------ transaction

    def _check_next(self, step: int, what: str) -> None:
        if step != self.version + 1:
            raise ChunkStateError(
                f"{what}({step}): the optimizer is at step {self.version}, the next step is {self.version + 1}"
            )

    def prepare(self, step: int) -> None:
        """PREPARE: the gradients now in retained memory are those of ``step`` (sealed)."""
        self._check_next(step, "prepare")
        if self._plan is not None:
            raise ChunkStateError(f"prepare({step}): step {self._plan.step} is being applied")
        self.layout.seal_grads(step, self.layout.grads.collect())

    def begin(self, step: int) -> None:
        """Start applying ``step``: fixes hyper-parameters and per-parameter scalars.

        Reads the present mask from retained memory, so a new process that
        resumes a step makes the same plan as the one that died.
        """
        self._check_next(step, "begin")
        if self.layout.prepared_step != step:
            raise ChunkStateError(
                f"begin({step}): gradients are prepared for step {self.layout.prepared_step}"
            )
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        self._plan = _Plan(step=step, present=self.layout.grads.present_mask(), groups=groups)
        self._make_plan(self._plan)

    def _require_plan(self, what: str) -> _Plan:
        if self._plan is None:
            raise ChunkStateError(f"{what}: no step begun (call begin)")
        return self._plan

    def save_undo(self, i: int, *, staged: bool = False) -> None:
        """Keep chunk i's old bytes (params + states) in an undo slot: CLEAN -> TORN
        (``staged``: copied ahead by ``layout.undo.stage``)."""
        plan = self._require_plan("save_undo")
        if self.layout.chunk_version(i) != plan.step - 1:
            raise ChunkStateError(
                f"save_undo: chunk {i} is at version {self.layout.chunk_version(i)}, not {plan.step - 1}"
            )
        self.layout.save_undo(i, verify=self._verify, staged=staged)

    def apply_chunk(self, i: int, *, seal: bool = True) -> None:
        """Write chunk i's new bytes (the math, in place) and seal them: TORN -> APPLIED.

        ``seal=False`` writes the bytes but leaves the chunk TORN (header unchanged):
        a caller that models "new bytes complete" as a separate event seals it later
        with ``layout.seal_chunk(i, step)``.
        """
        plan = self._require_plan("apply_chunk")
        status = self.layout.chunk_status(i)
        if status is not ChunkStatus.TORN or self.layout.undo.version(i) != plan.step - 1:
            raise ChunkStateError(
                f"apply_chunk: chunk {i} is {status.value} at version {self.layout.chunk_version(i)}; "
                f"it needs an undo copy of version {plan.step - 1} (call save_undo)"
            )
        with torch.no_grad():
            self._apply(plan, i)
        if seal:
            self.layout.seal_chunk(i, plan.step)

    def restore_undo(self, i: int) -> None:
        """Put chunk i's old bytes back: TORN/APPLIED -> CLEAN at the old version."""
        self.layout.undo.restore(i)

    def finish_chunk(self, i: int) -> None:
        """Release chunk i's undo copy once its parity is written: APPLIED -> CLEAN."""
        self.layout.undo.release(i)

    def end(self) -> None:
        """Every chunk is CLEAN at the new step: commit the process state."""
        plan = self._require_plan("end")
        for i in range(self.layout.n_chunks):
            st = self.layout.chunk_status(i)
            if st is not ChunkStatus.CLEAN or self.layout.chunk_version(i) != plan.step:
                raise ChunkStateError(
                    f"end: chunk {i} is {st.value} at version {self.layout.chunk_version(i)}, not clean at {plan.step}"
                )
        self._commit(plan)
        self.version = plan.step
        self._plan = None
        self.layout.derive_params()

    def roll_forward(self, on_applied: Callable[[int], None] | None = None) -> None:
        """Finish step ``version + 1`` from whatever state its chunks are in.

        TORN chunks are restored and re-applied, APPLIED ones finished, CLEAN old
        ones applied, CLEAN new ones left. ``on_applied(i)`` runs between apply
        and finish (the parity update). The gradients must be prepared for the
        step and pass their checksums (else :class:`ChecksumError`).
        """
        step = self.version + 1
        bad = self.layout.grads.verify(step)
        if bad:
            raise ChecksumError(
                f"roll_forward: the gradients of step {step} fail their checksum in chunks {bad} "
                "(rebuild them from gradient parity, or roll back)"
            )
        if self._plan is None or self._plan.step != step:
            self.begin(step)
        n = self.layout.n_chunks
        # first free every undo slot: finish what is applied, restore what is torn
        for i in range(n):
            st = self.layout.chunk_status(i)
            if st is ChunkStatus.APPLIED:
                if on_applied is not None:
                    on_applied(i)
                self.finish_chunk(i)
            elif st is ChunkStatus.TORN:
                self.restore_undo(i)
        self._apply_pending(step, on_applied)
        self.end()

    def _apply_pending(self, step: int, on_applied: Callable[[int], None] | None) -> None:
        """Apply every chunk still CLEAN at ``step - 1``, one at a time."""
        for i in range(self.layout.n_chunks):
            if self.layout.chunk_version(i) == step - 1:
                self.save_undo(i)
                self.apply_chunk(i)
                if on_applied is not None:
                    on_applied(i)
                self.finish_chunk(i)

    def roll_back(self) -> None:
        """Abandon step ``version + 1``: restore every TORN or APPLIED chunk, drop its gradients."""
        for i in range(self.layout.n_chunks):
            if self.layout.chunk_status(i) is not ChunkStatus.CLEAN:
                self.restore_undo(i)
        self._plan = None
        self.layout.clear_prepared()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One whole transaction: prepare, begin, every chunk in order, end."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        s = self.version + 1
        self.prepare(s)
        self.begin(s)
        self._apply_pending(s, None)
        self.end()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the retained gradients; ``.grad`` stays a view (see GradBuffer.zero).

        Refused while the gradients of the next step are prepared and not yet
        applied: a roll-forward still needs them (``roll_back`` releases them).
        """
        if self._plan is not None or self.layout.prepared_step > self.version:
            raise ChunkStateError(
                f"zero_grad: the gradients of step {self.layout.prepared_step} are prepared and not applied"
            )
        self.layout.grads.zero(set_to_none)

    # ---------------------------------------------------------- process state

    def _enc_state(self, idx: int, key: str, v: Any) -> Any:
        if (
            isinstance(v, torch.Tensor)
            and key in self.layout.states
            and aliases(v, self.layout.state_view(key, idx))
        ):
            return {"retained": key}
        return _enc(v, f"state of {self.layout.slots[idx].name!r}[{key!r}]")

    def _kind(self) -> str:
        return type(self).__name__

    def process_state(self) -> dict[str, Any]:
        """The small, JSON-able state a new process needs besides the retained buffers.

        Step version, hyper-parameters of every group (including what LR
        schedulers add), and per-parameter scalars (e.g. Adam's step count);
        retained state tensors appear as ``{"retained": name}``.
        """
        if self._plan is not None:
            raise ChunkStateError(f"process_state: step {self._plan.step} is being applied")
        groups = []
        for gi, g in enumerate(self.param_groups):
            enc = {k: _enc(v, f"param_groups[{gi}][{k!r}]") for k, v in g.items() if k != "params"}
            enc["params"] = [self.layout.index_of(p) for p in g["params"]]
            groups.append(enc)
        state = {}
        for p, st in self.state.items():
            idx = self.layout.index_of(p)
            state[str(idx)] = {k: self._enc_state(idx, k, v) for k, v in st.items()}
        return {
            "format": PROCESS_STATE_FORMAT,
            "kind": self._kind(),
            "version": self.version,
            "param_groups": groups,
            "state": state,
        }

    def load_process_state(self, ps: dict[str, Any]) -> None:
        """Restore what :meth:`process_state` returned (e.g. in a promoted shadow)."""
        if ps.get("format") != PROCESS_STATE_FORMAT or ps.get("kind") != self._kind():
            raise LayoutError(
                f"process state is {ps.get('kind')!r} format {ps.get('format')!r}, want {self._kind()!r} format {PROCESS_STATE_FORMAT}"
            )
        if len(ps["param_groups"]) != len(self.param_groups):
            raise LayoutError(
                f"process state has {len(ps['param_groups'])} parameter groups, the optimizer {len(self.param_groups)}"
            )
        for gi, (enc, g) in enumerate(zip(ps["param_groups"], self.param_groups, strict=True)):
            mine = [self.layout.index_of(p) for p in g["params"]]
            if enc["params"] != mine:
                raise LayoutError(
                    f"parameter group {gi} holds parameters {enc['params']} in the process state, {mine} here"
                )
        params = self.layout.params
        new_state: dict[torch.Tensor, dict[str, Any]] = {}
        for sidx, st in ps["state"].items():
            idx = int(sidx)
            entry = {}
            for k, v in st.items():
                if isinstance(v, dict) and "retained" in v:
                    entry[k] = self.layout.state_view(v["retained"], idx)
                else:
                    entry[k] = _dec(v)
            new_state[params[idx]] = entry
        for enc, g in zip(ps["param_groups"], self.param_groups, strict=True):
            for k, v in enc.items():
                if k != "params":
                    g[k] = _dec(v)
        version = int(ps["version"])
        base = self.layout.base_version()
        # A step in flight (its gradients prepared) may have moved some or all chunks
        # to version + 1 already: that process state is the one to roll forward from.
        in_flight = self.layout.prepared_step == version + 1 and base == version + 1
        if base != version and not in_flight:
            raise LayoutError(
                f"process state is at step {version}, the retained chunks at {self.layout.base_version()}"
            )
        self.state.clear()
        self.state.update(new_state)
        self.version = version
        self._plan = None
        self.layout.derive_params()

    def set_version(self, step: int) -> None:
        """Declare the current bytes to be step ``step`` (after loading a checkpoint taken then).

        Re-seals every chunk at ``step`` and sets :attr:`version`.
        """
        self._require_idle("set_version")
        self.layout.seal_all(step)
        self.version = step
        self.layout.derive_params()

    # -------------------------------------------------- torch-format state dict

    def _adopt_state(self, clone_rest: bool = False) -> None:
        """Make every retained-key state tensor a view of its buffer (copying it in).

        ``clone_rest``: also clone the other tensors (scalars such as ``step``), so
        that nothing aliases the tensors of a loaded state dict (torch's own
        ``load_state_dict`` keeps them when dtype and device already match).
        """
        for p, st in self.state.items():
            idx = self.layout.index_of(p)
            for k, v in list(st.items()):
                if clone_rest and k not in self.layout.states and isinstance(v, torch.Tensor):
                    st[k] = v.clone()
                if k in self.layout.states and isinstance(v, torch.Tensor):
                    view = self.layout.state_view(k, idx)
                    if not aliases(v, view):
                        st[k] = copy_in(v, view, f"state {k!r} of {self.layout.slots[idx].name!r}")

    def _require_idle(self, what: str) -> None:
        if self._plan is not None:
            raise ChunkStateError(f"{what}: step {self._plan.step} is being applied")
        for i in range(self.layout.n_chunks):
            if self.layout.chunk_status(i) is not ChunkStatus.CLEAN:
                raise ChunkStateError(f"{what}: chunk {i} is {self.layout.chunk_status(i).value}")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a torch-format state dict: tensors are copied into the retained buffers.

        Unlike torch, nothing of ``state_dict`` is kept by reference (scalar
        tensors are cloned too), so the source optimizer can go on independently.
        The chunks are re-sealed at the current ``version`` (their bytes changed).
        """
        self._require_idle("load_state_dict")
        super().load_state_dict(state_dict)
        self._adopt_state(clone_rest=True)
        self.layout.seal_all(self.version)
        self.layout.derive_params()

    # ---------------------------------------------------------- to implement

    def _make_plan(self, plan: _Plan) -> None:
        raise NotImplementedError

    def _apply(self, plan: _Plan, i: int) -> None:
        raise NotImplementedError

    def _commit(self, plan: _Plan) -> None:
        raise NotImplementedError


_DEFAULT_KEYS: dict[str, frozenset[str]] = {}


def _torch_defaults(cls: type[torch.optim.Optimizer]) -> frozenset[str]:
    if cls.__qualname__ not in _DEFAULT_KEYS:
        made = cls([nn.Parameter(torch.zeros(1))])  # type: ignore[call-arg]
        _DEFAULT_KEYS[cls.__qualname__] = frozenset(made.defaults)
    return _DEFAULT_KEYS[cls.__qualname__]


class ChunkedOptimizer(RetainedOptimizer):
    """Per-chunk elementwise optimizers: plan keys, merged runs, torch's functional math.

    ``Chunked<X>(layout, params=None, *args, verify=False, **kwargs)`` takes
    torch's ``<X>`` arguments and runs torch's own constructor (validation,
    defaults); ``params`` defaults to every layout parameter. ``verify=True``
    checks each chunk's checksum before its step (two extra reads per chunk).
    """

    _torch_cls: type[torch.optim.Optimizer]

    def __init__(
        self,
        layout: RetainedLayout,
        params: Any = None,
        *args: Any,
        verify: bool = False,
        **kwargs: Any,
    ) -> None:
        self._init_retained(layout, verify)
        self._torch_cls.__init__(self, layout.params if params is None else params, *args, **kwargs)
        for g in self.param_groups:
            if g.get("differentiable"):
                raise ValueError("differentiable=True is not supported by chunked optimizers")
        missing = [s for s in self.states_for(self.param_groups) if s not in layout.states]
        if missing:
            raise LayoutError(f"{type(self).__name__} needs the layout states {missing}")
        self._param_indices()

    @staticmethod
    def states_for(groups: Iterable[dict[str, Any]]) -> tuple[str, ...]:
        """The layout state buffers these parameter groups need."""
        raise NotImplementedError

    @classmethod
    def _torch_defaults(cls) -> frozenset[str]:
        """The hyper-parameters torch's class has (a subclass adding one is not chunkable)."""
        return _torch_defaults(cls._torch_cls)

    def _key(self, plan: _Plan, idx: int, group: int) -> Hashable:
        """What parameters must share to be updated by one call (besides the group)."""
        return group

    def _make_plan(self, plan: _Plan) -> None:
        keys: list[Hashable | None] = [None] * len(self.layout.params)
        for idx, g in self._param_indices().items():
            if plan.present[idx]:
                keys[idx] = (g, self._key(plan, idx, g))
        plan.keys = keys

    def runs(self, i: int) -> list[tuple[int, Hashable, int, int]]:
        """The calls chunk i takes in the current step: ``(group, key, start, stop)``."""
        plan = self._require_plan("runs")
        out: list[tuple[int, Hashable, int, int]] = []
        open_run = False  # may the next piece extend the last run?
        for pc in self.layout.geometry.chunk_pieces(i):
            key = plan.keys[pc.param]
            if key is None:  # skipped: a run must not reach over it
                open_run = False
                continue
            if open_run and out[-1][1] == key:
                g, k, a, _ = out[-1]
                out[-1] = (g, k, a, pc.stop)
            else:
                out.append((key[0], key, pc.start, pc.stop))  # type: ignore[index]
            open_run = True
        return out

    def _apply(self, plan: _Plan, i: int) -> None:
        for g, key, a, b in self.runs(i):
            self._apply_run(plan, plan.groups[g], key, a, b)

    def _apply_run(self, plan: _Plan, hp: dict[str, Any], key: Hashable, a: int, b: int) -> None:
        raise NotImplementedError

    def _present_params(self, plan: _Plan) -> Iterable[tuple[int, nn.Parameter, dict[str, Any]]]:
        for idx, key in enumerate(plan.keys):
            if key is not None:
                yield idx, self.layout.params[idx], plan.groups[key[0]]  # type: ignore[index]


class ChunkedSGD(ChunkedOptimizer, torch.optim.SGD):
    """``torch.optim.SGD`` (momentum, dampening, nesterov, weight decay, maximize), chunked.

    Constructor: ``ChunkedSGD(layout, params=None, lr=1e-3, momentum=0, ...)``
    with torch's arguments and validation (``params`` defaults to every layout
    parameter). Needs the state buffer ``momentum_buffer`` when momentum != 0.
    """

    _torch_cls: type[torch.optim.Optimizer] = torch.optim.SGD

    @staticmethod
    def states_for(groups: Iterable[dict[str, Any]]) -> tuple[str, ...]:
        return ("momentum_buffer",) if any(g.get("momentum", 0) != 0 for g in groups) else ()

    def _key(self, plan: _Plan, idx: int, group: int) -> Hashable:
        st = self.state.get(self.layout.params[idx], {})
        return st.get("momentum_buffer") is not None

    def _apply_run(self, plan: _Plan, hp: dict[str, Any], key: Hashable, a: int, b: int) -> None:
        lay = self.layout
        momentum = hp["momentum"]
        initialised = key[1]  # type: ignore[index]
        bufs: list[torch.Tensor | None] = []
        if momentum != 0:
            bufs = [lay.state_buffer("momentum_buffer")[a:b] if initialised else None]
        _torch_sgd(
            [lay.param_buffer[a:b]],
            [lay.grad_buffer[a:b]],
            bufs,
            weight_decay=hp["weight_decay"],
            momentum=momentum,
            lr=hp["lr"],
            dampening=hp["dampening"],
            nesterov=hp["nesterov"],
            maximize=hp["maximize"],
            has_sparse_grad=False,
            foreach=hp["foreach"],
            fused=hp["fused"],
        )
        if momentum != 0 and not initialised:
            buf = bufs[0]
            assert buf is not None
            lay.state_buffer("momentum_buffer")[a:b].copy_(buf)

    def _commit(self, plan: _Plan) -> None:
        for idx, p, hp in self._present_params(plan):
            if hp["momentum"] != 0:
                self.state[p]["momentum_buffer"] = self.layout.state_view("momentum_buffer", idx)


class ChunkedAdam(ChunkedOptimizer, torch.optim.Adam):
    """``torch.optim.Adam`` (weight decay, amsgrad, maximize, decoupled weight decay), chunked.

    Constructor: ``ChunkedAdam(layout, params=None, lr=1e-3, betas=..., ...)``
    with torch's arguments and validation. Needs the state buffers ``exp_avg``,
    ``exp_avg_sq`` and, with amsgrad, ``max_exp_avg_sq``. The per-parameter step
    count is a float32 tensor exactly as in torch (``state[p]["step"]``).
    """

    _torch_cls: type[torch.optim.Optimizer] = torch.optim.Adam

    @staticmethod
    def states_for(groups: Iterable[dict[str, Any]]) -> tuple[str, ...]:
        groups = list(groups)
        extra = ("max_exp_avg_sq",) if any(g.get("amsgrad") for g in groups) else ()
        return ("exp_avg", "exp_avg_sq", *extra)

    def _step_tensor(self, idx: int, hp: dict[str, Any]) -> torch.Tensor:
        st = self.state.get(self.layout.params[idx], {})
        if "step" in st:
            t: torch.Tensor = st["step"]
            return t
        fused = hp["fused"]
        p = self.layout.params[idx]
        if hp["capturable"] or fused:
            dtype = _get_scalar_dtype(is_fused=fused)  # type: ignore[no-untyped-call]
            return torch.zeros((), dtype=dtype, device=p.device)
        return torch.tensor(0.0, dtype=_get_scalar_dtype())  # type: ignore[no-untyped-call]

    def _key(self, plan: _Plan, idx: int, group: int) -> Hashable:
        return float(self._step_tensor(idx, plan.groups[group]).item())

    def _make_plan(self, plan: _Plan) -> None:
        super()._make_plan(plan)
        # one step tensor (pre-step value) per key; torch's adam increments a copy
        self._steps: dict[Hashable, torch.Tensor] = {}
        for idx, key in enumerate(plan.keys):
            if key is not None and key not in self._steps:
                self._steps[key] = self._step_tensor(idx, plan.groups[key[0]])  # type: ignore[index]

    def _apply_run(self, plan: _Plan, hp: dict[str, Any], key: Hashable, a: int, b: int) -> None:
        lay = self.layout
        amsgrad = hp["amsgrad"]
        beta1, beta2 = hp["betas"]
        _torch_adam(
            [lay.param_buffer[a:b]],
            [lay.grad_buffer[a:b]],
            [lay.state_buffer("exp_avg")[a:b]],
            [lay.state_buffer("exp_avg_sq")[a:b]],
            [lay.state_buffer("max_exp_avg_sq")[a:b]] if amsgrad else [],
            [self._steps[key].clone()],
            foreach=hp["foreach"],
            capturable=hp["capturable"],
            differentiable=False,
            fused=hp["fused"],
            has_complex=False,
            decoupled_weight_decay=hp["decoupled_weight_decay"],
            amsgrad=amsgrad,
            beta1=beta1,
            beta2=beta2,
            lr=hp["lr"],
            weight_decay=hp["weight_decay"],
            eps=hp["eps"],
            maximize=hp["maximize"],
        )

    def _commit(self, plan: _Plan) -> None:
        lay = self.layout
        for idx, p, hp in self._present_params(plan):
            st = self.state[p]
            if "step" not in st:
                st["step"] = self._step_tensor(idx, hp)
                st["exp_avg"] = lay.state_view("exp_avg", idx)
                st["exp_avg_sq"] = lay.state_view("exp_avg_sq", idx)
                if hp["amsgrad"]:
                    st["max_exp_avg_sq"] = lay.state_view("max_exp_avg_sq", idx)
            st["step"] += 1  # the same float32 increment torch does


class ChunkedAdamW(ChunkedAdam, torch.optim.AdamW):
    """``torch.optim.AdamW``, chunked (``ChunkedAdam`` with decoupled weight decay)."""

    _torch_cls = torch.optim.AdamW


# ------------------------------------------------------------ any torch optimizer


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
    but its chunks. Parameter-shaped state entries (see :func:`required_states`)
    live in the layout's state buffers.

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


# ----------------------------------------------------------------- factories

_CHUNKED: dict[type, Any] = {
    torch.optim.SGD: ChunkedSGD,
    torch.optim.Adam: ChunkedAdam,
    torch.optim.AdamW: ChunkedAdamW,
}
_STEP_CODE = ("step", "_init_group")  # what a subclass overrides to change the math


def _chunked_class(optimizer: torch.optim.Optimizer) -> Any:
    """The chunked class for ``optimizer``, or None (the generic path).

    SGD, Adam, AdamW, and a subclass of one that changes neither its step nor its
    hyper-parameters (the chunked versions call torch's functional math, not ``step``).
    """
    mro = type(optimizer).__mro__
    base = next((c for c in mro if c in _CHUNKED), None)
    if base is None:
        return None
    below = mro[: mro.index(base)]
    if any(name in c.__dict__ for c in below for name in _STEP_CODE):
        return None
    if not set(optimizer.defaults) <= _CHUNKED[base]._torch_defaults():
        return None
    return _CHUNKED[base]


def is_chunkable(optimizer: torch.optim.Optimizer) -> bool:
    """Does ``optimizer`` take the chunked fast path (see :func:`_chunked_class`)?"""
    return isinstance(optimizer, ChunkedOptimizer) or _chunked_class(optimizer) is not None


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`UnsupportedOptimizerError` (one line: which optimizer, why) unless
    leto can retain ``optimizer``: chunked, or a deterministic step it can replay."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"optimizer: {type(optimizer).__name__} is not a torch.optim.Optimizer"
        )
    if not is_chunkable(optimizer) and not isinstance(optimizer, RetainedOptimizer):
        _probe_states(optimizer)


def required_states(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The layout state buffers ``optimizer`` needs once retained."""
    if isinstance(optimizer, RetainedOptimizer):
        return optimizer.layout.states
    cls = _chunked_class(optimizer)
    if cls is not None:
        return tuple(cls.states_for(optimizer.param_groups))
    return _probe_states(optimizer)


def to_retained(
    optimizer: torch.optim.Optimizer,
    layout: RetainedLayout,
    *,
    alloc: Allocator | None = None,
    adopt: bool = True,
    verify: bool = False,
) -> RetainedOptimizer:
    """The retained version of a torch optimizer whose parameters are ``layout``'s.

    SGD, Adam and AdamW become chunked (their existing state, if any, is copied
    into the retained buffers; ``param_groups`` are shared with ``optimizer`` so
    a scheduler bound to it still drives the LR; do not step ``optimizer``
    itself any more). Any other optimizer is wrapped by :class:`WholeStepOptimizer`
    (its before copy from ``alloc``). ``adopt=False`` (attaching to retained state):
    the optimizer's own state is not copied in; the process state loaded next is.
    """
    cls = _chunked_class(optimizer)
    if cls is None:
        return WholeStepOptimizer(layout, optimizer, alloc=alloc, adopt=adopt, verify=verify)
    defaults = dict(optimizer.defaults)
    if cls is ChunkedAdamW:
        defaults.pop("decoupled_weight_decay", None)
    groups = [dict(g) for g in optimizer.param_groups]
    new: RetainedOptimizer = cls(layout, groups, verify=verify, **defaults)
    if adopt and optimizer.state:
        new.load_state_dict(optimizer.state_dict())
    new.param_groups = optimizer.param_groups
    return new


def bind_layout(
    model: nn.Module | list[tuple[str, nn.Parameter]],
    states: tuple[str, ...],
    *,
    attach: bool,
    alloc: Allocator | None,
    prefix: str,
    **create: Any,
) -> RetainedLayout:
    """The retained layout of ``model`` with the optimizer ``states``: attached to the
    existing one (checked to hold those states) or created (``create``: the rest of
    :meth:`RetainedLayout.create`'s arguments; one undo slot)."""
    if attach:
        if alloc is None:
            raise LayoutError("attach needs the allocator that holds the retained segments")
        layout = RetainedLayout.attach(model, alloc=alloc, prefix=prefix)
        missing = [s for s in states if s not in layout.states]
        if missing:
            raise LayoutError(f"the retained layout lacks the optimizer states {missing}")
        return layout
    return RetainedLayout.create(
        model, states=states, undo_slots=1, alloc=alloc, prefix=prefix, **create
    )


def retain(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    chunk_numel: int,
    alloc: Allocator | None = None,
    prefix: str = "leto",
    attach: bool = False,
    align_bytes: int = 256,
    verify: bool = False,
    master_weights: bool = False,
) -> RetainedOptimizer:
    """Create (or ``attach`` to) the retained layout of ``model`` and retain ``optimizer``.

    The layout gets the state buffers the optimizer needs (the generic path's
    before copy comes from ``alloc`` too). With ``attach=True`` the
    existing layout is validated against the model (shapes) and the optimizer
    (states); load the process state afterwards. ``master_weights=True``: float32
    master weights, gradients and optimizer state for bf16/fp16 parameters
    (:class:`~leto.retained.layout.RetainedLayout`); on attach the retained layout
    says which.
    """
    layout = bind_layout(
        model,
        required_states(optimizer),
        attach=attach,
        alloc=alloc,
        prefix=prefix,
        chunk_numel=chunk_numel,
        align_bytes=align_bytes,
        master_weights=master_weights,
    )
    return to_retained(optimizer, layout, alloc=alloc, adopt=not attach, verify=verify)
