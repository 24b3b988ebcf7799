"""``leto launch --slurm`` (docs/launch.md, "On Slurm"): the node count, node rank,
rendezvous host, job id and run directory taken from the variables srun sets; flags
that say the same thing twice, and a step that is not one task per node, refused in one
line. The agent is a stand-in here (test_torchrun_flags'); a real two-node job started
with srun's variables is in tests/gloo/test_launch_slurm.py."""

from __future__ import annotations

import os

import pytest
from test_torchrun_flags import Started, here, launch  # noqa: F401 (here: a fixture)

from leto.adapters.slurm import first_host

pytestmark = pytest.mark.usefixtures("here")  # the stand-in agent, in a working directory

# what srun sets for the second task of a step of one task on each of 4 nodes
STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NUM_NODES": "6",
    "SLURM_JOB_NODELIST": "gpu[07-12]",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "localhost,gpu[09-11]",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
}


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node01", "node01"),
        ("tux[01-04,07],gpu5", "tux01"),
        ("tux[7,1-3]", "tux7"),  # as written: Slurm keeps the order it was given
        ("rack[1-2]-n[003-004]", "rack1-n003"),
        ("a-b.c,d[1-2]", "a-b.c"),
        (" gpu[0009] ", "gpu0009"),
    ],
)
def test_the_first_host_of_a_slurm_host_list(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


@pytest.mark.parametrize("nodelist", ["", "tux[a-b]", "tux[1-2", "tux[[1]]", "tu x", ",n1"])
def test_a_host_list_that_cannot_be_read_is_refused(nodelist: str) -> None:
    with pytest.raises(ValueError, match="host list|range of numbers"):
        first_host(nodelist)


def _env(monkeypatch: pytest.MonkeyPatch, **changes: str | None) -> None:
    for k in [k for k in os.environ if k.startswith("SLURM")]:
        monkeypatch.delenv(k)
    for k, v in {**STEP, **changes}.items():
        if v is not None:
            monkeypatch.setenv(k, v)


def test_srun_variables_give_the_node_its_place(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _env(monkeypatch)
    got = launch(["--slurm", "--nproc-per-node", "2", "--master-port", "29611"], capsys)
    assert isinstance(got, Started), got
    o = got.opts
    assert (o.nnodes, o.node_rank, o.nproc_per_node) == (4, 1, 2)  # the step's nodes
    assert (o.rdzv_host, o.rdzv_port) == ("localhost", 29611)  # the step's first node
    assert o.run_dir == os.path.join("leto-runs", "slurm-4242")
    assert got.env["TORCHELASTIC_RUN_ID"] == "slurm-4242"


def test_without_step_variables_the_job_list_and_torchrun_defaults_serve(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _env(
        monkeypatch,
        SLURM_STEP_NUM_NODES=None,
        SLURM_STEP_NUM_TASKS=None,
        SLURM_STEP_NODELIST=None,
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="localhost,gpu8",
        SLURM_NODEID="0",
    )
    got = launch(["--slurm", "--rdzv-id", "mine", "--run-dir", "here"], capsys)
    assert isinstance(got, Started), got
    assert (got.opts.nnodes, got.opts.node_rank, got.opts.rdzv_port) == (2, 0, 29500)
    assert got.opts.run_dir == "here" and got.env["TORCHELASTIC_RUN_ID"] == "mine"


@pytest.mark.parametrize(
    ("argv", "changes", "says"),
    [
        (["--nnodes", "2"], {}, "--slurm and --nnodes: "),
        (["--node-rank", "0"], {}, "--slurm and --node-rank: "),
        (["--rdzv-endpoint", "localhost:29500"], {}, "--slurm and --rdzv-endpoint: "),
        (["--master-addr", "localhost"], {}, "--slurm and --master-addr: "),
        ([], {"SLURM_JOB_ID": None}, "SLURM_JOB_ID is not set"),
        ([], {"SLURM_NODEID": None}, "SLURM_NODEID is not set"),
        ([], {"SLURM_STEP_NUM_TASKS": "8"}, "srun started 8 tasks on 4 node(s)"),
        ([], {"SLURM_NODEID": "4"}, "SLURM_NODEID=4 is not in 0..3"),
        ([], {"SLURM_STEP_NUM_NODES": "four"}, "SLURM_STEP_NUM_NODES='four' is not a number"),
        ([], {"SLURM_STEP_NODELIST": "gpu[x]"}, "SLURM_STEP_NODELIST 'gpu[x]'"),
    ],
)
def test_slurm_refuses_what_it_cannot_square_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    changes: dict[str, str | None],
    says: str,
) -> None:
    _env(monkeypatch, **changes)
    got = launch(["--slurm", *argv], capsys)
    assert isinstance(got, str) and says in got, got
