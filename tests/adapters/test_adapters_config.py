"""leto.Config: loading from TOML, dicts and the environment; every error names its field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import leto
from leto.adapters.config import Config, ConfigError


def err(fn, *args, **kwargs) -> ConfigError:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as e:
        fn(*args, **kwargs)
    return e.value


def test_defaults_and_lazy_export() -> None:
    assert leto.Config is Config
    c = Config()
    assert (c.backend, c.nodes, c.ranks_per_node, c.chunk_size) == ("fake", 1, 1, 1 << 20)
    assert c.tier1 and c.tier2 and c.tier2_interval == 10 and c.checkpoint_dir is None
    assert (c.tier1_code, c.tier1_kind) == ("auto", "parity")
    r = Config.from_env(
        {"LETO_BACKEND": "gloo", "LETO_TOPOLOGY": "1x2", "LETO_TIER1_CODE": "replica"}
    )
    assert (r.backend, r.tier1_code, r.tier1_kind) == ("gloo", "replica", "replica")
    assert c.topology.node_sizes == (1,)


@pytest.mark.parametrize(
    "data,kind",
    [
        ({"backend": "gloo", "topology": "2x2"}, "replica"),  # "auto": data-parallel
        ({"backend": "gloo", "topology": "2x1"}, "parity"),  # no other rank to copy from
        ({"backend": "gloo", "tier1_code": "parity"}, "parity"),
        ({"backend": "fake"}, "parity"),
        ({"backend": "fake", "tier1_code": "parity"}, "parity"),
        ({"backend": "gloo", "topology": "1x2", "tier1": False}, None),
        ({"backend": "fake", "tier1": False, "tier1_code": "parity"}, None),
        ({"backend": "gloo", "topology": "2x2", "shard": True}, "parity"),  # shards differ
    ],
)
def test_tier1_kind_resolves_auto_by_backend(data: dict, kind: str | None) -> None:  # type: ignore[type-arg]
    assert Config.from_dict(data).tier1_kind == kind


def test_from_dict_with_topology_string() -> None:
    c = Config.from_dict({"backend": "fake", "topology": "2x4", "chunk_size": 4096, "tier2": False})
    assert (c.nodes, c.ranks_per_node, c.ranks, c.chunk_size, c.tier2) == (2, 4, 8, 4096, False)
    assert Config.from_dict({"topology": [3, 2]}).ranks == 6


@pytest.mark.parametrize(
    "data,field,message",
    [
        ({"backend": "mpi"}, "backend", "unknown backend 'mpi' (choose one of fake, gloo, nccl)"),
        ({"chunk_size": -1}, "chunk_size", "must be positive, got -1"),
        ({"chunk_size": 0}, "chunk_size", "must be positive, got 0"),
        ({"chunk_size": 1.5}, "chunk_size", "must be an integer"),
        ({"tier2_interval": 0}, "tier2_interval", "must be positive"),
        ({"tier2_parity": 0}, "tier2_parity", "must be positive"),
        (
            {"topology": "2x1", "tier2_parity": 2},
            "tier2_parity",
            "2 parities across 2 node(s): tier 2 with m parities needs more than m nodes",
        ),
        (
            {"nodes": 2, "ranks_per_node": 2, "world_size": 3},
            "topology",
            "2 nodes x 2 ranks per node = 4 ranks, but the world size is 3",
        ),
        ({"topology": "2by2"}, "topology", "is not NODESxRANKS"),
        ({"topology": "0x2"}, "topology", "must be positive"),
        ({"topology": "2x2", "nodes": 3}, "topology", "contradicts"),
        ({"tier1": "yes"}, "tier1", "must be true or false"),
        (
            {"backend": "gloo", "tier1_code": "xor"},
            "tier1_code",
            "unknown code 'xor' (choose one of auto, parity, replica)",
        ),
        (
            {"tier1_code": "replica"},
            "tier1_code",
            "'replica' is built for the gloo and nccl backends only, not 'fake' (use 'parity' or 'auto')",
        ),
        (
            {"backend": "gloo", "topology": "2x1", "tier1_code": "replica"},
            "tier1_code",
            "'replica' copies a lost rank from another rank of its node, but a node here has one rank",
        ),
        (
            {"backend": "gloo", "tier1": False, "tier1_code": "replica"},
            "tier1_code",
            "'replica' is a tier-1 code, but tier1 is off",
        ),
        ({"shard": "yes"}, "shard", "must be true or false"),
        ({"shard": True}, "shard", "sharded state runs on the gloo backend only, not 'fake'"),
        (
            {"backend": "gloo", "topology": "1x2", "shard": True, "tier1_code": "replica"},
            "tier1_code",
            "'replica' cannot protect sharded state (shard = true)",
        ),
        ({"colour": "blue"}, "colour", "unknown setting"),
        ({"backend": "gloo", "device": "tpu"}, "device", "unknown device 'tpu' (choose auto, cpu"),
        ({"backend": "gloo", "device": "cuda:x"}, "device", "unknown device 'cuda:x'"),
        ({"backend": "gloo", "device": 0}, "device", "unknown device 0"),
        ({"backend": "gloo", "checksum": "md5"}, "checksum", "unknown algorithm 'md5' (choose"),
        ({"checkpoint_dir": ""}, "checkpoint_dir", "must be a directory path"),
    ],
)
def test_bad_settings_name_their_field(data: dict, field: str, message: str) -> None:  # type: ignore[type-arg]
    e = err(Config.from_dict, data)
    assert e.field == field
    assert str(e).startswith(f"leto config: {field}: ") and message in str(e)


def test_sharded_master_weights_keep_their_disk_checkpoint(tmp_path: Path) -> None:
    cfg = Config.from_dict(
        {
            "backend": "gloo",
            "topology": "1x2",
            "shard": True,
            "master_weights": True,
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "resume": str(tmp_path),
        }
    )
    assert (cfg.checkpoint_dir, cfg.resume) == (str(tmp_path / "ckpt"), str(tmp_path))


def test_checkpoint_dir_must_not_be_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    assert err(Config, checkpoint_dir=str(f)).field == "checkpoint_dir"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_nccl_without_cuda_fails_at_load() -> None:
    e = err(Config.from_dict, {"backend": "nccl"})
    assert e.field == "backend"
    assert "'nccl' needs CUDA" in str(e) and "torch.cuda.is_available() is False" in str(e)


def test_device_and_checksum_resolve_and_cuda_is_refused_without_it() -> None:
    c = Config.from_dict({"backend": "gloo"})
    assert (str(c.torch_device), c.checksum_algorithm) == ("cpu", "xxh3")
    c = Config.from_dict({"backend": "gloo", "device": "cpu", "checksum": "fletcher"})
    assert (str(c.torch_device), c.checksum_algorithm) == ("cpu", "fletcher")
    assert (
        Config.from_env({"LETO_BACKEND": "gloo", "LETO_CHECKSUM": "fletcher"}).checksum
        == "fletcher"
    )
    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    e = err(Config.from_dict, {"backend": "gloo", "device": "cuda"})
    assert (
        e.field == "device"
        and "'cuda' needs CUDA, but torch.cuda.is_available() is False" in str(e)
    )
    assert "\n" not in str(e)


def test_toml_with_and_without_a_leto_table(tmp_path: Path) -> None:
    p = tmp_path / "leto.toml"
    p.write_text(
        '[leto]\nbackend = "fake"\ntopology = "2x2"\nchunk_size = 512\ntier2_interval = 4\n'
    )
    c = Config.load(p)
    assert (c.ranks, c.chunk_size, c.tier2_interval) == (4, 512, 4)
    p.write_text('backend = "gloo"\nnodes = 1\nranks_per_node = 3\ncheckpoint_dir = "ck"\n')
    c = Config.load(str(p))
    assert (c.backend, c.ranks, c.checkpoint_dir) == ("gloo", 3, "ck")


def test_toml_errors_name_the_file_and_the_field(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[leto]\nchunk_size = -8\n")
    e = err(Config.from_toml, p)
    assert e.field == "chunk_size" and str(p) in str(e)
    p.write_text("backend = \n")
    assert err(Config.from_toml, p).field == "config"
    p.write_text('[leto]\nbackend = "fake"\n[other]\nx = 1\n')
    assert err(Config.from_toml, p).field == "other"
    assert err(Config.from_toml, tmp_path / "missing.toml").field == "config"


def test_environment(tmp_path: Path) -> None:
    env = {
        "LETO_BACKEND": "fake",
        "LETO_TOPOLOGY": "2x3",
        "LETO_CHUNK_SIZE": "1024",
        "LETO_TIER1": "off",
        "LETO_TIER2_INTERVAL": "5",
        "LETO_CHECKPOINT_DIR": "none",
        "PATH": "/bin",
    }
    c = Config.from_env(env)
    assert (c.ranks, c.chunk_size, c.tier1, c.tier2_interval, c.checkpoint_dir) == (
        6,
        1024,
        False,
        5,
        None,
    )
    assert err(Config.from_env, {"LETO_CHUNK_SIZE": "big"}).field == "chunk_size"
    assert err(Config.from_env, {"LETO_CHUNK_SIZE": "-3"}).field == "chunk_size"
    assert err(Config.from_env, {"LETO_TIER2": "maybe"}).field == "tier2"
    assert err(Config.from_env, {"LETO_TEIR2": "1"}).field == "teir2"  # a typo is not ignored
    e = err(Config.from_env, {"LETO_TOPOLOGY": "2x2", "WORLD_SIZE": "8"})
    assert e.field == "topology" and "world size is 8" in str(e)
    p = tmp_path / "base.toml"
    p.write_text('[leto]\ntopology = "2x2"\nchunk_size = 64\n')
    c = Config.from_env({"LETO_CONFIG": str(p), "LETO_CHUNK_SIZE": "128"})
    assert (c.ranks, c.chunk_size) == (4, 128)


def test_load_dispatch() -> None:
    c = Config(nodes=2)
    assert Config.load(c) is c
    assert Config.load({"nodes": 3}).nodes == 3
    assert err(Config.load, 42).field == "config"


def test_bounds_and_odd_values_are_refused_in_one_line(tmp_path: Path) -> None:
    assert err(Config.from_dict, {"topology": "99999x1"}).field == "topology"
    assert err(Config.from_dict, {"topology": "²x1"}).field == "topology"  # not a decimal digit
    e = err(Config.from_dict, {"nodes": 65_536, "ranks_per_node": 1024})
    assert e.field == "topology" and "more than leto's limit of 1,048,576" in str(e)
    assert "must be at most 1,000,000" in str(err(Config.from_dict, {"tier2_interval": 10**6 + 1}))
    e = err(Config.from_dict, {"a\nb": 1})
    assert e.field == "a\nb" and len(str(e).splitlines()) == 1
    e = err(Config.from_env, {"LETO_CHUNK_SIZE": "9" * 5000})
    assert e.field == "chunk_size" and len(str(e)) < 200
    assert Config.from_dict({"chunk_size": 1 << 30}).chunk_size == 1 << 30


def test_launch_defaults_sit_under_the_config_file(tmp_path: Path) -> None:
    """Under `leto launch`: the launched shape, then LETO_CONFIG (only the keys it sets),
    then the variables."""
    p = tmp_path / "job.toml"
    p.write_text("chunk_size = 64\n")
    env = {
        "LETO_ROLE": "trainer",
        "WORLD_SIZE": "6",
        "LOCAL_WORLD_SIZE": "3",
        "LETO_CONFIG": str(p),
    }
    c = Config.from_env(env)
    assert (c.backend, c.nodes, c.ranks_per_node, c.chunk_size) == ("gloo", 2, 3, 64)
    p.write_text('backend = "fake"\ntopology = "1x6"\n')
    c = Config.from_env(env)
    assert (c.backend, c.nodes, c.ranks_per_node, c.chunk_size) == ("fake", 1, 6, 1 << 20)
    assert Config.from_env({**env, "LETO_TIER2": "off"}).tier2 is False


def test_a_files_topology_other_than_the_launched_world_names_the_file(tmp_path: Path) -> None:
    """A new user's trial: examples/gloo-1node.toml pinned 1x2, and a 3-rank launch
    failed with an error labelled "config (environment)"."""
    p = tmp_path / "job.toml"
    p.write_text('backend = "gloo"\ntopology = "1x2"\n')
    env = {"LETO_ROLE": "trainer", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}
    with pytest.raises(ConfigError) as e:
        Config.from_env({**env, "LETO_CONFIG": str(p)})
    line = str(e.value)
    assert str(p) in line and "1x2 is 2 ranks, but this job runs 3" in line, line
    assert "\n" not in line
    # the examples' file takes the launched shape
    examples = Path(__file__).resolve().parents[2] / "examples"
    c = Config.from_env({**env, "LETO_CONFIG": str(examples / "gloo-1node.toml")})
    assert (c.nodes, c.ranks_per_node) == (1, 3)
