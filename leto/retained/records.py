"""Every chunk's record: the version its data bytes are at and their checksum.

A chunk's *data* is its slice of params and every optimizer state buffer. Its
record lives in the header (:mod:`.header`), with a host copy of the versions (a
recovery reads every chunk's: a list entry each, not a device read). Writes are
ordered data, then checksum, then version, so a crash between any two leaves a
record that a checksum pass tells from a sealed one.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from .checksum import DOMAIN_DATA, checksum, checksum_chunks
from .geometry import ChunkGeometry
from .header import CHECKSUM, SUSPECT, VERSION, Header

__all__ = ["ChunkRecords"]


class ChunkRecords:
    """The version and checksum recorded for each chunk's data bytes, and the suspect flag.

    ``data``: the flat buffers a chunk's data spans (params, then states in order);
    ``h``: the header's words as read when the layout was bound (:meth:`Header.read`).
    """

    def __init__(
        self,
        header: Header,
        geometry: ChunkGeometry,
        data: list[torch.Tensor],
        algorithm: str,
        h: list[int],
    ) -> None:
        self._header = header
        self._table = header.table
        self._geometry = geometry
        self._data = data
        self.algorithm = algorithm
        self.n_chunks = geometry.n_chunks
        self._ver = header.chunk_column(h, VERSION)

    def version(self, i: int) -> int:
        """The step chunk i's bytes are at (for TORN: the step they were at before)."""
        self._geometry.check(i)
        return int(self._ver[i])

    def versions(self) -> list[int]:
        """Every chunk's :meth:`version` (a copy)."""
        return list(self._ver)

    def stored_checksum(self, i: int) -> int:
        return int(self._header.words[self._header.row(i) + CHECKSUM].item())

    def stored_checksums(self) -> torch.Tensor:
        """Every chunk's recorded checksum (int64, a copy)."""
        return self._table[:, CHECKSUM].clone()

    def stored_checksum_list(self) -> list[int]:
        """Every chunk's :meth:`stored_checksum`, read in one call."""
        return [int(x) for x in self._table[:, CHECKSUM].tolist()]

    def compute_checksum(self, i: int, version: int) -> torch.Tensor:
        """Checksum of chunk i's current data bytes, salted with ``version``."""
        return checksum(
            self._geometry.slices(self._data, i),
            index=i,
            version=version,
            domain=DOMAIN_DATA,
            algorithm=self.algorithm,
        )

    def data_checksums(self, versions: Sequence[int]) -> torch.Tensor:
        """Checksums of every chunk's current data bytes, chunk i salted with ``versions[i]``."""
        return checksum_chunks(
            self._data,
            self.n_chunks,
            versions,
            domain=DOMAIN_DATA,
            algorithm=self.algorithm,
        )

    def seal(self, i: int, version: int) -> None:
        """Record chunk i's bytes as version ``version`` (checksum, then version)."""
        self._geometry.check(i)
        r = self._header.row(i)
        self._header.write(r + CHECKSUM, self.compute_checksum(i, version))
        self._header.write(r + VERSION, version)
        self._ver[i] = version

    def seal_all(self, version: int) -> None:
        """Record every chunk's bytes as ``version`` (one batched checksum pass)."""
        self._table[:, CHECKSUM] = self.data_checksums([version] * self.n_chunks)
        self._table[:, VERSION] = version
        self._ver = [version] * self.n_chunks

    def put(self, i: int, version: int, checksum: int | torch.Tensor) -> None:
        """Record chunk i as ``version`` with a known ``checksum`` (bytes put back from an
        undo copy): checksum, then version."""
        r = self._header.row(i)
        self._header.write(r + CHECKSUM, checksum)
        self._header.write(r + VERSION, version)
        self._ver[i] = version

    def verify_chunk(self, i: int) -> bool:
        """Do chunk i's bytes match its recorded checksum and version?"""
        return bool(self.compute_checksum(i, self._ver[i]).item() == self.stored_checksum(i))

    def failing(self, intact: Collection[int] = ()) -> list[bool]:
        """Per chunk: do its bytes fail their record? ``intact``: chunks the caller
        checked since anything last wrote them (not read again: False)."""
        if intact:
            intact = set(intact)
            return [i not in intact and not self.verify_chunk(i) for i in range(self.n_chunks)]
        bad: list[bool] = (self.data_checksums(self._ver) != self._table[:, CHECKSUM]).tolist()
        return bad

    @property
    def suspect(self) -> bool:
        """A checksum pass found some chunk failing since the last recovery ended: the
        next recovery's report reads every chunk, none is deferred."""
        return int(self._header.words[SUSPECT]) != 0

    def mark_suspect(self, value: bool = True) -> None:
        self._header.write(SUSPECT, int(value))
