"""A warm shadow maps its node's tier-1 blocks before any promotion
(``RankMemory.premap_node``); a promoted rank then asks its agent only for the blocks it
did not map early (``RankMemory._blocks``), and the blocks are the agent's segments."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from leto.backends.gloo import messages as M
from leto.backends.gloo.host_memory import HostMemory
from leto.backends.gloo.parity_block import block_bytes
from leto.backends.gloo.rank_memory import RankMemory
from leto.retained.recovery import IntegrityError

MEMBERS = 2


class _Channel:
    """The agent's side of the requests, served by a real :class:`HostMemory`."""

    def __init__(self, mem: HostMemory) -> None:
        self.mem = mem
        self.asked: list[list[str]] = []  # the names of each NodeSegments request

    def request(self, msg: M.Message) -> tuple[dict[str, Any], list[int]]:
        if isinstance(msg, M.NodeListing):
            return self.mem.node_listing(), []
        assert isinstance(msg, M.NodeSegments)
        self.asked.append(list(msg.names))
        reply, fds = self.mem.node_segments_of(msg.names, msg.sizes)
        return reply, [os.dup(fd) for fd in fds]  # as SCM_RIGHTS would: the rank's own


def _node() -> tuple[HostMemory, _Channel]:
    agent = SimpleNamespace(job="premap-test", node=0)
    mem = HostMemory(agent)  # type: ignore[arg-type]
    return mem, _Channel(mem)


def _rank(ch: _Channel) -> RankMemory:
    s = SimpleNamespace(ch=ch, members=MEMBERS, cfg=SimpleNamespace(tier1=True))
    return RankMemory(s)  # type: ignore[arg-type]


def test_a_promoted_rank_asks_only_for_the_blocks_it_did_not_map_early() -> None:
    mem, ch = _node()
    want = [(f"parity.{c}", 64) for c in range(3)] + [("gparity", 128)]
    first = _rank(ch)
    made = first._blocks(want)  # the node's first rank makes them
    made[1].parity().fill_(7)  # bytes written through one mapping...
    mem.node_segment("other", 10)  # a segment that is no block
    shadow = _rank(ch)
    assert shadow.premap_node() == 4
    ch.asked.clear()
    assert shadow.premap_node() == 4 and ch.asked == []  # nothing new: nothing asked
    first._blocks([("parity.3", 64)])  # made after the shadow's last look
    ch.asked.clear()
    more = want + [("parity.3", 64), ("parity.4", 64)]  # and one made by the promotion
    blocks = shadow._blocks(more)
    assert ch.asked == [["parity.3", "parity.4"]]  # one request, for those not mapped early
    assert [b.nbytes for b in blocks] == [64, 64, 64, 128, 64, 64]
    assert torch.equal(blocks[1].parity(), torch.full((64,), 7, dtype=torch.uint8))  # ...seen
    assert shadow.premapped == {}  # taken: a later layout maps afresh
    mem.close()


def test_early_blocks_of_another_geometry_are_not_used() -> None:
    mem, ch = _node()
    _rank(ch)._blocks([("parity.0", 64)])
    shadow = _rank(ch)
    assert shadow.premap_node() == 1
    (early,) = shadow.premapped.values()
    ch.asked.clear()
    # the promoted rank's layout wants another size: asked for, and refused by the agent
    # as before (the segment has the other size); the early mapping's descriptor closed
    reply, fds = mem.node_segment("parity.0", block_bytes(MEMBERS, 32))
    assert not reply["ok"] and fds == []
    with pytest.raises(IntegrityError, match="sent 0 segments for 1"):
        shadow._blocks([("parity.0", 32)])
    assert ch.asked == [["parity.0"]]
    with pytest.raises(OSError):
        os.fstat(early.fd)  # closed
    mem.close()


def test_without_tier_1_nothing_is_mapped() -> None:
    mem, ch = _node()
    _rank(ch)._blocks([("parity.0", 64)])
    s = SimpleNamespace(ch=ch, members=MEMBERS, cfg=SimpleNamespace(tier1=False))
    assert RankMemory(s).premap_node() == 0  # type: ignore[arg-type]
    mem.close()
