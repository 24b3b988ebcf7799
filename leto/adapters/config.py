"""``leto.Config``: the backend, the topology, chunking, the tiers and the checkpoint.

Load it from a TOML file, a dict or the environment; it is validated on load, and
every error names the setting that is wrong::

    cfg = leto.Config.load("leto.toml")          # a file ([leto] table or top level)
    cfg = leto.Config.from_dict({"backend": "fake", "topology": "2x2"})
    cfg = leto.Config.from_env()                 # LETO_BACKEND, LETO_TOPOLOGY, ...

Settings (TOML key / ``LETO_<KEY>`` variable):

===================  ========  ==========================================================
backend              "fake"    ``fake`` (simulated ranks in one process), ``gloo`` (CPU
                               processes), ``nccl`` (CUDA; refused without CUDA)
topology             "1x1"     ``"NODESxRANKS"``; or ``nodes`` (<= 65,536) and
                               ``ranks_per_node`` (<= 1,024), at most 1,048,576 ranks
world_size           none      if given (or ``WORLD_SIZE`` in the environment), it must
                               equal nodes x ranks_per_node
chunk_size           1048576   elements per chunk of the retained state (1 .. 2**30;
                               every rank allocates whole chunks)
tier1                true      per-step protection inside each node (tier 1)
tier1_code           "auto"    what tier 1 keeps: ``parity`` (single parity over the
                               node's ranks, any training) or ``replica`` (nothing: the
                               node's other ranks hold the same state, as in data-parallel
                               training; a lost rank is copied from one of them; gloo only,
                               and a job whose ranks differ is refused with this setting
                               named); ``auto``: ``replica`` on gloo with 2+ ranks per
                               node, ``parity`` otherwise
tier2                true      cross-node snapshots every ``tier2_interval`` steps
tier2_interval       10        K: steps between tier-2 snapshots (1 .. 1,000,000)
tier2_parity         1         m: lost nodes the tier-2 snapshot survives (1 .. 255; m >= 2
                               needs more than m nodes: a Reed-Solomon code over the
                               nodes' snapshots, each node storing m / (nodes - m) of one)
checkpoint_dir       none      directory for the torch.distributed.checkpoint fallback
checkpoint_interval  0         steps between periodic checkpoints (0 .. 1,000,000; 0: only
                               the start's, unless checkpoint_mtbf is set)
checkpoint_mtbf      0         seconds between failures: with no interval, checkpoint every
                               Young/Daly sqrt(2 x save cost x MTBF), in steps, for the
                               measured save cost and step time (0 .. 10 years)
checkpoint_async     false     write the periodic checkpoint (gloo) in the background:
                               training stalls only while the state is copied to host
                               buffers, and the checkpoint is durable when every rank's
                               write completed (docs/gloo.md, "Asynchronous checkpoints";
                               not with shard)
resume               none      start from this torch.distributed.checkpoint directory
                               (leto's checkpoint_dir or one step of it, or any DCP
                               checkpoint of the same model); ``leto launch --resume DIR``
verify_chunks        true      check each chunk's checksum before its step overwrites it
replica_check        1         steps between checks that the data-parallel replicas agree
                               (gloo, unsharded: every rank's digest of its retained
                               chunks' checksums, optimizer scalars and scheduler, compared
                               at the step's commit and at the end; a minority that
                               disagrees is repaired in place from the majority on its
                               node (tier 1 as replicas), any other disagreement ends the
                               job in one line naming the ranks and the step, or restarts
                               it from its checkpoint with ``--max-restarts``); 0: off
master_weights       false     float32 master weights, gradients and optimizer state in
                               retained memory for bf16/fp16 parameters (and models that
                               mix dtypes); the model's parameters are cast from them after
                               every step (docs/loop.md, "Mixed precision"); with shard,
                               each rank's shard of them
shard                false     ZeRO-style sharded state: each rank retains only its 1/W
                               shard of the parameters (master copy), gradients and
                               optimizer state; gradients are reduce-scattered, each rank
                               steps its shard, the parameters are all-gathered
                               (docs/gloo.md, "Sharded state"). gloo only; tier 1 is
                               parity (``auto`` resolves to it, ``replica`` is refused);
                               SGD, Adam, AdamW; each rank writes its own shard of a
                               disk checkpoint, which resumes at the world size and
                               chunk_size it was written at
device               "auto"    where the retained state and the model live: ``cpu``,
                               ``cuda`` or ``cuda:N`` (refused without CUDA); ``auto`` is
                               ``cuda`` with the nccl backend, else ``cpu``. On a GPU the
                               keepers hold GPU memory (docs/gpu.md); gloo and nccl only
batch_parts          0         the parts a global batch is cut into, one per rank of the
                               full world (``--nnodes MIN:MAX``: MAX nodes' ranks); 0: as
                               many as the world has ranks, whatever it is (a shrunk world
                               keeps the global batch, each rank's part larger). gloo only
keep_global_batch    false     with batch_parts, when the world has fewer ranks than
                               parts: true, each rank computes its parts in turn,
                               accumulating their gradients (every part trained on);
                               false, each rank computes its own part and the missing
                               ranks' parts are skipped (the per-rank batch kept).
                               docs/gloo.md, "Shrink and grow back"
checksum             "auto"    the chunk checksum's algorithm: ``xxh3`` (host memory
                               only) or ``fletcher`` (torch ops, any device); ``auto`` is
                               xxh3 on ``cpu``, fletcher on a GPU
micro_batches        1         the step function's form (``train(step_fn)``, gloo): each
                               rank's share of a step is split into this many micro-batches
                               (1 .. 4,096), ``step_fn`` called on each, their gradients
                               accumulated in order (as a loop under ``no_sync`` does)
parallel_replay      true      with micro_batches >= 2: after a death before the vote, the
                               lost share's micro-batches are computed by every rank and
                               added in order by the replacement (bitwise its own sum;
                               docs/loop.md, "The step in flight, replayed in parallel").
                               It needs a compute that draws no random numbers (dropout:
                               refused, naming this setting); false: the replacement
                               computes its share alone, as before
===================  ========  ==========================================================

``LETO_CONFIG=path.toml`` makes :meth:`Config.from_env` read that file first; the
other variables override it. The variables ``leto launch`` sets for its trainers
(``LETO_ROLE``, ``LETO_INCARNATION``, ``LETO_RUN_DIR``, ``LETO_JOB``, and
``LETO_RESTART`` in a restart of the job) and the few
other ``LETO_*`` variables leto reads elsewhere are not settings and are left
alone; any other ``LETO_*`` variable is refused (a typo is not ignored, and the
closest setting is named). A file given to ``leto.wrap(config=...)`` is read as
``LETO_CONFIG`` is, the variables over it. Under ``leto launch`` the defaults are the job's:
``backend = "gloo"`` and the topology the launcher started, for a file or a dict
given to ``leto.wrap(config=...)`` as for ``LETO_CONFIG``.

A TOML file with no settings is refused: it would run the defaults (the fake
backend, one rank) without a word, which is never what a file was written for.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from leto.argcheck import BadInput, Bound, dir_to_create, show
from leto.core.erasure import Topology
from leto.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["BACKENDS", "TIER1_CODES", "Config", "ConfigError", "check_count"]

BACKENDS = ("fake", "gloo", "nccl")
# one process per rank under `leto launch` (the gloo backend's processes; nccl: its
# collectives on CUDA tensors over NCCL)
PROCESS_BACKENDS = ("gloo", "nccl")
TIER1_CODES = ("auto", "parity", "replica")
CHECKSUMS = ("auto", "xxh3", "fletcher")
_ENV_PREFIX = "LETO_"
# LETO_* variables that are not settings: set by `leto launch`'s agent for its
# trainers (leto.backends.gloo.agent), or read by other parts of leto.
NOT_SETTINGS = frozenset(
    {
        "LETO_ROLE",
        "LETO_INCARNATION",
        "LETO_RUN_DIR",
        "LETO_JOB",
        "LETO_RESTART",
        "LETO_CHECK_KEPT_PARITY",
        "LETO_DUMP_FINAL",
        "LETO_TLA2TOOLS",
        "LETO_BENCH_TEST_MARK",
        "LETO_STAGE_COLLECTIVES",
    }
)
MAX_RANKS = 1 << 20
BOUNDS: dict[str, Bound] = {
    "nodes": Bound(lo=1, hi=65_536, integer=True),
    "ranks_per_node": Bound(lo=1, hi=1_024, integer=True),
    "world_size": Bound(lo=1, hi=MAX_RANKS, integer=True),
    "chunk_size": Bound(
        lo=1, hi=1 << 30, integer=True, unit="elements", why_hi="each rank allocates whole chunks"
    ),
    "tier2_interval": Bound(lo=1, hi=1_000_000, integer=True, unit="steps"),
    "tier2_parity": Bound(lo=1, hi=255, integer=True, unit="nodes"),
    "checkpoint_interval": Bound(lo=0, hi=1_000_000, integer=True, unit="steps"),
    "replica_check": Bound(lo=0, hi=1_000_000, integer=True, unit="steps"),
    "checkpoint_mtbf": Bound(lo=0, hi=10 * 365 * 86_400, integer=True, unit="seconds"),
    "batch_parts": Bound(lo=0, hi=MAX_RANKS, integer=True, unit="parts"),
    "micro_batches": Bound(lo=1, hi=4_096, integer=True),
}


def check_count(field: str, value: Any) -> None:
    """Refuse (ConfigError) a value of the integer setting ``field`` (``nodes``,
    ``ranks_per_node``, ``world_size``, ``chunk_size``, ``tier2_interval``) that a
    Config would refuse; for flags that set one."""
    _int(field, value)


def _int(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, f"must be an integer, got {show(value)}")
    if value < 1:
        raise ConfigError(field, f"must be positive, got {value}")
    problem = BOUNDS[field].problem(value)
    if problem is not None:
        raise ConfigError(field, problem)


def _v_backend(_inst: Any, _attr: Any, value: Any) -> None:
    if value not in BACKENDS:
        raise ConfigError(
            "backend", f"unknown backend {show(value)} (choose one of {', '.join(BACKENDS)})"
        )
    if value == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "backend",
                "'nccl' needs CUDA, but torch.cuda.is_available() is False on this machine "
                f"(torch {torch.__version__}); use 'gloo' or 'fake' on CPU",
            )


def _v_positive(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    _int(attr.name, value)


def _v_bool(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(attr.name, f"must be true or false, got {show(value)}")


def _v_tier1_code(_inst: Any, _attr: Any, value: Any) -> None:
    if value not in TIER1_CODES:
        raise ConfigError(
            "tier1_code", f"unknown code {show(value)} (choose one of {', '.join(TIER1_CODES)})"
        )


def _v_device(_inst: Any, _attr: Any, value: Any) -> None:
    if value in ("auto", "cpu"):
        return
    kind, _, index = value.partition(":") if isinstance(value, str) else ("", "", "")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ConfigError(
            "device", f"unknown device {show(value)} (choose auto, cpu, cuda or cuda:N)"
        )
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            "device",
            f"{value!r} needs CUDA, but torch.cuda.is_available() is False on this machine "
            f"(torch {torch.__version__}); use 'cpu'",
        )
    if index and int(index) >= torch.cuda.device_count():
        raise ConfigError(
            "device", f"{value!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )


def _v_checksum(_inst: Any, _attr: Any, value: Any) -> None:
    if value not in CHECKSUMS:
        raise ConfigError(
            "checksum", f"unknown algorithm {show(value)} (choose one of {', '.join(CHECKSUMS)})"
        )


def _v_world(_inst: Any, _attr: Any, value: Any) -> None:
    if value is not None:
        _int("world_size", value)


def _v_count(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    """A non-negative integer within its bound (0: off)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(attr.name, f"must be an integer, got {show(value)}")
    problem = BOUNDS[attr.name].problem(value)
    if problem is not None:
        raise ConfigError(attr.name, problem)


def _v_resume(_inst: Any, _attr: Any, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value or "\0" in value:
        raise ConfigError("resume", f"must be a checkpoint directory or none, got {show(value)}")
    if not os.path.isdir(value):
        raise ConfigError("resume", f"{value} is not a directory")


def _v_dir(_inst: Any, _attr: Any, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value or "\0" in value:
        raise ConfigError("checkpoint_dir", f"must be a directory path or none, got {show(value)}")
    try:
        dir_to_create("checkpoint_dir", value)
    except BadInput as e:
        raise ConfigError("checkpoint_dir", str(e).removeprefix("checkpoint_dir ")) from None


@attrs.frozen(kw_only=True)
class Config:
    """Validated leto settings (see the module docstring)."""

    backend: str = attrs.field(default="fake", validator=_v_backend)
    nodes: int = attrs.field(default=1, validator=_v_positive)
    ranks_per_node: int = attrs.field(default=1, validator=_v_positive)
    world_size: int | None = attrs.field(default=None, validator=_v_world)
    chunk_size: int = attrs.field(default=1 << 20, validator=_v_positive)
    tier1: bool = attrs.field(default=True, validator=_v_bool)
    tier1_code: str = attrs.field(default="auto", validator=_v_tier1_code)
    tier2: bool = attrs.field(default=True, validator=_v_bool)
    tier2_interval: int = attrs.field(default=10, validator=_v_positive)
    tier2_parity: int = attrs.field(default=1, validator=_v_positive)
    checkpoint_dir: str | None = attrs.field(default=None, validator=_v_dir)
    checkpoint_interval: int = attrs.field(default=0, validator=_v_count)
    checkpoint_mtbf: int = attrs.field(default=0, validator=_v_count)
    checkpoint_async: bool = attrs.field(default=False, validator=_v_bool)
    resume: str | None = attrs.field(default=None, validator=_v_resume)
    verify_chunks: bool = attrs.field(default=True, validator=_v_bool)
    replica_check: int = attrs.field(default=1, validator=_v_count)
    master_weights: bool = attrs.field(default=False, validator=_v_bool)
    shard: bool = attrs.field(default=False, validator=_v_bool)
    device: str = attrs.field(default="auto", validator=_v_device)
    checksum: str = attrs.field(default="auto", validator=_v_checksum)
    batch_parts: int = attrs.field(default=0, validator=_v_count)
    keep_global_batch: bool = attrs.field(default=False, validator=_v_bool)
    micro_batches: int = attrs.field(default=1, validator=_v_positive)
    parallel_replay: bool = attrs.field(default=True, validator=_v_bool)

    def __attrs_post_init__(self) -> None:
        n = self.nodes * self.ranks_per_node
        if n > MAX_RANKS:
            raise ConfigError(
                "topology",
                f"{self.nodes} nodes x {self.ranks_per_node} ranks per node = {n:,} ranks, "
                f"more than leto's limit of {MAX_RANKS:,}",
            )
        if self.world_size is not None and self.world_size != n:
            raise ConfigError(
                "topology",
                f"{self.nodes} nodes x {self.ranks_per_node} ranks per node = {n} ranks, "
                f"but the world size is {self.world_size}",
            )
        if self.micro_batches > 1 and self.backend == "fake":
            raise ConfigError(
                "micro_batches",
                f"{self.micro_batches} micro-batches: the step function's micro-batches run on "
                "the gloo and nccl backends; on fake, accumulate inside step_fn",
            )
        if self.tier2_parity > 1 and self.tier2_parity >= self.nodes:
            raise ConfigError(
                "tier2_parity",
                f"{self.tier2_parity} parities across {self.nodes} node(s): tier 2 with m "
                "parities needs more than m nodes (each lost node's share lives on another)",
            )
        if self.shard:
            self._check_shard()
        if self.batch_parts or self.keep_global_batch:
            self._check_batch_parts()
        self._check_device()
        if self.checkpoint_async:
            self._check_async()
        if self.tier1_code == "replica":
            if not self.tier1:
                raise ConfigError("tier1_code", "'replica' is a tier-1 code, but tier1 is off")
            if self.backend not in PROCESS_BACKENDS:
                raise ConfigError(
                    "tier1_code",
                    f"'replica' is built for the gloo and nccl backends only, not {self.backend!r} "
                    "(use 'parity' or 'auto')",
                )
            if self.ranks_per_node < 2:
                raise ConfigError(
                    "tier1_code",
                    "'replica' copies a lost rank from another rank of its node, but a node "
                    "here has one rank (use 'parity' or 'auto')",
                )

    def _check_device(self) -> None:
        dev = self.torch_device
        if dev.type == "cpu":
            if self.backend == "nccl":
                raise ConfigError("device", "the nccl backend runs on CUDA tensors, not 'cpu'")
            return
        if self.backend == "fake":
            raise ConfigError(
                "device", f"the fake backend keeps its state in host memory, not on {dev}"
            )
        if self.shard:
            raise ConfigError(
                "shard", f"sharded state (shard = true) runs on the CPU only, not on {dev}"
            )
        if self.checksum == "xxh3":
            raise ConfigError(
                "checksum", f"xxh3 reads host memory; the state is on {dev} (use 'fletcher')"
            )

    def _check_async(self) -> None:
        if self.backend not in PROCESS_BACKENDS:
            raise ConfigError(
                "checkpoint_async",
                f"asynchronous checkpoints are built for the gloo and nccl backends only, not "
                f"{self.backend!r}",
            )
        if self.shard:
            raise ConfigError(
                "checkpoint_async",
                "asynchronous checkpoints of sharded state (shard = true) are not built: "
                "set checkpoint_async = false",
            )

    def _check_batch_parts(self) -> None:
        if self.backend not in PROCESS_BACKENDS:
            raise ConfigError(
                "batch_parts",
                f"a world that shrinks and grows runs on the gloo backend only, not {self.backend!r}",
            )
        if self.shard:
            raise ConfigError(
                "batch_parts", "sharded state (shard = true) does not change its world"
            )
        if self.keep_global_batch and not self.batch_parts:
            raise ConfigError(
                "keep_global_batch",
                "keeping the global batch by accumulation needs batch_parts (the parts of "
                "the full world's global batch, one per rank of --nnodes MAX)",
            )

    def _check_shard(self) -> None:
        if self.backend not in PROCESS_BACKENDS:
            raise ConfigError(
                "shard", f"sharded state runs on the gloo backend only, not {self.backend!r}"
            )
        if self.tier1_code == "replica":
            raise ConfigError(
                "tier1_code",
                "'replica' cannot protect sharded state (shard = true): each rank holds a "
                "different shard, so no rank is another's replica (use 'parity' or 'auto')",
            )

    # --- derived ------------------------------------------------------------------

    @property
    def topology(self) -> Topology:
        return Topology.uniform(self.nodes, self.ranks_per_node)

    @property
    def torch_device(self) -> torch.device:
        """Where the retained state lives (``device``, ``auto`` resolved)."""
        import torch

        if self.device == "auto":
            return torch.device("cuda" if self.backend == "nccl" else "cpu")
        return torch.device(self.device)

    @property
    def checksum_algorithm(self) -> str:
        """The chunk checksum's algorithm (``checksum``, ``auto`` resolved)."""
        if self.checksum != "auto":
            return self.checksum
        return "xxh3" if self.torch_device.type == "cpu" else "fletcher"

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def tier1_kind(self) -> str | None:
        """What tier 1 keeps in this job: ``"parity"``, ``"replica"``, or None (tier 1 off).

        ``auto`` is ``replica`` on gloo with two or more ranks per node (its training
        is data-parallel: every rank of a node holds the same state, so a copy is as
        good as a parity and costs no per-step update) and ``parity`` otherwise (the
        other backends; a node of one rank, whose parity is a copy of its own state;
        sharded state, whose ranks hold different shards).
        """
        if not self.tier1:
            return None
        if self.tier1_code == "auto":
            replica = (
                self.backend in PROCESS_BACKENDS and self.ranks_per_node >= 2 and not self.shard
            )
            return "replica" if replica else "parity"
        return self.tier1_code

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    # --- loading ------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str | None = None) -> Config:
        """Settings from a mapping (TOML values: ints, bools, strings)."""
        if not isinstance(data, Mapping):
            raise ConfigError(
                "config", f"expected a table of settings, got {type(data).__name__}", source
            )
        fields = {a.name for a in attrs.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key == "topology":
                nodes, per = _parse_topology(value, source)
                kwargs.setdefault("nodes", nodes)
                kwargs.setdefault("ranks_per_node", per)
                if kwargs["nodes"] != nodes or kwargs["ranks_per_node"] != per:
                    raise ConfigError(
                        "topology", f"{show(value)} contradicts nodes/ranks_per_node", source
                    )
                continue
            if key not in fields:
                raise ConfigError(key, _unknown(key, ["topology", *sorted(fields)]), source)
            if key in ("nodes", "ranks_per_node") and key in kwargs and kwargs[key] != value:
                raise ConfigError("topology", f"{key}={show(value)} contradicts topology", source)
            kwargs[key] = value
        try:
            return cls(**kwargs)
        except ConfigError as e:
            if source is None or e.source is not None:
                raise
            raise ConfigError(e.field, e.message, source) from None

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> Config:
        """Settings from a TOML file: a ``[leto]`` table, or keys at the top level."""
        return cls.from_dict(_read_toml(path), source=str(path))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """Settings from ``LETO_*`` variables (and ``LETO_CONFIG``, ``WORLD_SIZE``).

        Layers, each over the one before: the defaults (under ``leto launch``, the
        job's backend and topology), the ``LETO_CONFIG`` file, the variables."""
        env = os.environ if environ is None else environ
        base: dict[str, Any] = _launch_defaults(env)
        if env.get("LETO_CONFIG"):
            path = env["LETO_CONFIG"]
            merged = _over(base, _read_toml(path))
            cfg = cls.from_dict(merged, source=path)  # its errors name the file
            base = {k: getattr(cfg, k) for k in merged if k != "topology"}
            if "topology" in merged:
                base["nodes"], base["ranks_per_node"] = cfg.nodes, cfg.ranks_per_node
                world = env.get("WORLD_SIZE", "")
                if world.isdigit() and int(world) != cfg.ranks:
                    raise ConfigError(
                        "topology",
                        f"{cfg.nodes}x{cfg.ranks_per_node} is {cfg.ranks} ranks, but this job "
                        f"runs {int(world)} (WORLD_SIZE); leave topology out of the file to "
                        "take the job's shape from leto launch",
                        path,
                    )
        types = {a.name: a for a in attrs.fields(cls)}
        for name, raw in sorted(env.items()):
            if not name.startswith(_ENV_PREFIX) or name == "LETO_CONFIG" or name in NOT_SETTINGS:
                continue
            key = name[len(_ENV_PREFIX) :].lower()
            src = f"from {name}"
            if key == "topology":
                base["nodes"], base["ranks_per_node"] = _parse_topology(raw, src)
                continue
            if key not in types:
                raise ConfigError(key, _unknown(key, ["topology", *sorted(types)], name), src)
            base[key] = _parse_env(key, raw, src)
        if base.get("world_size") is None and env.get("WORLD_SIZE"):
            base["world_size"] = _parse_env("world_size", env["WORLD_SIZE"], "from WORLD_SIZE")
        return cls.from_dict(base, source="environment")

    @classmethod
    def load(
        cls,
        source: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Config:
        """A Config from a Config, a dict, a TOML path, or (None) the environment.

        A file is read as ``LETO_CONFIG`` is: under the ``LETO_*`` variables (in a
        script run with plain ``python`` too) and, under ``leto launch``, over the job's
        defaults (the gloo backend and the launched topology); a dict over the job's
        defaults: a file or a dict that names no topology takes the launched one."""
        env = os.environ if environ is None else environ
        if isinstance(source, Config):
            return source
        if source is None:
            return cls.from_env(env)
        launched = _launch_defaults(env)
        if isinstance(source, Mapping):
            return cls.from_dict(_over(launched, source))
        if isinstance(source, (str, os.PathLike)):
            return cls.from_env({**env, "LETO_CONFIG": os.fspath(source)})
        raise ConfigError("config", f"cannot load settings from {type(source).__name__}")


def _read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The settings of a TOML file (its ``[leto]`` table, or its top level); a file
    with none is refused."""
    p = Path(path)
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError(
                "config",
                "reading TOML needs Python >= 3.11 (tomllib) or the tomli package",
                str(p),
            ) from None
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError("config", f"cannot read the file: {e.strerror}", str(p)) from None
    except ValueError as e:  # a NUL in the path
        raise ConfigError("config", f"not a file path: {e}", str(p)) from None
    try:
        data = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("config", f"not valid TOML: {e}", str(p)) from None
    if "leto" in data:
        extra = sorted(k for k in data if k != "leto")
        if extra:
            raise ConfigError(extra[0], "unknown setting outside the [leto] table", str(p))
        data = data["leto"]
        if not isinstance(data, dict):
            raise ConfigError("leto", f"must be a table of settings, got {data!r}", str(p))
    if not data:
        raise ConfigError(
            "config",
            "the file has no settings (it would run the defaults: the fake backend, one "
            "rank); give at least the backend",
            str(p),
        )
    return data


def _unknown(key: str, known: list[str], variable: str = "") -> str:
    """The message for an unknown setting (``variable``: the ``LETO_*`` variable that
    named it): the closest known one, or all of them."""

    def spell(k: str) -> str:
        return "LETO_" + k.upper() if variable else k

    where = f"variable {variable}; " if variable else ""
    close = difflib.get_close_matches(str(key), known, n=1)
    if close:
        return f"unknown setting ({where}did you mean {spell(close[0])}?)"
    return f"unknown setting ({where}known: {', '.join(map(spell, known))})"


def _over(base: Mapping[str, Any], data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` over ``base``: a topology in ``data`` replaces the base's nodes and
    ranks_per_node (from_dict refuses a topology that contradicts them)."""
    if "topology" in data:
        base = {k: v for k, v in base.items() if k not in ("nodes", "ranks_per_node")}
    return {**base, **data}


def _launch_defaults(env: Mapping[str, str]) -> dict[str, Any]:
    """Under ``leto launch`` (whose agent sets ``LETO_ROLE``): the gloo backend and the
    topology the launcher started; elsewhere none."""
    if not env.get("LETO_ROLE"):
        return {}
    out: dict[str, Any] = {"backend": "gloo"}
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    if world.isdecimal() and local.isdecimal() and int(local) > 0 and int(world) % int(local) == 0:
        out["nodes"], out["ranks_per_node"] = int(world) // int(local), int(local)
    return out


def _parse_topology(value: Any, source: str | None) -> tuple[int, int]:
    if isinstance(value, str):
        parts = value.lower().replace(" ", "").split("x")
        if len(parts) == 2 and all(p.isascii() and p.isdecimal() and len(p) < 30 for p in parts):
            nodes, per = int(parts[0]), int(parts[1])
        else:
            raise ConfigError("topology", f'{show(value)} is not NODESxRANKS (e.g. "2x4")', source)
    elif (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        nodes, per = value
    else:
        raise ConfigError("topology", f'{show(value)} is not NODESxRANKS (e.g. "2x4")', source)
    if nodes < 1 or per < 1:
        raise ConfigError(
            "topology", f"{show(value)}: nodes and ranks per node must be positive", source
        )
    for field, n in (("nodes", nodes), ("ranks_per_node", per)):
        problem = BOUNDS[field].problem(n)
        if problem is not None:
            raise ConfigError("topology", f"{show(value)}: {field} {problem}", source)
    return nodes, per


def _parse_env(key: str, raw: str, source: str) -> Any:
    a = {f.name: f for f in attrs.fields(Config)}[key]
    text = raw.strip()
    if key in ("checkpoint_dir", "resume"):
        return None if text.lower() in ("", "none") else text
    if key in ("backend", "tier1_code", "device", "checksum"):
        return text
    if a.validator is _v_bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(key, f"must be true or false, got {show(raw)}", source)
    digits = text.removeprefix("-").removeprefix("+")
    if not (digits.isascii() and digits.isdecimal()) or len(digits) > 30:
        raise ConfigError(key, f"must be an integer, got {show(raw)}", source)
    return int(text)
