"""The device path of the retained state, run on a CPU (issue 41 part 1).

A layout in GPU memory differs from one in host memory in three ways the gloo backend
sees: its chunks are checked with the Fletcher checksum in torch ops (xxh3 reads host
memory only), tier 1's and tier 2's collectives run through host copies (gloo reduces
host tensors only: :class:`~leto.retained.parity.HostStaged`), and the keeper hands its
memory over as a handle (:mod:`leto.backends.gloo.memory_provider`). The first two are
forced here on a CPU (``checksum = "fletcher"``, ``LETO_STAGE_COLLECTIVES=1``): the same
copies and the same checks a GPU job makes, in a real job, killed and recovered, ending
bitwise the failure-free run made without them. ``tests/gpu/test_gpu_job.py`` runs the
same on a GPU.
"""

from __future__ import annotations

from pathlib import Path

from jobs import STEPS_1x2, STEPS_2x2, digests_equal, explain, job, story

from leto.backends.gloo.harness import JobResult

DEVICE_PATH = {"CHECKSUM": "fletcher", "LETO_STAGE_COLLECTIVES": "1"}


def _device_path_used(res: JobResult) -> None:
    """Every rank's layout recorded Fletcher and staged its parity collectives."""
    (done,) = res.of("training_done")
    want = {"device": "cpu", "checksum": "fletcher", "staged": True}
    assert list(done["memory"].values()) == [want] * len(done["digests"]), done["memory"]


def test_the_device_path_recovers_tier1_a_restart_and_a_lost_node_bitwise(
    tag: str, ref_2x2: JobResult
) -> None:
    faults = [
        # the keeper SIGKILLed after a chunk's new bytes: rebuilt from tier-1 parity,
        # whose reduce runs through host copies
        {
            "kind": "lose_memory",
            "rank": 2,
            "step": 2,
            "phase": "apply",
            "chunk": 1,
            "where": "written",
        },
        {"kind": "crash", "rank": 1, "step": 4, "phase": "prepare"},
        {"kind": "crash", "rank": 0, "step": 5, "phase": "parity", "chunk": 0},
        # a whole node lost: its ranks restored from the tier-2 snapshot (staged too)
        {"kind": "lose_node", "rank": 2, "step": 8, "phase": "prepare"},
    ]
    res = job(
        Path(tag) / "run",
        nnodes=2,
        nproc=2,
        steps=STEPS_2x2,
        faults=faults,
        env=DEVICE_PATH,
        extra=["--spare-timeout", "60"],
    )
    assert res.ok, explain(res)
    _device_path_used(res)
    kinds = [r["kind"] for r in res.recoveries]
    assert kinds[0] == "tier1" and res.recoveries[0]["chunks_repaired_tier1"] >= 1, story(res)
    assert kinds[-1] == "tier2" and res.recoveries[-1]["chunks_restored"] > 0, story(res)
    # the same values as the failure-free run with xxh3 and no staging: the copies move
    # bytes, the reductions run on the same values
    assert digests_equal(res, ref_2x2), "not bitwise equal to the failure-free run"


def test_the_device_checksum_finds_a_flipped_bit(tag: str, ref_1x2: JobResult) -> None:
    faults = [
        {"kind": "corrupt", "rank": 0, "step": 3, "phase": "forward", "chunk": 1},
        {"kind": "crash", "rank": 1, "step": 6, "phase": "finish"},
    ]
    res = job(Path(tag) / "run", steps=STEPS_1x2, faults=faults, env=DEVICE_PATH)
    assert res.ok, explain(res)
    _device_path_used(res)
    first = res.of("failure")[0]
    assert "chunks [1] fail their checksums at PREPARE of step 3" in first["traceback"], first
    assert res.recoveries[0]["chunks_repaired_tier1"] == 1, story(res)
    assert digests_equal(res, ref_1x2), "not bitwise equal to the failure-free run"
