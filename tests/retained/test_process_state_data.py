"""Data and process state for the user's loop: batches of tuples and dicts split per
rank, a StatefulDataLoader's state (tensors inside) through JSON, CUDA RNG states,
schedulers that take a metric, and the DDP conversion's size."""

from __future__ import annotations

import difflib
import json
import random
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from leto.retained.process_state import (
    BatchCursor,
    ProcessStateError,
    capture_rng,
    from_json,
    is_per_rank,
    restore_rng,
    shard,
    step_scheduler,
    takes_metric,
    to_json,
)

ROOT = Path(__file__).resolve().parents[2]


def test_shard_splits_tuples_and_dicts_alike() -> None:
    x, y = torch.arange(8).view(4, 2), torch.arange(4)
    a, b = shard((x, y), 1, 2)
    assert torch.equal(a, x[1::2]) and torch.equal(b, y[1::2])
    d = shard({"x": x, "y": y, "name": "batch"}, 0, 2)
    assert torch.equal(d["x"], x[0::2]) and d["name"] == "batch"
    assert shard([0, 1, 2, 3, 4], 1, 2) == [1, 3]
    with pytest.raises(TypeError, match="cannot shard"):
        shard(object(), 0, 2)


def test_tensors_in_a_state_survive_json() -> None:
    st = {"g": torch.arange(5, dtype=torch.uint8), "n": 3, "l": [torch.ones(2)]}
    back = from_json(json.loads(json.dumps(to_json(st, "state"))))
    assert torch.equal(back["g"], st["g"]) and back["n"] == 3
    assert torch.equal(back["l"][0], st["l"][0])
    with pytest.raises(ProcessStateError, match="not JSON"):
        to_json({"o": object()}, "state")


def test_stateful_dataloader_resumes_where_it_was() -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    ds = TensorDataset(torch.arange(40.0).view(20, 2), torch.arange(20))

    def loader() -> object:
        g = torch.Generator().manual_seed(0)
        return sdl.StatefulDataLoader(ds, batch_size=4, shuffle=True, generator=g)

    a = BatchCursor(loader())
    seen = [a.batch(s) for s in (1, 2)]
    state = json.loads(json.dumps(a.state_after(2)))  # what the agent keeps
    nxt = a.batch(3)
    b = BatchCursor(loader())
    b.restore(state)
    got = b.batch(3)
    assert torch.equal(got[1], nxt[1]) and not torch.equal(got[1], seen[1][1])


def test_loader_over_a_distributed_sampler_is_per_rank() -> None:
    ds = TensorDataset(torch.arange(8))
    assert is_per_rank(DataLoader(ds, sampler=DistributedSampler(ds, 2, 0)))
    assert not is_per_rank(DataLoader(ds, batch_size=2))


def test_rng_states_come_back_through_json_in_either_encoding() -> None:
    np = pytest.importorskip("numpy")
    random.seed(3)
    np.random.seed(5)
    torch.manual_seed(7)
    st = json.loads(json.dumps(capture_rng()))
    assert isinstance(st["python"][1], str) and isinstance(st["numpy"][1], str)  # base64 words

    def draws() -> tuple[float, float, float]:
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    want = draws()
    restore_rng(st)
    assert draws() == want
    # a process state written with the words as numbers (before the base64 words)
    version, words, gauss = random.getstate()
    np_state = np.random.get_state()
    old = dict(st)
    old["python"] = [version, list(words), gauss]
    old["numpy"] = [np_state[0], [int(k) for k in np_state[1]], *np_state[2:]]
    restore_rng(old)
    again = draws()
    restore_rng(st)  # another state between: the old encoding must restore, not keep
    restore_rng(old)
    assert draws() == again and again != want


def test_cuda_rng_state_is_kept_with_the_cpu_ones() -> None:
    if not torch.cuda.is_available():
        assert "cuda" not in capture_rng()
        pytest.skip("no CUDA here: the CUDA generators are captured only where CUDA runs")
    torch.cuda.init()
    st = capture_rng()
    assert len(st["cuda"]) == torch.cuda.device_count()


def test_reduce_lr_on_plateau_is_stepped_with_the_metric() -> None:
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    assert takes_metric(plateau)
    assert not takes_metric(torch.optim.lr_scheduler.StepLR(opt, 1))
    step_scheduler(plateau, 1.0)
    step_scheduler(plateau, 2.0)  # worse: the LR drops
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    with pytest.raises(ProcessStateError, match="needs a metric"):
        step_scheduler(plateau)


def test_the_ddp_conversion_is_a_small_diff() -> None:
    plain = (ROOT / "examples" / "ddp_plain.py").read_text().split('"""')[2].splitlines()
    leto = (ROOT / "examples" / "ddp_loop.py").read_text().split('"""')[2].splitlines()
    changed = [
        ln
        for ln in difflib.unified_diff(plain, leto, lineterm="", n=0)
        if ln[:1] in "+-" and not ln.startswith(("+++", "---")) and ln[1:].strip()
    ]
    removed = [ln for ln in changed if ln[0] == "-"]
    added = [ln for ln in changed if ln[0] == "+"]
    assert 0 < max(len(removed), len(added)) <= 10, changed  # a changed line counts once
