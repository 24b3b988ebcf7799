"""Large-scale goodput simulation: how much of a training job's wall-clock time is
productive (ETTR) under failures, for checkpoint/restart, Gemini, JIT checkpointing
and leto, on the same failure traces. See ``docs/simulate.md``.

Modules: :mod:`~leto.sim.calibration` (failure model from public data),
:mod:`~leto.sim.params` (every assumption), :mod:`~leto.sim.trace` (failure traces),
:mod:`~leto.sim.spares` (the spare-node pool), :mod:`~leto.sim.coverage` (leto's tiers
from the core's coverage analysis), :mod:`~leto.sim.strategies`, :mod:`~leto.sim.engine`
(the event loop), :mod:`~leto.sim.theory` (closed forms), :mod:`~leto.sim.experiment`,
:mod:`~leto.sim.sweep`, :mod:`~leto.sim.plots`, :mod:`~leto.sim.report`,
:mod:`~leto.sim.cli`.
"""
