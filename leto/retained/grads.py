"""The gradient buffer: ``.grad`` views, which gradients are present, and the sealed
gradients of a step (the protocol's ``grad[r]``).

Presence is tracked, not read from ``.grad is None`` (the views always exist): see
"Gradients present" in :mod:`leto.retained.layout`. :meth:`GradBuffer.seal` writes
the present mask to the header with a per-chunk gradient checksum and version, so a
roll-forward in a new process skips the same parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .checksum import DOMAIN_GRAD, checksum_chunks
from .errors import LayoutError
from .geometry import ChunkGeometry
from .header import GRAD_CHECKSUM, GRAD_VERSION, PREPARED, REDUCED, Header
from .views import aliases, copy_in

__all__ = ["GradBuffer"]


class GradBuffer:
    """The flat gradient buffer of a layout's parameters and its header words.

    ``derived``: the parameters whose ``.grad`` is a tensor of their own dtype, cast
    into the buffer at PREPARE (master weights); ``h``: the header's words as read
    when the layout was bound (a new process's present marks start from the mask
    sealed last; a fresh header's says none).
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        header: Header,
        geometry: ChunkGeometry,
        params: list[nn.Parameter],
        derived: Sequence[int],
        algorithm: str,
        h: list[int],
    ) -> None:
        self.buffer = buffer
        self._header = header
        self._table = header.table
        self._geometry = geometry
        self._params = params
        self._derived = set(derived)
        self._algorithm = algorithm
        self._gver = header.chunk_column(h, GRAD_VERSION)
        self._prepared = h[PREPARED]
        self._flags = [bool(x) for x in h[header.mask_base : header.mask_base + len(params)]]
        self._hooks: list[Any] = []

    def view(self, i: int) -> torch.Tensor:
        """Parameter i's gradient: its view of the buffer."""
        return self._geometry.view_in(self.buffer, i)

    def chunk(self, i: int) -> torch.Tensor:
        """Chunk i's slice of the buffer."""
        a, b = self._geometry.chunk_range(i)
        return self.buffer[a:b]

    # ------------------------------------------------------------ presence

    def bind(self, i: int, p: nn.Parameter) -> None:
        """Make ``p.grad`` its view and mark it present whenever backward writes it."""
        p.grad = self.view(i)
        self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(i)))  # type: ignore[no-untyped-call]

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self._flags[i] = True

        return hook

    def set_present(self, present: Sequence[bool]) -> None:
        """Which parameters have a gradient, known from elsewhere (the gradients were
        written into the buffer by another hand: FSDP2's reduce-scatter into its
        regions): a present one's ``.grad`` is its view, an absent one's None."""
        if len(present) != len(self._params):
            raise LayoutError(f"present mask has {len(present)} entries, want {len(self._params)}")
        for i, (p, has) in enumerate(zip(self._params, present, strict=True)):
            p.grad = self.view(i) if has else None
            self._flags[i] = bool(has)

    def adopt(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Copy in the gradients the parameters had before they were bound (present)."""
        with torch.no_grad():
            for i, g in enumerate(grads):
                if g is not None and self._params[i].requires_grad:
                    self.view(i).copy_(g)  # a derived parameter keeps its own too
                    self._flags[i] = True

    def close(self) -> None:
        """Remove the hooks (the views stay)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def zero(self, set_to_none: bool = True) -> None:
        """Zero the flat grad buffer, keeping ``.grad`` views (no ``None``).

        ``set_to_none=True`` fills ``-0.0`` and marks every gradient absent (what
        torch's None means); ``False`` fills ``+0.0`` and keeps present marks,
        like torch's ``grad.zero_()``. A derived parameter's own ``.grad`` is set
        to None or zeroed, as torch does.
        """
        for i, p in enumerate(self._params):
            if not p.requires_grad:
                continue
            if i in self._derived:
                if set_to_none or p.grad is None:
                    p.grad = None
                else:
                    with torch.no_grad():
                        p.grad.zero_()
                continue
            view = self.view(i)
            if p.grad is None:
                self._flags[i] = False
            elif not aliases(p.grad, view):
                self._flags[i] = True
            if not aliases(p.grad, view):
                p.grad = view
        with torch.no_grad():
            self.buffer.fill_(-0.0 if set_to_none else 0.0)
        if set_to_none:
            self._flags = [False] * len(self._params)

    def collect(self) -> list[bool]:
        """Which parameters have a gradient now; copies in any ``.grad`` the user replaced.

        A ``.grad`` of None counts absent (and stays None); a foreign tensor is
        copied into the flat buffer and the view re-bound. A derived parameter's
        ``.grad`` (its own dtype) is cast into the buffer and stays its own.
        """
        present = []
        for i, p in enumerate(self._params):
            g = p.grad
            if g is None:
                present.append(False)
                continue
            if i in self._derived:
                copy_in(g, self.view(i), f"the .grad of {self._geometry.slots[i].name!r}")
                present.append(True)
                continue
            view = self.view(i)
            if not aliases(g, view):
                p.grad = copy_in(g, view, f"the .grad of {self._geometry.slots[i].name!r}")
                self._flags[i] = True
            present.append(self._flags[i])
        return present

    # ------------------------------------------------------------- sealing

    def checksums(self) -> list[int]:
        """The per-chunk gradient checksums recorded by the last :meth:`seal`."""
        return [int(x) for x in self._table[:, GRAD_CHECKSUM].tolist()]

    def checksums_at(self, step: int) -> torch.Tensor:
        """Checksums of every chunk of the current gradient bytes, as those of ``step``."""
        n = self._geometry.n_chunks
        return checksum_chunks(
            [self.buffer], n, [step] * n, domain=DOMAIN_GRAD, algorithm=self._algorithm
        )

    def seal(self, step: int, present: Sequence[bool]) -> None:
        """PREPARE: record the gradients in retained memory as those of ``step``.

        Writes the present mask and a per-chunk gradient checksum; ``prepared``
        is written last.
        """
        if len(present) != len(self._params):
            raise LayoutError(f"present mask has {len(present)} entries, want {len(self._params)}")
        h = self._header
        h.write(PREPARED, -1)
        self._prepared = -1
        h.words[h.mask_base : h.mask_base + len(present)] = torch.tensor(
            [int(bool(x)) for x in present], dtype=torch.int64
        ).to(h.words.device)
        self._table[:, GRAD_CHECKSUM] = self.checksums_at(step)
        self._table[:, GRAD_VERSION] = step
        self._gver = [step] * self._geometry.n_chunks
        h.write(PREPARED, step)
        self._prepared = step

    def present_mask(self) -> list[bool]:
        """The present mask sealed with the gradients (read from retained memory)."""
        h = self._header
        return [bool(x) for x in h.words[h.mask_base : h.mask_base + len(self._params)].tolist()]

    def verify(self, step: int) -> list[int]:
        """Chunks whose gradients are not sealed for ``step`` or fail their checksum."""
        bad = (self.checksums_at(step) != self._table[:, GRAD_CHECKSUM]).tolist()
        return [i for i in range(self._geometry.n_chunks) if bad[i] or self._gver[i] != step]

    def clear_prepared(self) -> None:
        """Forget the prepared gradients (a rolled-back step: nothing in flight survives,
        or the next step's reduced gradients are about to overwrite them)."""
        self._header.write(PREPARED, -1)
        self._prepared = -1
        self._header.write(REDUCED, -1)

    def mark_reduced(self, step: int) -> None:
        """The gradients of ``step`` are reduced into the buffer, not sealed yet (the
        protocol's Reduce: a recovery reports them as ``step``'s, unsealed)."""
        self._header.write(REDUCED, step)

    @property
    def reduced_step(self) -> int:
        """The step whose reduced gradients fill the buffer unsealed (-1: none; only
        meaningful while :attr:`prepared_step` is -1)."""
        return int(self._header.words[REDUCED].item())

    @property
    def prepared_step(self) -> int:
        """The step whose gradients were sealed last (-1: none)."""
        return int(self._prepared)
