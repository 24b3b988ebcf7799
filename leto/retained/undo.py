"""Undo slots: copies of whole chunks' data kept while a step writes them, and the
chunk status they define (CLEAN, TORN, APPLIED: "Undo and chunk status" in
:mod:`leto.retained.layout`).

A slot's header row is chunk, version, checksum; the chunk index is written last,
so a half-written slot is never taken for valid, and the status is derived from the
header alone: a new process reads it after a crash.
"""

from __future__ import annotations

import enum

import torch

from .checksum import DOMAIN_DATA, checksum, copy_checksum
from .errors import ChecksumError, ChunkStateError
from .geometry import ChunkGeometry
from .header import CHECKSUM, SLOT_CHECKSUM, SLOT_CHUNK, SLOT_VERSION, Header
from .records import ChunkRecords

__all__ = ["ChunkStatus", "UndoSlots"]


class ChunkStatus(enum.Enum):
    CLEAN = "clean"
    TORN = "torn"
    APPLIED = "applied"


class UndoSlots:
    """A layout's undo slots: their bytes (``copies``, one row per slot: params, then
    states), their header rows, and the copy staged ahead of a :meth:`save`.

    ``data``: the flat buffers a chunk's data spans; ``h``: the header's words as read
    when the layout was bound.
    """

    def __init__(
        self,
        header: Header,
        records: ChunkRecords,
        geometry: ChunkGeometry,
        copies: torch.Tensor,
        data: list[torch.Tensor],
        h: list[int],
    ) -> None:
        self._header = header
        self._records = records
        self._geometry = geometry
        #: ``(undo_slots, 1 + len(states), chunk_numel)``: each slot's copy of a chunk
        self.copies = copies
        self._data = data
        self._chunk = header.slot_column(h, SLOT_CHUNK)
        self._ver = header.slot_column(h, SLOT_VERSION)
        self._staged: tuple[int, int, int] | None = None  # stage's (slot, chunk, version)

    # ---------------------------------------------------------------- status

    def slot_of(self, i: int) -> int | None:
        """The slot holding chunk i's undo copy, or None."""
        for k, c in enumerate(self._chunk):
            if c == i:
                return k
        return None

    def status(self, i: int) -> ChunkStatus:
        v = self._records.version(i)
        return self._status(i, self.slot_of(i), v)

    def _status(self, i: int, k: int | None, v: int) -> ChunkStatus:
        if k is None:
            return ChunkStatus.CLEAN
        if v == self._ver[k]:
            return ChunkStatus.TORN
        if v == self._ver[k] + 1:
            return ChunkStatus.APPLIED
        raise ChunkStateError(
            f"chunk {i}: header version {v} and undo version {self._ver[k]} are inconsistent"
        )

    def statuses(self) -> list[ChunkStatus]:
        """Every chunk's :meth:`status`, read in one pass over the header's host copy."""
        slot = {c: k for k, c in enumerate(self._chunk) if c >= 0}
        n = self._geometry.n_chunks
        if not slot:
            return [ChunkStatus.CLEAN] * n
        ver = self._records.versions()
        return [self._status(i, slot.get(i), ver[i]) for i in range(n)]

    def base_version(self) -> int:
        """The step every chunk's trusted bytes are at least at (undo version for torn/applied)."""
        ver = self._records.versions()
        vs = []
        for i in range(self._geometry.n_chunks):
            k = self.slot_of(i)
            vs.append(self._ver[k] if k is not None else ver[i])
        return int(min(vs))

    # ------------------------------------------------------------------ copies

    def stage(self, i: int) -> bool:
        """Copy CLEAN chunk i's data into a free undo slot ahead of its :meth:`save`
        (``staged=True``), which then writes only the slot's header: the copy runs where
        the caller waits anyway (a step's COMMIT round trip). The slot stays free until
        then (its header unchanged: a recovery ignores its bytes). False (nothing copied)
        if no slot is free or the chunk is not clean.

        The caller writes nothing into chunk i between the two calls; any other undo
        operation, and any seal (:meth:`drop_staged`), drops the staged copy.
        """
        k = self._free_for(i)
        if k is None:
            return False
        self._copy(k, i)
        self._staged = (k, i, self._records.version(i))
        return True

    def stage_checked(self, i: int) -> bool | None:
        """:meth:`stage`, the copy checked against chunk i's record as it is made: one
        pass over the bytes, each block hashed just after it is copied, while it is in
        cache (:func:`~leto.retained.checksum.copy_checksum`). That is a check of chunk
        i's bytes (they are what was copied) and of the copy at once, so it stands in
        for a separate checksum pass over chunk i (PREPARE's, PROTOCOL.md "Which bytes a
        report reads"). True: staged, the bytes match; False: they fail their checksum,
        and the copy is dropped; None: nothing copied (as :meth:`stage`'s False)."""
        k = self._free_for(i)
        if k is None:
            return None
        v = self._records.version(i)
        cs = copy_checksum(
            list(self.copies[k]),
            self._geometry.slices(self._data, i),
            index=i,
            version=v,
            domain=DOMAIN_DATA,
            algorithm=self._records.algorithm,
        )
        if int(cs.item()) != self._records.stored_checksum(i):
            return False
        self._staged = (k, i, v)
        return True

    def holds_staged(self, i: int) -> bool:
        """Is a copy of chunk i at its version staged, its slot still free?"""
        ahead = self._staged
        return (
            ahead is not None
            and ahead[1:] == (i, self._records.version(i))
            and self._chunk[ahead[0]] == -1
        )

    def _free_for(self, i: int) -> int | None:
        """Drop any staged copy; the free slot CLEAN chunk i may be staged into, or None."""
        self._staged = None
        if self.status(i) is not ChunkStatus.CLEAN or -1 not in self._chunk:
            return None
        return self._chunk.index(-1)

    def drop_staged(self) -> None:
        """Forget the copy :meth:`stage` made (its chunk's bytes or record change)."""
        self._staged = None

    def _copy(self, k: int, i: int) -> None:
        with torch.no_grad():
            for dst, src in zip(self.copies[k], self._geometry.slices(self._data, i), strict=True):
                dst.copy_(src)

    def save(self, i: int, *, verify: bool = False, staged: bool = False) -> None:
        """Copy chunk i's data into a free undo slot; the chunk becomes TORN.

        ``verify=True`` first checks the bytes against their checksum (two extra
        reads), so corruption is caught before a step launders it into new bytes.
        ``staged=True``: the bytes were copied by :meth:`stage` (used if that copy
        is of chunk i at its version and its slot is still free; else copied here).
        """
        ahead, self._staged = self._staged, None
        status = self.status(i)
        if status is not ChunkStatus.CLEAN:
            raise ChunkStateError(f"save_undo: chunk {i} is {status.value}, not clean")
        v = self._records.version(i)
        if verify and not self._records.verify_chunk(i):
            raise ChecksumError(f"chunk {i} fails its checksum at version {v}")
        if staged and ahead is not None and ahead[1:] == (i, v):
            k = ahead[0]
            staged = self._chunk[k] == -1
        else:
            staged = False
        if not staged:
            try:
                k = self._chunk.index(-1)
            except ValueError:
                busy = [c for c in self._chunk]
                raise ChunkStateError(
                    f"save_undo: no free undo slot for chunk {i} (slots hold chunks {busy}; finish or restore one)"
                ) from None
            self._copy(k, i)
        h = self._header
        base = h.slot(k)
        h.write(base + SLOT_CHECKSUM, h.words[h.row(i) + CHECKSUM])
        h.write(base + SLOT_VERSION, v)
        self._ver[k] = v
        h.write(base + SLOT_CHUNK, i)  # last: the slot is valid
        self._chunk[k] = i

    def _checked(self, i: int) -> int:
        k = self.slot_of(i)
        if k is None:
            raise ChunkStateError(f"chunk {i} has no undo copy")
        return k

    def data(self, i: int) -> list[torch.Tensor]:
        """The undo copy of chunk i (same structure as the layout's ``chunk_data``)."""
        return list(self.copies[self._checked(i)])

    def version(self, i: int) -> int:
        return int(self._ver[self._checked(i)])

    def checksum(self, i: int) -> int:
        """The checksum recorded with chunk i's undo copy (of its bytes at :meth:`version`)."""
        k = self._checked(i)
        return int(self._header.words[self._header.slot(k) + SLOT_CHECKSUM].item())

    def verify(self, i: int) -> bool:
        k = self._checked(i)
        cs = checksum(
            list(self.copies[k]),
            index=i,
            version=self._ver[k],
            domain=DOMAIN_DATA,
            algorithm=self._records.algorithm,
        )
        return bool(cs.item() == self.checksum(i))

    def restore(self, i: int) -> None:
        """Put chunk i's undo copy back (after checking it); the chunk becomes CLEAN at the old version."""
        self._staged = None
        k = self._checked(i)
        if not self.verify(i):
            raise ChecksumError(f"the undo copy of chunk {i} fails its checksum")
        with torch.no_grad():
            for dst, src in zip(self._geometry.slices(self._data, i), self.copies[k], strict=True):
                dst.copy_(src)
        base = self._header.slot(k)
        self._records.put(i, self._ver[k], self._header.words[base + SLOT_CHECKSUM])
        self._header.write(base + SLOT_CHUNK, -1)
        self._chunk[k] = -1

    def release(self, i: int) -> None:
        """Drop chunk i's undo copy once its new bytes (and parity) are written."""
        status = self.status(i)
        if status is not ChunkStatus.APPLIED:
            raise ChunkStateError(
                f"release_undo: chunk {i} is {status.value}, not applied (its undo is still needed)"
            )
        k = self._checked(i)
        self._header.write(self._header.slot(k) + SLOT_CHUNK, -1)
        self._chunk[k] = -1
