"""Human-readable tables of an experiment and of a sweep."""

from __future__ import annotations

from leto.sim.calibration import FailureClass
from leto.sim.experiment import Result
from leto.sim.measured import INPUTS, LAWS, Calibration, at_scale
from leto.sim.sweep import SweepResult


def header(result: Result) -> str:
    p = result.params
    shares = ", ".join(
        f"{c.name.lower().replace('_', ' ')} {s:.1%}"
        for c, s in zip(FailureClass, p.class_shares, strict=True)
    )
    mtbf_src = "given" if p.mtbf_hours is not None else f"{p.calibration} calibration"
    mean_failures = sum(result.failures) / len(result.failures)
    return "\n".join(
        [
            f"{p.gpus:,} GPUs ({p.nodes:,} nodes x {p.ranks_per_node}), {p.days:g} days, "
            f"model {p.model_size / 1e9:.3g}B params, step {p.step_time_s:g} s",
            f"job MTBF {p.mtbf_s / 3600:.3g} h ({mtbf_src}); {mean_failures:,.0f} failures per run; "
            f"{p.seeds} seed(s) from {p.seed}; {p.spare_nodes} spare node(s)",
            f"failure mix: {shares}",
        ]
    )


def table(result: Result, causes: int = 4) -> str:
    rows = [
        f"{'strategy':<11} {'ETTR':>7} {'+/-95%':>7} {'ckpt every':>10}  time lost, hours (top causes)"
    ]
    for name, r in result.strategies.items():
        top = sorted(r.lost_hours.items(), key=lambda kv: -kv[1])[:causes]
        lost = ", ".join(f"{c} {h:.1f}" for c, h in top)
        every = (
            f"{r.ckpt_interval_s / 60:.1f} min"
            if r.ckpt_interval_s < 7200
            else (f"{r.ckpt_interval_s / 3600:.1f} h")
        )
        rows.append(f"{name:<11} {r.ettr:>7.2%} {r.ettr_ci95 * 100:>6.2f}pp {every:>10}  {lost}")
    tiers = result.strategies.get("leto")
    if tiers is not None:
        n = sum(tiers.tiers) or 1
        rows.append(
            "leto tiers: "
            + ", ".join(
                f"{label} {k / n:.1%}"
                for label, k in zip(
                    ("in place", "tier 1", "tier 2", "disk"), tiers.tiers, strict=True
                )
            )
        )
    return "\n".join(rows)


def sweep_table(sweep: SweepResult) -> str:
    names = list(sweep.results[0].strategies)
    head = f"{sweep.field:>12} " + " ".join(f"{n:>10}" for n in names)
    lines = [head]
    for v, r in zip(sweep.values, sweep.results, strict=True):
        cells = " ".join(f"{r.strategies[n].ettr:>10.2%}" for n in names)
        lines.append(f"{v:>12g} {cells}")
    lines.append(f"({len(sweep.values)} points in {sweep.elapsed_s:.1f} s)")
    return "\n".join(lines)


def inputs(result: Result, cal: Calibration) -> str:
    """Every measurable figure: its value in this job, measured (from where) or assumed."""
    used = {n for s in result.strategies for n in INPUTS.get(s, ())}
    used.update(("restart_s", "ckpt_fixed_s", "storage_node_gb_s"))
    rows = [f"{'input':<18} {'in this job':>18}  {'':<8}  source; law"]
    for f in cal.figures:
        if f.param not in used:
            continue
        mark = "measured" if f.measured else "assumed"
        law = LAWS[f.param].text if f.measured else ""
        rows.append(
            f"{f.param:<18} {at_scale(f.param, result.params):>18}  {mark:<8}  {f.source}"
            + (f"; {law}" if law else "")
        )
    return "\n".join(rows)


def headline(result: Result, cal: Calibration) -> str:
    """Each in-place strategy's ETTR, and which of its inputs were measured."""
    lines = []
    for name in ("leto", "torchft"):
        r = result.strategies.get(name)
        if r is None:
            continue
        yes, no = cal.measured(name)
        lines.append(
            f"{name} at {result.params.gpus:,} GPUs: ETTR {r.ettr:.2%}; "
            f"measured: {', '.join(yes) or 'none'}; assumed: {', '.join(no) or 'none'}"
        )
    return "\n".join(lines)
