"""``leto bench tier2`` at a tiny size: its figures are sane (not timed)."""

from __future__ import annotations

import json

import pytest

from leto.cli import main


def test_bench_tier2_measures_every_m_against_m1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "tier2", "--nodes", "4", "--mib", "0.01", "--parities", "2,3"]
    assert main([*argv, "--rounds", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    rows = {r["m"]: r for r in res["rows"]}
    assert sorted(rows) == [1, 2, 3] and res["nodes"] == 4
    assert rows[1]["ratio_to_m1"] == 1.0
    n = res["bytes_per_node"]
    # each node stores m / (nodes - m) of a snapshot in parity (rounded up per share)
    assert rows[1]["parity_bytes_per_node"] == -(-n // 3)
    assert rows[2]["parity_bytes_per_node"] == 2 * -(-n // 2)
    assert rows[3]["parity_bytes_per_node"] == 3 * n
    for r in rows.values():
        assert len(r["encode_s_all"]) == 2 and r["encode_s"] > 0 and r["ratio_to_m1"] > 0


def test_bench_tier2_refuses_more_parities_than_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "tier2", "--nodes", "3", "--parities", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--parities" in err and "below --nodes (3)" in err
    assert main(["bench", "tier2", "--parities", "two"]) == 2
    assert "--parities: not a list of integers" in capsys.readouterr().err
