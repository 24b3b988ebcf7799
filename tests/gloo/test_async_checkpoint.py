"""Asynchronous disk checkpoints (``checkpoint_async``) on real processes: the same
files as the synchronous save's, bitwise; a trainer SIGKILLed while its write is in
flight: the job recovers, that checkpoint never becomes durable, a later one does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jobs import digests_equal, explain, job

from leto.backends.gloo.harness import JobResult
from leto.errors import ConfigError
from leto.retained.checkpoint import CheckpointStore, read_meta
from leto.retained.dcp_state import read_checkpoint

STEPS = 9


@pytest.fixture(scope="module")
def sync(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    ckpt = tmp_path_factory.mktemp("sync") / "ckpt"
    env = {"TIER2": "0", "CKPT": str(ckpt), "CKPT_EVERY": "2"}
    res = job(ckpt.parent / "run", steps=STEPS, env=env)
    assert res.ok and res.digests, explain(res)
    return res


def _flat(obj: object, prefix: str = "") -> dict[str, object]:
    if isinstance(obj, dict):
        out: dict[str, object] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}/{k}"))
        return out
    return {prefix: obj}


def _stalls(res: JobResult) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for r in (0, 1):
        out += json.loads((res.run_dir / f"stalls-rank{r}").read_text())
    return out


def test_async_checkpoint_is_the_sync_ones_bitwise(tag: str, sync: JobResult) -> None:
    ckpt = Path(tag) / "ckpt"
    # each write waits 0.3 s first: the steps after it run meanwhile, changing the
    # retained state its staged copy was taken from
    env = {
        "TIER2": "0",
        "CKPT": str(ckpt),
        "CKPT_EVERY": "2",
        "CKPT_ASYNC": "1",
        "CKPT_SLOW": "0.3",
    }
    res = job(Path(tag) / "run", steps=STEPS, env=env)
    assert res.ok, explain(res)
    assert [e["step"] for e in res.of("checkpoint")] == [2, 4, 6, 8]
    assert digests_equal(res, sync), "the async job's end differs from the sync job's"
    assert {e["mode"] for e in _stalls(res)} == {"async"}
    assert {e["mode"] for e in _stalls(sync)} == {"sync"}
    assert sorted(e["step"] for e in _stalls(res)) == [2, 2, 4, 4, 6, 6, 8, 8]
    sync_dir = Path(str(sync.run_dir.parent / "ckpt"))
    a_path, s_path = CheckpointStore(ckpt).path(8), CheckpointStore(sync_dir).path(8)
    a_state, a_meta = read_checkpoint(a_path)
    s_state, s_meta = read_checkpoint(s_path)
    a, s = _flat(a_state), _flat(s_state)
    assert sorted(a) == sorted(s) and any(isinstance(v, torch.Tensor) for v in a.values())
    for k, v in s.items():
        if isinstance(v, torch.Tensor):
            assert isinstance(a[k], torch.Tensor) and torch.equal(a[k], v), k
        else:
            assert a[k] == v, k
    assert a_meta is not None and s_meta is not None
    assert a_meta["process_states"] == s_meta["process_states"]
    assert a_meta["checksums"] == s_meta["checksums"]
    # the same files: DCP's collective save of the same plan, one .metadata
    names = sorted(p.name for p in a_path.iterdir())
    assert names == sorted(p.name for p in s_path.iterdir()), names


@pytest.fixture(scope="module")
def seven(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    res = job(tmp_path_factory.mktemp("seven") / "run", steps=7, env={"TIER2": "0"})
    assert res.ok and res.digests, explain(res)
    return res


def test_a_trainer_killed_while_its_async_write_is_in_flight(tag: str, seven: JobResult) -> None:
    ckpt = Path(tag) / "ckpt"
    run_dir = Path(tag) / "run"
    env = {
        "TIER2": "0", "CKPT": str(ckpt), "CKPT_EVERY": "2", "CKPT_ASYNC": "1",
        "STEP_SLEEP": "0.05", "KILL_WRITER": "1:4",
    }  # fmt: skip
    # 7 steps: the checkpoint of 6 (the last) prunes only before the durable 2, so what
    # became of step 4's is still to be seen at the end
    res = job(run_dir, steps=7, env=env)
    assert res.ok, explain(res)
    killed = json.loads((run_dir / "killed-writer").read_text())
    assert killed["step"] == 4 and killed["rank"] == 1, killed
    assert len(res.recoveries) == 1, res.recoveries
    # step 4's checkpoint was in flight (rank 0's part and DCP's .metadata written, rank
    # 1's metadata not): never durable, never the model's, its partial files removed by
    # the survivor's cancel; the next one (6) is durable
    assert [e["step"] for e in res.of("checkpoint")] == [2, 6]
    store = CheckpointStore(ckpt)
    assert not store.path(4).exists()
    assert store.durable_steps() == [2, 6]
    assert read_meta(store.path(6)) is not None
    assert digests_equal(res, seven), "not bitwise equal to the failure-free run"


def test_checkpoint_async_must_be_a_bool() -> None:
    import leto

    with pytest.raises(ConfigError) as e:
        leto.Config.from_dict({"backend": "gloo", "checkpoint_async": "yes"})
    assert str(e.value).splitlines() == [
        "leto config: checkpoint_async: must be true or false, got 'yes'"
    ]
    assert leto.Config.from_dict({"backend": "gloo", "checkpoint_async": True}).checkpoint_async
