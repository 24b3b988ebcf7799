"""The spare pool (issue 20, part 3): warm spare agents take a lost node's place
without anyone starting anything.

A job of 3 nodes x 1 rank whose node 0 starts two spare agents (``--spares 2``)
loses node 1 and then node 2 (each agent SIGKILLed, its processes with it, at two
different steps); the harness restarts nothing: each place is taken by a spare from
the pool, lowest id first, and the job ends bitwise equal to the failure-free run,
its trace replayed through the core's model. The pieces (assignment order, the empty
pool, a spare that cannot prove the job's secret) are tested in process below.
"""

from __future__ import annotations

from pathlib import Path

from jobs import digests_equal, explain, job

STEPS = 9


def test_two_lost_nodes_are_replaced_from_the_pool_bitwise(session_dir: Path) -> None:
    ref = job(session_dir / "ref-3x1", nnodes=3, nproc=1, steps=STEPS)
    assert ref.ok and ref.digests, explain(ref)
    faults = [
        {"kind": "lose_node", "rank": 1, "step": 4, "phase": "backward"},
        {"kind": "lose_node", "rank": 2, "step": 7, "phase": "prepare"},
    ]
    res = job(
        session_dir / "spares-3x1",
        nnodes=3,
        nproc=1,
        steps=STEPS,
        faults=faults,
        # slow steps: the spares (importing torch beside three nodes) are in the pool,
        # warm, before the first loss
        env={"STEP_SLEEP": "0.4"},
        spares=2,
        extra=["--spare-timeout", "60"],
        respawn=False,  # nobody restarts a lost node: the pool does
        timeout=120.0,
    )
    assert res.ok, explain(res)
    assert [len(res.codes[n]) for n in (1, 2)] == [1, 1], res.codes  # no agent restarted
    lost = [f["node"] for f in res.of("failure") if f["kind"] == "node_lost"]
    assert lost == [1, 2], res.of("failure")
    pooled = res.of("spare_joined")
    assert sorted(e["spare"] for e in pooled) == [0, 1], pooled
    first_loss = res.of("failure")[0]["t_rel"]
    assert all(e["t_rel"] < first_loss for e in pooled), "the spares were not waiting"
    assigned = [(e["spare"], e["node"]) for e in res.of("spare_assigned")]
    assert assigned == [(0, 1), (1, 2)], assigned
    joined = [(e["node"], e["spare"]) for e in res.of("node_joined")]
    assert joined[-2:] == [(1, True), (2, True)], joined
    assert len(res.recoveries) == 2 and all(r["kind"] == "tier2" for r in res.recoveries)
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"
