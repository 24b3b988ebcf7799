"""Which trainers' output ``leto launch`` shows on its console (torchrun's
``--redirects``, ``--tee`` and ``--local-ranks-filter``).

The agent writes every process's output to its log in ``RUN_DIR/logs`` and copies each
trainer's, line by line, to its own stdout as ``[rank N] line`` (whole lines, one write
for the lines it has). :class:`ShownRanks`, put in place of ``sys.stdout`` in the
agent's process, drops the lines of the ranks not shown and passes everything else
through. The processes forked from the agent inherit it as their ``sys.stdout``: in
them (another pid) it writes everything, untouched.
"""

from __future__ import annotations

import os
import re
from typing import Any, TextIO

__all__ = ["ShownRanks"]

_PREFIX = re.compile(r"\[rank (\d+)\] ")


class ShownRanks:
    """``stream``, less the trainer lines of local ranks not in ``shown`` (a global rank
    ``r`` is local rank ``r % nproc``: every node has ``nproc`` ranks)."""

    def __init__(self, stream: TextIO, shown: frozenset[int], nproc: int) -> None:
        self.stream = stream
        self.shown = shown
        self.nproc = nproc
        self.pid = os.getpid()

    def _shown(self, line: str) -> bool:
        m = _PREFIX.match(line)
        return m is None or int(m.group(1)) % self.nproc in self.shown

    def write(self, text: str) -> int:
        if os.getpid() != self.pid:
            return self.stream.write(text)
        kept = "".join(line for line in text.splitlines(keepends=True) if self._shown(line))
        if kept:
            self.stream.write(kept)
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, reconfigure, encoding, ...
        return getattr(self.stream, name)
