"""Chunked optimizers against torch.optim, undo/roll-forward, fallback, process state.

Which comparisons are bitwise and why:

* SGD, Adam, AdamW with ``foreach=False`` (torch's single-tensor path, the CPU
  default) or ``foreach=True``: BITWISE (``torch.equal``) over 200 steps with an
  LR scheduler. The chunked step calls the same torch functional on slices, and
  those updates are elementwise.
* Adam with ``fused=True``: WITHIN 1e-6 RELATIVE over 200 steps. torch's fused
  CPU kernel rounds its vectorised body and its scalar tail differently, so
  cutting the tensor into chunks moves which elements take which path.
* The generic path (RMSprop, Adagrad) runs torch's own step, on a scratch copy: BITWISE.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from leto.retained import (
    ChecksumError,
    ChunkedAdam,
    ChunkedAdamW,
    ChunkedSGD,
    ChunkStateError,
    ChunkStatus,
    InMemorySegments,
    LayoutError,
    RetainedLayout,
    UnsupportedOptimizerError,
    WholeStepOptimizer,
    check_supported,
    is_chunkable,
    required_states,
    retain,
    to_retained,
)

STEPS = 200


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """One intra-op thread: the machine is shared, and fused CPU kernels crawl with two."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Net(nn.Module):
    """Two layers, plus a head used only on even steps (its grads are then None).

    The head's parameters sit between l1's and l2's in the flat buffers, so an
    update must skip them without touching them.
    """

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 10, device=device)
        self.aux = nn.Linear(10, 2, device=device)
        self.l2 = nn.Linear(10, 2, device=device)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        y = self.l2(h)
        return y + self.aux(h) if use_aux else y


def make_net(device: str = "cpu") -> Net:
    torch.manual_seed(0)
    return Net(device)


def groups(model: nn.Module, split: bool, **hp: Any) -> list[dict[str, Any]]:
    if not split:
        return [{"params": list(model.parameters())}]
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def train_step(model: Net, opt: torch.optim.Optimizer, step: int, sign: float = 1.0) -> None:
    x, y = batch(step)
    opt.zero_grad()
    loss = sign * torch.nn.functional.mse_loss(torch.tanh(model(x, use_aux=step % 2 == 0)), y)
    loss.backward()
    opt.step()


def run_pair(
    cls: type[torch.optim.Optimizer],
    hp: dict[str, Any],
    *,
    split: bool = False,
    chunk_numel: int = 16,
    steps: int = STEPS,
    sched: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> tuple[Net, Net, torch.optim.Optimizer, Any]:
    sign = -1.0 if hp.get("maximize") else 1.0
    ref_model, model = make_net(), make_net()
    ref = cls(groups(ref_model, split), **hp)
    opt = retain(model, cls(groups(model, split), **hp), chunk_numel=chunk_numel, align_bytes=16)
    make = sched or (lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=30, gamma=0.6))
    s_ref, s_opt = make(ref), make(opt)
    for step in range(steps):
        train_step(ref_model, ref, step, sign)
        s_ref.step()
        train_step(model, opt, step, sign)
        s_opt.step()
    return ref_model, model, ref, opt


def assert_bitwise(a: nn.Module, b: nn.Module) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), f"{n}: max diff {(p - q).abs().max().item()}"


SGD_CASES = [
    {"lr": 0.05},
    {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2},
    {"lr": 0.02, "momentum": 0.8, "dampening": 0.1, "weight_decay": 1e-3, "maximize": True},
]
ADAM_CASES = [
    {"lr": 1e-2},
    {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True},
    {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "foreach": True},
]
ADAMW_CASES = [
    {"lr": 1e-2, "weight_decay": 0.05},
    {"lr": 5e-3, "amsgrad": True, "maximize": True},
]


@pytest.mark.parametrize("hp", SGD_CASES)
def test_sgd_bitwise(hp: dict[str, Any]) -> None:
    hp = {"foreach": False, **hp}
    # chunk 64: chunk 1 holds l1.bias, the (often absent) aux head and l2: one group, one
    # run per side of the skipped head
    ref_model, model, _, opt = run_pair(torch.optim.SGD, hp, chunk_numel=64)
    assert isinstance(opt, ChunkedSGD)
    assert_bitwise(ref_model, model)


def test_runs_merge_neighbours_but_never_reach_over_a_skipped_parameter() -> None:
    model = make_net()
    opt = retain(model, torch.optim.SGD(model.parameters(), lr=0.1), chunk_numel=64, align_bytes=16)
    assert [s.offset for s in opt.layout.slots] == [0, 60, 72, 92, 96, 116]
    x, _ = batch(1)
    opt.zero_grad()
    model(x, use_aux=False).sum().backward()  # aux (params 2, 3) gets no gradient
    opt.prepare(1)
    opt.begin(1)
    assert opt.runs(0) == [(0, (0, False), 0, 64)]
    assert opt.runs(1) == [(0, (0, False), 64, 70), (0, (0, False), 96, 118)]
    opt.roll_back()
    opt.zero_grad()
    model(x, use_aux=True).sum().backward()
    opt.prepare(1)
    opt.begin(1)
    assert opt.runs(1) == [(0, (0, False), 64, 118)]  # padding included, harmless


@pytest.mark.parametrize("hp", ADAM_CASES)
def test_adam_bitwise(hp: dict[str, Any]) -> None:
    hp = {"foreach": False, **hp}
    ref_model, model, ref, opt = run_pair(torch.optim.Adam, hp, chunk_numel=24)
    assert isinstance(opt, ChunkedAdam) and not isinstance(opt, ChunkedAdamW)
    assert_bitwise(ref_model, model)
    # per-parameter step counts follow torch, aux skipped on odd steps
    aux = model.aux.weight
    assert (
        opt.state[aux]["step"].item()
        == ref.state[ref_model.aux.weight]["step"].item()
        == STEPS // 2
    )
    assert torch.equal(opt.state[aux]["exp_avg"], ref.state[ref_model.aux.weight]["exp_avg"])


@pytest.mark.parametrize("hp", ADAMW_CASES)
def test_adamw_bitwise(hp: dict[str, Any]) -> None:
    hp = {"foreach": False, **hp}
    ref_model, model, _, opt = run_pair(torch.optim.AdamW, hp, chunk_numel=7 * 4)
    assert isinstance(opt, ChunkedAdamW)
    assert_bitwise(ref_model, model)


def test_param_groups_and_a_scheduler_that_changes_betas_bitwise() -> None:
    one_cycle = lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.02, total_steps=STEPS)  # noqa: E731
    ref_model, model, _, _ = run_pair(
        torch.optim.AdamW,
        {"lr": 1e-2, "weight_decay": 0.1, "foreach": False},
        split=True,
        sched=one_cycle,
    )
    assert_bitwise(ref_model, model)
    cos = lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=50)  # noqa: E731
    ref_model, model, _, _ = run_pair(
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2, "foreach": False},
        split=True,
        sched=cos,
        chunk_numel=1 << 12,
    )
    assert_bitwise(ref_model, model)


def test_fused_adam_within_tolerance() -> None:
    """Not bitwise (see module docstring): within 1e-6 relative over 200 steps."""
    ref_model, model, _, _ = run_pair(
        torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01, "fused": True}, chunk_numel=20
    )
    for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- transactions


def snapshot(opt: Any) -> list[torch.Tensor]:
    """Params, states, and the chunk table (versions, checksums) of the header."""
    lay = opt.layout
    return [t.clone() for t in (*lay.data_buffers(), lay.header.table)]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def trained(
    cls: type[torch.optim.Optimizer],
    hp: dict[str, Any],
    steps: int,
    alloc: Any = None,
    undo_all: bool = False,
) -> tuple[Net, Any]:
    model = make_net()
    plain = cls(model.parameters(), **hp)
    if undo_all:  # an undo slot per chunk: many chunks may be in flight at once
        lay = RetainedLayout.create(
            model, chunk_numel=16, align_bytes=16, states=required_states(plain), undo_slots=None
        )
        opt = to_retained(plain, lay)
    else:
        opt = retain(model, plain, chunk_numel=16, alloc=alloc, align_bytes=16)
    for s in range(steps):
        train_step(model, opt, s)
    return model, opt


def backward(model: Net, opt: Any, step: int) -> None:
    x, y = batch(step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(torch.tanh(model(x, use_aux=step % 2 == 0)), y).backward()


ADAM = (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True})
SGD_M = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True})


@pytest.mark.parametrize("cls,hp", [ADAM, SGD_M])
def test_undo_of_half_the_chunks_restores_every_bit(cls: Any, hp: dict[str, Any]) -> None:
    model, opt = trained(cls, hp, 5, undo_all=True)
    backward(model, opt, 5)
    opt.prepare(6)
    before, ps = snapshot(opt), json.dumps(opt.process_state())
    n = opt.layout.n_chunks
    opt.begin(6)
    for i in range(n // 2):  # half the chunks applied, each holding its undo copy
        opt.save_undo(i)
        opt.apply_chunk(i)
        assert opt.layout.chunk_status(i) is ChunkStatus.APPLIED
    assert not equal(snapshot(opt)[:-1], before[:-1])
    opt.save_undo(n // 2)  # and one torn: garbage half-written
    opt.layout.chunk_data(n // 2)[0][:5] = float("nan")
    for i in range(n // 2 + 1):
        opt.restore_undo(i)
    opt._plan = None
    assert equal(snapshot(opt), before)  # params, states and header, bit for bit
    assert opt.layout.verify() == []
    assert json.dumps(opt.process_state()) == ps


@pytest.mark.parametrize("cls,hp", [ADAM, SGD_M])
def test_restore_undo_of_applied_and_torn_chunks_is_bit_exact(cls: Any, hp: dict[str, Any]) -> None:
    model, opt = trained(cls, hp, 5)
    backward(model, opt, 5)
    before, ps = snapshot(opt), json.dumps(opt.process_state())
    n = opt.layout.n_chunks
    opt.prepare(6)
    opt.begin(6)
    for i in range(n // 2):  # apply half of the chunks (one undo slot: restore each)
        opt.save_undo(i)
        opt.apply_chunk(i)
        assert opt.layout.chunk_status(i) is ChunkStatus.APPLIED
        opt.restore_undo(i)
    opt.save_undo(n // 2)  # a torn chunk: garbage half-written
    opt.layout.chunk_data(n // 2)[0][:5] = float("nan")
    opt.roll_back()
    assert equal(snapshot(opt)[:-1], before[:-1])
    assert all(opt.layout.chunk_status(i) is ChunkStatus.CLEAN for i in range(n))
    assert opt.layout.verify() == []
    assert json.dumps(opt.process_state()) == ps


@pytest.mark.parametrize("cls,hp", [ADAM, SGD_M])
def test_roll_forward_after_restore_equals_an_uninterrupted_step(
    cls: Any, hp: dict[str, Any]
) -> None:
    ref_model, ref = trained(cls, hp, 5)
    model, opt = trained(cls, hp, 5)
    for m, o in ((ref_model, ref), (model, opt)):
        backward(m, o, 5)
    ref.step()
    n = opt.layout.n_chunks
    opt.prepare(6)
    opt.begin(6)
    for i in range(n - 1):
        opt.save_undo(i)
        opt.apply_chunk(i)
        opt.restore_undo(i)  # undo everything applied so far
    opt.save_undo(n - 1)
    opt.layout.chunk_data(n - 1)[-1].fill_(123.0)  # torn
    seen = []
    opt.roll_forward(on_applied=seen.append)
    assert seen == list(range(n))
    assert equal(snapshot(opt), snapshot(ref))
    assert_bitwise(ref_model, model)
    for s in range(6, 12):
        train_step(ref_model, ref, s)
        train_step(model, opt, s)
    assert_bitwise(ref_model, model)


@pytest.mark.parametrize("cls,hp", [ADAM, SGD_M])
def test_roll_forward_in_a_new_process(cls: Any, hp: dict[str, Any]) -> None:
    """A trainer dies mid-step; a shadow attaches to the retained segments and finishes it."""
    ref_model, ref = trained(cls, hp, 4)
    store = InMemorySegments()
    model, opt = trained(cls, hp, 4, alloc=store)
    for m, o in ((ref_model, ref), (model, opt)):
        backward(m, o, 4)
    ref.step()
    process_state = json.dumps(opt.process_state())  # retained by the keeper at step 4
    n = opt.layout.n_chunks
    opt.prepare(5)
    opt.begin(5)
    for i in range(n // 2):
        opt.save_undo(i)
        opt.apply_chunk(i)
        opt.finish_chunk(i)
    opt.save_undo(n // 2)
    opt.apply_chunk(n // 2)  # APPLIED, undo still held
    del model, opt  # the trainer dies

    shadow = make_net(device="meta")
    new = retain(
        shadow,
        cls(shadow.parameters(), **hp),
        chunk_numel=16,
        alloc=store,
        attach=True,
        align_bytes=16,
    )
    new.load_process_state(json.loads(process_state))
    assert new.version == 4 and new.layout.chunk_status(n // 2) is ChunkStatus.APPLIED
    assert new.layout.verify() == [] and new.layout.grads.verify(5) == []
    new.roll_forward()
    assert new.version == 5
    assert_bitwise(ref_model, shadow)
    assert equal(snapshot(new), snapshot(ref))
    for s in range(5, 10):
        train_step(ref_model, ref, s)
        train_step(shadow, new, s)
    assert_bitwise(ref_model, shadow)


def test_transaction_errors() -> None:
    model, opt = trained(*ADAM, 1)
    with pytest.raises(ChunkStateError, match="next step is 2"):
        opt.prepare(3)
    with pytest.raises(ChunkStateError, match="prepared for step 1"):
        opt.begin(2)
    with pytest.raises(ChunkStateError, match="no step begun"):
        opt.apply_chunk(0)
    backward(model, opt, 1)
    opt.prepare(2)
    opt.begin(2)
    with pytest.raises(ChunkStateError, match="call save_undo"):
        opt.apply_chunk(0)
    opt.save_undo(0)
    with pytest.raises(ChunkStateError, match="being applied"):
        opt.process_state()
    with pytest.raises(ChunkStateError, match="not clean at 2"):
        opt.end()
    with pytest.raises(ChunkStateError, match="still needed"):
        opt.finish_chunk(0)
    with pytest.raises(ChunkStateError):
        opt.load_state_dict(opt.state_dict())
    opt.roll_back()
    opt.step()
    assert opt.version == 2


def test_constructor_errors() -> None:
    model = make_net()
    lay = RetainedLayout.create(model, chunk_numel=16)
    with pytest.raises(LayoutError, match="exp_avg"):
        ChunkedAdam(lay, lr=1e-3)
    with pytest.raises(LayoutError, match="momentum_buffer"):
        ChunkedSGD(lay, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="Invalid learning rate"):  # torch's own validation
        ChunkedSGD(lay, lr=-1.0)
    with pytest.raises(ValueError, match="differentiable"):
        ChunkedSGD(lay, lr=0.1, differentiable=True)
    with pytest.raises(LayoutError, match="not a parameter"):
        ChunkedSGD(lay, [nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS cannot be retained.*closure"):
        WholeStepOptimizer(lay, torch.optim.LBFGS(model.parameters()))
    opt = ChunkedSGD(lay, lr=0.1)
    with pytest.raises(TypeError):
        WholeStepOptimizer(lay, opt)
    with pytest.raises(LayoutError, match="format"):
        opt.load_process_state({"format": 0})
    other = make_net()
    with pytest.raises(LayoutError, match="lacks the optimizer states"):
        store = InMemorySegments()
        RetainedLayout.create(other, chunk_numel=16, alloc=store)
        retain(
            make_net("meta"),
            torch.optim.Adam(other.parameters()),
            chunk_numel=16,
            alloc=store,
            attach=True,
        )


# -------------------------------------------------------------- state dicts


def test_process_state_is_json_and_round_trips() -> None:
    model, opt = trained(torch.optim.AdamW, {"lr": 1e-2, "betas": (0.85, 0.99)}, 3)
    ps = opt.process_state()
    text = json.dumps(ps)
    assert "tensor" in text and "retained" in text
    model2, opt2 = trained(torch.optim.AdamW, {"lr": 5.0}, 0)
    with pytest.raises(LayoutError, match="retained chunks at 0"):
        opt2.load_process_state(json.loads(text))
    with torch.no_grad():
        for b2, b in zip(opt2.layout.data_buffers(), opt.layout.data_buffers(), strict=True):
            b2.copy_(b)
    opt2.set_version(3)
    opt2.load_process_state(json.loads(text))
    assert opt2.param_groups[0]["betas"] == (0.85, 0.99) and opt2.param_groups[0]["lr"] == 1e-2
    assert opt2.process_state() == ps
    for s in range(3, 8):
        train_step(model, opt, s)
        train_step(model2, opt2, s)
    assert_bitwise(model, model2)


def test_torch_state_dict_round_trips_both_ways() -> None:
    hp = {"lr": 1e-2, "weight_decay": 0.1, "foreach": False}
    model, opt = trained(torch.optim.Adam, hp, 6)
    # chunked -> torch
    ref_model = make_net()
    with torch.no_grad():
        for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
            p.copy_(q)
    ref = torch.optim.Adam(ref_model.parameters(), **hp)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # as torch.save/torch.load would
    # torch -> chunked (the existing state is copied into retained buffers)
    model3 = make_net()
    with torch.no_grad():
        for p, q in zip(model3.parameters(), model.parameters(), strict=True):
            p.copy_(q)
    plain = torch.optim.Adam(model3.parameters(), **hp)
    plain.load_state_dict(ref.state_dict())
    opt3 = retain(model3, plain, chunk_numel=32)
    assert opt3.layout.verify() == []
    st = opt3.state[model3.l1.weight]
    assert st["exp_avg"].data_ptr() != plain.state_dict()["state"][0]["exp_avg"].data_ptr()
    opt3.set_version(opt.version)
    for s in range(6, 12):
        train_step(model, opt, s)
        train_step(ref_model, ref, s)
        train_step(model3, opt3, s)
    assert_bitwise(ref_model, model)
    assert_bitwise(ref_model, model3)


# ------------------------------------------------------------------ fallback


@pytest.mark.parametrize(
    "cls,hp",
    [
        (
            torch.optim.RMSprop,
            {"lr": 1e-2, "momentum": 0.9, "centered": True, "weight_decay": 1e-3},
        ),
        (torch.optim.Adagrad, {"lr": 5e-2}),
    ],
)
def test_whole_step_fallback_bitwise(cls: Any, hp: dict[str, Any]) -> None:
    ref_model, model, ref, opt = run_pair(cls, {"foreach": False, **hp}, steps=60)
    assert isinstance(opt, WholeStepOptimizer)
    assert_bitwise(ref_model, model)
    lay = opt.layout
    assert set(lay.states) == set(required_states(ref))
    for name in lay.states:  # the optimizer's state tensors are retained views
        for i, p in enumerate(lay.params):
            if name in opt.state[p]:
                assert opt.state[p][name].data_ptr() == lay.state_view(name, i).data_ptr()
    json.dumps(opt.process_state())


def test_generic_path_transactions() -> None:
    """Roll back a begun step; then half a step written, the trainer dies, a new process
    replays the step from the retained before copy: bitwise the uninterrupted run."""
    hp = {"lr": 1e-2, "momentum": 0.5, "foreach": False}
    store = InMemorySegments()
    model, opt = trained(torch.optim.RMSprop, hp, 3, alloc=store)
    assert isinstance(opt, WholeStepOptimizer)
    ref_model, ref = trained(torch.optim.RMSprop, hp, 3)
    for m, o in ((model, opt), (ref_model, ref)):
        backward(m, o, 3)
    ref.step()
    before, ps = snapshot(opt), json.dumps(opt.process_state())
    n = opt.layout.n_chunks
    opt.prepare(4)
    opt.begin(4)
    opt.save_undo(0)
    opt.apply_chunk(0)
    assert not equal(snapshot(opt)[:-1], before[:-1])
    opt.roll_back()
    assert equal(snapshot(opt)[:-1], before[:-1])
    assert json.dumps(opt.process_state()) == ps
    opt.prepare(4)  # the same gradients, prepared again
    opt.begin(4)
    for i in range(n // 2):  # written and released: these chunks' old bytes are gone
        opt.save_undo(i)
        opt.apply_chunk(i)
        opt.finish_chunk(i)
    opt.save_undo(n // 2)
    opt.apply_chunk(n // 2, seal=False)  # torn
    del model, opt  # the trainer dies

    shadow = make_net(device="meta")
    new = retain(
        shadow,
        torch.optim.RMSprop(shadow.parameters(), **hp),
        chunk_numel=16,
        alloc=store,
        attach=True,
        align_bytes=16,
    )
    new.load_process_state(json.loads(ps))
    new.roll_forward()
    assert new.version == 4
    assert equal(snapshot(new), snapshot(ref))
    assert_bitwise(ref_model, shadow)
    assert json.dumps(new.process_state()) == json.dumps(ref.process_state())


def test_generic_path_refuses_a_damaged_before_copy() -> None:
    hp = {"lr": 1e-2, "foreach": False}
    store = InMemorySegments()
    model, opt = trained(torch.optim.Adagrad, hp, 2, alloc=store)
    backward(model, opt, 2)
    opt.prepare(3)
    opt.begin(3)
    opt.save_undo(0)
    opt.apply_chunk(0)
    opt.finish_chunk(0)
    store.segments["leto.before"][5] ^= 1  # a flipped bit in the retained copy
    opt._plan = None  # a new process: it did not write the copy itself
    with pytest.raises(ChecksumError, match="cannot be replayed"):
        opt.roll_forward()


def test_unsupported_optimizers_are_named_with_why() -> None:
    model = make_net()
    with pytest.raises(UnsupportedOptimizerError, match="^optimizer: LBFGS .*closure"):
        check_supported(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(UnsupportedOptimizerError, match="^optimizer: SparseAdam .*sparse"):
        check_supported(torch.optim.SparseAdam(model.parameters()))

    class Noisy(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for g in self.param_groups:
                for p in g["params"]:
                    p.add_(torch.randn_like(p), alpha=g["lr"])

    with pytest.raises(UnsupportedOptimizerError, match="^optimizer: Noisy .*not deterministic"):
        check_supported(Noisy(model.parameters(), lr=0.1))
    check_supported(torch.optim.RMSprop(model.parameters()))


def test_subclasses_take_the_chunked_path_only_with_torch_s_step() -> None:
    model = make_net()

    class Renamed(torch.optim.AdamW):
        pass

    class OwnStep(torch.optim.AdamW):
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    assert is_chunkable(Renamed(model.parameters()))
    assert not is_chunkable(OwnStep(model.parameters()))
    assert not is_chunkable(torch.optim.RMSprop(model.parameters()))


def test_to_retained_shares_param_groups_with_the_original() -> None:
    model = make_net()
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
    lay = RetainedLayout.create(model, chunk_numel=16)
    opt = to_retained(plain, lay)
    with pytest.warns(UserWarning):
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.05


@pytest.mark.parametrize("cls,hp", [ADAM, SGD_M])
def test_settle_lets_tier_1_follow_a_written_chunk_before_its_undo_goes(
    cls: Any, hp: dict[str, Any]
) -> None:
    """A rank stopped at the safe point between its last chunk's write and that chunk's
    tier-1 update (an abort reaches a survivor there): every chunk is at the target, the
    last one APPLIED with its undo copy held. The settle calls ``on_applied`` for it
    before it releases the undo copy (the backend's parity update reads it), so tier 1
    follows the chunk instead of the recovery re-encoding the node's parity."""
    from leto.retained.recovery import settle

    ref_model, ref = trained(cls, hp, 4)
    model, opt = trained(cls, hp, 4)
    for m, o in ((ref_model, ref), (model, opt)):
        backward(m, o, 4)
    ref.step()
    ps4 = json.dumps(opt.process_state())
    n = opt.layout.n_chunks
    opt.prepare(5)
    opt.begin(5)
    for i in range(n):
        opt.save_undo(i)
        opt.apply_chunk(i)
        if i < n - 1:
            opt.finish_chunk(i)
    assert opt.layout.chunk_status(n - 1) is ChunkStatus.APPLIED
    seen: list[int] = []
    done = settle(
        opt.layout,
        opt,
        5,
        history={4: ps4},
        pending={"step": 5, "present": None, "rng": None, "sampler": None},
        load_ps=lambda js: opt.load_process_state(json.loads(js)),
        step_scheduler=lambda: None,
        who="rank 0",
        on_applied=seen.append,
    )
    assert seen == [n - 1]  # only the chunk whose tier-1 update the stop left out
    assert (done.forward, done.back) == (0, 0)
    assert opt.version == 5 and opt.layout.verify() == []
    assert all(opt.layout.chunk_status(i) is ChunkStatus.CLEAN for i in range(n))
    assert equal(snapshot(opt), snapshot(ref))
    assert_bitwise(ref_model, model)
