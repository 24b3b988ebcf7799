"""A process's phase, step and progress counter in shared memory, and the mutex that
tells its death.

A trainer changes phase eight times a step (forward, backward, allreduce, ...).
Its node agent needs the phase only when something goes wrong: to place a death
("died in apply of step 12") and to tell a hang inside the computation from a
wait. Sending a message per change cost the agent a wakeup and a JSON decode
each time, 32 per step on a node of two ranks; instead the trainer writes the
three numbers into a memfd segment it shares with its agent (the descriptor
travels with its ``hello``), and the agent reads them when it looks: every tick
of its loop for the hang check, and once more when the process has died.

Layout: four little-endian int64 words ``seq, phase, step, progress``. A write
is a seqlock: ``seq`` odd, the three words, ``seq`` even; a reader takes the
words only from a read with an even ``seq`` that a second read repeats. One
writer per board (the trainer's main thread; :meth:`write` is not thread-safe).
A phase outside :data:`PHASES` is not written: the caller sends it as a message.
At :data:`MUTEX_AT`, a robust mutex the process's main thread holds for its life
(:mod:`.deathwatch`): the agent learns of its death from it before the kernel has
torn the process's memory down.
"""

from __future__ import annotations

import mmap
import os
import struct

from . import segments
from .deathwatch import MUTEX_BYTES, hold

__all__ = ["MUTEX_AT", "PHASES", "SIZE", "StatusBoard"]

PHASES = (
    "startup",
    "idle",
    "forward",
    "backward",
    "allreduce",
    "prepare",
    "decide",
    "apply",
    "snapshot",
    "stopped",
    "done",
    "shadow",
    "report",
    "reconcile",
    "rebuild",
    "resume",
)
_INDEX = {p: i for i, p in enumerate(PHASES)}
_WORDS = struct.Struct("<qqqq")
_SEQ = struct.Struct("<q")
_DATA = struct.Struct("<qqq")
MUTEX_AT = 64  # the words, then the mutex, each on its own cache line
SIZE = MUTEX_AT + MUTEX_BYTES


class StatusBoard:
    """A mapping of one board segment (see the module docstring)."""

    def __init__(self, fd: int) -> None:
        if segments.size_of(fd) != SIZE:
            raise ValueError(f"a status board has {SIZE} bytes, not {segments.size_of(fd)}")
        self.mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._seq = 0
        self._held: object | None = None  # the writer's mutex (it pins the mapping)

    @classmethod
    def create(cls) -> tuple[StatusBoard, int]:
        """A new board, its mutex held by the calling thread for the rest of the process's
        life, and its descriptor (to send to the reader; the caller closes it)."""
        fd = segments.create(f"leto-board-{os.getpid()}", SIZE)
        try:
            board = cls(fd)
            try:
                board._held = hold(board.mm, MUTEX_AT)
            except OSError:  # no robust mutexes here: the pidfd decides
                pass
            return board, fd
        except BaseException:
            os.close(fd)
            raise

    def write(self, phase: str, step: int, progress: int) -> bool:
        """Publish the three values; False (nothing written) for a phase not in PHASES."""
        i = _INDEX.get(phase)
        if i is None:
            return False
        self._seq += 1
        _SEQ.pack_into(self.mm, 0, self._seq)  # odd: a write is under way
        _DATA.pack_into(self.mm, 8, i, step, progress)
        self._seq += 1
        _SEQ.pack_into(self.mm, 0, self._seq)  # even: done
        return True

    def read(self, tries: int = 100) -> tuple[str, int, int] | None:
        """``(phase, step, progress)`` as last written; None before the first write, or
        if no consistent read came in ``tries`` (a writer stopped half way: the caller
        keeps what it knew)."""
        for _ in range(tries):
            a = _WORDS.unpack_from(self.mm, 0)
            if a[0] % 2 == 0 and _WORDS.unpack_from(self.mm, 0) == a:
                if a[0] == 0 or not 0 <= a[1] < len(PHASES):
                    return None
                return PHASES[a[1]], a[2], a[3]
        return None

    def close(self) -> None:
        """Unmap a reader's board; a writer's stays mapped (its mutex stays held) until
        the process ends."""
        if self._held is None:
            self.mm.close()
