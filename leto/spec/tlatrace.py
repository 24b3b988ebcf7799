"""A run's trace checked by TLC against ``Leto.tla`` (``spec/TraceLeto.tla``).

``leto spec trace RUN_DIR --tlc``: the events the run's coordinator fed the core's
model (``events.jsonl``, its ``core`` records) are expanded, by the same replay as
:mod:`leto.spec.trace`, into the spec's own actions (aggregated events and
abbreviations into their chunk-level events; an adoption into ``Adopt``), written as
the TLA+ module ``TraceData`` (``Trace == << ... >>`` and the run's constants), and
TLC runs ``TraceLeto.tla`` on it: one behaviour of Leto, one action per event, or a
deadlock at the first event the spec does not enable.

Model values: the core's sentinels become the spec's ``TORN``, ``LOST``, ``GARBAGE``,
``NONE``; ranks and nodes are numbers from 0, chunks from 1 (``Chunks == 1..NChunks``);
a shadow still spawning is the spec's ``NONE``.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import attrs

from leto.core import aggregate
from leto.core import events as ev
from leto.core.adopt import Retained, adopt
from leto.core.chunk import GARBAGE, LOST, NONE, TORN
from leto.core.cluster import ClusterModel, ClusterState
from leto.core.errors import ProtocolError
from leto.spec.location import SPEC_DIR
from leto.spec.tlc import TLCResult, run_tlc
from leto.spec.trace import CoreSetup, InputError, TraceError, decode, expand, read

__all__ = ["TLATrace", "check_tlc", "run_module", "to_tla"]

_SENTINEL = {TORN: "TORN", LOST: "LOST", GARBAGE: "GARBAGE", NONE: "NONE"}


@attrs.frozen
class TLATrace:
    """What TLC was given, and what it said."""

    events: int
    result: TLCResult
    replayed: int  # events TLC replayed (ti - 1 in its last state)

    @property
    def ok(self) -> bool:
        return self.result.violations == ["TraceUnfinished"] and self.replayed == self.events

    def line(self) -> str:
        if self.ok:
            return f"TLC trace OK: {self.events} events, a behaviour of Leto.tla"
        if "Deadlock" in self.result.violations:
            return (
                f"TLC trace DIVERGES at event {self.replayed + 1} of {self.events}: "
                "Leto.tla does not enable it there"
            )
        return f"TLC trace not checked: {self.result.error or self.result.violations}"


def _v(x: int) -> str:
    return _SENTINEL.get(x, str(x))


def _fn(keys: Iterable[int], vals: Iterable[str]) -> str:
    pairs = list(zip(keys, vals, strict=True))
    return "(" + " @@ ".join(f"{k} :> {v}" for k, v in pairs) + ")"


def _row(values: Iterable[int], base: int = 0) -> str:
    vals = list(values)
    return _fn(range(base, base + len(vals)), (_v(x) for x in vals))


def _adopt_tla(model: ClusterModel, rep: Retained) -> str:
    groups = model.config.groups
    data = _fn(range(len(rep.data)), (_row(r, 1) for r in rep.data))
    undo = _fn(range(len(rep.undo)), (_row(r, 1) for r in rep.undo))
    grad = _row(rep.grad)
    chunks = range(1, model.config.chunks + 1)
    par = _fn(
        range(len(groups)),
        (
            # a node whose parity is LOST: every chunk's (the spec's par[n] is per chunk)
            _fn(chunks, ("LOST" for _ in chunks))
            if p is None
            else _fn(chunks, (_fn(groups[n], (_v(x) for x in row)) for row in p))
            for n, p in enumerate(rep.par)
        ),
    )
    gpar = _fn(
        range(len(groups)),
        (
            "LOST" if g is None else _fn(groups[n], (_v(x) for x in g))
            for n, g in enumerate(rep.gpar)
        ),
    )
    t2lost = "{" + ", ".join(str(n) for n in sorted(rep.t2lost)) + "}"
    return (
        f'[a |-> "Adopt", data |-> {data}, undo |-> {undo}, grad |-> {grad}, '
        f"par |-> {par}, gpar |-> {gpar}, t2 |-> {rep.t2}, t2lost |-> {t2lost}]"
    )


def _event_tla(e: ev.Event) -> str:
    fields = attrs.asdict(cast(attrs.AttrsInstance, e))
    parts = [f'a |-> "{type(e).__name__}"']
    if "rank" in fields:
        parts.append(f"r |-> {fields['rank']}")
    if "chunk" in fields:
        parts.append(f"c |-> {fields['chunk'] + 1}")
    if "node" in fields:
        parts.append(f"n |-> {fields['node']}")
    return "[" + ", ".join(parts) + "]"


def to_tla(records: list[tuple[int, dict[str, Any]]]) -> tuple[str, str, int]:
    """``(TraceData.tla, TraceLeto.cfg, events)`` for a run's numbered records; a
    :class:`TraceError` for a trace the Python replay refuses or the spec cannot take."""
    setup: CoreSetup | None = None
    model: ClusterModel | None = None
    s: ClusterState | None = None
    steps: list[str] = []
    max_step = faults = 0
    for n, rec in records:
        name = rec.get("event")
        if name == "core_init":
            setup = CoreSetup.from_record(rec)
            if setup.start != 0:
                raise TraceError("a resumed run (start > 0): Leto.tla's Init is step 0")
            if not setup.tier1:
                raise TraceError("tier 1 off: Leto.tla has tier 1 on")
            model = setup.model()
            s = setup.initial(model)
            continue
        if name != "core":
            continue
        if model is None or s is None:
            raise TraceError(f"line {n}: a core record before core_init")
        try:
            if "adopt" in rec:
                rep = Retained.from_record(rec["adopt"])
                s = adopt(model, s, rep)
                steps.append(_adopt_tla(model, rep))
                continue
            for raw in rec["feed"]:
                for e in expand(model, s, decode(raw)):
                    s = model.step(s, e)[0]
                    # an aggregated event as the chunk-level events it refines
                    spec = aggregate.expand(model, e) if isinstance(e, ev.Aggregated) else (e,)
                    steps += [_event_tla(x) for x in spec]
                    faults += isinstance(e, ev.Fault)
                    max_step = max(max_step, *s.step)
        except (ProtocolError, ValueError, KeyError) as err:
            raise TraceError(f"line {n}: the Python replay refuses it: {err}") from None
    if setup is None or model is None:
        raise TraceError("no core_init record")
    R = model.config.ranks
    node_of = _fn(range(R), (str(model.node_of[r]) for r in range(R)))
    body = ",\n    ".join(steps)
    module = (
        "---- MODULE TraceData ----\n"
        "EXTENDS Leto, TLC\n"
        f"TRanks == 0..{R - 1}\n"
        f"TNodes == 0..{len(setup.nodes) - 1}\n"
        f"TNodeOf == {node_of}\n"
        f"Trace == <<\n    {body}\n>>\n"
        "====\n"
    )
    k = max_step + 1 if setup.k is None else setup.k
    cfg = (
        "CONSTANTS\n"
        "    Ranks <- TRanks\n    Nodes <- TNodes\n    NodeOf <- TNodeOf\n"
        f"    NChunks = {setup.chunks}\n    MaxStep = {max_step + 1}\n"
        f"    MaxFaults = {faults}\n    K = {k}\n    T2Parity = {setup.tier2_parity}\n"
        '    Mutant = "none"\n'
        "    NONE = NONE\n    TORN = TORN\n    LOST = LOST\n    GARBAGE = GARBAGE\n"
        "    InitShadow <- TraceInitShadow\n"
        "INIT TraceInit\nNEXT TraceNext\n"
        "INVARIANTS\n    TraceUnfinished\n    TypeOK\n    SingleWriter\n    ParityOK\n"
        "    TailOK\n"
    )
    return module, cfg, len(steps)


def check_tlc(path: str | Path, *, timeout: float = 600.0, job: str | None = None) -> TLATrace:
    """``leto spec trace RUN_DIR --tlc`` (job ``job``'s records, or the latest job's);
    :class:`InputError` for bad input."""
    _, records = read(path, job)
    try:
        module, cfg, n = to_tla(records)
    except TraceError as e:
        raise InputError(str(e)) from None
    return run_module(module, cfg, n, timeout=timeout)


def run_module(module: str, cfg: str, events: int, *, timeout: float = 600.0) -> TLATrace:
    """TLC on ``TraceLeto.tla`` with this ``TraceData`` module and configuration."""
    with tempfile.TemporaryDirectory(prefix="leto-tlatrace-") as d:
        root = Path(d)
        for f in ("Leto.tla", "TraceLeto.tla"):
            shutil.copy(SPEC_DIR / f, root / f)
        (root / "TraceData.tla").write_text(module)
        (root / "TraceLeto.cfg").write_text(cfg)
        res = run_tlc("TraceLeto.cfg", "TraceLeto.tla", workers=1, timeout=timeout, spec_dir=root)
    return TLATrace(events, res, _last_ti(res.counterexample))


def _last_ti(counterexample: str) -> int:
    """The last ``ti`` of TLC's error trace, minus one: the events it replayed."""
    last = 0
    for line in counterexample.splitlines():
        line = line.strip()
        if line.startswith("/\\ ti = "):
            last = int(line.removeprefix("/\\ ti = "))
    return max(last - 1, 0)
