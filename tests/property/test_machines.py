"""Each machine's table against an expectation written here, independently, from the
theory of operation in its module docstring; and every illegal event refused with the
machine's state left as it was."""

from __future__ import annotations

import enum
from typing import Any

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from leto.core import events as ev
from leto.core.chunk import CHUNK, ChunkState
from leto.core.errors import ProtocolError
from leto.core.recovery import RECOVERY, Phase
from leto.core.shadow import SHADOW, ShadowState
from leto.core.table import Table
from leto.core.trainer import TRAINER, TrainerState
from leto.core.txn import COMMIT, TXN, CommitState, TxnState

T, C, S, Tr, P, Cm = TxnState, ChunkState, ShadowState, TrainerState, Phase, CommitState

EXPECTED: dict[str, dict[tuple[Any, type], Any]] = {
    "txn": {
        (T.IDLE, ev.Compute): T.COMPUTED,
        (T.COMPUTED, ev.Reduce): T.REDUCED,
        (T.REDUCED, ev.Prepare): T.PREPARED,
        (T.PREPARED, ev.BeginChunk): T.APPLYING,
        (T.APPLYING, ev.BeginChunk): T.APPLYING,
        (T.APPLYING, ev.EndChunk): T.APPLYING,
        (T.APPLYING, ev.ParityChunk): T.APPLYING,
        (T.APPLYING, ev.Finish): T.TAIL,  # the user's loop tail, until the next batch
        (T.TAIL, ev.Close): T.IDLE,
        **{(x, e): T.IDLE for x in T for e in (ev.Promote, ev.Resume)},
    },
    "commit": {
        (Cm.OPEN, ev.Prepare): Cm.VOTING,
        (Cm.VOTING, ev.Prepare): Cm.VOTING,
        (Cm.VOTING, ev.Decide): Cm.OPEN,
        **{(x, e): Cm.OPEN for x in Cm for e in (ev.Fence, ev.Reconcile, ev.RestoreCheckpoint)},
    },
    "chunk": {
        (C.CLEAN, ev.BeginChunk): C.WRITING,
        (C.WRITING, ev.EndChunk): C.WRITTEN,
        (C.WRITTEN, ev.ParityChunk): C.CLEAN,
        **{(x, e): C.LOST for x in C for e in (ev.LoseMemory, ev.LoseNode)},
        **{(x, e): C.CLEAN for x in C for e in (ev.Reconcile, ev.RestoreCheckpoint)},
        **{(x, ev.StaleWrite): C.CORRUPT for x in (C.CLEAN, C.WRITING, C.WRITTEN)},
    },
    "shadow": {
        (S.SPAWNING, ev.ShadowWarm): S.WARM,
        (S.COLD, ev.ShadowWarm): S.WARM,
        (S.WARM, ev.ShadowReclaim): S.COLD,
        (S.WARM, ev.Promote): S.SPAWNING,
        (S.COLD, ev.Promote): S.SPAWNING,
        **{(x, ev.LoseNode): S.SPAWNING for x in S},
    },
    "trainer": {
        (Tr.ALIVE, ev.Crash): Tr.DEAD,
        (Tr.ALIVE, ev.Hang): Tr.HUNG,
        **{(x, e): Tr.DEAD for x in Tr for e in (ev.LoseMemory, ev.LoseNode)},
        (Tr.HUNG, ev.Fence): Tr.DEAD,
        (Tr.DEAD, ev.Promote): Tr.ALIVE,
    },
    "recovery": {
        **{
            (x, ev.Detect): P.FENCING
            for x in (P.RUNNING, P.PROMOTING, P.RECONCILING, P.FALLBACK, P.REBUILDING, P.RESUMING)
        },
        (P.FENCING, ev.Fence): P.PROMOTING,
        (P.PROMOTING, ev.Promote): P.PROMOTING,
        (P.PROMOTING, ev.EndPromote): P.RECONCILING,
        (P.RECONCILING, ev.Reconcile): P.REBUILDING,
        (P.RECONCILING, ev.GoFallback): P.FALLBACK,
        (P.FALLBACK, ev.RestoreCheckpoint): P.REBUILDING,
        (P.REBUILDING, ev.Rebuild): P.RESUMING,
        (P.RESUMING, ev.Resume): P.RUNNING,
        (P.RUNNING, ev.Decide): P.RUNNING,
        (P.RUNNING, ev.Tier2Snapshot): P.RUNNING,
        (P.RUNNING, ev.BeginCheckpoint): P.RUNNING,
        (P.RUNNING, ev.WriteShard): P.RUNNING,
        (P.RUNNING, ev.CheckpointDurable): P.RUNNING,
        **{
            (x, ev.GiveUp): P.FAILED
            for x in (P.FENCING, P.PROMOTING, P.RECONCILING, P.FALLBACK, P.REBUILDING, P.RESUMING)
        },
    },
}

TABLES: dict[str, tuple[Table[Any], type[enum.Enum]]] = {
    "txn": (TXN, TxnState),
    "commit": (COMMIT, CommitState),
    "chunk": (CHUNK, ChunkState),
    "shadow": (SHADOW, ShadowState),
    "trainer": (TRAINER, TrainerState),
    "recovery": (RECOVERY, Phase),
}


def _instance(cls: type) -> ev.Event:
    fields = {"rank": 0, "chunk": 0, "node": 0}
    names = getattr(cls, "__attrs_attrs__", ())
    return cls(**{a.name: fields[a.name] for a in names})  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", sorted(TABLES))
def test_table_equals_independent_expectation(name: str) -> None:
    table, _ = TABLES[name]
    assert dict(table.transitions) == EXPECTED[name]
    assert table.machine == name


@pytest.mark.parametrize("name", sorted(TABLES))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_walk_follows_table_and_refuses_illegal(name: str, data: st.DataObject) -> None:
    table, states = TABLES[name]
    expected = EXPECTED[name]
    state = data.draw(st.sampled_from(sorted(states, key=lambda s: s.value)))
    for _ in range(30):
        cls = data.draw(st.sampled_from(sorted(ev.ALL, key=lambda c: c.__name__)))
        e = _instance(cls)
        note(f"{state.name} + {cls.__name__}")
        if (state, cls) in expected:
            nxt = table.next(state, e)
            assert nxt is expected[(state, cls)]
            state = nxt
        else:
            before = state
            with pytest.raises(ProtocolError) as info:
                table.next(state, e)
            assert info.value.machine == name
            assert info.value.state is before and info.value.event == e
            assert name in str(info.value) and before.name in str(info.value)


def test_protocol_error_names_machine_state_and_event() -> None:
    with pytest.raises(
        ProtocolError, match=r"txn: event Finish\(rank=0\) is illegal in state IDLE"
    ):
        TXN.next(TxnState.IDLE, ev.Finish(0))


def test_duplicate_rows_are_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate row"):
        Table.build("x", [(TxnState.IDLE, ev.Compute, None), (TxnState.IDLE, ev.Compute, None)])


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (ev.Compute, {"rank": -1}, "rank must be >= 0"),
        (ev.BeginChunk, {"rank": 0, "chunk": -2}, "chunk must be >= 0"),
        (ev.LoseNode, {"node": "1"}, "node must be an int"),
        (ev.Crash, {"rank": True}, "rank must be an int"),
    ],
)
def test_events_validate_in_their_constructor(
    cls: type, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        cls(**kwargs)


def test_events_are_frozen() -> None:
    e = ev.Compute(1)
    with pytest.raises(AttributeError):
        e.rank = 2  # type: ignore[misc]
