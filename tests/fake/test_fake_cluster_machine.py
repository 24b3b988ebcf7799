"""The core's Hypothesis machine, driven against the fake backend with real tensors.

:class:`leto.testing.cluster.ClusterMachine` picks steps, faults (crash, hang,
memory loss, node loss) at random points, and recovery events; every transition's
effects run here on real tensors (:meth:`Engine.execute`). After every rule the
real state must refine the core's: each chunk's status and version as the model
says, parity records as the model's, the tier-1 parity bytes exactly the code of
the members' bytes, every checksum valid. At the end the run is completed without
faults and must be bitwise equal to a run that never failed.
"""

from __future__ import annotations

from typing import Any

from fakejob import make_engine, same_state
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import invariant

from leto.core import events as ev
from leto.core.cluster import ClusterConfig, ClusterState, Effect
from leto.core.erasure import Topology
from leto.core.recovery import Phase
from leto.core.trainer import TrainerState
from leto.core.txn import TxnState
from leto.retained.layout import ChunkStatus
from leto.testing.cluster import ClusterMachine

CONFIG = ClusterConfig(topology=Topology((2, 1)), chunks=2, max_step=3, max_faults=3, k=1)
CHUNK = 16  # 26 parameters -> 2 chunks, as the model's config says

_TRAINING = (
    ev.Compute, ev.Reduce, ev.Prepare, ev.Decide, ev.BeginChunk, ev.EndChunk,
    ev.ParityChunk, ev.Finish, ev.Close, ev.Tier2Snapshot,
)  # fmt: skip

_reference: dict[ClusterConfig, Any] = {}


def reference(config: ClusterConfig) -> Any:
    """The failure-free run to the model's last step (computed once per config)."""
    if config not in _reference:
        eng = make_engine(config.topology, chunk_numel=CHUNK, k=config.k, core_config=config)
        finish_training(eng)
        _reference[config] = eng
    return _reference[config]


def finish_training(eng: Any) -> None:
    """Recover if needed, then run training events (no faults) to the last step."""
    eng.recover()
    model = eng.model
    for _ in range(10_000):
        s = eng.state
        if all(st == model.config.max_step for st in s.step) and all(
            p is TxnState.IDLE for p in s.pc
        ):
            return
        options = sorted((e for e in model.enabled(s) if isinstance(e, _TRAINING)), key=repr)
        assert options, f"training is stuck in {s}"
        eng.feed(options[0])
    raise AssertionError("training did not finish")


class RealCluster(ClusterMachine):
    config = CONFIG

    def __init__(self) -> None:
        super().__init__()
        cfg = self.config
        self.engine = make_engine(cfg.topology, chunk_numel=CHUNK, k=cfg.k, core_config=cfg)
        assert self.engine.state == self.state
        self.last: ClusterState = self.state

    def execute(self, event: ev.Event, effects: tuple[Effect, ...], state: ClusterState) -> None:
        self.engine.execute(event, effects, self.last, state)
        self.engine.record.adopt(state)
        self.last = state

    @invariant()
    def real_state_refines_the_model(self) -> None:
        wrong = self.engine.mismatches(self.state)
        assert not wrong, wrong

    @invariant()
    def parity_is_the_code_of_the_data(self) -> None:
        wrong = self.engine.parity_exact()
        assert not wrong, wrong

    @invariant()
    def every_checksum_holds(self) -> None:
        eng = self.engine
        for p in eng.procs:
            if p.ropt is None or eng.backend.memory_lost(p.rank):
                continue
            assert p.layout.verify() == [], f"rank {p.rank}: chunks fail their checksums"

    @invariant()
    def recovered_state_is_at_the_target(self) -> None:
        s = self.state
        if s.phase not in (Phase.REBUILDING, Phase.RESUMING):
            return
        for p in self.engine.procs:
            if s.trainer[p.rank] is not TrainerState.ALIVE or p.ropt is None:
                continue
            lay = p.layout
            for c in range(lay.n_chunks):
                assert lay.chunk_status(c) is ChunkStatus.CLEAN
                assert lay.chunk_version(c) == s.target, (p.rank, c, lay.chunk_version(c), s.target)

    def teardown(self) -> None:
        super().teardown()
        for rec in self.engine.recoveries:  # --hypothesis-show-statistics
            event(f"recovered: {rec['kind']}")
        self.engine.record.adopt(self.state)
        finish_training(self.engine)
        diff = same_state(self.engine, reference(self.config))
        assert not diff, f"not bitwise equal to the failure-free run: {diff}"


TestRealCluster = RealCluster.TestCase
TestRealCluster.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class RealClusterTwoByTwo(RealCluster):
    """Two ranks on each node, tier 2 every second step."""

    config = ClusterConfig(topology=Topology((2, 2)), chunks=2, max_step=3, max_faults=3, k=2)


TestRealClusterTwoByTwo = RealClusterTwoByTwo.TestCase
TestRealClusterTwoByTwo.settings = settings(
    max_examples=30,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
