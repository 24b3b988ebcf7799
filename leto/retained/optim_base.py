"""What every retained optimizer shares: the transaction API, process state and the
torch-format state dict (:class:`RetainedOptimizer`; the API is described in
:mod:`leto.retained.optim`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from .layout import ChecksumError, ChunkStateError, ChunkStatus, LayoutError, RetainedLayout
from .views import aliases, copy_in

__all__ = ["RetainedOptimizer", "PROCESS_STATE_FORMAT"]

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

    Subclasses: :class:`~leto.retained.optim_chunked.ChunkedOptimizer` (per-chunk
    math) and :class:`~leto.retained.optim_whole.WholeStepOptimizer` (fallback). Not
    instantiated directly.
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
