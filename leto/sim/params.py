"""Every assumption of the simulation in one record, each default with its source.

Sources (full references in ``docs/simulate.md``):

* [L3]  Llama 3 paper: 16,384 H100s, 16M-token batches at ~400 TFLOPs/GPU for the 405B
  model; checkpoint storage (Tectonic) sustaining 2 TB/s.
* [ZeRO] Rajbhandari et al.: mixed-precision Adam keeps 16 bytes of state per parameter.
* [GEM] Gemini (SOSP'23): in-memory checkpoints every iteration in CPU memory of peers,
  two replicas, interleaved with training traffic; remote checkpoints about every 3 h.
* [JIT] Gupta et al. (EuroSys'24): just-in-time checkpoint from healthy replicas,
  one minibatch replayed, "nearly zero steady state overhead".
* [A]   an assumption of this simulator, stated as such; override it, or load measured
  phase costs with ``--bench FILE`` (the JSON of ``leto bench recovery``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs

from leto.argcheck import Bound, show
from leto.sim import calibration

LLAMA3_PARAMS = 405e9


class SimInputError(ValueError):
    """Input the simulator refuses; the message is one line, fit for the terminal."""


# Every number is finite and bounded: the ceilings keep a run to what a simulation of
# a real job needs (and to memory and minutes); MAX_FAILURES bounds the work itself.
MAX_FAILURES = 10_000_000
_BIG = 1e9


def _bounded(bound: Bound) -> Any:
    def check(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is None and attr.default is None:
            return
        problem = bound.problem(value)
        if problem is not None:
            raise SimInputError(f"{attr.name} {problem}")

    return check


_positive = _bounded(Bound(lo=0, lo_open=True, hi=_BIG))
_non_negative = _bounded(Bound(lo=0, hi=_BIG))
_optional_positive = _positive
_fraction = _bounded(Bound(lo=0, hi=1))


def _calibration(inst: object, attr: attrs.Attribute[Any], value: str) -> None:
    if value not in calibration.CALIBRATIONS:
        choices = ", ".join(calibration.CALIBRATIONS)
        raise SimInputError(f"{attr.name} must be one of {choices}, got {show(value)}")


def _int_at_least(low: int, high: int = 1_000_000, why: str = "") -> Any:
    return _bounded(Bound(lo=low, hi=high, integer=True, why_hi=why))


def _bool(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise SimInputError(f"{attr.name} must be true or false, got {show(value)}")


@attrs.frozen(kw_only=True)
class SimParams:
    # -- the job ---------------------------------------------------------------------------
    gpus: int = attrs.field(
        default=16_384, validator=_int_at_least(1, 10_000_000, "ten million")
    )  # [L3]
    gpus_per_node: int = attrs.field(default=8, validator=_int_at_least(1, 1024))  # [L3] HGX H100
    days: float = attrs.field(
        default=30.0, validator=_bounded(Bound(lo=0, lo_open=True, hi=36_500, why_hi="a century"))
    )
    # None: Llama 3's 405B parameters per 16,384 GPUs, capped at 405B ([L3], see model_size).
    model_params: float | None = attrs.field(
        default=None, validator=_bounded(Bound(lo=0, lo_open=True, hi=1e15))
    )
    bytes_per_param: float = attrs.field(default=16.0, validator=_positive)  # [ZeRO]
    step_time_s: float = attrs.field(
        default=6.0, validator=_positive
    )  # [L3] 6*405e9*16M/(16384*400T)
    # -- failures --------------------------------------------------------------------------
    calibration: str = attrs.field(default="llama3", validator=_calibration)
    mtbf_hours: float | None = attrs.field(default=None, validator=_optional_positive)
    hof_fraction: float | None = attrs.field(default=None, validator=_fraction)  # None: the table's
    # -- the cluster around the job ------------------------------------------------------
    # None: sized to the nodes expected away at once (see spare_nodes); an int: a fixed pool.
    spares: int | None = attrs.field(default=None, validator=_int_at_least(0))
    reboot_min: float = attrs.field(default=10.0, validator=_non_negative)  # [A]
    repair_hours: float = attrs.field(default=72.0, validator=_non_negative)  # [A]
    storage_node_gb_s: float = attrs.field(default=2.5, validator=_positive)  # [A]
    storage_total_gb_s: float = attrs.field(default=2000.0, validator=_positive)  # [L3]
    net_node_gb_s: float = attrs.field(default=50.0, validator=_positive)  # [A] one 400 Gb/s NIC
    host_gb_s: float = attrs.field(default=25.0, validator=_positive)  # [A] PCIe GPU<->host
    # -- recovery phases (seconds); --bench replaces these with measured ones --------------
    detect_s: float = attrs.field(default=10.0, validator=_non_negative)  # [A] every strategy
    restart_s: float = attrs.field(default=300.0, validator=_non_negative)  # [A] job restart
    ckpt_fixed_s: float = attrs.field(default=1.0, validator=_non_negative)  # [A] per checkpoint
    promote_s: float = attrs.field(default=1.0, validator=_non_negative)  # [A] leto shadow
    # leto's reconcile: reconcile_s at reconcile_ref_gib of state per GPU, plus
    # reconcile_s_per_gib for each GiB beyond it (None: one pass over the state in HBM).
    reconcile_s: float = attrs.field(default=1.0, validator=_non_negative)  # [A]
    reconcile_ref_gib: float = attrs.field(default=0.0, validator=_non_negative)
    reconcile_s_per_gib: float | None = attrs.field(default=None, validator=_non_negative)
    # The communicator rebuild: rebuild_comm_s at rebuild_ref_ranks ranks, scaled by
    # log2(ranks) / log2(rebuild_ref_ranks); None: rebuild_comm_s at every scale.
    rebuild_comm_s: float = attrs.field(default=20.0, validator=_non_negative)  # [A] leto
    rebuild_ref_ranks: int | None = attrs.field(default=None, validator=_int_at_least(2))
    # The coordinator's plan and adoption: coordinator_s at coordinator_ref_ranks ranks,
    # linear in ranks (`leto bench control`); 0 by default: inside rebuild_comm_s.
    coordinator_s: float = attrs.field(default=0.0, validator=_non_negative)  # [A]
    coordinator_ref_ranks: int = attrs.field(default=1, validator=_int_at_least(1))
    # Tier-2 restore throughput per node (GB/s); None: the NIC's, net_node_gb_s.
    tier2_gb_s: float | None = attrs.field(default=None, validator=_positive)  # [A]
    gpu_reset_s: float = attrs.field(default=30.0, validator=_non_negative)  # [A]
    spare_join_s: float = attrs.field(default=30.0, validator=_non_negative)  # [A] warm spare
    # -- torchft: replica groups heal from a live peer while the others train on -----------
    torchft_groups: int = attrs.field(default=16, validator=_int_at_least(1, 1_000_000))  # [A]
    torchft_restart_s: float = attrs.field(default=60.0, validator=_non_negative)  # [A]
    torchft_quorum_s: float = attrs.field(default=5.0, validator=_non_negative)  # [A]
    # Heal throughput per rank (GB/s); None: the node's NIC shared by its ranks.
    torchft_heal_gb_s: float | None = attrs.field(default=None, validator=_positive)  # [A]
    # The job's throughput during a heal, of nominal; None: (G - 1) / G.
    torchft_survivors: float | None = attrs.field(default=None, validator=_fraction)  # [A]
    # -- strategies ------------------------------------------------------------------------
    fallback_max_interval_h: float = attrs.field(default=3.0, validator=_positive)  # [GEM]
    gemini_replicas: int = attrs.field(default=2, validator=_int_at_least(1, 1024))  # [GEM]
    gemini_overhead: float = attrs.field(default=0.0, validator=_fraction)  # [GEM]
    tier1: bool = attrs.field(default=True, validator=_bool)
    tier2: bool = attrs.field(default=True, validator=_bool)
    tier2_parity: int = attrs.field(default=1, validator=_int_at_least(1, 1024))
    tier2_every_steps: int = attrs.field(default=1, validator=_int_at_least(1))
    # None: leto's critical-path copies per step (see leto_overhead_fraction).
    leto_overhead: float | None = attrs.field(default=None, validator=_fraction)
    hbm_gb_s: float = attrs.field(default=3000.0, validator=_positive)  # H100 HBM3 ~3 TB/s
    # -- the experiment --------------------------------------------------------------------
    seeds: int = attrs.field(default=5, validator=_int_at_least(1, 10_000))
    seed: int = attrs.field(default=0, validator=_int_at_least(0, 2**63 - 1))

    def __attrs_post_init__(self) -> None:
        expected = self.expected_failures
        if expected > MAX_FAILURES:
            raise SimInputError(
                f"about {expected:,.0f} failures to simulate ({self.gpus:,} GPUs, "
                f"{self.days:g} days, MTBF {self.mtbf_s / 3600.0:.3g} h, {self.seeds} seeds), "
                f"more than the limit of {MAX_FAILURES:,}: fewer GPUs, days or seeds, or a "
                "longer MTBF"
            )

    # ---- derived quantities --------------------------------------------------------------
    @property
    def expected_failures(self) -> float:
        """Failures the experiment draws, over all its seeds (its work is proportional)."""
        return self.horizon_s / self.mtbf_s * self.seeds

    @property
    def ranks_per_node(self) -> int:
        return min(self.gpus_per_node, self.gpus)

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.ranks_per_node)

    @property
    def model_size(self) -> float:
        """Parameters: as given, else Llama 3's parameters-per-GPU, at most 405B."""
        if self.model_params is not None:
            return self.model_params
        return LLAMA3_PARAMS * min(1.0, self.gpus / calibration.LLAMA3_GPUS)

    @property
    def state_bytes(self) -> float:
        return self.model_size * self.bytes_per_param

    @property
    def state_per_gpu(self) -> float:
        """Bytes of training state each GPU holds (fully sharded)."""
        return self.state_bytes / self.gpus

    @property
    def state_per_node(self) -> float:
        return self.state_per_gpu * self.ranks_per_node

    @property
    def storage_bw(self) -> float:
        """Bytes/s the job can write to or read from checkpoint storage."""
        return min(self.storage_total_gb_s, self.storage_node_gb_s * self.nodes) * 1e9

    @property
    def ckpt_write_s(self) -> float:
        """Seconds to persist one full checkpoint."""
        return self.state_bytes / self.storage_bw

    @property
    def ckpt_read_s(self) -> float:
        return self.state_bytes / self.storage_bw

    @property
    def snapshot_s(self) -> float:
        """Seconds training blocks for an async checkpoint: copy to host memory."""
        return self.ckpt_fixed_s + self.state_per_gpu / (self.host_gb_s * 1e9)

    @property
    def mtbf_s(self) -> float:
        """The job's mean time between failures at this scale, in seconds."""
        if self.mtbf_hours is not None:
            return self.mtbf_hours * 3600.0
        return calibration.job_mtbf_hours(self.gpus, self.calibration) * 3600.0

    @property
    def horizon_s(self) -> float:
        return self.days * 86400.0

    @property
    def spare_nodes(self) -> int:
        """The spare pool: as given, else the mean number of nodes away (rebooting or in
        repair) plus three standard deviations (Poisson) plus one, rounded up."""
        if self.spares is not None:
            return self.spares
        shares, rate = self.class_shares, 1.0 / self.mtbf_s
        away = rate * (shares[2] * self.reboot_min * 60.0 + shares[3] * self.repair_hours * 3600.0)
        return math.ceil(away + 3.0 * math.sqrt(away)) + 1

    @property
    def class_shares(self) -> tuple[float, float, float, float]:
        shares = calibration.class_shares(calibration.load_categories())
        if self.hof_fraction is None:
            return shares
        return calibration.with_hof_fraction(shares, self.hof_fraction)

    @property
    def rebuild_s(self) -> float:
        """leto's communicator rebuild (and the coordinator's work) at this scale."""
        comm = self.rebuild_comm_s
        if self.rebuild_ref_ranks is not None and self.gpus > 1:
            comm *= math.log2(self.gpus) / math.log2(self.rebuild_ref_ranks)
        return comm + self.coordinator_s * self.gpus / self.coordinator_ref_ranks

    @property
    def reconcile_at_scale_s(self) -> float:
        """leto's reconcile: its fixed part, plus the state per GPU beyond the reference."""
        per_gib = self.reconcile_s_per_gib
        if per_gib is None:
            per_gib = 2**30 / (self.hbm_gb_s * 1e9)
        extra = max(0.0, self.state_per_gpu / 2**30 - self.reconcile_ref_gib)
        return self.reconcile_s + per_gib * extra

    @property
    def tier2_restore_s(self) -> float:
        """Seconds to rebuild a lost node's state from the tier-2 snapshot."""
        gb_s = self.net_node_gb_s if self.tier2_gb_s is None else self.tier2_gb_s
        return self.state_per_node / (gb_s * 1e9)

    @property
    def torchft_heal_s(self) -> float:
        """Seconds for a replica group's rank to copy its state from a live peer."""
        gb_s = self.torchft_heal_gb_s
        if gb_s is None:
            gb_s = self.net_node_gb_s / self.ranks_per_node
        return self.state_per_gpu / (gb_s * 1e9)

    @property
    def torchft_replicas(self) -> int:
        """torchft's replica groups in this job: whole nodes each, so at most the nodes."""
        return min(self.torchft_groups, self.nodes)

    @property
    def torchft_survivor_fraction(self) -> float:
        """The job's throughput while a group heals, as a fraction of nominal."""
        if self.torchft_survivors is not None:
            return self.torchft_survivors
        return (self.torchft_replicas - 1) / self.torchft_replicas

    @property
    def leto_overhead_fraction(self) -> float:
        """Fraction of each step leto adds to the critical path.

        The undo copy of each chunk (in HBM) is on it. The tier-1 parity copy to host
        memory and the tier-2 traffic (every ``tier2_every_steps`` steps) overlap the
        next step's compute; only what does not fit in one step spills onto it.
        """
        if self.leto_overhead is not None:
            return self.leto_overhead
        undo = self.state_per_gpu / (self.hbm_gb_s * 1e9)
        background = 0.0
        if self.tier1:
            background += self.state_per_gpu / (self.host_gb_s * 1e9)
        if self.tier2:
            background += self.state_per_node / (self.net_node_gb_s * 1e9) / self.tier2_every_steps
        spill = max(0.0, background - self.step_time_s)
        return min(1.0, (undo + spill) / self.step_time_s)

    def as_dict(self) -> dict[str, Any]:
        """The inputs and the derived figures, for ``--json``."""
        out: dict[str, Any] = attrs.asdict(self)
        out["derived"] = {
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "model_params": self.model_size,
            "state_bytes": self.state_bytes,
            "mtbf_hours": self.mtbf_s / 3600.0,
            "class_shares": dict(
                zip(
                    [c.name.lower() for c in calibration.FailureClass],
                    self.class_shares,
                    strict=True,
                )
            ),
            "in_place_categories": [
                c.name
                for c in calibration.load_categories()
                if c.cls == calibration.FailureClass.IN_PLACE
            ],
            "spare_nodes": self.spare_nodes,
            "ckpt_write_s": self.ckpt_write_s,
            "ckpt_read_s": self.ckpt_read_s,
            "snapshot_s": self.snapshot_s,
            "leto_overhead": self.leto_overhead_fraction,
            "rebuild_s": self.rebuild_s,
            "reconcile_s": self.reconcile_at_scale_s,
            "tier2_restore_s": self.tier2_restore_s,
            "torchft_heal_s": self.torchft_heal_s,
            "torchft_survivor_fraction": self.torchft_survivor_fraction,
        }
        return out


# Fields a `leto bench recovery` JSON must carry (seconds), and those it may carry.
BENCH_REQUIRED = ("detect_s", "restart_s", "promote_s", "rebuild_comm_s")
BENCH_OPTIONAL = ("ckpt_fixed_s", "gpu_reset_s", "spare_join_s", "leto_overhead")


def read_bench_json(path: str | Path) -> Any:
    """A bench file's JSON; a file that cannot be read or parsed is one line naming it."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise SimInputError(f"bench JSON {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise SimInputError(f"bench JSON {path}: not JSON ({exc.msg}, line {exc.lineno})") from exc


def load_bench(path: str | Path) -> dict[str, float]:
    """Per-phase costs from the JSON of ``leto bench recovery``.

    The object holds the fields of :data:`BENCH_REQUIRED` (and any of
    :data:`BENCH_OPTIONAL`), in seconds, at its top level or under ``"phases"``.
    """
    obj = read_bench_json(path)
    if isinstance(obj, dict) and isinstance(obj.get("phases"), dict):
        obj = obj["phases"]
    if not isinstance(obj, dict):
        raise SimInputError(f"bench JSON {path}: expected an object of phase costs")
    missing = [k for k in BENCH_REQUIRED if k not in obj]
    if missing:
        raise SimInputError(f"bench JSON {path}: missing field {', '.join(map(repr, missing))}")
    out: dict[str, float] = {}
    for key in BENCH_REQUIRED + BENCH_OPTIONAL:
        if key not in obj:
            continue
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise SimInputError(
                f"bench JSON {path}: field {key!r} must be seconds >= 0, got {value!r}"
            )
        out[key] = float(value)
    return out
