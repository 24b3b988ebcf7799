"""``ProcessGroups.destroy``: a generation's communicators are left at once and torn
down on a thread of their own (a gloo group's destructor takes 10-40 ms here), which a
process exiting meanwhile waits for instead of aborting."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from leto.backends.gloo.process_groups import ProcessGroups
from leto.backends.gloo.procs import free_port


def test_destroy_leaves_at_once_and_tears_down_on_its_own_thread(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    groups = ProcessGroups(None)  # type: ignore[arg-type]  # destroy reads no session
    groups.pg_gen, groups.node_group = 0, dist.new_group([0])
    groups.destroy()
    assert not dist.is_initialized() and groups.node_group is None and groups.pg_gen is None
    t = groups.teardown
    assert t is not None and t is not threading.current_thread() and not t.daemon
    t.join(30)
    assert not t.is_alive()
    # the next generation forms at once, the old one's teardown or not
    dist.init_process_group("gloo", store=dist.PrefixStore("g1", store), rank=0, world_size=1)
    x = torch.ones(3)
    dist.all_reduce(x)
    assert x.tolist() == [1.0, 1.0, 1.0]
    groups.destroy()
    assert groups.teardown is not None
    groups.teardown.join(30)


_EXITING = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    import torch.distributed as dist
    from leto.backends.gloo.process_groups import ProcessGroups
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    groups = ProcessGroups(None)
    groups.pg_gen = 0
    groups.node_group = dist.new_group([0, 1])
    groups.cross_group = dist.new_group([0, 1])
    dist.barrier()
    groups.destroy()
    # the process ends here, its groups' teardown under way
    """
)


def test_a_process_that_exits_during_the_teardown_exits_cleanly() -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _EXITING, str(r), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "terminate called" not in err, (p.returncode, err[-2000:])


def test_a_formed_groups_collective_timeout_is_set_through_torchs_private_api(
    tmp_path: Path,
) -> None:
    """ProcessGroups forms a generation with a short timeout and then gives its groups
    the collective timeout through torch's ``_set_pg_timeout``: fails when torch changes
    it (``set_timeout`` is the one place that calls it)."""
    from datetime import timedelta

    from leto.backends.gloo.process_groups import FORM_TIMEOUT_S, set_timeout

    store = dist.FileStore(str(tmp_path / "store"), 1)
    form = timedelta(seconds=FORM_TIMEOUT_S)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=form)
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        assert backend.options._timeout == form
        set_timeout(timedelta(seconds=42), dist.group.WORLD)
        assert backend.options._timeout == timedelta(seconds=42)
    finally:
        dist.destroy_process_group()


def test_a_failed_formation_leaves_the_group_names_of_a_fresh_process() -> None:
    """A failed init_process_group counts a group torch never made: without the reset the
    next generation's groups of this rank are named otherwise than a promoted shadow's,
    and the two never meet (found killing two ranks 15 ms apart: every later generation
    timed out forming)."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    from leto.backends.gloo.process_groups import reset_group_count

    store = dist.TCPStore(
        "127.0.0.1", 0, 2, True, timeout=timedelta(seconds=5), wait_for_workers=False
    )
    before = distributed_c10d._world.group_count
    try:  # a peer that never comes
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("g", store), rank=0, world_size=2,
            timeout=timedelta(seconds=0.5),
        )  # fmt: skip
    except Exception:  # noqa: BLE001 - gloo's timeout, its type varies by version
        pass
    assert not dist.is_initialized()
    assert distributed_c10d._world.group_count == before + 1  # what torch does today
    reset_group_count()
    assert distributed_c10d._world.group_count == 0


def test_nccl_groups_are_made_for_both_devices_and_only_nccl_is_aborted(tmp_path: Path) -> None:
    """``backend = "nccl"`` makes every group for host tensors over gloo and CUDA tensors
    over NCCL; a recovery aborts the NCCL communicators only, found through torch's
    private ``ProcessGroup._get_backend`` (fails when torch changes it): a gloo group,
    which serves CUDA tensors itself where NCCL is absent, is not aborted and still works."""
    from leto.backends.gloo.process_groups import abort_nccl, group_backend

    assert group_backend("nccl") == "cpu:gloo,cuda:nccl" and group_backend("gloo") == "gloo"
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        world = dist.group.WORLD
        assert world is not None and world._get_backend(torch.device("cuda")).name() == "gloo"
        assert abort_nccl([world, dist.new_group([0])]) == 0
        t = torch.ones(3)
        dist.all_reduce(t)  # not aborted
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_parity_collectives_are_staged_on_a_device_or_when_asked(monkeypatch: Any) -> None:
    from types import SimpleNamespace

    from leto.retained.parity import HostStaged, TorchDistCollective

    def groups(device: str, backend: str = "gloo") -> ProcessGroups:
        cfg = SimpleNamespace(backend=backend, torch_device=torch.device(device))
        return ProcessGroups(SimpleNamespace(cfg=cfg))  # type: ignore[arg-type]

    monkeypatch.delenv("LETO_STAGE_COLLECTIVES", raising=False)
    assert not groups("cpu").stage
    assert groups("meta").stage  # any device but the host's: gloo reduces host tensors only
    assert not groups("meta", "nccl").stage  # NCCL reduces CUDA tensors where they are
    monkeypatch.setenv("LETO_STAGE_COLLECTIVES", "1")
    g = groups("cpu")
    assert g.stage and g.stage_always
    dist.init_process_group(
        "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,  # type: ignore[attr-defined]
    )
    try:
        coll = g.parity(None)
        assert isinstance(coll, HostStaged) and isinstance(coll.inner, TorchDistCollective)
        t = torch.arange(4.0)
        coll.all_reduce_sum(t)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0] and coll.staged == 1
    finally:
        dist.destroy_process_group()
