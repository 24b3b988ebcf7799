"""The fake backend: simulated ranks in one process, deterministic faults.

:mod:`.backend` is the machine (memory, collectives, processes, the fault injector);
:mod:`.engine` drives the core over it with the one recovery executor
(:mod:`leto.retained.recovery`): :mod:`.executors` carries out each effect, and
:mod:`.recovery`, :mod:`.tier1`, :mod:`.snapshots`, :mod:`.checkpoints`,
:mod:`.layouts`, :mod:`.integrity`, :mod:`.faults` and :mod:`.inspect` hold the rest
of what the engine does, one concept each, each typing the part of the engine it uses
as a Protocol (:mod:`.host`).
"""

from __future__ import annotations

from .backend import (
    APPLY_WHERE,
    DECIDE_WHERE,
    FAULT_KINDS,
    PHASES,
    RECOVERY_WHERE,
    FakeBackend,
    FakeKeeper,
    Fault,
    FaultInjector,
)

__all__ = [
    "APPLY_WHERE",
    "DECIDE_WHERE",
    "FAULT_KINDS",
    "FakeBackend",
    "FakeKeeper",
    "Fault",
    "FaultInjector",
    "PHASES",
    "RECOVERY_WHERE",
]
