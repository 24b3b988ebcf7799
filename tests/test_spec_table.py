"""spec/README.md's action table keeps spec/Leto.tla's Next and leto.core.events in sync."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from leto.core import events as ev
from leto.core.chunk import CHUNK
from leto.core.recovery import RECOVERY
from leto.core.shadow import SHADOW
from leto.core.trainer import TRAINER
from leto.core.txn import COMMIT, TXN

SPEC = Path(__file__).resolve().parent.parent / "spec"
HEADER = "| TLA+ action | core event class | machine |"
TABLES = {"txn": TXN, "commit": COMMIT, "chunk": CHUNK, "shadow": SHADOW, "recovery": RECOVERY}


def action_table(text: str) -> dict[str, tuple[str, str]]:
    lines = text.splitlines()
    start = lines.index(HEADER)  # ValueError if the table is gone
    rows: dict[str, tuple[str, str]] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        action, cls, machine = cells[:3]
        assert action not in rows, f"{action} listed twice"
        rows[action] = (cls, machine)
    return rows


def next_actions(tla: str) -> set[str]:
    """The actions of ``Next``, and those ``BoundedNext`` adds (the deadline)."""
    body = re.search(r"^Next ==\n(.*?)(?=^\S)", tla, re.S | re.M)
    assert body is not None, "no Next definition in Leto.tla"
    bounded = re.search(r"^BoundedNext == Next((?: \\/ \w+)+)$", tla, re.M)
    assert bounded is not None, "no BoundedNext definition in Leto.tla"
    defined = set(re.findall(r"^([A-Z]\w*)(?:\([^)]*\))? ==", tla, re.M))
    used = set(re.findall(r"\b([A-Z]\w*)\b", body.group(1) + bounded.group(1)))
    return used & defined - {"Ranks", "Chunks", "Nodes"}


@pytest.fixture(scope="module")
def table() -> dict[str, tuple[str, str]]:
    return action_table((SPEC / "README.md").read_text())


def test_table_lists_exactly_the_actions_of_next(table: dict[str, tuple[str, str]]) -> None:
    assert set(table) == next_actions((SPEC / "Leto.tla").read_text())


def test_table_lists_exactly_the_core_events(table: dict[str, tuple[str, str]]) -> None:
    classes = {cls.removeprefix("events.") for cls, _ in table.values()}
    assert classes == {c.__name__ for c in ev.ALL}
    for action, (cls, _) in table.items():
        assert cls == f"events.{action}", f"{action} maps to {cls}"
        assert issubclass(getattr(ev, cls.removeprefix("events.")), ev.Event)


def test_machine_column_names_a_machine_that_takes_the_event(
    table: dict[str, tuple[str, str]],
) -> None:
    for action, (cls, machine) in table.items():
        event_type = getattr(ev, cls.removeprefix("events."))
        if machine == "fault":
            assert issubclass(event_type, ev.Fault)
        elif machine == "keeper":
            assert event_type is ev.StaleWrite
        elif machine == "trainer":
            assert event_type in TRAINER.events()
        else:
            assert machine in TABLES, f"unknown machine {machine!r} for {action}"
            assert event_type in TABLES[machine].events(), f"{machine} does not take {action}"


def test_the_checks_reject_a_drifted_table() -> None:
    text = (SPEC / "README.md").read_text().replace("events.Decide", "events.Decided")
    drifted = action_table(text)
    assert {c.removeprefix("events.") for c, _ in drifted.values()} != {c.__name__ for c in ev.ALL}
    assert next_actions(
        "Next ==\n    \\/ Foo\n    \\/ Bar(r)\n\nFoo == TRUE\nBar(r) == TRUE\nBaz == TRUE\n"
        "BoundedNext == Next \\/ Baz\n"
    ) == {"Foo", "Bar", "Baz"}
    with pytest.raises(AssertionError, match="no BoundedNext"):
        next_actions("Next ==\n    \\/ Foo\n\nFoo == TRUE\n")


def test_every_file_spec_changing_names_exists() -> None:
    """spec/CHANGING.md names the files a protocol change touches: each must exist (a
    renamed module is renamed there too), and a planted name must be found missing."""
    root = Path(__file__).resolve().parent.parent

    def missing(text: str) -> list[str]:
        names = re.findall(r"`([\w./*-]+\.(?:py|md|tla|cfg))`", text)
        out = []
        for name in names:
            if "*" in name or "<" in name:
                continue  # a pattern (`*_handlers.py`, `MCLeto_<mutant>.cfg`)
            if "/" not in name:  # a module named next to its package: seek it
                places = ("leto/**", "tests/**", "spec")
                if not any(any(root.glob(f"{p}/{name}")) for p in places):
                    out.append(name)
            elif not (root / name).exists():
                out.append(name)
        return out

    text = (root / "spec" / "CHANGING.md").read_text()
    assert len(re.findall(r"\.py`", text)) >= 20
    assert missing(text) == []
    assert missing("`leto/backends/gloo/no_such_part.py` and `nowhere_at_all.py`") == [
        "leto/backends/gloo/no_such_part.py",
        "nowhere_at_all.py",
    ]
