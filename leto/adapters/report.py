"""``leto report RUN_DIR``: a run's failure/recovery timeline, printed and plotted.

Reads ``RUN_DIR/events.jsonl`` (written by ``leto launch``'s coordinator, one JSON
object per line) and prints, in order: the job, every failure (what failed, how
it was detected), every recovery (its phases and their durations, roll forward /
back / tier 1 / tier 2 / checkpoint, chunks repaired, the shadow warm or cold,
restarts), and a summary. It saves a PNG of the timeline (training progress
over time, failures, recoveries by kind, the phase breakdown of each recovery)
to ``RUN_DIR/timeline.png`` unless ``--no-plot`` or ``--out`` says otherwise.
``--json`` prints the summary as one JSON object instead of the text.

A run directory used for several jobs holds each one's records (every record names its
job, :mod:`leto.jobs`): the report is the latest job's, or ``--job ID``'s, and says so in
one line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

from leto.argcheck import BadInput, Bound, file_to_write, refuse, show
from leto.jobs import Choice, NoSuchJob, choose

__all__ = ["configure", "load", "of_job", "plot", "run", "summarize", "timeline_lines"]

PHASES = ("fence", "promote", "rejoin", "reconcile", "rebuild", "resume")
KIND_WORDS = {
    "inplace": "nothing to repair",
    "back": "rolled back the uncommitted step",
    "forward": "rolled forward to the committed step",
    "tier1": "rebuilt from tier 1",
    "tier2": "restored the tier-2 snapshot",
    "ckpt": "loaded the disk checkpoint",
}
KIND_COLORS = {
    "inplace": "#8fbc8f",
    "back": "#f0ad4e",
    "forward": "#5bc0de",
    "tier1": "#9370db",
    "tier2": "#d9534f",
    "ckpt": "#555555",
}


class ReportError(ValueError):
    pass


# The fields the report computes with, and what each must hold where it is present
# ("t_rel" in every record, "step" in a "step" record). Any other field is printed as
# it is, so it may hold anything.
_LIMIT = 1e12
_NUMBER = Bound(lo=-_LIMIT, hi=_LIMIT)
_COUNT = Bound(lo=0, hi=_LIMIT, integer=True)
FIELDS: dict[str, Bound] = {
    "t_rel": _NUMBER,
    "seconds": Bound(lo=0, hi=_LIMIT),
    "restarts": _COUNT,
    "chunks_repaired_tier1": _COUNT,
    "tier1_from_replicas": _COUNT,
    "chunks_rolled_forward": _COUNT,
    "steps_lost": _COUNT,
}
_STEP = Bound(lo=-1, hi=_LIMIT, integer=True)


def load(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's event log, each checked to hold what the report reads.

    A line that is not JSON is skipped (a writer killed half way through a line
    leaves one), but a file with no record, records that are not JSON objects or
    have no ``"event"``, and fields of the wrong type are refused, naming the line."""
    p = Path(run_dir)
    f = p / "events.jsonl" if p.is_dir() else p
    if not f.is_file():
        raise ReportError(
            f"no event log at {f} (a run directory of `leto launch` holds events.jsonl)"
        )
    try:
        text = f.read_bytes().decode("utf-8")
    except OSError as e:
        raise ReportError(f"cannot read {f}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ReportError(
            f"{f} is not an event log: it is not UTF-8 text (byte {e.start})"
        ) from None
    events = []
    skipped = 0
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            skipped += 1
            continue
        _check_record(f, n, rec)
        events.append(rec)
    if not events:
        what = "no line of it is a JSON record" if skipped else "it holds no events"
        raise ReportError(f"{f} is not an event log: {what}")
    return events


def of_job(
    events: list[dict[str, Any]], job: str | None, where: object
) -> tuple[list[dict[str, Any]], Choice]:
    """The records of job ``job`` (an id or a prefix of one; None: the latest job), and
    which job of the log's that is."""
    try:
        choice = choose(events, job)
    except NoSuchJob as e:
        raise ReportError(f"{where}: {e}") from None
    return [e for e in events if choice.holds(e)], choice


def _check_record(f: Path, n: int, rec: Any) -> None:
    where = f"{f}: line {n}"
    if not isinstance(rec, dict):
        raise ReportError(f"{where}: a record must be a JSON object, got {show(rec)}")
    event = rec.get("event")
    if not isinstance(event, str):
        got = "none" if "event" not in rec else show(event)
        raise ReportError(f'{where}: a record must name its "event" (a string), got {got}')
    what = f"{where}: {show(event)} record:"
    if "t_rel" not in rec:
        raise ReportError(f'{what} no "t_rel" (seconds since the job started)')
    if "job" in rec and not isinstance(rec["job"], str):
        raise ReportError(f"{what} job must be a string (the job's id), got {show(rec['job'])}")
    for key, bound in FIELDS.items():
        if key in rec and not (key == "steps_lost" and rec[key] is None):
            problem = bound.problem(rec[key])
            if problem is not None:
                raise ReportError(f"{what} {key} {problem}")
    if event == "step":
        problem = _STEP.problem(rec.get("step"))
        if problem is not None:
            raise ReportError(f"{what} step {problem}")
    if event == "node_joined" and "node" not in rec:
        raise ReportError(f'{what} no "node"')
    phases = rec.get("phases_ms", {})
    if not isinstance(phases, dict):
        raise ReportError(f"{what} phases_ms must be an object, got {show(phases)}")
    for k, v in phases.items():
        problem = Bound(lo=0, hi=_LIMIT).problem(v)
        if problem is not None:
            raise ReportError(f"{what} phases_ms.{show(k)} {problem}")
    promoted = rec.get("promoted", [])
    if not isinstance(promoted, list):
        raise ReportError(f"{what} promoted must be a list, got {show(promoted)}")
    for p in promoted:
        if not isinstance(p, dict) or "rank" not in p:
            raise ReportError(
                f'{what} each of promoted must be an object with "rank", got {show(p)}'
            )
        problem = None if "ms" not in p else Bound(lo=0, hi=_LIMIT).problem(p["ms"])
        if problem is not None:
            raise ReportError(f"{what} promoted ms {problem}")


def _line(value: Any, last: bool = False) -> str:
    """The first (or last) non-blank line of a field's text."""
    lines = [ln for ln in str(value).splitlines() if ln.strip()]
    return (lines[-1] if last else lines[0]).strip() if lines else ""


def _label(value: Any) -> str:
    """A field's text as a plot label: one line, short, no mathtext (``$``)."""
    return _line(value)[:40].replace("$", r"\$")


def _failure_text(e: dict[str, Any]) -> str:
    kind = e.get("kind")
    who = f"node {e.get('node')}" if kind == "node_lost" else f"rank {e.get('rank')}"
    if e.get("pid") is not None:
        who += f" (pid {e['pid']})"
    words = {
        "crash": "died",
        "exception": "raised an exception",
        "hang": "hangs",
        "keeper_lost": "lost its retained memory (keeper died)",
        "diverged": "differed from its replicas (its memory discarded)",
        "node_lost": "was lost",
        "collective_error": "broke a collective",
    }.get(str(kind), str(kind))
    where = ""
    if e.get("in_phase") and e.get("in_phase") not in ("idle", "startup"):
        where = f" in {e['in_phase']}"
    detail = e.get("detail")
    how = e.get("detected_by", "")
    text = f"{who} {words}{where} (step {e.get('step')}, {e.get('phase')}): detected by {how}"
    if detail:
        text += f", {detail}"
    tb = e.get("traceback")
    if tb:
        text += f"; {_line(tb, last=True)}"
    return text


def _recovery_text(e: dict[str, Any]) -> str:
    phases = e.get("phases_ms", {})
    ph = ", ".join(f"{k} {phases[k]:.1f} ms" for k in PHASES if k in phases)
    prom = ", ".join(
        f"rank {p['rank']} {'warm' if p.get('warm') else 'cold'} {p.get('ms', 0):.0f} ms" + _pids(p)
        for p in e.get("promoted", [])
    )
    kind = str(e.get("kind"))
    what = KIND_WORDS.get(kind, kind)
    details = []
    for key, label in (
        ("chunks_rolled_forward", "chunks rolled forward"),
        ("chunks_rolled_back", "chunks rolled back"),
        ("chunks_repaired_tier1", "chunks repaired from tier 1"),
        ("grads_repaired_tier1", "gradient blocks repaired from tier 1"),
        ("tier1_from_replicas", "copied from replicas"),
        ("chunks_restored", "chunks restored"),
    ):
        if e.get(key):
            details.append(f"{e[key]} {label}")
    if e.get("steps_lost"):
        details.append(f"{e['steps_lost']} committed step(s) to recompute")
    if e.get("restarts"):
        details.append(f"restarted {e['restarts']}x")
    tail = f" [{'; '.join(details)}]" if details else ""
    return (
        f"gen {e.get('generation')}: {kind} ({what}), resumed at step {e.get('resumed_at')} "
        f"in {float(e.get('seconds', 0)):.3f} s; promoted: {prom or 'none'}; {ph}{tail}"
    )


def _pids(p: dict[str, Any]) -> str:
    """`` (pid 120 -> 131)``: the failed trainer's process, and the promoted shadow's."""
    if p.get("pid") is None:
        return ""
    return f" (pid {p.get('old_pid', '?')} -> {p['pid']})"


def timeline_lines(events: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in events:
        ev = e["event"]
        t = f"{float(e.get('t_rel', 0)):9.3f}"
        if ev == "job_start":
            out.append(
                f"{t}  JOB      {e.get('nodes')} node(s) x {e.get('nproc_per_node')} rank(s), "
                f"{Path(str(e.get('script'))).name}, job {e.get('job')}"
            )
        elif ev == "node_joined":
            out.append(
                f"{t}  NODE     node {e['node']} joined"
                + (" (replacement)" if e.get("spare") else "")
            )
        elif ev == "training_started":
            out.append(
                f"{t}  START    {e.get('n_chunks')} chunks of {e.get('chunk_numel')} elements per rank, "
                f"tier 1 {_tier1_words(e)}, tier 2 "
                + (f"every {e.get('tier2_interval')} steps" if e.get("tier2") else "off")
                + f", checkpoint {'yes' if e.get('checkpoint') else 'no'}"
            )
        elif ev == "failure":
            out.append(f"{t}  FAILURE  {_failure_text(e)}")
        elif ev == "recovery_start":
            out.append(f"{t}  RECOVER  begins at committed step {e.get('from_step')}")
        elif ev == "recovery_restart":
            out.append(
                f"{t}  RESTART  a failure during recovery ({e.get('phase')}): next generation"
            )
        elif ev == "recovery_end":
            out.append(f"{t}  RECOVERED {_recovery_text(e)}")
        elif ev == "replicas_disagree":
            groups = " / ".join("{" + ", ".join(map(str, g)) + "}" for g in e.get("groups") or [])
            how = (
                "; ".join(f"rank {r} copied from rank {src}" for r, src in e["repair"])
                if e.get("repair")
                else "not repaired"
            )
            out.append(
                f"{t}  SPLIT    replicas disagree after step {e.get('step')} ({groups}): {how}"
            )
        elif ev == "job_restart":
            out.append(
                f"{t}  RESTART  the job starts again from its checkpoint (restart "
                f"{e.get('attempt')} of {e.get('of')}): {_line(e.get('cause'))}"
            )
        elif ev == "shadow" and e.get("state") in ("cold", "failed"):
            why = _line(e.get("reason", ""))
            out.append(f"{t}  SHADOW   rank {e.get('rank')} {e.get('state')}: {why}")
        elif ev == "training_done":
            out.append(f"{t}  DONE     step {e.get('step')}, {e.get('recoveries')} recoveries")
        elif ev == "job_failed":
            out.append(f"{t}  FAILED   {_line(e.get('error'))}")
        elif ev == "job_end":
            out.append(f"{t}  END      {e.get('status')}")
    return out


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    recs = [e for e in events if e["event"] == "recovery_end"]
    fails = [e for e in events if e["event"] == "failure"]
    steps = [e for e in events if e["event"] == "step"]
    done = next((e for e in events if e["event"] == "training_done"), None)
    # a job that completed stays completed: with etcd, an agent cut off from the majority
    # (the coordinator before a failover) logs its own end after its successor's, not
    # knowing the job went on without it
    ends = [e for e in events if e["event"] == "job_end"]
    end = next((e for e in ends if e.get("status") == "ok"), ends[-1] if ends else None)
    ok = end is not None and end.get("status") == "ok"
    by_kind: dict[str, int] = {}
    for r in recs:
        by_kind[str(r.get("kind"))] = by_kind.get(str(r.get("kind")), 0) + 1
    detected: dict[str, int] = {}
    for f in fails:
        detected[str(f.get("kind"))] = detected.get(str(f.get("kind")), 0) + 1
    promoted = [p for r in recs for p in r.get("promoted", [])]
    return {
        "status": None if end is None else end.get("status"),
        "failures": len(fails),
        "failures_by_kind": dict(sorted(detected.items())),
        "recoveries": len(recs),
        "recoveries_by_kind": dict(sorted(by_kind.items())),
        "recovery_seconds": [float(r.get("seconds", 0)) for r in recs],
        "recovery_restarts": sum(int(r.get("restarts", 0)) for r in recs),
        "replica_splits": sum(1 for e in events if e["event"] == "replicas_disagree"),
        "replica_repairs": sum(
            len(e.get("repair") or []) for e in events if e["event"] == "replicas_disagree"
        ),
        "job_restarts": sum(1 for e in events if e["event"] == "job_restart"),
        "promotions_warm": sum(1 for p in promoted if p.get("warm")),
        "promotions_cold": sum(1 for p in promoted if not p.get("warm")),
        "chunks_repaired_tier1": sum(int(r.get("chunks_repaired_tier1", 0)) for r in recs),
        "tier1_from_replicas": sum(int(r.get("tier1_from_replicas", 0)) for r in recs),
        "chunks_rolled_forward": sum(int(r.get("chunks_rolled_forward", 0)) for r in recs),
        "steps_lost": sum(int(r.get("steps_lost", 0) or 0) for r in recs),
        "final_step": None if done is None else done.get("step"),
        "steps_logged": len(steps),
        "digests": None if done is None else done.get("digests"),
        "error": None
        if ok
        else next((e.get("error") for e in events if e["event"] == "job_failed"), None),
    }


def _tier1_words(e: dict[str, Any]) -> str:
    if not e.get("tier1"):
        return "off"
    kind = e.get("tier1_kind")
    return f"on ({kind})" if kind else "on"


def plot(events: list[dict[str, Any]], out: str | Path) -> Path:
    """Save the timeline as a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [(float(e["t_rel"]), int(e["step"])) for e in events if e["event"] == "step"]
    recs = [e for e in events if e["event"] == "recovery_end"]
    fails = [e for e in events if e["event"] == "failure"]
    fig, (ax, bx) = plt.subplots(
        2, 1, figsize=(11, 6.5), gridspec_kw={"height_ratios": [3, 2]}, constrained_layout=True
    )
    if steps:
        ax.plot(
            [t for t, _ in steps],
            [s for _, s in steps],
            ".-",
            color="#337ab7",
            lw=1,
            ms=3,
            label="committed step",
        )
    for r in recs:
        t1 = float(r["t_rel"])
        t0 = t1 - float(r.get("seconds", 0))
        kind = str(r.get("kind"))
        ax.axvspan(t0, t1, color=KIND_COLORS.get(kind, "#999999"), alpha=0.35, lw=0)
    seen: set[str] = set()
    for f in fails:
        kind = str(f.get("kind"))
        ax.axvline(
            float(f["t_rel"]),
            color="#d9534f",
            lw=0.8,
            ls="--",
            label=None if "failure" in seen else "failure",
        )
        seen.add("failure")
        ax.annotate(
            _label(kind),
            (float(f["t_rel"]), ax.get_ylim()[1] if steps else 1),
            rotation=90,
            fontsize=7,
            va="top",
            ha="right",
            color="#a94442",
        )
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    for kind, color in KIND_COLORS.items():
        if any(str(r.get("kind")) == kind for r in recs):
            handles.append(Patch(color=color, alpha=0.35, label=f"recovery: {kind}"))
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("step")
    ax.set_title("leto: training progress, failures and in-place recoveries")
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    if recs:
        colors = {
            "fence": "#777777",
            "promote": "#5bc0de",
            "rejoin": "#337ab7",
            "reconcile": "#9370db",
            "rebuild": "#f0ad4e",
            "resume": "#5cb85c",
        }
        for i, r in enumerate(recs):
            left = 0.0
            ph = r.get("phases_ms", {})
            for name in PHASES:
                w = float(ph.get(name, 0.0))
                bx.barh(i, w, left=left, color=colors[name], label=name if i == 0 else None)
                left += w
            bx.text(
                left,
                i,
                f" {_label(r.get('kind'))} {float(r.get('seconds', 0)) * 1e3:.0f} ms",
                va="center",
                fontsize=7,
            )
        bx.set_yticks(range(len(recs)))
        bx.set_yticklabels([f"gen {_label(r.get('generation'))}" for r in recs], fontsize=7)
        bx.invert_yaxis()
        bx.set_xlabel("milliseconds per recovery phase")
        bx.legend(loc="lower right", fontsize=7, ncol=5)
    else:
        bx.text(0.5, 0.5, "no recoveries", ha="center", va="center", transform=bx.transAxes)
        bx.set_axis_off()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory of `leto launch` (or its events.jsonl)")
    parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/timeline.png)")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--job",
        default=None,
        metavar="ID",
        help="the job to report, by its id or a prefix of it, where RUN_DIR holds several "
        "(default: the latest)",
    )


def run(args: argparse.Namespace) -> int:
    png = None
    try:
        if not args.no_plot:
            base = Path(args.run_dir)
            png = (
                Path(args.out)
                if args.out
                else (base if base.is_dir() else base.parent) / "timeline.png"
            )
            file_to_write("--out" if args.out else "the plot (--out, --no-plot)", png)
            if importlib.util.find_spec("matplotlib") is None:
                raise ReportError(
                    "the plot needs matplotlib (pip install matplotlib); or --no-plot"
                )
        events, choice = of_job(load(args.run_dir), args.job, args.run_dir)
    except (ReportError, BadInput) as e:
        return refuse("report", e)
    summary = summarize(events)
    summary["job"] = choice.job or None
    summary["jobs"] = len(choice.jobs)
    if png is not None:
        plot(events, png)
        summary["plot"] = str(png)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    note = choice.note(args.run_dir)
    if note is not None:
        print(note)
    for line in timeline_lines(events):
        print(line)
    print()
    secs = ", ".join(f"{s:.3f}" for s in summary["recovery_seconds"]) or "none"
    print(
        f"{summary['failures']} failure(s) {summary['failures_by_kind']}, "
        f"{summary['recoveries']} recovery(ies) {summary['recoveries_by_kind']}, "
        f"{summary['recovery_restarts']} recovery restart(s); recovery seconds: {secs}"
    )
    if summary["replica_splits"] or summary["job_restarts"]:
        print(
            f"replicas disagreed {summary['replica_splits']} time(s), "
            f"{summary['replica_repairs']} rank(s) repaired from the majority; "
            f"the job restarted from its checkpoint {summary['job_restarts']} time(s)"
        )
    print(
        f"shadows promoted warm {summary['promotions_warm']}, cold {summary['promotions_cold']}; "
        f"{summary['chunks_repaired_tier1']} chunk(s) repaired from tier 1 "
        f"({summary['tier1_from_replicas']} copies from replicas), "
        f"{summary['chunks_rolled_forward']} rolled forward, {summary['steps_lost']} step(s) recomputed"
    )
    print(f"status: {summary['status']}" + (f" ({summary['error']})" if summary["error"] else ""))
    if png is not None:
        print(f"plot: {png}")
    return 0
