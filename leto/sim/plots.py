"""PNG plots of sweeps: ETTR per strategy against the swept parameter, with 95% bands."""

from __future__ import annotations

from pathlib import Path

from leto.sim.sweep import SWEEPS, SweepResult

STYLE = {
    "ckpt-sync": ("tab:gray", "--"),
    "ckpt-async": ("tab:brown", "--"),
    "gemini": ("tab:blue", "-."),
    "jit": ("tab:purple", ":"),
    "leto": ("tab:red", "-"),
}


def plot_sweep(sweep: SweepResult, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, label, log = SWEEPS[sweep.name]
    fig, ax = plt.subplots(figsize=(7.0, 4.5), dpi=120)
    xs = list(sweep.values)
    for name in sweep.results[0].strategies:
        mean, half = sweep.series(name)
        color, style = STYLE.get(name, ("black", "-"))
        ax.plot(xs, mean, style, color=color, label=name, linewidth=2 if name == "leto" else 1.4)
        lo = [m - h for m, h in zip(mean, half, strict=True)]
        hi = [m + h for m, h in zip(mean, half, strict=True)]
        ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)
    if log:
        ax.set_xscale("log")
    p = sweep.results[0].params
    fixed = {
        "gpus": f"{p.days:g}-day job, {p.calibration} calibration",
        "hof": f"{p.gpus:,} GPUs, {p.days:g}-day job",
        "mtbf": f"{p.gpus:,} GPUs, {p.days:g}-day job",
    }[sweep.name]
    ax.set_xlabel(label)
    ax.set_ylabel("effective training time ratio (ETTR)")
    ax.set_title(f"ETTR vs {sweep.name} ({fixed}, {p.seeds} seed(s))")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
