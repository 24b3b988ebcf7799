"""The benchmark's workload: sizes, chunking, data, memory estimates."""

from __future__ import annotations

import subprocess
import sys

import pytest

from leto.bench.workload import BenchError, StepBatches, Workload, format_count, parse_count


@pytest.mark.parametrize(
    ("text", "n"), [("4M", 4_000_000), ("250k", 250_000), ("1.5G", 1_500_000_000), ("900", 900)]
)
def test_parse_count(text: str, n: int) -> None:
    assert parse_count(text) == n


@pytest.mark.parametrize("text", ["", "abc", "4X", "-3M", "0"])
def test_parse_count_refuses(text: str) -> None:
    with pytest.raises(BenchError):
        parse_count(text)


def test_sizes_are_nearest_and_ordered() -> None:
    sizes = [Workload.for_params(parse_count(s)) for s in ("1M", "4M", "16M")]
    for wl, want in zip(sizes, (1e6, 4e6, 16e6), strict=True):
        assert abs(wl.params - want) / want < 0.1
        assert wl.width % 64 == 0
    assert [format_count(w.params) for w in sizes] == ["1.06M", "4.21M", "15.8M"]


def test_chunks_even_out_the_state() -> None:
    import torch

    from leto.retained import InMemorySegments, retain

    wl = Workload.for_params(1_000_000)  # 1.06M params: just over one 2**20 chunk
    assert wl.chunk_numel <= 1 << 20
    model = wl.build_model()
    lay = retain(
        model, wl.build_optimizer(model), chunk_numel=wl.chunk_numel, alloc=InMemorySegments()
    ).layout
    assert lay.n_chunks == 2
    padding = lay.n_chunks * lay.chunk_numel - wl.params
    assert padding < 0.01 * wl.params  # not a nearly empty second chunk
    assert isinstance(lay.param_buffer, torch.Tensor)


def test_data_is_a_function_of_the_step() -> None:
    wl = Workload.for_params(50_000, world=4, batch=8)
    g = wl.global_batch(7)
    shards = [wl.batch_indices(7, r) for r in range(4)]
    assert sorted(sum((s.tolist() for s in shards), [])) == sorted(g.tolist())
    assert wl.global_batch(7).tolist() == g.tolist()
    assert wl.global_batch(8).tolist() != g.tolist()
    sampler = StepBatches(wl)
    it = iter(sampler)
    first = [next(it) for _ in range(3)]
    state = sampler.state_dict()
    resumed = StepBatches(wl)
    resumed.load_state_dict({"step": 1})
    assert next(iter(resumed)).tolist() == first[1].tolist()
    assert first[1].tolist() == wl.global_batch(2).tolist()
    assert state == {"step": 3}


def test_memory_estimates() -> None:
    small, big = Workload.for_params(1_000_000), Workload.for_params(16_000_000)
    for system in ("plain", "ckpt-disk", "ckpt-disk-async", "gemini", "leto"):
        assert big.memory_estimate(system) > small.memory_estimate(system) > 0
    assert small.memory_estimate("gemini") > small.memory_estimate("ckpt-disk")
    with pytest.raises(BenchError):
        small.memory_estimate("nope")


def test_a_worker_flushes_subnormals_on_one_thread() -> None:
    # in a fresh process (the floating-point mode is the process's threads'): a
    # subnormal product is zero after worker_torch, on a thread started after it too
    probe = (
        "import threading, torch\n"
        "from leto.bench.workload import worker_torch\n"
        "tiny = lambda: float(torch.tensor([1e-39]) * 1.0)\n"
        "before = tiny()\n"
        "worker_torch()\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(tiny())); t.start(); t.join()\n"
        "print(before > 0, tiny(), seen[0], torch.get_num_threads())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["True", "0.0", "0.0", "1"], out.stdout
