"""Allocators: where a retained layout's segments come from, by name."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import LayoutError

__all__ = ["Allocator", "default_allocator", "InMemorySegments", "settle"]

Allocator = Callable[[str, int], torch.Tensor]
"""``alloc(name, nbytes) -> 1-D uint8 tensor`` of exactly ``nbytes`` bytes.

For :meth:`RetainedLayout.create` it may return fresh memory (its contents are
overwritten); for :meth:`RetainedLayout.attach` it must return the existing
segment of that name (a keeper maps it; the fake backend looks it up).
"""


def default_allocator(name: str, nbytes: int) -> torch.Tensor:
    """Plain process memory (``torch.empty``): no retention, for tests and single runs."""
    del name
    return torch.empty(nbytes, dtype=torch.uint8)


class InMemorySegments:
    """A create-or-attach allocator over a dict: a keeper in one process.

    A name seen before returns the same tensor (its size must match); a new name
    gets zeroed memory on ``device``. Drop entries from ``segments`` to simulate
    lost memory.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.segments: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, nbytes: int) -> torch.Tensor:
        seg = self.segments.get(name)
        if seg is None:
            seg = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            self.segments[name] = seg
        elif seg.numel() != nbytes:
            raise LayoutError(f"segment {name!r} has {seg.numel()} bytes, {nbytes} requested")
        return seg


def settle(device: torch.device) -> None:
    """Wait until ``device`` has carried out every write queued on it (a no-op on the
    host). Called before a message says that retained bytes are written (a vote, a
    step's finish, a recovery's report): a process killed after it says so has no
    queued kernel left to lose."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
