"""A ``Parameter`` (or its ``.grad``) as a view of a retained buffer: binding one, telling
whether a tensor is that view, copying a foreign tensor into it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .errors import LayoutError

__all__ = ["bind", "aliases", "copy_in", "fmt_shape"]


def bind(p: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``p`` a view of ``view`` in place (keeps the Parameter object)."""
    try:
        p.data = view
    except RuntimeError:  # e.g. a meta-device skeleton: incompatible TensorImpl
        torch.utils.swap_tensors(p, nn.Parameter(view, requires_grad=p.requires_grad))  # type: ignore[no-untyped-call]


def aliases(t: torch.Tensor | None, view: torch.Tensor) -> bool:
    return (
        t is not None
        and t.device == view.device
        and t.data_ptr() == view.data_ptr()
        and t.shape == view.shape
        and t.stride() == view.stride()
        and t.dtype == view.dtype
    )


def copy_in(t: torch.Tensor, view: torch.Tensor, what: str) -> torch.Tensor:
    """Copy a foreign tensor into its retained ``view`` (same shape) and return the view."""
    if t.shape != view.shape:
        raise LayoutError(f"{what} has shape {fmt_shape(t.shape)}, want {fmt_shape(view.shape)}")
    with torch.no_grad():
        view.copy_(t)
    return view


def fmt_shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
