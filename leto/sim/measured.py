"""The simulator calibrated from measurement: `leto bench` results as its parameters.

A bench runs four ranks on one host; the simulator's job runs up to millions of GPUs.
Each figure a bench measures is therefore taken with a *law* that carries it to the
simulated scale, and the law lives in :class:`~leto.sim.params.SimParams` (a measured
figure sets a parameter and, where the law needs one, its reference scale: the ranks or
the bytes per rank it was measured at), so sweeps over GPUs apply it at every point.

Files are told apart by their ``"benchmark"`` member (``recovery``, ``scaling``,
``tier2``) or, for ``leto bench control --json``, by its rows; an object of phase costs
(``detect_s``, ``restart_s``, ``promote_s``, ``rebuild_comm_s``, ...; the form of the
``"phases"`` member of a recovery result) is still read as seconds at scale.

A field a file should carry but does not, or whose value is not a number, stops the run
with one line naming the file and the field; a figure a file does not measure at all
(no torchft system in a recovery result, no node-loss scenario) keeps its assumption,
and the report says why (:class:`Figure`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from leto.sim.params import (
    BENCH_OPTIONAL,
    SimInputError,
    SimParams,
    load_bench,
    read_bench_json,
)

# A bench workload's state per rank: parameters and AdamW's two moments in fp32
# (``leto.bench.workload.Workload.state_bytes``; a test keeps the two equal).
BENCH_STATE_BYTES_PER_PARAM = 12
GIB = 2**30


@attrs.frozen
class Law:
    """How a measured figure is carried to the simulated scale, and what it rests on."""

    text: str
    assumes: str = ""  # the constants the law takes as given


# The parameters a bench measures (or could), in the report's order, with their laws.
LAWS: Mapping[str, Law] = {
    "detect_s": Law("constant: each trainer's death is seen by its own node's agent"),
    "promote_s": Law("constant: every failed rank's warm shadow is promoted in parallel"),
    "reconcile_s": Law(
        "measured seconds + measured s/GiB x (state per GPU - the bench's state per rank)",
        "without a scaling result: one pass over the state at hbm_gb_s",
    ),
    "rebuild_comm_s": Law(
        "x log2(GPUs) / log2(the bench's ranks)",
        "a communicator's bootstrap is log-depth in its ranks",
    ),
    "coordinator_s": Law("x GPUs / the bench's ranks: plan + adoption, linear in ranks"),
    "tier2_gb_s": Law(
        "state per node / the measured encode throughput per node",
        "the restore's decode moves the bytes the encode does; measured over gloo loopback",
    ),
    "spare_join_s": Law("constant: a warm spare's agent joins, whatever the job's size"),
    "gpu_reset_s": Law("constant", "hardware: no bench resets a GPU"),
    "restart_s": Law(
        "constant: stop, start and import on each host in parallel",
        "leaves out rescheduling and NCCL init at scale (favours the restart strategies)",
    ),
    "ckpt_fixed_s": Law("constant"),
    "storage_node_gb_s": Law(
        "state / min(storage_total_gb_s, measured bytes/s per node x nodes)",
        "storage_total_gb_s = 2,000 GB/s [L3]",
    ),
    "torchft_restart_s": Law("constant: the failed group's processes restart in parallel"),
    "torchft_quorum_s": Law("constant: one quorum among the replica groups"),
    "torchft_heal_gb_s": Law("state per GPU / the measured heal throughput per rank"),
    "torchft_survivors": Law(
        "as measured: the survivors' throughput during a heal, of steady",
        "without it: (G - 1) / G of nominal",
    ),
}

# What each strategy's headline rests on.
INPUTS: Mapping[str, tuple[str, ...]] = {
    "leto": (
        "detect_s",
        "promote_s",
        "reconcile_s",
        "rebuild_comm_s",
        "coordinator_s",
        "tier2_gb_s",
        "spare_join_s",
        "gpu_reset_s",
        "restart_s",
        "storage_node_gb_s",
    ),
    "torchft": (
        "detect_s",
        "torchft_restart_s",
        "torchft_quorum_s",
        "torchft_heal_gb_s",
        "torchft_survivors",
        "spare_join_s",
        "gpu_reset_s",
    ),
}


@attrs.frozen
class Figure:
    """Where one parameter's value comes from."""

    param: str
    measured: bool
    source: str  # the file and field, or why the assumption stands

    def as_dict(self) -> dict[str, Any]:
        law = LAWS.get(self.param)
        return {
            "param": self.param,
            "measured": self.measured,
            "source": self.source,
            "law": law.text if law else "",
            "assumes": law.assumes if law else "",
        }


@attrs.frozen
class Calibration:
    """Parameter values taken from bench files, and every figure's provenance."""

    values: dict[str, Any]
    figures: tuple[Figure, ...]

    def figure(self, param: str) -> Figure:
        return next(f for f in self.figures if f.param == param)

    def measured(self, strategy: str) -> tuple[list[str], list[str]]:
        """The inputs of ``strategy``'s headline: (measured, assumed)."""
        names = INPUTS.get(strategy, ())
        yes = [n for n in names if self.figure(n).measured]
        return yes, [n for n in names if n not in yes]


class _File:
    """One bench result, read field by dotted path (list items by index); errors name
    the file and the field."""

    def __init__(self, path: str, obj: dict[str, Any]) -> None:
        self.path, self.obj, self.name = path, obj, Path(path).name

    def _walk(self, field: str) -> tuple[bool, Any]:
        node: Any = self.obj
        for key in field.split("."):
            if isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            elif isinstance(node, dict) and key in node:
                node = node[key]
            else:
                return False, None
        return True, node

    def has(self, field: str) -> bool:
        found, node = self._walk(field)
        return found and node is not None

    def get(self, field: str) -> Any:
        found, node = self._walk(field)
        if not found:
            raise SimInputError(f"bench JSON {self.path}: missing field {field!r}")
        return node

    def number(self, field: str, *, positive: bool = False, signed: bool = False) -> float:
        node = self.get(field)
        ok = isinstance(node, int | float) and not isinstance(node, bool)
        ok = ok and (signed or node > 0 if positive else signed or node >= 0)
        if not ok:
            want = "a number" if signed else "a number > 0" if positive else "a number >= 0"
            raise SimInputError(
                f"bench JSON {self.path}: field {field!r} must be {want}, got {node!r}"
            )
        return float(node)


Reader = Callable[[_File, dict[str, Any], dict[str, str]], None]


def _recovery(f: _File, values: dict[str, Any], src: dict[str, str]) -> None:
    world = f.number("workload.world", positive=True)
    rank_bytes = BENCH_STATE_BYTES_PER_PARAM * f.number("workload.params", positive=True)

    def take(param: str, field: str, value: float | None = None) -> None:
        values[param] = f.number(field) if value is None else value
        src[param] = f"{f.name}: {field}"

    if f.has("systems.leto"):
        leto = "systems.leto.phases."
        take("detect_s", leto + "detection")
        take("promote_s", leto + "process_state")
        take("reconcile_s", leto + "model_state")
        values["reconcile_ref_gib"] = rank_bytes / GIB
        take("rebuild_comm_s", leto + "communicator")
        values["rebuild_ref_ranks"] = max(2, int(world))
    for param in ("restart_s", "ckpt_fixed_s", *BENCH_OPTIONAL):
        if f.has(f"phases.{param}") and param in LAWS:
            take(param, f"phases.{param}")
    if f.has("systems.ckpt-disk"):
        load = f.number("systems.ckpt-disk.phases.model_state", positive=True)
        # the baseline's ranks share one host: its bytes over its load, per node
        take(
            "storage_node_gb_s",
            "systems.ckpt-disk.phases.model_state",
            world * rank_bytes / load / 1e9,
        )
    if f.has("systems.torchft"):
        ft = "systems.torchft."
        take("torchft_restart_s", ft + "phases.process_state")
        take("torchft_quorum_s", ft + "phases.communicator")
        heal = f.number(ft + "phases.model_state", positive=True)
        take("torchft_heal_gb_s", ft + "phases.model_state", rank_bytes / heal / 1e9)
        field = ft + "survivor_throughput.fraction_of_steady"
        if f.has(field):
            take("torchft_survivors", field, min(1.0, f.number(field)))


def _scaling(f: _File, values: dict[str, Any], src: dict[str, str]) -> None:
    field = "slope_s_per_gib.resume.leto"
    # a slope a little below 0 is noise: read as 0
    values["reconcile_s_per_gib"] = max(0.0, f.number(field, signed=True))
    src["reconcile_slope"] = f"{f.name}: {field}"


def _tier2(f: _File, values: dict[str, Any], src: dict[str, str], parity: int) -> None:
    rows = f.get("rows")
    index = (
        next((i for i, r in enumerate(rows) if isinstance(r, dict) and r.get("m") == parity), None)
        if isinstance(rows, list)
        else None
    )
    if index is None:
        src["tier2_gb_s"] = f"assumed: {f.name} has no row with m = {parity} (tier2_parity)"
        return
    field = f"rows.{index}.encode_s"
    node_bytes = f.number("bytes_per_node", positive=True)
    values["tier2_gb_s"] = node_bytes / f.number(field, positive=True) / 1e9
    src["tier2_gb_s"] = f"{f.name}: {field} (m = {parity})"


def _control(f: _File, values: dict[str, Any], src: dict[str, str]) -> None:
    rows = f.get("rows")
    last = f"rows.{len(rows) - 1 if isinstance(rows, list) else 0}"
    plan = f.get(f"{last}.aggregated.plan")
    if not isinstance(plan, dict) or not plan:
        raise SimInputError(f"bench JSON {f.path}: missing field {last + '.aggregated.plan'!r}")
    worst = max(f.number(f"{last}.aggregated.plan.{k}.ms") for k in plan)
    values["coordinator_s"] = (worst + f.number(f"{last}.aggregated.adopt.ms")) / 1e3
    values["coordinator_ref_ranks"] = int(f.number(f"{last}.ranks", positive=True))
    src["coordinator_s"] = f"{f.name}: {last}.aggregated.adopt.ms + the largest plan.*.ms"


def _kind(obj: dict[str, Any]) -> str:
    if isinstance(obj.get("benchmark"), str):
        return str(obj["benchmark"])
    if "rows" in obj and "per_node" in obj:
        return "control"
    return "phases"


def calibrate(paths: Sequence[str], base: SimParams) -> Calibration:
    """The parameters the bench files at ``paths`` measure (later files win), and the
    provenance of every parameter in :data:`LAWS`; ``base`` gives the simulated job."""
    values: dict[str, Any] = {}
    src: dict[str, str] = {}
    for path in paths:
        obj = _read(path)
        kind = _kind(obj)
        f = _File(path, obj)
        if kind == "recovery":
            _recovery(f, values, src)
        elif kind == "scaling":
            _scaling(f, values, src)
        elif kind == "tier2":
            _tier2(f, values, src, base.tier2_parity)
        elif kind == "control":
            _control(f, values, src)
        elif kind == "phases":
            for param, value in load_bench(path).items():
                values[param] = value
                src[param] = f"{f.name}: {param} (seconds at scale, as given)"
        else:
            raise SimInputError(
                f"bench JSON {path}: benchmark {kind!r} measures none of the simulator's "
                "parameters (recovery, scaling, tier2 or control do)"
            )
    figures = []
    for param in LAWS:
        if param in src and not src[param].startswith("assumed"):
            figures.append(Figure(param, True, src[param]))
        else:
            none = "no bench file given" if not paths else "no bench file measures it"
            figures.append(Figure(param, False, src.get(param) or f"assumed: {none}"))
    if "reconcile_slope" in src:
        i = list(LAWS).index("reconcile_s")
        rec = figures[i]
        slope = f"{rec.source}; per GiB: {src['reconcile_slope']}"
        figures[i] = Figure(rec.param, rec.measured, slope)
    return Calibration(values=values, figures=tuple(figures))


# The reference scale a measured figure carries; it goes with the figure.
COMPANIONS: Mapping[str, tuple[str, ...]] = {
    "reconcile_s": ("reconcile_ref_gib",),
    "rebuild_comm_s": ("rebuild_ref_ranks",),
    "coordinator_s": ("coordinator_ref_ranks",),
}


def with_flags(cal: Calibration, explicit: Mapping[str, Any]) -> Calibration:
    """Parameters set on the command line win over the bench files, and say so; a value
    set by hand is taken at scale (its measured reference scale is dropped with it)."""
    figures = tuple(
        Figure(f.param, False, "set on the command line") if f.param in explicit else f
        for f in cal.figures
    )
    dropped = set(explicit)
    for param in explicit:
        dropped.update(COMPANIONS.get(param, ()))
    values = {k: v for k, v in cal.values.items() if k not in dropped}
    return Calibration(values=values, figures=figures)


def at_scale(param: str, p: SimParams) -> str:
    """What ``param`` comes to in the simulated job, for the report."""
    shown: dict[str, Callable[[SimParams], str]] = {
        "reconcile_s": lambda q: f"{q.reconcile_at_scale_s:.3g} s",
        "rebuild_comm_s": lambda q: f"{q.rebuild_s - _coordinator(q):.3g} s",
        "coordinator_s": lambda q: f"{_coordinator(q):.3g} s",
        "tier2_gb_s": lambda q: f"{q.tier2_restore_s:.3g} s a node",
        "storage_node_gb_s": lambda q: f"{q.ckpt_read_s:.3g} s a load",
        "torchft_heal_gb_s": lambda q: f"{q.torchft_heal_s:.3g} s",
        "torchft_survivors": lambda q: f"{q.torchft_survivor_fraction:.3g} of nominal",
    }
    if param in shown:
        return shown[param](p)
    return f"{getattr(p, param):.3g} s"


def _coordinator(p: SimParams) -> float:
    return p.coordinator_s * p.gpus / p.coordinator_ref_ranks


def _read(path: str) -> dict[str, Any]:
    obj = read_bench_json(path)
    if not isinstance(obj, dict):
        raise SimInputError(f"bench JSON {path}: expected an object")
    return obj
