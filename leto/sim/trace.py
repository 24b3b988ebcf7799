"""A failure trace: when failures strike the job, what each destroys, and where.

Every strategy is simulated on the *same* trace, so differences between strategies
come from the strategies, not from luck. Failures arrive as a Poisson process in
wall-clock time (they strike whether the job is training or recovering), at the job's
mean time between failures for its scale (:mod:`leto.sim.calibration`).

Each quantity is drawn from its own random stream (one ``SeedSequence`` child per
stream), and inter-arrival times are unit exponentials scaled by the MTBF, so traces
for nearby parameters are *coupled*: a sweep of the MTBF rescales the same arrivals,
and a sweep of the HOF fraction reclasses the same failures monotonically (a failure
in place at fraction h stays in place at every fraction above h).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from leto.sim.calibration import FailureClass
from leto.sim.params import SimParams

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

_STREAMS = ("arrivals", "class", "node", "rank", "phase", "lag")


@attrs.frozen(eq=False)
class Trace:
    """Failures of one job, in time order; every array has one entry per failure."""

    horizon_s: float
    times: npt.NDArray[np.float64]  # seconds since the job started
    cls: npt.NDArray[np.int8]  # FailureClass codes
    node: npt.NDArray[np.int64]  # the node struck
    rank: npt.NDArray[np.int64]  # the local rank struck (for a device-memory loss)
    phase: npt.NDArray[np.float64]  # how far into its step the job was, in [0, 1)
    lag: npt.NDArray[np.float64]  # how far into the tier-2 snapshot interval, in [0, 1)
    spare_wait_s: npt.NDArray[np.float64]  # wait for a spare node (node-class failures)

    def __len__(self) -> int:
        return len(self.times)

    @property
    def loses_node(self) -> npt.NDArray[np.bool_]:
        return self.cls >= FailureClass.NODE_LOSS


def generate(params: SimParams, seed: int) -> Trace:
    """Draw the trace of failures for ``params`` with ``seed``."""
    import numpy as np

    from leto.sim.spares import spare_waits

    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(len(_STREAMS))]
    rng = dict(zip(_STREAMS, streams, strict=True))
    horizon, mtbf = params.horizon_s, params.mtbf_s
    expected = horizon / mtbf
    count = int(expected + 10.0 * expected**0.5 + 20.0)
    gaps = rng["arrivals"].standard_exponential(count)
    times = np.cumsum(gaps) * mtbf
    while times[-1] < horizon:  # astronomically rare with the margin above
        more = rng["arrivals"].standard_exponential(count)
        times = np.concatenate([times, times[-1] + np.cumsum(more) * mtbf])
    n = int(np.searchsorted(times, horizon))
    times = times[:n]
    edges = np.cumsum(params.class_shares)[:-1]
    cls = np.searchsorted(edges, rng["class"].random(n), side="right").astype(np.int8)
    node = rng["node"].integers(0, params.nodes, n)
    rank = rng["rank"].integers(0, params.ranks_per_node, n)
    phase = rng["phase"].random(n)
    lag = rng["lag"].random(n)
    back = np.where(
        cls == FailureClass.NODE_LOSS, params.reboot_min * 60.0, params.repair_hours * 3600.0
    )
    wait = spare_waits(times, cls >= FailureClass.NODE_LOSS, back, params.spare_nodes)
    return Trace(horizon, times, cls, node, rank, phase, lag, wait)
