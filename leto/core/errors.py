"""The one error type of the protocol core."""

from __future__ import annotations

from typing import Any


class ProtocolError(Exception):
    """An event that is illegal in the current state.

    It names the machine, the state and the event; the machine that raised it is left
    exactly as it was (every transition computes a new value and only then replaces
    the old one).
    """

    def __init__(self, machine: str, state: Any, event: Any, why: str = "") -> None:
        self.machine = machine
        self.state = state
        self.event = event
        self.why = why
        state_name = getattr(state, "name", state)
        detail = f": {why}" if why else ""
        super().__init__(f"{machine}: event {event!r} is illegal in state {state_name}{detail}")


class StepAgreementError(ValueError):
    """The ranks' reports of their retained step cannot be agreed on
    (:func:`leto.core.steps.agree_step`): one line naming the steps reported."""
