"""Shrink instead of stopping, and grow back (issue 43 part 3): an elastic job
(``--nnodes 1:2``, a checkpoint every step) loses a node and no spare comes within the
spare timeout; the core shrinks the world (``leto.core.world.decide``) and the job goes on
with the node left, from its latest checkpoint. A spare that joins later grows it back.
Each run ends bitwise equal to the failure-free run of the same world-size schedule
(2 nodes to step 6, 1 node from step 7, and 2 again from the step the grow resumed at),
made of failure-free jobs resumed at the changes, the way the world changed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from jobs import digests_equal, explain, job
from test_coordinator import Harness

from leto.adapters.config import Config, ConfigError
from leto.backends.gloo.harness import JobResult
from leto.core.recovery import Phase
from leto.core.restart import Restart
from leto.spec.trace import replay

STEPS = 10
LOSS = [{"kind": "lose_node", "rank": 1, "step": 7, "phase": "backward"}]
ELASTIC = ["--nnodes", "1:2", "--spare-timeout", "0.5", "--no-shadows"]


def _env(tag: str, name: str) -> dict[str, str]:
    return {"CKPT": str(Path(tag) / name), "CKPT_EVERY": "1", "TOPO": "auto"}


def _schedule(tag: str, worlds: list[tuple[int, int]], steps: int) -> JobResult:
    """The failure-free run of a world-size schedule: ``(nodes, from step)`` in turn (the
    first from step 0), each world a job resumed from the previous one's checkpoint of
    the step the next world starts from."""
    env = _env(tag, "ref-ckpt")
    ends = [start for _, start in worlds[1:]] + [steps]
    res: JobResult | None = None
    for i, ((nodes, _), until) in enumerate(zip(worlds, ends, strict=True)):
        resume = ["--resume", env["CKPT"]] if i else []
        res = job(Path(tag) / f"ref-{i}", nnodes=nodes, nproc=1, steps=until, env=env, extra=resume)
        assert res.ok, explain(res)
    assert res is not None
    return res


POLICIES = {
    "split": {},  # batch_parts = 0: the global batch split over the ranks there are
    "accumulate": {"BATCH_PARTS": "2", "KEEP_GLOBAL": "1"},  # rank 0 alone: parts 0, 1
    "per_rank": {"BATCH_PARTS": "2"},  # rank 0 alone: part 0, part 1 skipped
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_lost_node_with_no_spare_shrinks_the_world_bitwise(tag: str, policy: str) -> None:
    """Each global-batch policy (docs/gloo.md, "The data order and the global batch"):
    bitwise its own failure-free run of the schedule, and not the fixed world's."""
    os.environ.update(POLICIES[policy])  # the jobs' environment (the harness passes it on)
    try:
        _shrinks_bitwise(tag)
    finally:
        for k in POLICIES[policy]:
            del os.environ[k]


def _shrinks_bitwise(tag: str) -> None:
    res = job(Path(tag) / "shrink", nnodes=1, nproc=1, steps=STEPS, env=_env(tag, "ckpt"),
              faults=LOSS, respawn=False, spare_agents=1, timeout=150.0, extra=ELASTIC)  # fmt: skip
    assert res.ok, explain(res)
    assert [e["nodes"] for e in res.of("rendezvous_closed")] == [2, 1]
    (shrink,) = res.of("world_shrink")
    assert (shrink["nodes"], shrink["lost"], shrink["was"]) == (1, [1], 2), shrink
    (restart,) = res.of("job_restart")
    assert restart["nodes"] == 1 and "goes on with 1 of 2 nodes" in restart["cause"], restart
    assert [e["start"] for e in res.of("core_init")] == [0, 6]  # from the checkpoint of 6
    assert [e["status"] for e in res.of("job_end")] == ["restarting", "ok"]
    ref = _schedule(tag, [(2, 0), (1, 6)], STEPS)
    assert digests_equal(res, ref), f"not bitwise the 2-then-1 run: {res.digests} {ref.digests}"
    fixed = job(Path(tag) / "fixed", nnodes=2, nproc=1, steps=STEPS, env=_env(tag, "fixed-ckpt"))
    assert not digests_equal(res, fixed), "the schedule made no difference: the check is vacuous"


def test_a_spare_that_joins_a_shrunk_world_grows_it_back_bitwise(tag: str) -> None:
    """The same loss; once the world shrank, a spare agent is started (as a scheduler
    would): it joins the pool, the core grows the world back to 2 nodes."""
    steps = 40

    def shrunk(run: Path) -> bool:
        log = run / "events.jsonl"
        return log.exists() and '"world_shrink"' in log.read_text()

    env = {**_env(tag, "ckpt"), "STEP_SLEEP": "0.3"}
    res = job(Path(tag) / "grow", nnodes=1, nproc=1, steps=steps, env=env, faults=LOSS,
              respawn=False, spare_agents=1, timeout=200.0, extra=ELASTIC, late_spare=shrunk)  # fmt: skip
    assert res.ok, explain(res)
    assert res.codes[-2] == [0], res.codes  # the late spare: node 1 of the grown world
    assert [e["nodes"] for e in res.of("rendezvous_closed")] == [2, 1, 2]
    (grow,) = res.of("world_grow")
    assert (grow["nodes"], grow["was"]) == (2, 1), grow
    assert [r.get("nodes") for r in res.of("job_restart")] == [1, 2]
    starts = [e["start"] for e in res.of("core_init")]
    assert starts[:2] == [0, 6] and 6 <= starts[2] < steps, starts
    ref = _schedule(tag, [(2, 0), (1, 6), (2, starts[2])], steps)
    assert digests_equal(res, ref), f"not bitwise the 2-1-2 run: {res.digests} {ref.digests}"


# --- in process: the coordinator's decisions (leto.core.world through Coordinator) ----


def _lose_one(nodes: int, lo: int, hi: int, **opts: object) -> Harness:
    h = Harness(nodes=nodes, per_node=1, spare_timeout=5.0, nodes_range=(lo, hi), **opts)
    h.step(1)
    h.c.node_down(nodes - 1, h.now)
    h.c.outbox.clear()
    h.c.tick(h.now + 4.0)
    assert h.c.failed is None  # a spare may still come
    h.c.tick(h.now + 6.0)
    return h


def test_the_spare_timeout_shrinks_a_world_above_min_and_tells_every_node() -> None:
    h = _lose_one(3, 2, 3, checkpoint=True)
    assert h.c.restart == Restart(1, 1, 2), h.c.restart  # needs no --max-restarts
    (shrink,) = h.events("world_shrink")
    assert (shrink["nodes"], shrink["lost"], shrink["was"]) == (2, [2], 3)
    fail = [m.to_wire() for n, m in h.c.outbox if n is None and m.to_wire()["t"] == "fail"]
    assert fail and (fail[0]["restart"], fail[0]["nodes"]) == (1, 2), fail
    assert h.c.state is not None and h.c.state.phase is Phase.FAILED  # the core's GiveUp
    assert replay(enumerate(h.log.records, 1)).divergence is None


def test_below_min_without_a_checkpoint_or_with_sharded_state_the_job_stops_in_one_line() -> None:
    for opts, why in [
        ({"lo": 2, "checkpoint": True}, "1 node(s) left, fewer than --nnodes 2:3 allows"),
        ({"lo": 1, "checkpoint": False}, "shrinks only a job with a checkpoint_dir"),
    ]:
        lo = opts.pop("lo")
        h = _lose_one(2, lo, 3, **opts)
        err = h.c.failed
        assert err is not None and why in err and "\n" not in err, err
        assert h.c.restart is None and not h.events("world_shrink")
    h = Harness(nodes=2, per_node=1, spare_timeout=5.0, nodes_range=(1, 2), checkpoint=True)
    h.c.info["shard"] = True  # as the ranks' ready messages say with shard = true
    h.step(1)
    h.c.node_down(1, h.now)
    h.c.tick(h.now + 6.0)
    assert h.c.restart is None and h.c.failed is not None
    assert "--nnodes 1:2 does not shrink sharded state (shard = true)" in h.c.failed
    fixed = _lose_one(2, 0, 0, checkpoint=True)  # no --nnodes MIN:MAX: as before
    assert fixed.c.failed is not None and "--nnodes" not in fixed.c.failed


def test_a_spare_joining_a_world_below_max_grows_it_between_steps() -> None:
    h = Harness(nodes=2, per_node=1, nodes_range=(1, 3), checkpoint=True)
    h.step(1)
    h.c.tick(h.now + 1.0)
    assert h.c.failed is None  # nobody in the pool: nothing to grow
    h.c.spares.joined("late")
    h.c.tick(h.now + 2.0)
    assert h.c.restart == Restart(1, 1, 3)
    (grow,) = h.events("world_grow")
    assert (grow["nodes"], grow["spare"], grow["was"]) == (2 + 1, 0, 2)
    full = Harness(nodes=3, per_node=1, nodes_range=(1, 3), checkpoint=True)
    full.step(1)
    full.c.spares.joined("late")
    full.c.tick(full.now + 2.0)
    assert full.c.failed is None and full.c.restart is None  # at MAX: the spare waits


def test_the_global_batch_policy_is_validated_in_one_line() -> None:
    gloo = {"backend": "gloo", "topology": "2x1"}
    cfg = Config.from_dict({**gloo, "batch_parts": 2, "keep_global_batch": True})
    assert (cfg.batch_parts, cfg.keep_global_batch) == (2, True)
    for settings, why in [
        ({"batch_parts": 2}, "runs on the gloo backend only, not 'fake'"),
        ({**gloo, "keep_global_batch": True}, "needs batch_parts"),
        ({**gloo, "batch_parts": 2, "shard": True}, "does not change its world"),
        ({**gloo, "batch_parts": -1}, "batch_parts"),
    ]:
        with pytest.raises(ConfigError, match=why) as e:
            Config.from_dict(settings)
        assert "\n" not in str(e.value)
