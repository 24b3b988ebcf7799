"""A node's tier-1 blocks live in one segment of its agent (``parity_block.TIER1``),
mapped once by each rank (``RankMemory.node_memory``); a warm shadow maps it before any
promotion (``RankMemory.premap_node``), so a promoted rank asks its agent for nothing.
Each block is locked by its own byte range of the segment."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from leto.backends.gloo import messages as M
from leto.backends.gloo.host_memory import HostMemory
from leto.backends.gloo.parity_block import tier1_bytes, tier1_name
from leto.backends.gloo.rank_memory import RankMemory
from leto.retained.recovery import IntegrityError

MEMBERS = 2


class _Channel:
    """The agent's side of the requests, served by a real :class:`HostMemory`."""

    def __init__(self, mem: HostMemory) -> None:
        self.mem = mem
        self.asked: list[tuple[str, int]] = []  # each NodeSegment request: name, bytes

    def request(self, msg: M.Message) -> tuple[dict[str, Any], list[int]]:
        if isinstance(msg, M.NodeListing):
            return self.mem.node_listing(), []
        assert isinstance(msg, M.NodeSegment)
        self.asked.append((msg.name, msg.nbytes))
        reply, fds = self.mem.node_segment(msg.name, msg.nbytes)
        return reply, [os.dup(fd) for fd in fds]  # as SCM_RIGHTS would: the rank's own


def _node() -> tuple[HostMemory, _Channel]:
    agent = SimpleNamespace(job="premap-test", node=0)
    mem = HostMemory(agent)  # type: ignore[arg-type]
    return mem, _Channel(mem)


def _rank(ch: _Channel, chunks: int = 3, *, tier1: bool = True) -> RankMemory:
    lay = SimpleNamespace(
        states=["exp_avg"], chunk_numel=8, dtype=torch.float32, n_chunks=chunks, numel=8 * chunks
    )
    s = SimpleNamespace(
        ch=ch,
        members=MEMBERS,
        cfg=SimpleNamespace(tier1=tier1),
        layout=lay,
        replica=False,
        parity=[],
        gparity=None,
    )
    return RankMemory(s)  # type: ignore[arg-type]


def test_a_promoted_rank_maps_the_segment_its_shadow_mapped_early() -> None:
    mem, ch = _node()
    first = _rank(ch)
    first.node_memory()  # the node's first rank makes it: one request for every block
    size = tier1_bytes(MEMBERS, 2 * 8 * 4, 3, 8 * 3 * 4)
    name = tier1_name(2 * 8 * 4, 3, 8 * 3 * 4)
    assert ch.asked == [(name, size)] and name == "tier1.3x64.96"
    blocks = first.session.parity
    assert [b.nbytes for b in blocks] == [64, 64, 64] and first.session.gparity.nbytes == 96
    blocks[1].parity().fill_(7)  # bytes written through one rank's mapping...
    mem.node_segment("other", 10)  # a segment that is no tier 1
    shadow = _rank(ch)
    assert shadow.premap_node() == 1
    assert shadow.premap_node() == 1 and ch.asked == [(name, size)] * 2  # mapped once
    shadow.node_memory()
    assert ch.asked == [(name, size)] * 2  # the promotion asks for nothing
    seen = shadow.session.parity[1].parity()
    assert torch.equal(seen, torch.full((64,), 7, dtype=torch.uint8))  # ...seen by another
    assert shadow.premapped is None  # taken: a later layout maps afresh
    mem.close()


def test_a_shadow_maps_nothing_before_a_rank_made_the_segment() -> None:
    mem, ch = _node()
    shadow = _rank(ch)
    assert shadow.premap_node() == 0 and ch.asked == []  # nothing made: nothing made here
    _rank(ch).node_memory()
    assert shadow.premap_node() == 1
    mem.close()


def test_an_early_segment_of_another_geometry_is_not_used() -> None:
    mem, ch = _node()
    _rank(ch, chunks=3).node_memory()
    shadow = _rank(ch, chunks=4)  # its layout has another size
    assert shadow.premap_node() == 1
    assert shadow.premapped is not None
    early_ino = os.fstat(shadow.premapped[1]).st_ino
    before = _held(early_ino)  # the agent's, the first rank's and the shadow's
    shadow.node_memory()  # its own geometry's segment: never the other's blocks
    assert ch.asked[-1] == (tier1_name(64, 4, 128), tier1_bytes(MEMBERS, 64, 4, 128))
    assert len(shadow.session.parity) == 4
    assert shadow.session.gparity is not None
    assert os.fstat(shadow.session.gparity.fd).st_ino != early_ino
    assert _held(early_ino) < before  # the early mapping closed, with its descriptor
    mem.close()


def _held(ino: int) -> int:
    """How many of this process's descriptors are of the file ``ino``."""
    return sum(
        _alive(fd) and os.fstat(fd).st_ino == ino for fd in map(int, os.listdir("/proc/self/fd"))
    )


def _alive(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_segment_the_agent_refuses_is_a_clear_error() -> None:
    mem, ch = _node()
    name = tier1_name(64, 3, 96)
    mem.node_segment(name, 8)  # made at a size no layout of this geometry has
    with pytest.raises(IntegrityError, match=rf"no segment {name} of \d+ bytes \({name} has 8"):
        _rank(ch).node_memory()
    mem.close()


def test_without_tier_1_nothing_is_mapped() -> None:
    mem, ch = _node()
    _rank(ch).node_memory()
    shadow = _rank(ch, tier1=False)
    assert shadow.premap_node() == 0
    shadow.node_memory()
    assert shadow.session.parity == [] and len(ch.asked) == 1
    mem.close()


def test_the_blocks_are_disjoint_and_each_locks_its_own_range() -> None:
    mem, ch = _node()
    r = _rank(ch)
    r.node_memory()
    blocks = [*r.session.parity, r.session.gparity]
    for b in blocks:  # every byte of each block, header included
        b.t.fill_(0)
    blocks[1].t.fill_(255)
    assert [int(b.t.sum()) for b in blocks] == [0, 255 * blocks[1].t.numel(), 0, 0]
    probe = (
        "import fcntl, sys\n"
        "fd, n, at = map(int, sys.argv[1:])\n"
        "try:\n"
        "    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, n, at)\n"
        "except OSError:\n"
        "    sys.exit(3)\n"
    )

    def other_process_locks(b: Any) -> bool:
        n, at = b._range
        rc = subprocess.run(
            [sys.executable, "-c", probe, str(b.fd), str(n), str(at)], pass_fds=[b.fd]
        ).returncode
        assert rc in (0, 3)
        return rc == 0

    with blocks[1].lock():
        assert not other_process_locks(blocks[1])  # held here: another process waits
        assert other_process_locks(blocks[0]) and other_process_locks(blocks[2])
        assert other_process_locks(blocks[3])
    assert other_process_locks(blocks[1])  # released
    os.fstat(blocks[0].fd)  # the descriptor stays open for the blocks' locks
    mem.close()
