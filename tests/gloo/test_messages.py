"""The gloo backend's wire messages: one frozen class per kind, in one module."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import attrs
import pytest

from leto.backends.gloo import messages as M
from leto.backends.gloo.wire import WireError

GLOO = Path(M.__file__).parent

# a valid value for each field name (every field of every kind is listed here)
GOOD: dict[str, Any] = {
    "pid": 7,
    "role": "trainer",
    "rank": 1,
    "local_rank": 1,
    "node": 1,
    "incarnation": 2,
    "phase": "forward",
    "step": 3,
    "progress": 9,
    "traceback": "Traceback ...",
    "code": 1,
    "json": "{}",
    "id": 4,
    "name": "parity.0",
    "nbytes": 64,
    "names": ["parity.0", "gparity"],
    "sizes": [64, 0],
    "gen": 2,
    "n_chunks": 2,
    "chunk_numel": 4,
    "tier1": True,
    "tier1_kind": "parity",
    "tier2": False,
    "tier2_interval": 10,
    "tier2_parity": 2,
    "checkpoint": False,
    "snapshot": {"step": 0},
    "pending": "{}",
    "loss": 0.5,
    "ps": "{}",
    "replica": "0123abcd",
    "source": 0,
    "diverged": [1],
    "meta": {"k": 1},
    "reason": "why",
    "data": [[1, 2]],  # runs [[value, count], ...]
    "undo": [[-4, 1], [1, 1]],
    "grad": -4,
    "lost": False,
    "pg_ms": 1.5,
    "node_par": [[[1, 1], 2]],
    "node_gpar": [1, 1],
    "summary": {"chunks_rolled_back": 0},
    "digest": {"params": "ab"},
    "memory": {"device": "cpu", "checksum": "xxh3", "staged": False},
    "error": "it broke",
    "restart": 1,
    "warm": True,
    "grow": True,
    "lost_nodes": [1],
    "ms": 12.5,
    "kind": "crash",
    "detected_by": "process exit (pidfd)",
    "detail": "killed by SIGKILL",
    "in_phase": "apply",
    "at_step": 3,
    "ms_since_heartbeat": 3.0,
    "state": "warm",
    "degraded": "no skeleton",
    "killed": [{"rank": 1, "pid": 7}],
    "nonce": "00ff",
    "proof": "ab" * 32,
    "spare": False,
    "spare_id": 0,
    "why": "refused",
    "kill": [1],
    "keeper_pid": 8,
    "keeper_socket": "leto-keeper",
    "target": 3,
    "repairs": [{"what": "tier1", "rank": 1, "chunk": 0, "version": 3, "count": 1}],
    "retake_t2": True,
    "t2": 0,
    "start": 2,
    "fault": "3",
    "host": "127.0.0.1",
    "port": 29400,
    "nnodes": 2,
    "at_start": True,
    "nodes": 2,
    "shard": False,
    "owner": 1,
    "micro_batches": [0, 3],
}
# for each field: a value its validator must refuse
BAD: dict[str, Any] = {
    "int": "3",
    "bool": 1,
    "str": 3,
    "list": "x",
    "dict": [1],
}


def _fields(kind: type[M.Message]) -> tuple[attrs.Attribute[Any], ...]:
    return tuple(attrs.fields(kind))  # type: ignore[arg-type]


def _full(kind: type[M.Message]) -> M.Message:
    return kind(**{a.name: GOOD[a.name] for a in _fields(kind)})


def _bad_value(a: attrs.Attribute[Any]) -> Any:
    ann = str(a.type)
    for word in ("bool", "int", "list", "dict", "str"):  # bool before int: bool is an int
        if ann.startswith(word):
            return BAD[word]
    return object()


@pytest.mark.parametrize("kind", M.KINDS, ids=lambda k: k.TAG)
def test_every_kind_round_trips_through_the_wire(kind: type[M.Message]) -> None:
    msg = _full(kind)
    wire = msg.to_wire()
    assert wire["t"] == kind.TAG
    assert M.decode(wire) == msg
    minimal = kind(**{a.name: GOOD[a.name] for a in _fields(kind) if a.default is attrs.NOTHING})
    assert M.decode(minimal.to_wire()) == minimal


def test_every_kind_is_in_the_tag_table_exactly_once() -> None:
    assert len(M.KINDS) == len(set(M.KINDS)) == len(M.TAGS)
    assert sorted(M.TAGS.values(), key=id) == sorted(M.KINDS, key=id)
    assert all(M.TAGS[k.TAG] is k for k in M.KINDS)
    defined = {v for v in vars(M).values() if isinstance(v, type) and issubclass(v, M.Message)} - {
        M.Message
    }
    assert defined == set(M.KINDS)
    for k in M.KINDS:
        assert k.ROUTE and all(isinstance(e, M.End) for e in k.ROUTE), k
        assert "__slots__" in vars(k)
        assert attrs.has(k) and k.__setattr__ is not object.__setattr__  # frozen


@pytest.mark.parametrize("kind", M.KINDS, ids=lambda k: k.TAG)
def test_a_malformed_message_of_each_kind_is_refused_in_one_line(kind: type[M.Message]) -> None:
    wire = _full(kind).to_wire()
    cases = [{**wire, "surprise": 1}]
    for a in _fields(kind):
        cases.append({**wire, a.name: _bad_value(a)})
        if a.default is attrs.NOTHING:
            cases.append({k: v for k, v in wire.items() if k != a.name})
    for case in cases:
        with pytest.raises(WireError) as e:
            M.decode(case)
        line = str(e.value)
        assert "\n" not in line and line.startswith(f"{kind.TAG}: "), line


@pytest.mark.parametrize(
    "obj",
    [[], "x", {}, {"t": 3}, {"t": "nonsense"}, {"t": "vote", "rank": -1, "step": 1, "gen": 0}],
)
def test_unknown_or_malformed_frames_are_wire_errors(obj: Any) -> None:
    with pytest.raises(WireError):
        M.decode(obj)


def test_a_negative_rank_and_an_overlong_name_are_refused() -> None:
    with pytest.raises(ValueError):
        M.Vote(rank=-1, step=1, gen=0)
    with pytest.raises(ValueError):
        M.Heartbeat(phase="x" * (M.MAX_NAME + 1), step=0, progress=0)
    with pytest.raises(TypeError):
        M.Commit(step=True, gen=0)  # a bool is not an int


# files of the trainer's side, still building and matching tagged dicts: the next to
# convert (this list only shrinks: a file that no longer has any fails the test)
NOT_YET: set[str] = set()
NOT_MESSAGES = {"messages.py", "eventlog.py"}  # the event log's "t" is a record's time


def _tagged_dicts(path: Path) -> list[int]:
    tree = ast.parse(path.read_text())
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Dict)
        and any(isinstance(k, ast.Constant) and k.value == "t" for k in n.keys)
    ]


def test_no_tagged_dict_literals_outside_the_messages_module() -> None:
    found = {
        p.name: lines
        for p in sorted(GLOO.glob("*.py"))
        if p.name not in NOT_MESSAGES and (lines := _tagged_dicts(p))
    }
    assert set(found) <= NOT_YET, {k: v for k, v in found.items() if k not in NOT_YET}
    assert set(found) == NOT_YET, f"no tagged dicts left in {sorted(NOT_YET - set(found))}"


def test_the_grep_finds_a_planted_tagged_dict(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('def f(conn):\n    conn.send({"t": "commit", "step": 1, "gen": 0})\n')
    assert _tagged_dicts(bad) == [2]


@pytest.mark.parametrize(
    "repair,why",
    [
        ({"what": "tier1", "rank": 1, "chunk": 0, "step": 3, "count": 1}, "has the fields"),
        ({"what": "mend", "rank": 1, "chunk": 0, "version": 3, "count": 1}, "not a valid"),
        ({"what": 4, "rank": 1, "chunk": 0, "version": 3, "count": 1}, "what is a name"),
        ({"what": "tier1", "rank": "1", "chunk": 0, "version": 3, "count": 1}, "rank is an"),
        ({"what": "tier1", "rank": 1, "chunk": 0, "version": 3, "count": 0}, "count"),
        ("tier1", "a repair is a dict"),
    ],
)
def test_a_reconcile_with_a_malformed_repair_is_refused_naming_it(repair: Any, why: str) -> None:
    # a repair travels in one shape (Repair.wire); the receiver reads nothing else
    good = {"what": "forward", "rank": 0, "chunk": 0, "version": 3, "count": 2}
    wire = {"t": "reconcile", "gen": 1, "kind": "forward", "target": 3}
    assert M.decode({**wire, "repairs": [good]}).repairs == [good]
    with pytest.raises(WireError) as e:
        M.decode({**wire, "repairs": [good, repair]})
    line = str(e.value)
    assert "\n" not in line and line.startswith("reconcile: ") and why in line, line
