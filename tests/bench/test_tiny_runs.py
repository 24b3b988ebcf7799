"""Tiny real runs: the benchmarks start real jobs, measure, and leave nothing behind.

Not timed tests: they check structure (every system, every phase, the ratio, the
JSON that ``leto simulate --bench`` reads), not how fast anything is.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import uuid
from pathlib import Path

import pytest

from leto.bench.timeline import PHASES
from leto.bench.workload import Workload

TINY = Workload.for_params(20_000, world=2, batch=8)


def _marked_processes(mark: bytes) -> list[int]:
    """Processes whose environment carries ``mark`` (inherited from this test)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{d}/environ").read_bytes()
        except OSError:
            continue
        if mark in env.split(b"\0"):
            out.append(int(d))
    return out


@pytest.fixture(autouse=True)
def _nothing_left_behind(monkeypatch: pytest.MonkeyPatch) -> object:
    # every process a test starts inherits this variable, so a leftover is found
    # by it, and benchmarks other people run on the machine are not counted
    token = uuid.uuid4().hex
    monkeypatch.setenv("LETO_BENCH_TEST_MARK", token)
    shm = set(os.listdir("/dev/shm"))
    yield
    assert _marked_processes(f"LETO_BENCH_TEST_MARK={token}".encode()) == []
    assert set(os.listdir("/dev/shm")) <= shm


@pytest.mark.slow
def test_tiny_recovery_run(tmp_path: Path) -> None:
    from leto.bench.recovery import run_recovery
    from leto.sim.params import load_bench

    res = run_recovery(
        ["leto", "ckpt-disk"], TINY, mtbf_s=30.0, repeats=1, gap_s=0.5, progress=False
    )
    assert list(res["systems"]) == ["ckpt-disk", "leto"]  # the baseline sets the schedule
    for name, s in res["systems"].items():
        assert len(s["runs"]) == 1, name
        run = s["runs"][0]
        assert all(run[p] >= 0 for p in PHASES), (name, run)
        assert sum(run[p] for p in PHASES) == pytest.approx(run["total"], abs=1e-6)
        assert s["total_s"] == pytest.approx(run["total"])
    disk = res["systems"]["ckpt-disk"]
    assert disk["interval_steps"] >= 1 and disk["calibration"]["save_s"] > 0
    assert disk["runs"][0]["detail"]["steps_recomputed"] >= 1
    f = res["schedule"][0]
    assert res["systems"]["leto"]["runs"][0]["detail"]["failed_step"] == f["step"]
    assert res["best_baseline"] == "ckpt-disk"
    assert res["ratio_vs_best_baseline"] == pytest.approx(
        disk["total_s"] / res["systems"]["leto"]["total_s"]
    )
    path = tmp_path / "recovery.json"
    path.write_text(json.dumps(res))
    costs = load_bench(path)  # the format `leto simulate --bench` reads
    assert set(costs) >= {"detect_s", "restart_s", "promote_s", "rebuild_comm_s"}


@pytest.mark.slow
@pytest.mark.soak  # test_tiny_recovery_run's path, another failure point
def test_tiny_recovery_run_with_a_death_after_the_vote() -> None:
    from leto.bench.recovery import run_recovery

    res = run_recovery(
        ["leto", "ckpt-disk"],
        TINY,
        mtbf_s=30.0,
        repeats=1,
        gap_s=0.5,
        progress=False,
        fail_at="update",
    )
    assert res["fail_at"] == "update"
    f = res["schedule"][0]
    assert f["at"] == "update"
    leto = res["systems"]["leto"]["runs"][0]
    # leto's death came in the step's apply (its own fault plan), after the commit:
    # rolled forward, the step kept, nothing computed again
    assert leto["detail"]["failed_step"] == f["step"]
    assert leto["detail"]["kind"] == "forward" and leto["detail"]["resumed_at"] == f["step"]
    assert leto["detail"]["steps_lost"] == 0 and leto["lost_work"] == 0.0
    assert sum(leto[p] for p in PHASES) == pytest.approx(leto["total"], abs=1e-6)
    # the baseline died before its optimizer step: that step is computed again
    disk = res["systems"]["ckpt-disk"]["runs"][0]
    assert disk["detail"]["failed_step"] == f["step"]
    assert disk["detail"]["steps_recomputed"] >= 1 and disk["lost_work"] > 0


@pytest.mark.slow
def test_tiny_leto_goodput_run() -> None:
    from leto.bench.goodput import run_leto

    res = run_leto(TINY, budget_s=6.0, schedule=[{"t": 1.0, "rank": 1}])
    assert res["failures"] == 1 and len(res["injected"]) == 1
    assert res["steps"] > 0 and res["step_s"] > 0
    t = [row[0] for row in res["timeline"]]
    assert t == sorted(t) and t[-1] == 6.0


@pytest.mark.slow
def test_tiny_torchft_goodput_run_counts_the_batches_a_heal_costs() -> None:
    from leto.bench.ftjob import missing
    from leto.bench.goodput import run_torchft

    if missing():
        pytest.skip(str(missing()))
    res = run_torchft(TINY, budget_s=12.0, schedule=[{"t": 1.0, "rank": 1}])
    assert res["failures"] == 1 and len(res["injected"]) == 1
    assert res["version"] == "0.2.0" and res["step_s"] > 0
    # the dead group was restarted and healed while the others trained on: some steps
    # were committed by fewer groups than the job has, each counting that share
    assert res["steps_committed"] > res["full_steps"] > 0, res
    assert res["full_steps"] <= res["steps"] < res["steps_committed"]
    t = [row[0] for row in res["timeline"]]
    assert t == sorted(t) and t[-1] == 12.0


@pytest.mark.slow
def test_tiny_overhead_run_measures_step_time_and_cpu() -> None:
    from leto.bench.overhead import DEFAULT_CONFIGS as CONFIGS
    from leto.bench.overhead import run_overhead

    res = run_overhead(TINY, rounds=1, periods=2, tier2_interval=5, warmup=2, progress=False)
    assert set(res["step_s"]) == set(CONFIGS) and all(t > 0 for t in res["step_s"].values())
    cpu = res["cpu_ms_per_step"]
    assert set(cpu) == set(CONFIGS)
    assert cpu["plain"]["trainer_ms"] > 0 and "extra_pct" not in cpu["plain"]
    leto = ("leto", "leto-no-tier2", "leto-parity")
    for c in leto:
        ph = cpu[c]["phases_ms"]
        # every step of the window passed through these phases, each with some CPU
        assert all(ph[p] > 0 for p in ("forward", "backward", "allreduce", "apply")), ph
        wall = cpu[c]["phases_wall_ms"]
        assert wall["decide"] > 0 and wall["apply"] > 0, wall  # the COMMIT wait: wall, not CPU
        # leto's other processes were measured: per node an agent, a zygote, a keeper
        # and a shadow per rank (their CPU, in clock ticks, may round to 0 in so short a run)
        (run,) = res["cpu_ms_per_step_runs"][c]
        assert run["others_procs"] >= 2 * (2 + 2 * TINY.world // 2) and run["others_ms"] >= 0
        assert cpu[c]["job_ms"] == pytest.approx(
            TINY.world * cpu[c]["trainer_ms"] + cpu[c]["others_ms"]
        )
    assert cpu["leto"]["phases_ms"].get("snapshot", 0.0) > 0  # tier 2 every 5 steps
    assert cpu["leto-parity"]["phases_ms"].get("snapshot", 0.0) > 0
    assert cpu["leto-no-tier2"]["phases_ms"].get("snapshot", 0.0) == 0.0
    from leto.bench.report import overhead_table

    table = overhead_table(res)
    assert table.count("by phase, CPU/wall: ") == 3 and "CPU per step (ms)" in table
    assert res["overhead_pct_ci95"] == dict.fromkeys(leto)  # one round: no interval
    assert all("unused_core_ms" in cpu[c] for c in CONFIGS) and " unused" in table
    # the forward passes' CPU of every job, the gauge of the drift-adjusted figure
    assert cpu["plain"]["forward_ms"] > 0
    adj = res["overhead_pct_adjusted_by_round"]
    assert set(adj) == set(leto) and all(len(v) == 1 for v in adj.values())
    assert res["overhead_pct_adjusted_ci95"] == dict.fromkeys(leto)
    assert table.count(" adj.") == 3 and "forward passes: " in table
    # the hypervisor's share of the machine, measured around every job
    assert all(len(v) == 1 and 0 <= v[0] <= 100 for v in res["steal_pct_runs"].values())
    assert "stolen by the hypervisor" in table
    # the parity configuration's own figure, from the same jobs' mean step times
    st = res["step_s"]
    assert res["overhead_pct_parity"] == pytest.approx(100 * (st["leto-parity"] / st["plain"] - 1))


def test_leto_job_nodes_share_the_benchmarks_session() -> None:
    # one session for every simulated node, as for plain DDP's workers (a session per
    # node is a scheduler autogroup per node: the nodes' ranks drift a second apart);
    # a process group per agent, so that a stop can SIGKILL what it left
    from leto.bench.gloojob import GlooJob

    with GlooJob(TINY, steps=3, tier2=False, tier2_interval=5) as job:
        job.start()
        assert len(job.procs) == job.nodes == 2
        for p in job.procs:
            assert os.getsid(p.pid) == os.getsid(0)
            assert os.getpgid(p.pid) == p.pid != os.getpgid(0)
        job.wait(lambda: bool(job.seen("job_end")), 120, "the job's end")


@pytest.mark.slow
@pytest.mark.parametrize("fail_at", ["forward", pytest.param("update", marks=pytest.mark.soak)])
def test_tiny_torchft_recovery_run(fail_at: str) -> None:
    pytest.importorskip("torchft", reason="torchft is in the dev extra")
    from leto.bench.recovery import run_recovery

    wl = Workload.for_params(20_000, world=4, batch=8)  # four replica groups of one rank
    res = run_recovery(
        ["torchft"], wl, mtbf_s=30.0, repeats=1, gap_s=0.5, progress=False, fail_at=fail_at
    )
    ft = res["systems"]["torchft"]
    assert ft["version"] == importlib.metadata.version("torchft")
    (run,) = ft["runs"]  # one failure, recovered: the restarted group committed a step
    assert all(run[p] >= 0 for p in PHASES), run
    assert sum(run[p] for p in PHASES) == pytest.approx(run["total"], abs=1e-6)
    assert run["model_state"] > 0 and run["communicator"] > 0 and run["process_state"] > 0
    d = run["detail"]
    assert d["failed_step"] >= d["scheduled_step"] == res["schedule"][0]["step"]
    # it healed to the survivors' state, then committed the next step with them
    assert d["rejoined_at"] == d["healed_to"] + 1
    # forward: the failed step was not committed (the survivors compute it again, so
    # the heal brings at least the step before it); update: the survivors committed it
    # with the dead group's gradients
    assert d["healed_to"] >= d["failed_step"] - (fail_at == "forward")
    assert d["transfer"] > 0 and d["import_torch"] > 0
    s = d["survivors"]
    # what the other groups trained meanwhile (none while the lighthouse waits out the
    # dead group's heartbeat: torchft's 5 s default outlasts this restart)
    assert s["steady_steps_per_s"] > 0 and s["steps"] >= 0
    assert s["steps_per_s"] == pytest.approx(s["steps"] / run["total"])
    assert 0 <= s["fraction_of_steady"] == pytest.approx(s["steps_per_s"] / s["steady_steps_per_s"])
    assert ft["survivor_throughput"]["steps_per_s"] == pytest.approx(s["steps_per_s"])
    assert ft["total_s"] == pytest.approx(run["total"])
