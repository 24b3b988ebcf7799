"""Shrink instead of stopping, and grow back, in place (issue 43 part 3): an elastic job
(``--nnodes 1:2`` or ``2:3``) loses a node (its last, or a middle one) and no spare
comes within the spare timeout; the core shrinks the world (``leto.core.world.decide``)
and the surviving trainers go on in place (``leto.core.reshape``: no process restarted,
nothing read from disk, the step in flight the one step trained again; a node after the
lost one renumbered, its rank 2 becoming rank 1). A spare that joins later grows it back
in place (the 3-node test), its state copied from rank 0. Each run ends bitwise equal to
the failure-free run of the same world-size schedule (e.g. 2 nodes to step 6, 1 node
from step 7, and 2 again from the step the grow happened at), made of failure-free jobs
resumed from a checkpoint at the changes (the checkpoints serve only the references).
A lost node 0 (a coordinator elected elsewhere) still shrinks by a restart from the
checkpoint (in process below)."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from etcd import EtcdCluster
from jobs import digests_equal, explain, job
from test_coordinator import Harness, ready

from leto.adapters.config import Config, ConfigError
from leto.backends.gloo.harness import JobResult
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


@pytest.mark.parametrize(
    "policy",
    # split, the default, is also the 3-node test's and the middle node's: CI runs accumulate
    [
        pytest.param(p, marks=[] if p == "accumulate" else pytest.mark.soak)
        for p in sorted(POLICIES)
    ],
)
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
    _in_place(res, was=2, left=1, step=6)
    ref = _schedule(tag, [(2, 0), (1, 6)], STEPS)
    assert digests_equal(res, ref), f"not bitwise the 2-then-1 run: {res.digests} {ref.digests}"
    fixed = job(Path(tag) / "fixed", nnodes=2, nproc=1, steps=STEPS, env=_env(tag, "fixed-ckpt"))
    assert not digests_equal(res, fixed), "the schedule made no difference: the check is vacuous"


def test_a_sharded_job_losing_its_last_node_reshards_in_place_bitwise(tag: str) -> None:
    """``shard = true`` on 2 nodes x 1 rank, node 1 lost in step 8 (step 7 committed, the
    tier-2 snapshot of step 6): the survivor goes back to the snapshot's step, gathers
    node 1's shard from its share of the tier-2 code, and reshards in place to one rank
    holding everything. Sharded training on 2 ranks is bitwise pure data parallelism
    (and on 1, the whole state), so the reference is the unsharded 2-then-1 run from the
    step the shrink resumed at."""
    at = 8  # 7 (the snapshot's step committed last) passes too: 8 also rolls one back
    os.environ["SHARD"] = "1"
    try:
        res = job(Path(tag) / "shrink", nnodes=1, nproc=1, steps=STEPS, env=_env(tag, "ckpt"),
                  faults=[{**LOSS[0], "step": at}], respawn=False, spare_agents=1, timeout=150.0,
                  extra=ELASTIC)  # fmt: skip
    finally:
        del os.environ["SHARD"]
    assert res.ok, explain(res)
    (shrink,) = res.of("world_shrink")
    step = shrink["step"]
    assert step == 6, shrink  # the tier-2 snapshot's (every 2 steps), not the committed 7
    _in_place(res, was=2, left=1, step=step, committed=at - 1)
    old, new = (e["chunks"] for e in res.of("core_init"))
    assert new > old, (old, new)  # resharded: one rank holds what two did
    ref = _schedule(tag, [(2, 0), (1, step)], STEPS)
    assert digests_equal(res, ref), f"not bitwise the 2-then-1 run: {res.digests} {ref.digests}"
    fixed = job(Path(tag) / "fixed", nnodes=2, nproc=1, steps=STEPS, env=_env(tag, "fixed-ckpt"))
    assert not digests_equal(res, fixed), "the schedule made no difference: the check is vacuous"


def _in_place(
    res: JobResult, *, was: int, left: int, step: int, grown: bool = False, committed: int = -1
) -> None:
    """The shrink was carried out in place: one rendezvous, no restart, nothing loaded
    from disk, the surviving trainers' processes those that started, every survivor
    rolled to the committed ``step`` (the step in flight, never committed, is the one
    step trained again; ``committed``: sharded, the step committed last, after the
    tier-2 snapshot's ``step`` every survivor went back to)."""
    assert [e["nodes"] for e in res.of("rendezvous_closed")] == [was]
    (shrink,) = res.of("world_shrink")
    assert shrink["in_place"] and (shrink["nodes"], shrink["was"], shrink["step"]) == (
        left,
        was,
        step,
    )
    assert not res.of("job_restart") and [e["status"] for e in res.of("job_end")] == ["ok"]
    starts = [e["start"] for e in res.of("core_init")]
    assert starts[:2] == [0, step] and len(starts) == 2 + grown  # the new worlds' models
    inits = res.of("core_init")  # the new worlds' models: in place (generation, old ckpt)
    assert all(e["gen"] > 0 and e["ckpt"] <= e["start"] for e in inits[1:]), inits
    started = [e for e in res.of("process_started") if e["role"] == "trainer"]
    kept = [(e["rank"], e["pid"]) for e in started if e["rank"] < len(shrink["ranks"])]
    assert len(dict(kept)) == len(kept) == len(shrink["ranks"]), f"a trainer restarted: {kept}"
    (fault,) = res.of("failure")[:1]
    # the step in flight (committed + 1) is the one trained again; sharded, every step
    # after the tier-2 snapshot's too
    assert fault["step"] == (step if committed < 0 else committed)


def test_a_3_node_job_shrinks_to_2_in_place_and_grows_back_to_3_bitwise(tag: str) -> None:
    """3 nodes (``--nnodes 2:3``): node 2 lost at step 7 with no spare: the job goes on
    with nodes 0 and 1 in place (tier 2 re-encoded over the two); a spare started once
    it shrank joins as node 2 in place, its rank's state copied from rank 0. Bitwise
    the failure-free 3-2-3 run."""
    steps = 40  # long enough for the late spare's start (seconds on a loaded machine)

    def shrunk(run: Path) -> bool:
        log = run / "events.jsonl"
        return log.exists() and '"world_shrink"' in log.read_text()

    loss = [{**LOSS[0], "rank": 2}]
    env = {**_env(tag, "ckpt"), "STEP_SLEEP": "0.3"}
    extra = ["--nnodes", "2:3", *ELASTIC[2:]]
    res = job(Path(tag) / "grow3", nnodes=1, nproc=1, steps=steps, env=env, faults=loss,
              respawn=False, spare_agents=2, timeout=200.0, extra=extra, late_spare=shrunk)  # fmt: skip
    assert res.ok, explain(res)
    assert res.of("world_grow"), "the late spare joined after training ended: nothing grew"
    _in_place(res, was=3, left=2, step=6, grown=True)
    (grow,) = res.of("world_grow")
    assert grow["in_place"] and (grow["nodes"], grow["was"]) == (3, 2), grow
    starts = [e["start"] for e in res.of("core_init")]
    assert grow["step"] == starts[2] and 6 <= starts[2] < steps, (grow, starts)
    ref = _schedule(tag, [(3, 0), (2, 6), (3, starts[2])], steps)
    assert digests_equal(res, ref), f"not bitwise the 3-2-3 run: {res.digests} {ref.digests}"


def test_a_lost_middle_node_shrinks_in_place_its_successors_renumbered_bitwise(tag: str) -> None:
    """3 nodes (``--nnodes 2:3``, with shadows), node 1 (the middle one) lost at step 7
    with no spare: node 2 becomes node 1 and its rank 2 rank 1, in place (its trainer's
    process kept, its part of the global batch now rank 1's). That trainer then crashes
    in step 9: its shadow, started as rank 2's, is promoted as rank 1. Bitwise the
    failure-free 3-then-2 run, and not the fixed 3-node run."""
    extra = ["--nnodes", "2:3", *ELASTIC[2:4]]  # shadows on
    crash = {"kind": "crash", "rank": 2, "step": 9, "phase": "forward"}  # old rank 2's
    res = job(Path(tag) / "middle", nnodes=1, nproc=1, steps=STEPS, env=_env(tag, "ckpt"),
              faults=[{**LOSS[0], "rank": 1}, crash], respawn=False, spare_agents=2,
              timeout=150.0, extra=extra)  # fmt: skip
    assert res.ok, explain(res)
    (shrink,) = res.of("world_shrink")
    assert (shrink["lost"], shrink["ranks"], shrink["renumbered"]) == ([1], [0, 2], {"2": 1})
    _in_place(res, was=3, left=2, step=6)
    started = [(e["rank"], e["pid"]) for e in res.of("process_started") if e["role"] == "trainer"]
    assert sorted(r for r, _ in started) == [0, 1, 2], f"a trainer (re)started: {started}"
    crashed = [f for f in res.of("failure") if f["t"] > shrink["t"]]
    assert [(f["rank"], f["step"]) for f in crashed] == [(1, 8)], crashed  # as rank 1
    promoted = [(p["rank"], p["warm"]) for r in res.recoveries for p in r["promoted"]]
    assert promoted == [(1, True)], res.recoveries  # the shadow warmed as rank 2's
    _bitwise_3_then_2(tag, res)


def _bitwise_3_then_2(tag: str, res: JobResult) -> None:
    """``res`` is bitwise the failure-free run of 3 nodes to step 6, then 2, and not the
    fixed 3-node run. One job less than :func:`_schedule`: the fixed 3-node run's only
    checkpoint (but its start's) is step 6's, which the 2-node part resumes from."""
    env = {**_env(tag, "ref-ckpt"), "CKPT_EVERY": "6"}
    fixed = job(Path(tag) / "fixed3", nnodes=3, nproc=1, steps=STEPS, env=env)
    assert fixed.ok, explain(fixed)
    ref = job(Path(tag) / "ref-2", nnodes=2, nproc=1, steps=STEPS, env=env,
              extra=["--resume", env["CKPT"]])  # fmt: skip
    assert ref.ok and [e["start"] for e in ref.of("core_init")] == [6], explain(ref)
    assert digests_equal(res, ref), f"not bitwise the 3-then-2 run: {res.digests} {ref.digests}"
    assert not digests_equal(res, fixed), "the schedule made no difference: the check is vacuous"


def test_node_0_lost_with_etcd_shrinks_in_place_every_node_renumbered(
    tag: str, etcd_cluster: EtcdCluster
) -> None:
    """3 nodes (``--nnodes 2:3``, ``--rdzv-backend etcd``), node 0 lost at step 7 with
    its agent, the coordinator's: node 1's agent takes the coordinator over (etcd), and
    with no spare the world shrinks in place, nodes 1 and 2 renumbered 0 and 1 (the
    coordinator's node too: etcd's record of it says so). Bitwise the 3-then-2 run."""
    rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_cluster.endpoint_flag]
    res = job(Path(tag) / "node0", nnodes=1, nproc=1, steps=STEPS, env=_env(tag, "ckpt"),
              faults=[{**LOSS[0], "rank": 0}], respawn=False, spare_agents=2, timeout=150.0,
              rdzv=[*rdzv, "--rdzv-id", "lose-node-0"], extra=["--nnodes", "2:3", *ELASTIC[2:]])  # fmt: skip
    assert res.of("job_end")[-1]["status"] == "ok", explain(res)
    assert len(res.of("coordinator_took_over")) == 1, explain(res)
    (shrink,) = res.of("world_shrink")
    assert shrink["in_place"] and (shrink["lost"], shrink["ranks"]) == ([0], [1, 2]), shrink
    assert shrink["renumbered"] == {"1": 0, "2": 1}, shrink
    assert not res.of("job_restart")
    started = [e["rank"] for e in res.of("process_started") if e["role"] == "trainer"]
    assert sorted(started) == [0, 1, 2], f"a trainer (re)started: {started}"
    _bitwise_3_then_2(tag, res)


def test_node_0_lost_without_etcd_ends_the_elastic_job_in_one_line_saying_why(tag: str) -> None:
    """Node 0's agent runs the coordinator: without etcd nothing takes its place, so the
    elastic job cannot shrink; node 1's agent ends in one line that says so."""
    res = job(Path(tag) / "node0", nnodes=1, nproc=1, steps=STEPS, env=_env(tag, "ckpt"),
              faults=[{**LOSS[0], "rank": 0}], respawn=False, spare_agents=1, timeout=60.0,
              extra=ELASTIC)  # fmt: skip
    assert not res.ok and not res.of("world_shrink"), explain(res)
    lines = [ln for ln in res.text(-1).splitlines() if "lost the coordinator" in ln]
    assert len(lines) == 1 and "without --rdzv-backend etcd no other agent" in lines[0], lines


# --- in process: the coordinator's decisions (leto.core.world through Coordinator) ----


def _lose_one(nodes: int, lo: int, hi: int, node: int = -1, **opts: object) -> Harness:
    h = Harness(nodes=nodes, per_node=1, spare_timeout=5.0, nodes_range=(lo, hi), **opts)
    h.step(1)
    h.c.node_down(node % nodes, h.now)
    h.c.outbox.clear()
    h.c.tick(h.now + 4.0)
    assert h.c.failed is None  # a spare may still come
    h.c.tick(h.now + 6.0)
    return h


def test_the_spare_timeout_shrinks_a_world_above_min_in_place_and_tells_every_node() -> None:
    for ckpt in (True, False):  # in place: no checkpoint needed
        h = _lose_one(3, 2, 3, checkpoint=ckpt)
        assert h.c.failed is None and h.c.restart is None, h.c.failed
        (shrink,) = h.events("world_shrink")
        assert (shrink["nodes"], shrink["lost"], shrink["was"]) == (2, [2], 3)
        assert shrink["in_place"] and (shrink["step"], shrink["ranks"]) == (1, [0, 1]), shrink
        sent = [m.to_wire() for n, m in h.c.outbox if n is None]
        gen = shrink["generation"]
        assert [m["t"] for m in sent] == ["fence", "reshape"], sent
        want = {"t": "reshape", "gen": gen, "step": 1, "nodes": 2, "grow": False, "lost_nodes": [2]}
        assert sent[1] == want, sent
        assert sent[0]["gen"] == gen and (h.c.W, h.c.topology.nodes, h.c.model) == (2, 2, None)
        for r in range(2):  # the survivors say ready again: the new world's model
            h.send(0, ready(r, gen=gen, start=1, checkpoint=ckpt))
        s = h.c.state
        assert s is not None and (s.gen, s.committed, s.step, s.ckpt) == (
            gen,
            1,
            (1, 1),
            0 if ckpt else 0,
        )
        assert [e["start"] for e in h.events("core_init")] == [0, 1]
        assert replay(enumerate(h.log.records, 1)).divergence is None


def test_a_middle_node_or_node_0_lost_shrinks_in_place_renumbering_below_min_one_line() -> None:
    h = Harness(nodes=3, per_node=2, spare_timeout=5.0, nodes_range=(2, 3))
    h.step(1)
    h.c.driver.pids.update({r: 100 + r for r in range(6)})
    h.c.degraded[5] = "no skeleton"
    h.c.node_down(1, h.now)
    h.c.outbox.clear()
    h.c.tick(h.now + 6.0)  # no checkpoint needed: in place
    assert h.c.failed is None and h.c.restart is None, h.c.failed
    (shrink,) = h.events("world_shrink")
    assert (shrink["nodes"], shrink["lost"], shrink["was"], shrink["in_place"]) == (2, [1], 3, True)
    assert (shrink["ranks"], shrink["renumbered"]) == ([0, 1, 4, 5], {"2": 1}), shrink
    gen = shrink["generation"]
    sent = [m.to_wire() for n, m in h.c.outbox if n is None]
    assert sent[1] == {
        "t": "reshape",
        "gen": gen,
        "step": 1,
        "nodes": 2,
        "grow": False,
        "lost_nodes": [1],
    }
    # what the coordinator keeps by node or rank follows node 2 to its new number
    assert (h.c.nodes_up, h.c.topology.nodes, h.c.W) == ({0, 1}, 2, 4)
    assert h.c.driver.pids == {0: 100, 1: 101, 2: 104, 3: 105} and h.c.degraded == {
        3: "no skeleton"
    }
    for r in range(4):  # the survivors, renumbered, say ready again: the new world's model
        h.send(r // 2, ready(r, gen=gen, start=1))
    s = h.c.state
    assert s is not None and (s.gen, s.committed, s.step) == (gen, 1, (1, 1, 1, 1))
    assert replay(enumerate(h.log.records, 1)).divergence is None
    h = _lose_one(3, 2, 3, node=0)  # node 0 (the coordinator elected elsewhere, etcd)
    assert h.c.failed is None and h.c.restart is None, h.c.failed
    (shrink,) = h.events("world_shrink")
    assert (shrink["lost"], shrink["ranks"], shrink["renumbered"]) == (
        [0],
        [1, 2],
        {"1": 0, "2": 1},
    )
    assert h.c.nodes_up == {0, 1} and h.c.W == 2
    for r in range(2):
        h.send(r, ready(r, gen=shrink["generation"], start=1))
    assert h.c.state is not None and h.c.state.committed == 1
    assert replay(enumerate(h.log.records, 1)).divergence is None
    h = _lose_one(2, 2, 3, checkpoint=True)
    err = h.c.failed
    assert err is not None and "1 node(s) left, fewer than --nnodes 2:3" in err, err
    assert "\n" not in err and h.c.restart is None and not h.events("world_shrink")
    # sharded state (shard = true): from 2 nodes to 1, node 1 lost, resharded at the
    # tier-2 snapshot's step (every rank's record of it sent with the change); else refused
    for nodes, lost in [(2, 1), (3, 2), (2, 0)]:
        h = Harness(nodes=nodes, per_node=1, spare_timeout=5.0, nodes_range=(1, 3), checkpoint=True)
        h.c.info["shard"] = True  # as the ranks' ready messages say with shard = true
        h.step(1)
        h.c.node_down(lost, h.now)
        h.c.outbox.clear()
        h.c.tick(h.now + 6.0)
        if (nodes, lost) != (2, 1):
            assert h.c.restart is None and h.c.failed is not None, (nodes, lost)
            assert (
                "--nnodes 1:3 shrinks sharded state (shard = true) only from 2 nodes to 1, its node 1 lost"
                in h.c.failed
            )
            continue
        assert h.c.failed is None, h.c.failed
        (shrink,) = h.events("world_shrink")
        sent = [m.to_wire() for n, m in h.c.outbox if n is None]
        assert [m["t"] for m in sent] == ["fence", "reshape"], sent
        assert sent[1]["snapshot"]["step"] == shrink["step"] == h.c.tier2.step, (sent, shrink)
        assert sorted(sent[1]["snapshot"]["meta"]) == ["0", "1"]
    fixed = _lose_one(2, 0, 0, checkpoint=True)  # no --nnodes MIN:MAX: as before
    assert fixed.c.failed is not None and "--nnodes" not in fixed.c.failed


def test_a_spare_joining_a_world_below_max_grows_it_in_place_between_steps() -> None:
    h = Harness(nodes=2, per_node=1, nodes_range=(1, 3), checkpoint=True)
    h.step(1)
    h.c.tick(h.now + 1.0)
    assert h.c.failed is None  # nobody in the pool: nothing to grow
    h.c.spares.joined("late")
    h.c.tick(h.now + 2.0)
    assert h.c.failed is None and h.c.restart is None  # in place
    (grow,) = h.events("world_grow")
    assert (grow["nodes"], grow["spare"], grow["was"], grow["step"]) == (2 + 1, 0, 2, 1)
    gen = grow["generation"]
    out = [(n, m.to_wire()) for n, m in h.c.outbox]
    assert out == [(None, {"t": "abort", "gen": gen - 1})], out  # the old world's step stops
    assert (h.c.W, h.c.model, dict(h.c.growing)) == (3, None, {"node": 2, "step": 1, "gen": gen})
    assert h.c.spares.assign(h.c.nodes_lost_at, h.c.nodes_up) == [(0, 2)]  # the pool's
    h.c.outbox.clear()
    h.c.node_up(2, spare=True, now=h.now)
    promote, h.c.outbox = [(n, m.to_wire()) for n, m in h.c.outbox], []
    assert promote == [(2, {"t": "promote_rank", "rank": 2, "gen": gen, "warm": False})]
    out = h.send(2, {"t": "promoted", "rank": 2, "gen": gen})
    assert [m for _, m in out] == [
        {"t": "fence", "gen": gen, "kill": []},
        {"t": "reshape", "gen": gen, "step": 1, "nodes": 3, "grow": True, "lost_nodes": []},
    ], out
    for r in range(3):
        h.send(r, ready(r, gen=gen, start=1, checkpoint=True))
    s = h.c.state
    assert s is not None and (s.gen, s.step, h.c.growing) == (gen, (1, 1, 1), {})
    assert replay(enumerate(h.log.records, 1)).divergence is None
    late = Harness(nodes=2, per_node=1, nodes_range=(1, 3), checkpoint=True, spare_timeout=5.0)
    late.step(1)
    late.c.spares.joined("late")
    late.c.tick(late.now + 1.0)  # the grow begins; its spare never starts its trainers
    late.c.tick(late.now + 5.5)
    assert late.c.failed is None
    late.c.tick(late.now + 6.5)
    err = late.c.failed
    assert err is not None and "did not start its trainers within 5 s" in err and "\n" not in err
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


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.soak)])
def test_a_kill_at_a_random_instant_of_the_shrink_ends_bitwise_or_in_one_line(
    tag: str, seed: int
) -> None:
    """The surviving trainer SIGKILLed at a random instant (0..0.4 s, seeded) after the
    core decided the shrink: while it rolls, forms the new world or re-encodes, or once
    the new world trains. The job never hangs: a death before the new world's model
    starts ends the shrunk job in one line, which ``--max-restarts 1`` restarts from the
    latest checkpoint on the nodes left; a death after it is recovered as any crash, by
    the rank's shadow (started for the 2-node world: promoted into the 1-node one).
    Either way, bitwise the 2-then-1 run."""
    run = Path(tag) / "kill"
    delay = random.Random(seed).uniform(0.0, 0.4)
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(job(
        run, nnodes=1, nproc=1, steps=STEPS, env={**_env(tag, "ckpt"), "STEP_SLEEP": "0.1"},
        faults=LOSS, respawn=False, spare_agents=1, timeout=150.0,
        extra=[*ELASTIC[:4], "--max-restarts", "1"],  # with shadows: one warmed for 2 nodes
    )), daemon=True)  # fmt: skip
    t.start()
    log, killed = run / "events.jsonl", None
    while t.is_alive() and killed is None:
        text = log.read_text() if log.exists() else ""
        if '"world_shrink"' in text:
            time.sleep(delay)
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
            killed = next(
                e["pid"] for e in reversed(records)
                if e["event"] == "process_started" and e["role"] == "trainer" and e.get("rank") == 0
            )  # fmt: skip
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.005)
    t.join()
    (res,) = box
    assert killed is not None, "the shrink was never decided"
    assert res.ok, explain(res)
    (shrink,) = res.of("world_shrink")[:1]
    assert shrink["in_place"], shrink
    t_shrink = shrink["t"]
    died = [f for f in res.of("failure") if f["t"] > t_shrink and f.get("rank") == 0]
    died += [r for r in res.of("job_restart") if "world changed in place" in r["cause"]]
    assert died, f"the kill of {killed} was not seen"
    ref = _schedule(tag, [(2, 0), (1, 6)], STEPS)
    assert digests_equal(res, ref), f"not bitwise the 2-then-1 run: {res.digests} {ref.digests}"
