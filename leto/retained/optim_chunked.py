"""Chunked optimizers: SGD, Adam and AdamW applied chunk by chunk over a RetainedLayout.

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
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.adam import adam as _torch_adam
from torch.optim.optimizer import _get_scalar_dtype
from torch.optim.sgd import sgd as _torch_sgd

from .layout import LayoutError, RetainedLayout
from .optim_base import RetainedOptimizer, _Plan

__all__ = ["ChunkedOptimizer", "ChunkedSGD", "ChunkedAdam", "ChunkedAdamW"]


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
