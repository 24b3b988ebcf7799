"""The gloo coordinator's command table covers every effect of the core, once."""

from __future__ import annotations

from leto.backends.gloo.commands import COMMANDS, Done, Send
from leto.core.effects import all_effect_types


def test_every_effect_has_exactly_one_entry_in_the_command_table() -> None:
    kinds = all_effect_types()
    assert len(kinds) >= 30
    assert len(set(kinds)) == len(kinds)
    assert set(COMMANDS) == set(kinds)
    assert len(COMMANDS) == len(kinds)


def test_each_entry_sends_a_command_or_says_who_does_it_and_why() -> None:
    for effect, how in COMMANDS.items():
        assert isinstance(how, (Send, Done)), effect
        if isinstance(how, Done):
            assert how.by in ("trainers", "agents", "keepers", "world", "coordinator"), effect
            assert how.why, effect
    sent = {e.__name__ for e, how in COMMANDS.items() if isinstance(how, Send)}
    assert {"RecordCommit", "Fence", "Promote", "Reconciled", "Resume"} <= sent
