"""The spare pool (issue 20, part 3): warm spare agents take a lost node's place
without anyone starting anything.

An elastic job (``--nnodes 2:3``) of 1 rank per node whose node 0 starts five spare
agents (``--spares 5``) starts with 3 nodes, the first two spares to join being nodes
1 and 2; it loses node 1 and then node 2 (each agent SIGKILLed, its processes with
it, at two different steps); the harness restarts nothing: each place is taken by a
spare from the pool, lowest id first, and the job ends bitwise equal to the
failure-free 3 x 1 run, its trace replayed through the core's model. The fifth spare,
never needed, ends with the job, and SIGKILL of node 0 takes its pooled spares with
it. With ``--max-restarts``, a node lost with no spare restarts the whole job from its
checkpoint. The pieces
(assignment order, the empty pool, a spare that cannot prove the job's secret) are
tested in process.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from jobs import TRAIN, STEPS_2x2, digests_equal, explain, job, left_after
from test_coordinator import Harness

from leto.backends.gloo import auth
from leto.backends.gloo import messages as M
from leto.backends.gloo.agent import Agent, AgentOptions
from leto.backends.gloo.harness import JobResult
from leto.backends.gloo.procs import free_port, processes_with
from leto.backends.gloo.wire import Conn, WireError
from leto.core.recovery import Phase
from leto.core.restart import Restart
from leto.spec.trace import replay

STEPS = 10


def test_two_lost_nodes_are_replaced_from_the_pool_bitwise(session_dir: Path) -> None:
    ref = job(session_dir / "ref-3x1", nnodes=3, nproc=1, steps=STEPS)
    assert ref.ok and ref.digests, explain(ref)
    faults = [
        {"kind": "lose_node", "rank": 1, "step": 5, "phase": "backward"},
        {"kind": "lose_node", "rank": 2, "step": 8, "phase": "prepare"},
    ]
    res = job(
        session_dir / "spares-3x1",
        nnodes=1,  # the harness starts node 0 only: the others are its spares
        nproc=1,
        steps=STEPS,
        faults=faults,
        # slow steps: the spares (importing torch beside three nodes) are in the pool,
        # warm, before the first loss
        env={"STEP_SLEEP": "0.4", "TOPO": "3x1"},
        spares=5,  # two are nodes 1 and 2, two replace them, the fifth ends with the job
        extra=["--nnodes", "2:3", "--spare-timeout", "60"],
        timeout=120.0,
    )
    assert res.ok, explain(res)
    assert res.codes == {0: [0]}, res.codes
    (closed,) = res.of("rendezvous_closed")  # MAX joined: the job starts with 3 nodes
    assert (closed["nodes"], closed["placed"]) == (3, [[0, 1], [1, 2]]), closed
    assert res.of("training_started")[0]["world_size"] == 3
    lost = [f["node"] for f in res.of("failure") if f["kind"] == "node_lost"]
    assert lost == [1, 2], res.of("failure")
    first_loss = res.of("failure")[0]["t_rel"]
    waiting = [e["spare"] for e in res.of("spare_joined") if e["t_rel"] < first_loss]
    assert waiting[:4] == [0, 1, 2, 3], f"the spares were not waiting: {res.of('spare_joined')}"
    assigned = [(e["spare"], e["node"]) for e in res.of("spare_assigned")]
    assert assigned == [(2, 1), (3, 2)], assigned
    joined = [(e["node"], e["spare"]) for e in res.of("node_joined")]
    assert joined == [(0, False), (1, False), (2, False), (1, True), (2, True)], joined
    assert len(res.recoveries) == 2 and all(r["kind"] == "tier2" for r in res.recoveries)
    assert digests_equal(res, ref), "not bitwise equal to the failure-free run"


def test_a_lost_node_with_no_spare_restarts_the_job_from_its_checkpoint_bitwise(
    tag: str, ref_2x2: JobResult
) -> None:
    """--max-restarts 1: node 1's agent dies at step 7 and nothing replaces it within the
    spare timeout; node 0 restarts the job (the same `leto launch`, exec'd), the node
    started again (as a scheduler would) joins the restart, every rank resumes from the
    latest checkpoint (step 6), and the job ends bitwise equal to the failure-free run."""
    env = {"CKPT": str(Path(tag) / "ckpt"), "CKPT_EVERY": "2"}
    faults = [{"kind": "lose_node", "rank": 2, "step": 7, "phase": "backward"}]
    res = job(Path(tag) / "run", nnodes=2, nproc=2, steps=STEPS_2x2, env=env, faults=faults,
              extra=["--spare-timeout", "0.2", "--max-restarts", "1", "--no-shadows"], timeout=120.0)  # fmt: skip
    assert res.ok, explain(res)
    assert len(res.codes[0]) == 1, res.codes  # node 0's launch lived on (exec'd)
    (restart,) = res.of("job_restart")
    assert (restart["attempt"], restart["of"]) == (1, 1), restart
    assert "no replacement joined within 0.2 s" in restart["cause"], restart
    starts = res.of("job_start")
    assert [s.get("restart", 0) for s in starts] == [0, 1], starts
    # a restart is the same job: one id in every record, its logs in the job's folder
    (job_id,) = {e.get("job") for e in res.events}
    assert job_id and (res.run_dir / "logs" / job_id / "node0-trainer0-1-restart1.log").exists()
    assert [e["status"] for e in res.of("job_end")] == ["restarting", "ok"]
    assert [e["start"] for e in res.of("core_init")] == [0, 6]  # from the checkpoint of 6
    assert len(res.of("failure")) == 1  # the fault plan's loss did not fire again
    assert "restarting the job (restart 1) from its checkpoint" in res.text(0)
    assert digests_equal(res, ref_2x2), "not bitwise equal to the failure-free run"


# --- in process: the pool's bookkeeping (the coordinator) and its links (routing) -------


def _assign(c: Any) -> list[tuple[int, int]]:
    """The coordinator's pool assigns its spares to the lost nodes (SparePool.assign)."""
    return list(c.spares.assign(c.nodes_lost_at, c.nodes_up))


def test_lost_nodes_take_the_lowest_spare_ids_in_the_order_they_were_lost() -> None:
    h = Harness(nodes=4, per_node=1)
    h.step(1)
    c = h.c
    assert [c.spares.joined(f"peer{i}") for i in range(3)] == [0, 1, 2]
    c.spares.left(1)  # a pooled spare died: out of the pool
    assert c.spares.ids == [0, 2]
    c.node_down(3, h.now)  # lost first
    c.node_down(2, h.now + 0.1)
    c.node_down(1, h.now + 0.1)  # lost at the same instant as node 2: the lower rank first
    assert _assign(c) == [(0, 3), (2, 1)]
    for n in (3, 1):
        c.node_up(n, spare=True, now=h.now + 1)
    assert c.spares.ids == [] and _assign(c) == []  # node 2 waits: the pool is empty
    assert c.spares.joined("late") == 3  # ids are never reused
    assert _assign(c) == [(3, 2)]
    assigned = [(e["spare"], e["node"]) for e in h.events("spare_assigned")]
    assert assigned == [(0, 3), (2, 1), (3, 2)]
    assert [e["spare"] for e in h.events("spare_left")] == [1]
    assert c.failed is None
    assert replay(enumerate(h.log.records, 1)).divergence is None


def test_a_node_lost_with_the_pool_empty_waits_the_spare_timeout_then_fails() -> None:
    h = Harness(nodes=2, per_node=1, spare_timeout=5.0)
    h.step(1)
    h.c.node_down(1, h.now)
    assert _assign(h.c) == []
    h.c.tick(h.now + 4.0)
    assert h.c.failed is None  # a spare (or a replacement by hand) may still come
    h.c.tick(h.now + 6.0)
    err = h.c.failed
    assert err is not None and "the spare pool was empty" in err and "--node-rank 1" in err
    assert "\n" not in err
    assert h.c.state is not None and h.c.state.phase is Phase.FAILED
    assert _assign(h.c) == []  # the job is over: nobody is assigned
    assert replay(enumerate(h.log.records, 1)).divergence is None


def test_a_spare_that_joins_while_a_node_waits_takes_its_place() -> None:
    h = Harness(nodes=2, per_node=1, spare_timeout=5.0)
    h.step(1)
    h.c.node_down(1, h.now)
    assert h.c.spares.joined("late") == 0
    assert _assign(h.c) == [(0, 1)]
    h.c.node_up(1, spare=True, now=h.now + 2.0)
    h.c.tick(h.now + 6.0)
    assert h.c.failed is None and not h.c.nodes_lost_at


def test_with_max_restarts_a_node_lost_with_the_pool_empty_restarts_the_job() -> None:
    """The spare timeout passes: the core decides a whole-job restart (leto.core.restart),
    every node is told so, and the log says which restart and why; once the restarts
    are spent, the same loss stops the job."""
    h = Harness(nodes=2, per_node=1, spare_timeout=5.0, max_restarts=2, checkpoint=True)
    h.step(1)
    h.c.node_down(1, h.now)
    h.c.outbox.clear()
    h.c.tick(h.now + 6.0)
    assert h.c.restart == Restart(1, 2) and h.c.failed is not None
    assert [(n, m.to_wire()) for n, m in h.c.outbox] == [
        (None, {"t": "fail", "error": h.c.failed, "restart": 1})
    ]
    (rec,) = h.events("job_restart")
    assert (rec["attempt"], rec["of"]) == (1, 2) and "--node-rank 1" in rec["cause"]
    assert h.events("job_failed") == []
    assert replay(enumerate(h.log.records, 1)).divergence is None
    spent = Harness(nodes=2, per_node=1, spare_timeout=5.0, max_restarts=2, restarts=2,
                    checkpoint=True)  # fmt: skip
    spent.step(1)
    spent.c.node_down(1, spent.now)
    spent.c.tick(spent.now + 6.0)
    assert spent.c.restart is None and spent.events("job_restart") == []
    assert [e["error"] for e in spent.events("job_failed")] == [spent.c.failed]


def test_max_restarts_without_a_checkpoint_dir_stops_the_job_at_its_start() -> None:
    h = Harness(nodes=2, per_node=1, max_restarts=1)  # the ranks' config: no checkpoint_dir
    assert h.c.failed is not None and h.c.restart is None and h.c.model is None
    assert "--max-restarts 1" in h.c.failed and "checkpoint_dir" in h.c.failed
    assert h.events("training_started") == []


def test_an_agent_told_of_a_restart_ends_to_start_again_and_a_failure_does_not() -> None:
    for restart in (1, None):
        ag = Agent(AgentOptions(script="x.py", script_args=[], nnodes=2, node_rank=1))
        ag.routing.from_coord(M.Fail(error="gave up", restart=restart))
        assert (ag.restart, ag.failed, ag.stop) == (restart, "gave up", True)


SECRET = b"0123456789abcdef" * 4


def _agent(h: Harness) -> Agent:
    """Node 0's agent around the coordinator ``h.c``: its listener, the secret."""
    ag = Agent(AgentOptions(script="x.py", script_args=[], nnodes=h.c.topology.nodes, quiet=True))
    ag.secret = SECRET
    ag.coord = h.c
    ag.log = h.log
    ag.listener = socket.create_server(("127.0.0.1", 0))
    ag.joined = set(range(h.c.topology.nodes))
    return ag


def _spare(ag: Agent, secret: bytes) -> tuple[Conn, M.Message, str, str]:
    """A spare agent's handshake with ``ag``: its connection, the answer, both nonces."""
    conn = Conn(socket.create_connection(ag.listener.getsockname()), send_timeout=5.0)  # type: ignore[union-attr]
    ag.routing.accept_link()
    link = list(ag.unproven.values())[-1]  # the connection just accepted
    challenge = M.decode(conn.recv(timeout=5)[0])
    assert isinstance(challenge, M.Challenge)
    nonce = auth.new_nonce()
    proof = auth.proof(secret, "spare", auth.POOL, challenge.nonce, nonce)
    conn.send(M.SpareHello(nonce=nonce, proof=proof).to_wire())
    select.select([link.conn], [], [], 5)
    ag.routing.on_link(link)
    return conn, M.decode(conn.recv(timeout=5)[0]), challenge.nonce, nonce


def test_a_spare_proves_the_secret_waits_and_is_assigned_a_bad_one_is_refused() -> None:
    h = Harness(nodes=2, per_node=1)
    h.step(1)
    ag = _agent(h)
    good = bad = None
    try:
        good, pooled, ns, nc = _spare(ag, SECRET)
        assert isinstance(pooled, M.Pooled) and pooled.spare_id == 0
        assert auth.verify(SECRET, "pool", 0, ns, nc, pooled.proof)  # the coordinator's proof
        # a spare without the job's secret: told so in one line, its connection closed
        bad, reject, _, _ = _spare(ag, b"not the job's secret, not at all")
        assert isinstance(reject, M.Reject) and "authentication failed" in reject.why
        assert bad.sock.recv(1) == b""  # closed
        (refused,) = h.events("connection_refused")
        assert "did not prove the job's secret" in refused["why"]
        assert list(ag.pool_links) == [0] and h.c.spares.ids == [0] and h.c.failed is None
        # the job goes on; node 1 is lost: the pooled spare takes its place
        h.step(2)
        h.c.node_down(1, h.now)
        ag.routing.assign_spares(h.now)
        assign = M.decode(good.recv(timeout=5)[0])
        go = M.decode(good.recv(timeout=5)[0])
        assert assign == M.Assign(node=1, gen=h.c.generation, nnodes=2) and go == M.Go(spare=True)
        assert ag.pool_links == {} and 1 in ag.links and 1 in h.c.nodes_up
        assert [(e["spare"], e["node"]) for e in h.events("spare_assigned")] == [(0, 1)]
        assert h.c.failed is None
    finally:
        for c in (good, bad):
            if c is not None:
                c.close()
        for conn in list(ag.links.values()):
            conn.close()
        ag.listener.close()  # type: ignore[union-attr]


def test_sigkill_of_node_0_takes_its_pooled_spares_with_it(tag: str) -> None:
    """Node 0 of a 2-node job waits for node 1 with a spare in its pool; SIGKILLed, it
    takes the spare (and the spare's zygote) with it: no process is left (the ``tag``
    fixture also checks /dev/shm)."""
    run = Path(tag) / "run"
    port = free_port()
    p = subprocess.Popen(
        [sys.executable, "-m", "leto.cli", "launch", "--nnodes", "2", "--node-rank", "0",
         "--spares", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--quiet", "--no-echo",
         "--run-dir", str(run), TRAIN],
        env={**os.environ, "TOPO": "2x1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        log = run / "events.jsonl"
        pooled = False
        while time.monotonic() < deadline and not pooled:
            time.sleep(0.1)
            pooled = log.exists() and '"event":"spare_joined"' in log.read_text()
        assert pooled, "the spare did not join the pool"
        assert len(processes_with(tag)) >= 4  # node 0, its zygote, the spare, its zygote
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert left_after(tag) == []


def _node(ag: Agent, node: int) -> tuple[Conn, list[M.Message]]:
    """Node ``node``'s agent's hello to ``ag``'s coordinator: its connection, and what
    came back (the coordinator's answer, and a Go if one followed)."""
    conn = Conn(socket.create_connection(ag.listener.getsockname()), send_timeout=5.0)  # type: ignore[union-attr]
    ag.routing.accept_link()
    link = list(ag.unproven.values())[-1]
    challenge = M.decode(conn.recv(timeout=5)[0])
    assert isinstance(challenge, M.Challenge)
    nonce = auth.new_nonce()
    proof = auth.proof(SECRET, "node", node, challenge.nonce, nonce)
    conn.send(M.NodeHello(node=node, nonce=nonce, proof=proof).to_wire())
    select.select([link.conn], [], [], 5)
    ag.routing.on_link(link)
    got = []
    while True:
        try:
            got.append(M.decode(conn.recv(timeout=0.3)[0]))
        except (TimeoutError, WireError):  # nothing more, or closed (a refusal)
            return conn, got


def test_a_successor_welcomes_live_nodes_back_then_loses_its_predecessors_node() -> None:
    """Node 1's agent took the coordinator over from node 0's (3 nodes): node 2 rejoins
    as itself (no new processes); node 0, not yet counted lost, is refused until then;
    once every live node is back, node 0 is lost and its replacement joins as one. Node
    2 hears the current tier-2 snapshot again first (its agent may have missed it). A
    node that does not come back within the rejoin deadline is lost too."""
    h = Harness(nodes=3, per_node=1)
    h.step(1)
    ag = _agent(h)
    ag.node, ag.started, ag.joined = 1, True, {1}
    ag.lost_leader, ag.rejoin, ag.rejoin_by = 0, {2}, h.now + 60.0
    h.c.tier2.set(1, dict.fromkeys(range(3)))  # kept by the predecessor: node 2 may not know
    conns = []
    try:
        c, early = _node(ag, 0)  # node 0's replacement, before node 2 is back
        conns.append(c)
        assert isinstance(early[0], M.Reject) and "not yet known lost" in early[0].why, early
        c, back = _node(ag, 2)
        conns.append(c)
        assert [type(m) for m in back][:1] == [M.Welcome] and not back[0].spare, back  # type: ignore[union-attr]
        assert back[1] == M.Tier2(step=1, gen=0), back  # before the recovery's orders
        assert not any(isinstance(m, M.Go) for m in back), back
        (lost,) = [e for e in h.events("failure") if e["kind"] == "node_lost"]
        assert lost["node"] == 0 and ag.lost_leader is None and ag.rejoin == set()
        c, replaced = _node(ag, 0)
        conns.append(c)
        assert isinstance(replaced[0], M.Welcome) and replaced[0].spare, replaced
        assert replaced[-1] == M.Go(spare=True), replaced
        # another take-over where node 2 never comes back: lost with node 0
        h2 = Harness(nodes=3, per_node=1)
        h2.step(1)
        ag2 = _agent(h2)
        ag2.node, ag2.started, ag2.joined = 1, True, {1}
        ag2.lost_leader, ag2.rejoin, ag2.rejoin_by = 0, {2}, h2.now + 60.0
        ag2.control.settle_rejoin(h2.now + 30.0)
        assert not h2.events("failure")  # still waiting for node 2
        ag2.control.settle_rejoin(h2.now + 61.0)
        assert [e["node"] for e in h2.events("failure")] == [2, 0]
        ag2.listener.close()  # type: ignore[union-attr]
    finally:
        for c in conns:
            c.close()
        for conn in list(ag.links.values()):
            conn.close()
        ag.listener.close()  # type: ignore[union-attr]


def test_what_comes_with_a_new_coordinators_answer_is_handled_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pooled spare whose coordinator failed over joins the new one's pool; the new
    coordinator assigns it a lost node's place at once, so its Assign and Go arrive in
    the same read as the answer. They are handled then: the socket has nothing more to
    wake the agent with (the job would wait for this node until its timeout)."""
    ag = Agent(AgentOptions(script="x.py", script_args=[], nnodes=2, quiet=True))
    ag.pooled = True
    old_ours, old_theirs = socket.socketpair()
    old_theirs.close()  # the coordinator's agent is gone
    ag.coord_conn = Conn(old_ours, send_timeout=5.0)
    new_ours, new_theirs = socket.socketpair()
    seen: list[tuple[str, object]] = []

    def repooled() -> None:  # control_plane.repool, its etcd and proofs aside
        theirs = Conn(new_theirs, send_timeout=5.0)
        for m in (
            M.Pooled(spare_id=0, proof="p"),
            M.Assign(node=1, gen=1, nnodes=2, at_start=False),
            M.Go(spare=True),
        ):
            theirs.send(m.to_wire())
        ag.coord_conn = Conn(new_ours, send_timeout=5.0)
        assert isinstance(M.decode(ag.coord_conn.recv(timeout=5)[0]), M.Pooled)

    def take_place(node: int, gen: int, nnodes: int, *, start: bool) -> None:
        seen.append(("assign", node))
        ag.pooled = False

    monkeypatch.setattr(ag.control, "coordinator_lost", repooled)
    monkeypatch.setattr(ag.supervisor, "take_place", take_place)
    monkeypatch.setattr(ag.supervisor, "go", lambda spare: seen.append(("go", spare)))
    try:
        ag.routing.on_coord()
        assert seen == [("assign", 1), ("go", True)], seen
    finally:
        ag.coord_conn.close()
        new_theirs.close()
