"""``leto bench``: bad input fails in one line, before anything starts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from leto.bench.cli import check_memory
from leto.bench.workload import BenchError, Workload
from leto.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["recovery", "--systems", "ckpt-disk,torchrun"], "unknown system 'torchrun'"),
        (["goodput", "--systems", "nvre"], "--systems nvre: measured by recovery, scaling only"),
        (["goodput", "--systems", ""], "names no system"),
        (["goodput", "--mtbf", "0"], "--mtbf must be positive, got 0"),
        (["recovery", "--mtbf", "-5"], "--mtbf must be positive, got -5"),
        (["goodput", "--budget", "-1"], "--budget must be positive"),
        (["recovery", "--params", "3G"], "choose a smaller model size"),
        (["overhead", "--params", "3G"], "choose a smaller model size"),
        (["overhead", "--configs", "leto,plain"], "--configs 'leto,plain': plain first"),
        (["overhead", "--configs", "plain,leto-fast"], "then distinct ones of leto, "),
        (["scaling", "--sizes", "1M,2G"], "choose a smaller model size"),
        (["recovery", "--params", "lots"], "not a parameter count"),
        (["recovery", "--repeats", "0"], "--repeats must be at least 1"),
        (["recovery", "--world", "1"], "--world must be at least 2"),
        (["scaling", "--sizes", "1M"], "at least two different model sizes"),
        (["scaling", "--sizes", "1M,1.0M"], "at least two different model sizes"),
        (["scaling", "--layers", "0"], "--layers 0: choose 1 to 256 hidden layers"),
        (["scaling", "--layers", "257"], "--layers 257: choose 1 to 256"),
        (["scaling", "--sizes", "1M,2M", "--accum", "0"], "--accum must be at least 1"),
        (["scaling", "--sizes", "1M,2M", "--accum", "65"], "--accum"),
        (["scaling", "--sizes", "1M,2M", "--batch", "2", "--accum", "4"], "more micro-batches"),
        (["recovery", "--device", "tpu"], "--device 'tpu': choose cpu, cuda or cuda:N"),
        (["scaling", "--device", "cuda:x"], "--device 'cuda:x': choose cpu, cuda or cuda:N"),
    ]
    + (
        []
        if torch.cuda.is_available()
        else [(["recovery", "--device", "cuda"], "--device 'cuda': this machine has no CUDA")]
    ),
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import leto.bench.cli as cli

    # as where torchft and nvre are installed: no line saying one is left out
    monkeypatch.setattr(cli, "missing", lambda: None)
    monkeypatch.setattr(cli, "nvre_missing", lambda: None)
    t = time.monotonic()
    code = main(["bench", *argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("leto bench: error: ") and message in err
    assert err.count("\n") == 1
    assert not (tmp_path / "out").exists()  # nothing started, nothing written
    assert time.monotonic() - t < 5


def test_torchft_not_installed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import leto.bench.cli as cli

    why = "torchft is not importable (ModuleNotFoundError: No module named 'torchft')"
    monkeypatch.setattr(cli, "missing", lambda: why)
    monkeypatch.setattr(cli, "nvre_missing", lambda: "nvre: not here")
    # asked for: one line naming it, exit 2, nothing started
    code = main(["bench", "recovery", "--systems", "torchft", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err == f"leto bench: error: --systems torchft: {why}\n"
    assert not (tmp_path / "o").exists()
    # the default: left out, each in one line, said once the arguments were found good
    notes: list[str] = []
    assert cli._systems(None, "recovery", notes) == [
        "ckpt-disk", "ckpt-disk-async", "gemini", "leto",
    ]  # fmt: skip
    assert notes == [
        f"leto bench: torchft left out: {why}",
        "leto bench: nvre left out: nvre: not here",
    ]
    # a bad argument beside it: its refusal alone, one line
    code = main(["bench", "recovery", "--world", "1", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--world" in err, err
    monkeypatch.setattr(cli, "missing", lambda: None)
    monkeypatch.setattr(cli, "nvre_missing", lambda: None)
    # every system but leto-serial, which is asked for by name (beside leto, with --accum)
    assert cli._systems(None, "recovery") == [s for s in cli.SYSTEMS if s != "leto-serial"]
    assert cli._systems("leto-serial,leto", "scaling") == ["leto-serial", "leto"]
    assert "torchft" in cli._systems(None, "goodput")  # a signal strikes it on the clock
    assert "nvre" not in cli._systems(None, "goodput")  # its restart has no such hook
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("bench", ["recovery", "scaling"])
def test_an_unknown_failure_point_is_refused_in_one_line(
    bench: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", bench, "--fail-at", "backward", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "--fail-at: invalid choice: 'backward'" in err
    assert "forward" in err and "update" in err
    assert not (tmp_path / "out").exists()


def test_no_benchmark_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench"]) == 2
    assert "choose a benchmark" in capsys.readouterr().err


def test_memory_check_uses_what_is_available() -> None:
    wl = Workload.for_params(4_000_000)
    need = wl.memory_estimate("gemini")
    check_memory(wl, ["gemini"], available=int(need / 0.8) + 1)
    with pytest.raises(BenchError, match=r"needs about .* GiB \(gemini\)"):
        check_memory(wl, ["ckpt-disk", "gemini"], available=int(need / 0.8) - 1)


def test_one_gib_of_state_per_rank_fits_this_machine_without_tier2_and_gemini() -> None:
    """1 GiB of model + optimizer state per rank, 4 ranks, on a 24 GiB machine (about 22
    GiB available): leto without its tier-2 snapshot and both disk baselines fit; leto
    with tier 2 (two host-memory copies, no parity share with tier 1 as replicas) and
    Gemini (four) do not."""
    wl = Workload.for_params(90_000_000, batch=512, world=4)
    assert 1.0 <= wl.state_bytes / 2**30 < 1.01
    avail = 22 * 2**30
    check_memory(wl, ["leto", "ckpt-disk", "ckpt-disk-async"], available=avail, tier2=False)
    with pytest.raises(BenchError, match=r"\(leto\)"):
        check_memory(wl, ["leto", "ckpt-disk"], available=avail)
    with pytest.raises(BenchError, match=r"\(gemini\)"):
        check_memory(wl, ["leto", "gemini"], available=avail, tier2=False)
    # tier 2: two slots of the rank's 12 B/param each, per rank
    assert (
        wl.memory_estimate("leto") - wl.memory_estimate("leto", tier2=False) == 4 * 24 * wl.params
    )


def test_help_lists_the_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for name in ("recovery", "overhead", "goodput", "scaling"):
        assert name in out


def test_scaling_layers_keep_the_size_and_shrink_a_layer() -> None:
    """``--layers``: the same state per rank in more, narrower layers (a layer's compute,
    what a survivor finishes before it stops, falls with width^2)."""
    from argparse import Namespace

    from leto.bench.cli import _workload

    args = Namespace(batch=512, world=4, seed=0, layers=32)
    deep, shallow = (
        _workload(args, "90M"),
        _workload(Namespace(**{**vars(args), "layers": 4}), "90M"),
    )
    assert (deep.layers, shallow.layers) == (32, 4)
    assert abs(deep.params - shallow.params) / shallow.params < 0.03
    assert deep.width**2 * 7 < shallow.width**2 < deep.width**2 * 9


def test_torchft_missing_says_why_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from leto.bench.ftjob import missing

    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft: ImportError
    why = missing()
    assert why is not None and why.startswith("torchft is not importable (ModuleNotFoundError")
    assert "\n" not in why and "torchft==0.2.0" in why


def test_nvre_missing_says_why_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from leto.bench.nvrejob import missing

    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext", None)  # its import: ImportError
    why = missing()
    assert why is not None and why.startswith("nvidia_resiliency_ext.inprocess is not importable")
    assert "\n" not in why and "nvidia-resiliency-ext==0.4.1" in why


def test_nvre_refuses_more_recoveries_than_reserves(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import leto.bench.cli as cli

    monkeypatch.setattr(cli, "nvre_missing", lambda: None)
    argv = ["bench", "recovery", "--systems", "nvre", "--repeats", "9", "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        "leto bench: error: --repeats 9: nvre needs a reserve process per recovery, at most 8\n"
    )


def test_the_device_travels_with_the_workload_and_moves_the_host_estimate() -> None:
    wl = Workload.for_params(10**6, device="cuda:0")
    assert Workload.from_dict(wl.as_dict()) == wl and wl.as_dict()["device"] == "cuda:0"
    host = Workload.for_params(10**6)
    assert host.device == "cpu"
    # on a device the state is there: host memory holds the processes and the data only
    assert wl.memory_estimate("leto") < host.memory_estimate("leto")
    assert wl.memory_estimate("gemini") == wl.memory_estimate("leto")
