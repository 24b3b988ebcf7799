"""The simulator calibrated from bench files: each field to its parameter, its law, and
the report's measured/assumed marks."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from leto.bench.workload import Workload
from leto.cli import main
from leto.sim import measured
from leto.sim.measured import calibrate, with_flags
from leto.sim.params import SimInputError, SimParams

PARAMS = 1_000_000  # the synthetic workload's parameters: 12 MB of state per rank
RANK_BYTES = 12 * PARAMS

RECOVERY: dict[str, Any] = {
    "benchmark": "recovery",
    "workload": {"world": 4, "params": PARAMS},
    "systems": {
        "ckpt-disk": {"phases": {"model_state": 0.4}},
        "leto": {
            "phases": {
                "detection": 0.003,
                "process_state": 0.01,
                "model_state": 0.02,
                "communicator": 0.06,
            }
        },  # fmt: skip
        "torchft": {
            "phases": {"process_state": 3.0, "communicator": 1.5, "model_state": 0.12},
            "survivor_throughput": {"fraction_of_steady": 0.25},
        },
    },
    "phases": {"restart_s": 4.0, "ckpt_fixed_s": 0.05, "detect_s": 0.003},
}
SCALING = {"benchmark": "scaling", "slope_s_per_gib": {"resume": {"leto": 0.5}}}
TIER2 = {
    "benchmark": "tier2",
    "bytes_per_node": 64_000_000,
    "rows": [{"m": 1, "encode_s": 0.32}, {"m": 2, "encode_s": 1.28}],
}
CONTROL = {
    "ranks": 1024,
    "per_node": 8,
    "rows": [
        {"ranks": 8, "aggregated": {"plan": {"a": {"ms": 0.1}}, "adopt": {"ms": 0.1}}},
        {
            "ranks": 1024,
            "aggregated": {"plan": {"a": {"ms": 2.0}, "b": {"ms": 3.0}}, "adopt": {"ms": 5.0}},
        },
    ],
}


def _write(tmp_path: Path, name: str, obj: Any) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return str(path)


def _all(tmp_path: Path) -> list[str]:
    return [
        _write(tmp_path, "recovery.json", RECOVERY),
        _write(tmp_path, "scaling.json", SCALING),
        _write(tmp_path, "tier2.json", TIER2),
        _write(tmp_path, "control.json", CONTROL),
    ]


def test_the_bench_workloads_state_per_parameter_is_the_one_the_loader_assumes() -> None:
    wl = Workload(width=64, layers=2, classes=4, batch=8, world=4)
    assert wl.state_bytes == measured.BENCH_STATE_BYTES_PER_PARAM * wl.params


def test_each_field_sets_its_parameter(tmp_path: Path) -> None:
    cal = calibrate(_all(tmp_path), SimParams())
    v = cal.values
    assert v["detect_s"] == 0.003 and v["promote_s"] == 0.01 and v["reconcile_s"] == 0.02
    assert v["rebuild_comm_s"] == 0.06 and v["rebuild_ref_ranks"] == 4
    assert v["reconcile_ref_gib"] == pytest.approx(RANK_BYTES / 2**30)
    assert v["restart_s"] == 4.0 and v["ckpt_fixed_s"] == 0.05
    # the baseline's four ranks load 48 MB from one host in 0.4 s
    assert v["storage_node_gb_s"] == pytest.approx(4 * RANK_BYTES / 0.4 / 1e9)
    assert v["torchft_restart_s"] == 3.0 and v["torchft_quorum_s"] == 1.5
    assert v["torchft_heal_gb_s"] == pytest.approx(RANK_BYTES / 0.12 / 1e9)
    assert v["torchft_survivors"] == 0.25
    assert v["reconcile_s_per_gib"] == 0.5
    assert v["tier2_gb_s"] == pytest.approx(64_000_000 / 0.32 / 1e9)  # m = 1: tier2_parity
    assert v["coordinator_s"] == pytest.approx((3.0 + 5.0) / 1e3)
    assert v["coordinator_ref_ranks"] == 1024
    assert {f.param for f in cal.figures if not f.measured} == {"spare_join_s", "gpu_reset_s"}
    assert cal.figure("detect_s").source == "recovery.json: systems.leto.phases.detection"
    assert "scaling.json: slope_s_per_gib.resume.leto" in cal.figure("reconcile_s").source


def test_the_laws_carry_each_figure_to_scale(tmp_path: Path) -> None:
    cal = calibrate(_all(tmp_path), SimParams())
    bench_job = {"gpus": 4, "gpus_per_node": 2, "model_params": 4 * PARAMS, "bytes_per_param": 12}
    at_bench = SimParams(**bench_job, **cal.values)
    assert at_bench.state_per_gpu == pytest.approx(RANK_BYTES)
    assert at_bench.reconcile_at_scale_s == pytest.approx(0.02)  # measured, at its own size
    big = SimParams(gpus=131_072, **cal.values)
    # the rebuild by log2(ranks), the coordinator linear in ranks
    assert big.rebuild_s == pytest.approx(0.06 * 17 / 2 + 0.008 * 131_072 / 1024)
    extra_gib = big.state_per_gpu / 2**30 - RANK_BYTES / 2**30
    assert big.reconcile_at_scale_s == pytest.approx(0.02 + 0.5 * extra_gib)
    assert big.tier2_restore_s == pytest.approx(big.state_per_node / 0.2e9)
    assert big.torchft_heal_s == pytest.approx(big.state_per_gpu / (RANK_BYTES / 0.12))
    assert big.torchft_survivor_fraction == 0.25
    # storage: the measured bandwidth of a node times the nodes, up to Tectonic's 2 TB/s
    node_bw = 4 * RANK_BYTES / 0.4
    assert big.storage_bw == pytest.approx(16_384 * node_bw)
    assert SimParams(gpus=1024, **cal.values).storage_bw == pytest.approx(128 * node_bw)
    fast = SimParams(gpus=131_072, **{**cal.values, "storage_node_gb_s": 1.0})
    assert fast.storage_bw == pytest.approx(2000e9)


def test_without_bench_files_every_figure_is_assumed() -> None:
    cal = calibrate([], SimParams())
    assert cal.values == {}
    assert all(not f.measured and f.source == "assumed: no bench file given" for f in cal.figures)
    assert cal.measured("leto") == ([], list(measured.INPUTS["leto"]))


def test_a_system_the_file_lacks_keeps_its_assumption_and_says_so(tmp_path: Path) -> None:
    obj = copy.deepcopy(RECOVERY)
    del obj["systems"]["torchft"]
    cal = calibrate([_write(tmp_path, "r.json", obj)], SimParams())
    assert "torchft_restart_s" not in cal.values
    assert cal.figure("torchft_heal_gb_s").source == "assumed: no bench file measures it"
    yes, no = cal.measured("torchft")
    assert yes == ["detect_s"] and "torchft_quorum_s" in no


def test_a_tier2_file_without_the_jobs_parity_keeps_the_assumption(tmp_path: Path) -> None:
    path = _write(tmp_path, "t.json", {**TIER2, "rows": [TIER2["rows"][0]]})
    cal = calibrate([path], SimParams(tier2_parity=2))
    assert "tier2_gb_s" not in cal.values
    assert cal.figure("tier2_gb_s").source == "assumed: t.json has no row with m = 2 (tier2_parity)"


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda o: o["systems"]["leto"]["phases"].pop("communicator"), "systems.leto.phases.communicator"),
        (lambda o: o["systems"]["leto"]["phases"].update(detection="fast"), "systems.leto.phases.detection"),
        (lambda o: o["systems"]["ckpt-disk"]["phases"].update(model_state=0), "systems.ckpt-disk.phases.model_state"),
        (lambda o: o["workload"].pop("world"), "workload.world"),
        (lambda o: o["systems"]["torchft"]["phases"].update(model_state=-1.0), "systems.torchft.phases.model_state"),
    ],
)  # fmt: skip
def test_a_wrong_or_missing_field_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Any, field: str
) -> None:
    obj = copy.deepcopy(RECOVERY)
    edit(obj)
    path = _write(tmp_path, "bad.json", obj)
    with pytest.raises(SimInputError, match=f"'{field}'"):
        calibrate([path], SimParams())
    assert main(["simulate", "--bench", path, "--seeds", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.json: " in err and repr(field) in err


def test_other_files_are_refused_by_name(tmp_path: Path) -> None:
    path = _write(tmp_path, "o.json", {"benchmark": "overhead"})
    with pytest.raises(SimInputError, match="benchmark 'overhead' measures none"):
        calibrate([path], SimParams())
    path = _write(tmp_path, "s.json", {"benchmark": "scaling", "slope_s_per_gib": {}})
    with pytest.raises(SimInputError, match="'slope_s_per_gib.resume.leto'"):
        calibrate([path], SimParams())


def test_a_flag_wins_over_the_file_and_drops_its_reference_scale(tmp_path: Path) -> None:
    cal = calibrate(_all(tmp_path), SimParams())
    cal = with_flags(cal, {"rebuild_comm_s": 5.0})
    assert "rebuild_comm_s" not in cal.values and "rebuild_ref_ranks" not in cal.values
    assert cal.figure("rebuild_comm_s").source == "set on the command line"
    p = SimParams(gpus=131_072, rebuild_comm_s=5.0, **cal.values)
    assert p.rebuild_s == pytest.approx(5.0 + 0.008 * 128)


def test_the_report_marks_measured_and_assumed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = _all(tmp_path)
    args = ["simulate", "--gpus", "131072", "--days", "2", "--seeds", "1"]
    assert main([*args, *(a for p in paths for a in ("--bench", p))]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("detect_s "))
    assert "measured" in row and "recovery.json: systems.leto.phases.detection" in row
    row = next(line for line in out.splitlines() if line.startswith("gpu_reset_s "))
    assert "assumed" in row and "measured" not in row
    head = next(line for line in out.splitlines() if line.startswith("leto at 131,072 GPUs"))
    assert head.endswith("; assumed: spare_join_s, gpu_reset_s")
    assert "measured: detect_s, promote_s, reconcile_s, rebuild_comm_s" in head
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["measured"] == {"leto": [], "torchft": []}
    assert not any(f["measured"] for f in data["calibration"])
    assert main([*args, "--bench", paths[0], "--set", "detect_s=7", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params"]["detect_s"] == 7.0 and "detect_s" not in data["measured"]["leto"]
    assert math.isclose(data["params"]["promote_s"], 0.01)


def test_the_committed_bench_files_calibrate_the_documented_run() -> None:
    bench = Path(__file__).resolve().parents[2] / "docs" / "bench"
    names = [
        "recovery-2473b2b-nvre-busy-machine.json",
        "recovery-f5acfc2.json",
        "scaling.json",
        "tier2-c0b3bda.json",
        "control-d41b045.json",
    ]
    cal = calibrate([str(bench / n) for n in names], SimParams())
    yes, no = cal.measured("leto")
    assert no == ["spare_join_s", "gpu_reset_s"] and len(yes) == 8
    assert cal.measured("torchft")[1] == ["spare_join_s", "gpu_reset_s"]
    # the later file wins: leto's figures are f5acfc2's, torchft's the earlier file's
    assert cal.figure("detect_s").source.startswith("recovery-f5acfc2.json")
    assert cal.figure("torchft_heal_gb_s").source.startswith("recovery-2473b2b")
    p = SimParams(gpus=131_072, **cal.values)
    assert 0.5 < p.rebuild_s < 2.0 and p.torchft_survivor_fraction < 0.05
