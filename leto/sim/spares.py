"""The spare-node pool: how long a failure that takes a node waits for a replacement.

A failure that loses a node (a reboot) or needs its replacement takes a spare from the
pool at once if one is free; the failed node rejoins the pool when it is back (after a
reboot, or after repair). With the pool empty, the job waits for the first node to come
back (possibly the failed node itself). The pool is a property of the cluster, so every
strategy sees the same waits on the same trace. Only node-taking failures are visited
(a heap of return times), a few per hour even at 131,072 GPUs.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


def spare_waits(
    times: npt.NDArray[np.float64],
    takes_node: npt.NDArray[np.bool_],
    back_after_s: npt.NDArray[np.float64],
    spares: int,
) -> npt.NDArray[np.float64]:
    """Seconds each failure waits for a node; 0 for failures that take none."""
    import numpy as np

    wait = np.zeros(len(times))
    out: list[float] = []  # when nodes now away come back
    free = spares
    for i in np.flatnonzero(takes_node).tolist():
        t = float(times[i])
        while out and out[0] <= t:
            heapq.heappop(out)
            free += 1
        heapq.heappush(out, t + float(back_after_s[i]))
        if free > 0:
            free -= 1
        else:
            wait[i] = heapq.heappop(out) - t
    return wait
