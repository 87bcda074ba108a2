"""benchmarks.policies' report: the text tables of the comparisons (measured, simulated, and
their agreement) and the goodput plot."""

from __future__ import annotations


def plot_goodput(goodput: dict | None, path: str, simulated: dict | None = None) -> None:
    """Attainment and goodput over rate, per policy: measured (solid) and simulated (dashed,
    over its own calibrated rates)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for section, style, suffix in ((goodput, "-", ""), (simulated, "--", " (simulated)")):
        for policy, pts in (section or {"points": {}})["points"].items():
            rates = [p["rate_rps"] for p in pts]
            label = policy + suffix
            left.plot(rates, [100 * p["attainment"] for p in pts], style, marker="o",
                      label=label)
            right.plot(rates, [p["goodput_rps"] for p in pts], style, marker="o", label=label)
    left.axhline(90, color="grey", linestyle="--", linewidth=1)
    left.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 102),
             title="requests meeting both SLOs")
    right.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)",
              title="goodput (requests meeting both SLOs per second)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_report(report: dict) -> str:
    """The comparisons that ran, as text tables: measured, simulated, then side by side."""
    lines = []
    if "model" in report:
        lines += [f"measured, model: {report['model']}", *_section_lines(report),
                  f"\ntargets (measured): {report['targets']}"]
    sim = report.get("simulated")
    if sim:
        lines += [f"\nsimulated on {sim['profile']} (predicted engine time of this run "
                  f"{sim['predicted_engine_seconds']:.0f} s)", *_section_lines(sim),
                  f"\ntargets (simulated): {sim['targets']}"]
    if report.get("agreement"):
        lines += ["\nranking, measured vs simulated (better policy; tie within 2%)",
                  f"{'figure':34} {'measured':>32} {'simulated':>32}  better m / s  agrees"]
        for row in report["agreement"]:
            lines.append(f"{row['figure']:34} {_pair(row['measured']):>32} "
                         f"{_pair(row['simulated']):>32}  {row['measured_better']} / "
                         f"{row['simulated_better']}  {row['agrees']}")
    return "\n".join(lines)


def _section_lines(sections: dict) -> list[str]:
    lines = []
    if "flood" in sections:
        lines += _flood_lines(sections["flood"])
    if "goodput" in sections:
        lines += _goodput_lines(sections["goodput"])
    if "priority" in sections:
        lines += _priority_lines(sections["priority"])
    return lines


def _pair(values: dict[str, float | None]) -> str:
    return " ".join(f"{p} {_g(v)}" for p, v in values.items())


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _flood_lines(flood: dict) -> list[str]:
    lines = [_calibration_line(flood), f"flooding tenant: B {flood['b_rate_rps']:.3f} req/s, A "
             f"{flood['a_rate_rps']:.3f} req/s (weights 1:1)",
             "policy  B TTFT p50 ms  A TTFT p50 ms  B share backlogged (cost/tokens)  "
             "backlogged s  tok/s  dur s"]
    for policy, run in flood["runs"].items():
        sh = run["backlogged_b_share"]
        lines.append(f"{policy:7} {_f(run['B']['ttft_p50_ms']):>13} "
                     f"{_f(run['A']['ttft_p50_ms']):>14} {_pct(sh['cost']):>18} / "
                     f"{_pct(sh['tokens']):<13} {run['backlogged_s']:>12} "
                     f"{run['tokens_per_s']:6.1f} {run['duration_s']:6}")
    return lines


def _goodput_lines(good: dict) -> list[str]:
    slos = ", ".join(f"{k} {v:.0f}" for k, v in good["slos_ms"].items())
    lines = [_calibration_line(good), f"goodput: SLOs (ms) {slos}",
             "policy    rate  attain  interactive  batch   goodput r/s  TTFT p50 int ms  "
             "TPOT p90 int ms"]
    for policy, pts in good["points"].items():
        for p in pts:
            lines.append(f"{policy:8} {p['rate_rps']:5.3f} {_pct(p['attainment']):>7} "
                         f"{_pct(p['interactive_attainment']):>12} "
                         f"{_pct(p['batch_attainment']):>6} {p['goodput_rps']:12.3f} "
                         f"{_f(p['interactive']['ttft_p50_ms']):>16} "
                         f"{_f(p['interactive']['tpot_p90_ms']):>16}")
    for policy, g in good["goodput_at_90"].items():
        lines.append(f"{policy}: goodput at 90% attainment {g['goodput_at_90_rps']:.3f} req/s "
                     f"({g['note']})")
    return lines


def _priority_lines(prio: dict) -> list[str]:
    lines = [_calibration_line(prio),
             f"priority: {prio['rate_rps']:.3f} req/s ({prio['load']}x capacity)",
             "policy    high TTFT p50/p90 ms   low TTFT p50/p90 ms   preemptions  tok/s"]
    for policy, run in prio["runs"].items():
        hi, lo = run["high"], run["low"]
        lines.append(f"{policy:9} {_f(hi['ttft_p50_ms']):>9} / {_f(hi['ttft_p90_ms']):<9} "
                     f"{_f(lo['ttft_p50_ms']):>9} / {_f(lo['ttft_p90_ms']):<9} "
                     f"{run['preemptions']:>11} {run['output_tokens_per_s']:6.1f}")
    return lines


def _calibration_line(section: dict) -> str:
    cal = section["calibration"]
    return (f"\ncalibration: capacity {cal['capacity_rps']:.3f} req/s, full decode step "
            f"{cal['step_s'] * 1000:.0f} ms")


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
