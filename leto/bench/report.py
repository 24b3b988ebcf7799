"""The tables ``leto bench`` prints."""

from __future__ import annotations

from typing import Any

from .timeline import PHASES

__all__ = ["goodput_table", "overhead_table", "recovery_table", "scaling_table"]

_LABEL = {
    "detection": "detect",
    "process_state": "process",
    "model_state": "model",
    "communicator": "comm",
    "lost_work": "lost work",
}


def _wl(res: dict[str, Any]) -> str:
    w = res["workload"]
    return (
        f"model {w['label']} params (MLP {w['layers']}x{w['width']}), {w['world']} ranks, "
        f"batch {w['batch']}/rank"
    )


def _fail_note(res: dict[str, Any]) -> str:
    """Where the failures struck, when not after the forward pass (the default)."""
    if res.get("fail_at", "forward") == "forward":
        return ""
    return "; deaths at the update, after the step's vote and commit"


def recovery_table(res: dict[str, Any]) -> str:
    lines = [
        f"recovery: {_wl(res)}; MTBF {res['mtbf_s']:g} s; median of {res['repeats']} recoveries"
        + _fail_note(res),
        f"{'system':<16}" + "".join(f"{_LABEL[p]:>10}" for p in PHASES) + f"{'total':>10}  notes",
    ]
    for name, s in res["systems"].items():
        ph = s["phases"]
        note = ""
        if s.get("interval_steps"):
            note = f"ckpt every {s['interval_steps']} steps ({s['interval_s']:.1f} s)"
        elif name == "gemini":
            note = "in-memory ckpt every step"
        elif name == "leto":
            note = "in place (leto launch, gloo)"
        elif name == "leto-serial":
            note = "in place, the lost share computed by its replacement alone"
        elif name == "torchft":
            frac = s["survivor_throughput"]["fraction_of_steady"]
            kept = f"{frac:.0%} of steady" if frac is not None else "unmeasured"
            note = (
                f"torchft {s['version']}, {s['backend'].split(', ', 2)[2]}; survivors kept {kept}"
            )
        elif name == "nvre":
            note = s["backend"]
        lines.append(
            f"{name:<16}"
            + "".join(f"{ph[p]:>9.3f}s" for p in PHASES)
            + f"{ph['total']:>9.3f}s  {note}"
        )
    if "ratio_vs_best_baseline" in res:
        best = res["best_baseline"]
        r = res["ratio_vs_best_baseline"]
        lines.append(
            f"best baseline: {best} ({res['systems'][best]['total_s']:.2f} s); "
            f"leto recovers {r:.1f}x faster"
        )
    return "\n".join(lines)


def _ci_txt(ci: list[float] | None) -> str:
    return f"{ci[0]:+.1f}% .. {ci[1]:+.1f}%" if ci else ""


def overhead_table(res: dict[str, Any]) -> str:
    lines = [
        f"overhead: {_wl(res)}; {res['backend']}; {res['rounds']} rounds of short jobs, "
        f"interleaved; {res['steps_per_job']} steps measured per job after "
        f"{res['warmup_steps']}; tier 2 every {res['tier2_interval']} steps",
        f"{'config':<16}{'step (mean)':>14}{'overhead':>11}{'95% CI (rounds)':>18}   by round",
    ]
    base = res["step_s"]["plain"]
    for name, t in res["step_s"].items():
        pct = "" if name == "plain" else f"{100.0 * (t / base - 1.0):+10.1f}%"
        ci_txt = _ci_txt((res.get("overhead_pct_ci95") or {}).get(name))
        rounds = res["overhead_pct_by_round"].get(name, [])
        lines.append(
            f"{name:<16}{t:>13.4f}s{pct:>11}{ci_txt:>18}   "
            + " ".join(f"{x:+.0f}%" for x in rounds)
        )
    adj = res.get("overhead_pct_adjusted") or {}
    for name, pct in adj.items():
        ci_txt = _ci_txt((res.get("overhead_pct_adjusted_ci95") or {}).get(name))
        rounds = res.get("overhead_pct_adjusted_by_round", {}).get(name, [])
        lines.append(
            f"{name + ' adj.':<30}{pct:+10.1f}%{ci_txt:>18}   "
            + " ".join(f"{x:+.1f}%" for x in rounds)
        )
    if adj:
        lines.append(
            "    (adj.: step time per CPU second of forward passes, the same work in every"
            " configuration: the machine's drift between jobs taken out)"
        )
    stolen = [x for v in (res.get("steal_pct_runs") or {}).values() for x in v if x is not None]
    if stolen:
        lines.append(
            f"CPU time stolen by the hypervisor during the jobs: mean {sum(stolen) / len(stolen):.1f}%, "
            f"most {max(stolen):.1f}% (/proc/stat)"
        )
    cpu = res.get("cpu_ms_per_step")
    if cpu:
        lines.append(
            f"CPU per step (ms)  {'trainer':>9}{'others':>9}{'job':>9}{'extra':>9}{'unused':>9}"
            "   (trainer: one rank's; others: leto's agents, coordinator, keepers, shadows;"
            " unused: core time no process of the job used)"
        )
        for name, c in cpu.items():
            extra = f"{c['extra_pct']:+8.1f}%" if "extra_pct" in c else ""
            unused = f"{c['unused_core_ms']:9.1f}" if "unused_core_ms" in c else ""
            lines.append(
                f"{name:<18}{c['trainer_ms']:>9.1f}{c['others_ms']:>9.1f}{c['job_ms']:>9.1f}"
                f"{extra:>9}{unused}"
            )
            if c.get("forward_ms") is not None:
                lines.append(f"    forward passes: {c['forward_ms']:.1f}")
            if c.get("phases_ms"):
                ph, wall = c["phases_ms"], c.get("phases_wall_ms") or {}
                cells = [
                    f"{k} {ph[k]:.1f}" + (f"/{wall.get(k, 0.0):.0f}" if wall else "")
                    for k in sorted(ph, key=lambda k: -ph[k])
                    if ph[k] >= 0.05 or wall.get(k, 0.0) >= 0.5
                ]
                label = "CPU/wall" if wall else "CPU"
                lines.append(f"    by phase, {label}: " + ", ".join(cells))
    return "\n".join(lines)


def goodput_table(res: dict[str, Any]) -> str:
    lines = [
        f"goodput: {_wl(res)}; budget {res['budget_s']:g} s; MTBF {res['mtbf_s']:g} s "
        f"({len(res['schedule'])} failures scheduled, seed {res['seed']}); "
        f"plain DDP step {res['plain_step_s']:.3f} s",
        f"{'system':<16}{'ETTR':>8}{'steps':>8}{'failures':>10}{'step time':>12}{'vs plain':>10}",
    ]
    for name, s in res["systems"].items():
        lines.append(
            f"{name:<16}{100 * s['ettr']:>7.1f}%{s['steps']:>8.0f}{s['failures']:>10.1f}"
            f"{s['step_s']:>11.3f}s{s['step_overhead_vs_plain_pct']:>+9.0f}%"
        )
    if "torchft" in res["systems"]:
        lines.append(
            "torchft's steps: each committed step counted by the share of the replica groups "
            "in its quorum (a group healing trains nothing)"
        )
    if "gain_pp_vs_best_baseline" in res:
        rounds = res.get("rounds", 1)
        ci = res.get("gain_pp_ci95")
        spread = "" if ci is None else f" (95% CI {ci[0]:+.1f}..{ci[1]:+.1f} over {rounds} rounds)"
        lines.append(
            f"leto vs best baseline ({res['best_baseline']}): "
            f"{res['gain_pp_vs_best_baseline']:+.1f} percentage points of productive time{spread}"
        )
    return "\n".join(lines)


def scaling_table(res: dict[str, Any]) -> str:
    sizes = res["sizes"]
    head = f"{'system':<16}" + "".join(f"{s:>10}" for s in sizes) + f"{'added':>10}{'s/GiB':>9}"
    lines = ["scaling: recovery (median) by model size" + _fail_note(res)]
    for key, title in (
        ("total", "total: failure -> the step in flight completed"),
        ("resume", "resume: failure -> training runs again (detect+process+model+comm)"),
        ("lost_work", "lost work: recomputing what the failure lost"),
    ):
        lines += ["", title, head]
        for name, vals in (res["totals"] if key == "total" else res[key]).items():
            lines.append(
                f"{name:<16}"
                + "".join(f"{t:>9.2f}s" for t in vals)
                + f"{res['added_s'][key][name]:>+9.2f}s{res['slope_s_per_gib'][key][name]:>9.2f}"
            )
    mib = ", ".join(
        f"{s} -> {b / 2**20:.0f} MiB"
        for s, b in zip(sizes, res["state_bytes_per_rank"], strict=True)
    )
    lines.append("")
    lines.append(
        "added: at the largest size minus at the smallest; s/GiB: least-squares slope over "
        f"the state per rank ({mib})"
    )
    if res.get("leto_tier2") is False:
        lines.append("leto ran without its tier-2 snapshot (--no-tier2)")
    if "leto_slope_vs_disk" in res:
        lines.append(
            f"leto's total grows {1 / res['leto_slope_vs_disk']:.1f}x slower than ckpt-disk's "
            "(slope ratio)"
            if res["leto_slope_vs_disk"] > 0
            else "leto's total does not grow with the state here"
        )
    return "\n".join(lines)


def curve_table(res: dict[str, Any]) -> str:
    w = res["workload"]
    lines = [
        f"overhead curve: model {w['label']} params, {w['world']} ranks; plain DDP vs leto "
        f"(its defaults); {res['rounds']} interleaved rounds per batch size",
        f"{'batch/rank':>10}{'plain step':>12}{'leto step':>11}{'overhead':>10}"
        f"{'95% CI (rounds)':>20}   by round",
    ]
    for p in res["points"]:
        ci = p["overhead_pct_ci95"]
        ci_txt = f"{ci[0]:+.1f}% .. {ci[1]:+.1f}%" if ci else ""
        lines.append(
            f"{p['batch']:>10}{p['plain_step_s']:>11.3f}s{p['leto_step_s']:>10.3f}s"
            f"{p['overhead_pct']:>+9.1f}%{ci_txt:>20}   "
            + " ".join(f"{x:+.1f}%" for x in p["overhead_pct_by_round"])
        )
    fx, sc = res["fit"]["fixed_s"], res["fit"]["scaling"]
    at = res["step_s_at_target"]
    where = (
        f"leto costs {res['target_pct']:g}% at {at:.3f} s steps"
        if at is not None
        else f"leto costs more than {res['target_pct']:g}% at every step time "
        "(the fit's proportional part alone is above it)"
        if 100 * sc >= res["target_pct"]
        else f"leto costs less than {res['target_pct']:g}% at every step time "
        "(the fit has no fixed part)"
    )
    lines += [
        f"fit: leto - plain = {1000 * fx:.1f} ms + {100 * sc:+.2f}% x plain step "
        f"(least squares over every round)",
        f"{where}; at 0.25 s steps {res['overhead_pct_at_0_25_s']:+.1f}%",
    ]
    return "\n".join(lines)
