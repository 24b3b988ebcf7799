"""Hosts that failed too often are not taken back (leto.backends.gloo.exclusion): the
count within the window, loopback never excluded, and the spare pool passing over a
spare of an excluded host (tests/hosts/test_host_exclusion.py runs it on test hosts)."""

from __future__ import annotations

from leto.backends.gloo.eventlog import EventLog
from leto.backends.gloo.exclusion import Exclusions, host_of
from leto.backends.gloo.spare_pool import SparePool


def test_a_host_is_excluded_at_its_kth_failure_within_the_window() -> None:
    log = EventLog(None)
    ex = Exclusions(log, after=2, window=60.0)
    ex.joined(1, "10.231.0.3:40112")
    ex.failed(1, now=0.0)
    assert ex.refusal("10.231.0.3:5555") is None  # one failure: still taken
    ex.failed(1, now=61.0)  # the first is out of the window now
    assert ex.refusal("10.231.0.3:5555") is None
    ex.failed(1, now=100.0)
    why = ex.refusal("10.231.0.3:5555")
    assert why is not None and why.startswith("host 10.231.0.3 failed 2 time(s) within 60 s")
    assert "--exclude-after 2" in why and "\n" not in why
    assert ex.refusal("10.231.0.4:1") is None  # another host
    (rec,) = [r for r in log.records if r["event"] == "host_excluded"]
    assert (rec["host"], rec["node"], rec["failures"]) == ("10.231.0.3", 1, 2)


def test_loopback_and_off_never_exclude_and_unknown_nodes_count_nothing() -> None:
    ex = Exclusions(EventLog(None), after=1, window=60.0)
    ex.joined(0, "127.0.0.1:4000")
    ex.failed(0, now=1.0)
    ex.failed(7, now=1.0)  # no host known for node 7
    assert ex.refusal("127.0.0.1:4001") is None and not ex.excluded
    off = Exclusions(EventLog(None), after=0, window=60.0)
    off.joined(1, "10.0.0.2:1")
    off.failed(1, now=1.0)
    assert off.refusal("10.0.0.2:9") is None
    assert host_of("[fe80::1]:29400") == "fe80::1" and host_of("10.0.0.2:1") == "10.0.0.2"


def test_the_pool_passes_over_a_spare_of_an_excluded_host_and_says_so_once() -> None:
    log = EventLog(None)
    ex = Exclusions(log, after=1, window=60.0)
    pool = SparePool(log, lambda: True, usable=lambda peer: ex.refusal(peer) is None)
    bad = pool.joined("10.231.0.3:1")  # the lowest id, on the host about to be excluded
    good = pool.joined("10.231.0.4:1")
    ex.joined(1, "10.231.0.3:2")
    ex.failed(1, now=5.0)
    assert pool.assign({1: 5.0}, up=set()) == [(good, 1)]
    assert pool.assign({2: 6.0}, up=set()) == []  # only the excluded host's spare is left
    passed = [r for r in log.records if r["event"] == "spare_passed_over"]
    assert [r["spare"] for r in passed] == [bad] and pool.ids == [bad]
    # without exclusions the lowest id takes the place, as before
    plain = SparePool(EventLog(None), lambda: True)
    first = plain.joined("10.231.0.3:1")
    plain.joined("10.231.0.4:1")
    assert plain.assign({1: 5.0}, up=set()) == [(first, 1)]
