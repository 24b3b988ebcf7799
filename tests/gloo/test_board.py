"""The status board: a trainer's phase, step and progress, shared with its agent."""

from __future__ import annotations

import os
import struct

import pytest

from leto.backends.gloo import segments
from leto.backends.gloo.board import PHASES, SIZE, StatusBoard
from leto.backends.gloo.records import Proc, look, note


def _pair() -> tuple[StatusBoard, StatusBoard]:
    """A writer's board and a reader's mapping of the same segment."""
    w, fd = StatusBoard.create()
    try:
        return w, StatusBoard(fd)
    finally:
        os.close(fd)


def test_a_write_is_read_through_another_mapping() -> None:
    w, r = _pair()
    assert r.read() is None  # never written
    assert w.write("forward", 7, 41)
    assert r.read() == ("forward", 7, 41)
    assert w.write("apply", 7, 46)
    assert r.read() == ("apply", 7, 46)
    assert all(w.write(p, 1, i) and r.read() == (p, 1, i) for i, p in enumerate(PHASES))


def test_an_unknown_phase_is_not_written() -> None:
    w, r = _pair()
    w.write("decide", 3, 10)
    assert not w.write("promote", 3, 11)
    assert r.read() == ("decide", 3, 10)


def test_a_write_half_done_is_not_read() -> None:
    w, r = _pair()
    w.write("backward", 2, 5)
    struct.pack_into("<q", w.mm, 0, 3)  # seq odd: the writer stopped half way
    assert r.read(tries=5) is None
    struct.pack_into("<qqqq", w.mm, 0, 4, PHASES.index("prepare"), 2, 6)
    assert r.read() == ("prepare", 2, 6)
    struct.pack_into("<qqqq", w.mm, 0, 6, len(PHASES), 2, 7)  # a phase code out of range
    assert r.read() is None


def test_a_segment_of_another_size_is_refused() -> None:
    fd = segments.create("not-a-board", SIZE + 8)
    try:
        with pytest.raises(ValueError, match="status board has 128 bytes"):
            StatusBoard(fd)
    finally:
        os.close(fd)


def test_the_agent_takes_only_newer_news() -> None:
    p = Proc(
        pid=1,
        pidfd=-1,
        role="trainer",
        local_rank=0,
        rank=0,
        incarnation=0,
        spawned=0.0,
        log_path="",
    )
    w, p.board = _pair()
    look(p, 1.0)  # nothing written yet: nothing changes
    assert (p.phase, p.step, p.progress) == ("startup", 0, -1)
    w.write("forward", 4, 20)
    look(p, 2.0)
    assert (p.phase, p.step, p.progress, p.progress_t) == ("forward", 4, 20, 2.0)
    look(p, 3.0)  # no progress since: the stuck clock keeps running
    assert p.progress_t == 2.0
    note(p, "idle", 3, 19, 4.0)  # a heartbeat sent before the board's write
    assert (p.phase, p.step, p.progress_t) == ("forward", 4, 2.0)
    note(p, "promote", 4, 21, 5.0)  # a phase the board cannot hold, sent as a message
    look(p, 6.0)
    assert (p.phase, p.progress) == ("promote", 21)
