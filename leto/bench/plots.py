"""PNG plots of ``leto bench`` results (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .timeline import PHASES

__all__ = ["plot_goodput", "plot_overhead", "plot_recovery", "plot_scaling"]

_COLORS = {
    "detection": "#9e9e9e",
    "process_state": "#e4572e",
    "model_state": "#29335c",
    "communicator": "#f3a712",
    "lost_work": "#a8c686",
}


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_recovery(res: dict[str, Any], path: str | Path) -> Path:
    """A stacked bar per system: the median of each phase of one recovery."""
    plt = _plt()
    names = list(res["systems"])
    rows = [(n, res["systems"][n]["phases"]) for n in names]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(rows)
    for p in PHASES:
        vals = [ph[p] for _, ph in rows]
        ax.bar(
            [n for n, _ in rows], vals, bottom=bottom, label=p.replace("_", " "), color=_COLORS[p]
        )
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, (_, ph) in enumerate(rows):
        ax.text(i, bottom[i], f"{ph['total']:.2f} s", ha="center", va="bottom", fontsize=9)
    w = res["workload"]
    title = f"One recovery, median of {res['repeats']} ({w['label']} params, {w['world']} ranks)"
    if "ratio_vs_best_baseline" in res:
        title += f"\nleto {res['ratio_vs_best_baseline']:.1f}x faster than {res['best_baseline']}"
    ax.set_title(title)
    ax.set_ylabel("seconds")
    ax.legend()
    return _save(plt, fig, path)


def plot_goodput(res: dict[str, Any], path: str | Path) -> Path:
    """Productive training time over wall-clock time, one line per system."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, s in res["systems"].items():
        t = [row[0] for row in s["timeline"]]
        y = [row[2] for row in s["timeline"]]
        (line,) = ax.step(t, y, where="post", label=f"{name} (ETTR {100 * s['ettr']:.1f}%)")
        for ft in s["failure_times_s"]:
            ax.axvline(ft, color=line.get_color(), alpha=0.25, lw=0.8)
    b = res["budget_s"]
    ax.plot([0, b], [0, b], "k:", lw=1, label="no failures, no overhead")
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("productive training time (s)")
    w = res["workload"]
    ax.set_title(
        f"Goodput: {w['label']} params, {w['world']} ranks, MTBF {res['mtbf_s']:g} s "
        f"({len(res['schedule'])} failures scheduled)"
    )
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_overhead(res: dict[str, Any], path: str | Path) -> Path:
    plt = _plt()
    names = list(res["step_s"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, [res["step_s"][n] for n in names], color="#29335c")
    base = res["step_s"]["plain"]
    for i, n in enumerate(names):
        t = res["step_s"][n]
        lab = f"{t:.3f} s" if n == "plain" else f"{t:.3f} s\n{100 * (t / base - 1):+.0f}%"
        ax.text(i, t, lab, ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("failure-free step time (s)")
    w = res["workload"]
    ax.set_title(f"Step time, {w['label']} params, {w['world']} ranks ({res['backend']})")
    return _save(plt, fig, path)


def plot_scaling(res: dict[str, Any], path: str | Path) -> Path:
    """Recovery time against the state size, log-log, one line per system."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    mib = [12 * r["workload"]["params"] / 2**20 for r in res["results"]]
    for name, tot in res["totals"].items():
        ax.plot(mib, tot, marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model + optimizer state per rank (MiB)")
    ax.set_ylabel("recovery time, median (s)")
    ax.set_title("Recovery time vs state size")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_curve(res: dict[str, Any], path: str | Path) -> Path:
    """Overhead against plain DDP's step time (log x), measured and fitted."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p["plain_step_s"] for p in res["points"]]
    ax.errorbar(
        xs,
        [p["overhead_pct"] for p in res["points"]],
        yerr=[
            [
                p["overhead_pct"] - (p["overhead_pct_ci95"] or [p["overhead_pct"]] * 2)[0]
                for p in res["points"]
            ],
            [
                (p["overhead_pct_ci95"] or [p["overhead_pct"]] * 2)[1] - p["overhead_pct"]
                for p in res["points"]
            ],
        ],
        fmt="o",
        color="#29335c",
        label="measured (95% CI over rounds)",
    )
    fx, sc = res["fit"]["fixed_s"], res["fit"]["scaling"]
    lo, hi = min(xs) * 0.8, max(xs) * 1.25
    grid = [lo * (hi / lo) ** (i / 50) for i in range(51)]
    ax.plot(grid, [100.0 * (fx / t + sc) for t in grid], color="#f3a712", label="fit c/t + b")
    ax.axhline(res["target_pct"], color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("plain DDP step time (s)")
    ax.set_ylabel("leto's failure-free overhead (%)")
    ax.set_title("Overhead against step time")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)
