"""Replay accuracy: predicted (`slotserve simulate`'s replay on a calibrated profile) vs
measured (`slotserve bench`'s in-process engine) on workloads not used for calibration.

    python -m benchmarks.replay_accuracy --profile PROFILE.json --cases w16,w64,w-online,knee

Cases: W (64 chat requests, lognormal output lengths, seed 0, all at t=0) at 16 and 64
slots (`w16`, `w64`); its online form, Poisson 4 req/s at 16 slots (`w-online`); the knee
(64 requests of 24 output tokens at t=0, max_num_seqs 1, 4, 16, 64: `knee`); W at 64 slots
predicted from the trace of its run at 16 slots (`w-trace`: prompt lengths, outputs and
prefix-cache hits only, as `slotserve replay TRACE --max-num-seqs 64` reads them; the
16-slot run's trace is written beside the report). Each case runs for real once (or
--repeats times: each figure's median), then is replayed on the profile; each figure is
reported as predicted / measured. Without
--profile the script calibrates first (`slotserve calibrate`'s default
grid: random-token prompts, fixed batch and context grid) and saves the profile beside the
report. NOTE: the measurement needs quiet cores; on a shared machine the measured side is
noisy, and so is the profile.

    python -m benchmarks.replay_accuracy --quick     # a smoke test of the whole path

--quick: a tiny calibration grid and the tiny cases (16 chat requests of 8 tokens at 4 slots,
and at 16 slots from the trace of the 4-slot run), written to the temp folder unless --out
is given; their figures mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.perf import workload_w
from slotserve.engine.async_engine import freeze_heap
from slotserve.lab.bench import BenchSampling, EngineTarget, generate_workload, run_bench
from slotserve.lab.bench.report import write_report
from slotserve.lab.replay import (
    FEATURES,
    LinearCost,
    ReplaySettings,
    StepFeatures,
    load_profile,
    replay,
    requests_from_trace,
    requests_from_workload,
)
from slotserve.lab.replay.calibrate import (
    CalibrationGrid,
    calibrate,
    fit_grid,
    format_points,
    format_residuals,
)

FIELDS = (("wall s", "duration_s", None), ("out tok/s", "output_throughput", None),
          ("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"),
          ("TPOT p50", "tpot_ms", "p50"), ("TPOT p99", "tpot_ms", "p99"))
ENGINE = dict(max_num_batched_tokens=512, max_model_len=1024)
DEFAULT_CASES = "w16,w64,w-online,knee,w-trace"
SMALL_GRID = CalibrationGrid(batch_sizes=(1, 8, 32), context_lens=(32, 128), chunk_sizes=(512,))
QUICK_GRID = CalibrationGrid(batch_sizes=(1, 4), context_lens=(16, 48), chunk_sizes=(64,),
                             decode_steps=2)


@dataclass(frozen=True)
class Case:
    """One case: the workload run at `slots`; trace_slots: predicted from the trace of its
    run at that many slots instead of from the workload itself."""

    label: str
    workload: object
    slots: int
    trace_slots: int | None = None


def cases(names: list[str]) -> list[Case]:
    """The cases of each name."""
    out = []
    for name in names:
        if name == "w16":
            out.append(Case("W, 16 slots", workload_w(), 16))
        elif name == "w64":
            out.append(Case("W, 64 slots", workload_w(), 64))
        elif name == "w-online":
            out.append(Case("W online 4 req/s, 16 slots", workload_w(4.0), 16))
        elif name == "knee":
            knee = generate_workload(64, prompts="chat", output_len=24, seed=0)
            out += [Case(f"knee, {n} slots", knee, n) for n in (1, 4, 16, 64)]
        elif name == "w-trace":
            out.append(Case("W, 64 slots from a 16-slot trace", workload_w(), 64, 16))
        elif name == "quick":
            out.append(Case("quick, 4 slots", quick_workload(), 4))
        elif name == "quick-trace":
            out.append(Case("quick, 16 slots from a 4-slot trace", quick_workload(), 16, 4))
        else:
            raise SystemExit(f"unknown case {name!r} (w16, w64, w-online, knee, w-trace, "
                             "quick, quick-trace)")
    return out


def quick_workload():
    """16 chat requests of 8 tokens (the --quick cases)."""
    return generate_workload(16, prompts="chat", output_len=8, seed=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", help="a `slotserve calibrate` profile (default: calibrate now)")
    p.add_argument("--cases", default=None,
                   help=f"default {DEFAULT_CASES} (--quick: quick,quick-trace)")
    p.add_argument("--out", default=None,
                   help="default benchmarks/results/replay-accuracy.json (--quick: in the "
                        "temp folder)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for calibration and runs (default: one per core)")
    p.add_argument("--small-grid", action="store_true",
                   help="calibrate on batches 1, 8, 32 x contexts 32, 128 x chunk 512 only")
    p.add_argument("--reuse-measured", metavar="REPORT.json",
                   help="take the measured side from an earlier report (same case labels) "
                        "instead of running it: re-predict on another profile")
    p.add_argument("--refit", action="store_true",
                   help="refit --profile from the samples it stores (the current fit method)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run each case this many times and compare with the median of each "
                        "figure (back-to-back runs of W at 64 slots spread ~10%% in TTFT)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: tiny calibration grid, one tiny case (figures mean nothing)")
    args = p.parse_args()
    if args.quick and args.small_grid:
        p.error("--quick and --small-grid are two calibration grids: give one")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    args.cases = args.cases or ("quick,quick-trace" if args.quick else DEFAULT_CASES)
    args.out = args.out or (str(Path(tempfile.gettempdir()) / "replay-accuracy-quick.json")
                            if args.quick else "benchmarks/results/replay-accuracy.json")
    target = EngineTarget.load(**ENGINE)
    if args.threads:
        torch.set_num_threads(args.threads)  # NOTE: after load, which sets one per core
    if args.profile:
        profile = load_profile(args.profile)
        if args.refit:
            profile = refit(profile)
    else:
        print("calibrating ...", file=sys.stderr, flush=True)
        grid = QUICK_GRID if args.quick else SMALL_GRID if args.small_grid \
            else CalibrationGrid()
        profile, samples = calibrate(target.configured(), grid, log=print)
        print(model_text(profile, samples))
        profile.save(args.out.replace(".json", "-profile.json"))
    reused = {}
    if args.reuse_measured:
        report = json.loads(Path(args.reuse_measured).read_text())
        reused = {row["case"]: row["measured"] for row in report["cases"]}
    rows = []
    for case in cases([c.strip() for c in args.cases.split(",") if c]):
        label = case.label
        requests, source = replay_input(case, target, trace_path(args.out, case), reused)
        if label in reused:
            measured = reused[label]
        else:
            measured = measure(case, target, args.repeats)
        settings = ReplaySettings(max_num_seqs=case.slots,
                                  num_blocks=measured["config"]["num_blocks"], **ENGINE)
        started = time.perf_counter()
        cached = source.pop("trace_cached_prefixes", [])
        predicted = replay(requests, settings, profile, workload=source,
                           cached_prefixes=cached).bench_result(label)
        replay_s = time.perf_counter() - started
        predicted = predicted.to_dict()
        rows.append({"case": label, "replay_s": replay_s, "measured": measured,
                     "predicted": predicted,
                     "ratios": {name: _ratio(_get(predicted, key, sub), _get(measured, key, sub))
                                for name, key, sub in FIELDS}})
        print(format_row(rows[-1]), flush=True)
    print(format_rows(rows))
    write_report(args.out, profile=profile.to_profile(), cases=rows)
    print(f"wrote {args.out}")


def measure(case: Case, target, repeats: int) -> dict:
    """The case run for real `repeats` times (each a fresh engine): the first run's report
    with each figure of FIELDS the median over the runs (`runs` keeps every run's)."""
    runs = []
    for i in range(repeats):
        print(f"running {case.label} ({i + 1}/{repeats}) ...", file=sys.stderr, flush=True)
        freeze_heap()  # NOTE: as the server after start-up; the runs before leave garbage
        runs.append(run_bench(case.workload, target.configured(max_num_seqs=case.slots),
                              sampling=BenchSampling(), label=case.label).to_dict())
    return median_figures(runs)


def median_figures(runs: list[dict]) -> dict:
    """The first run's report, each figure of FIELDS replaced by its median over `runs`,
    and `runs`: every run's figures."""
    merged = copy.deepcopy(runs[0])
    for _, key, sub in FIELDS:
        values = [_get(run, key, sub) for run in runs]
        value = None if None in values else statistics.median(values)
        if sub is None:
            merged[key] = value
        else:
            merged[key] = {**merged[key], sub: value}
    if len(runs) > 1:
        merged["runs"] = [{name: _get(run, key, sub) for name, key, sub in FIELDS}
                          for run in runs]
    return merged


def trace_path(out: str, case: Case) -> Path | None:
    """Where a trace case's recorded run is written (beside the report)."""
    if case.trace_slots is None:
        return None
    return Path(out.replace(".json", f"-trace-{case.trace_slots}-slots.json"))


def replay_input(case: Case, target, path: Path | None, reused: dict) -> tuple[list, dict]:
    """(requests, what they came from) to replay: the workload's own prompts, or the trace
    of its run at `case.trace_slots` (recorded now, or the one an earlier report left when
    its measured side is reused)."""
    if path is None:
        return requests_from_workload(case.workload, target.tokenizer), case.workload.params
    if case.label not in reused or not path.exists():
        print(f"recording the trace of {case.label} at {case.trace_slots} slots ...",
              file=sys.stderr, flush=True)
        run_bench(case.workload, target.configured(max_num_seqs=case.trace_slots),
                  sampling=BenchSampling(), label=f"trace at {case.trace_slots} slots",
                  trace_path=str(path))
    requests, info = requests_from_trace(json.loads(path.read_text()))
    return requests, {**info, "trace": str(path)}


def refit(profile: LinearCost) -> LinearCost:
    """The profile's stored samples fit again (with today's `calibrate.fit_grid`)."""
    samples = [(StepFeatures(**{f: s.get(f, 0) for f in FEATURES}), s["seconds"])
               for s in profile.meta.get("samples", [])]
    model = fit_grid(samples)
    model.meta = {**profile.meta, "fit": model.residuals(samples), "refit": True}
    return model


def model_text(profile, samples) -> str:
    return "\n".join([profile.format(), format_residuals(profile.meta["fit"]),
                      format_points(profile, samples)])


def _get(result: dict, key: str, sub: str | None):
    return result[key] if sub is None else result[key][sub]


def _ratio(predicted, measured):
    return None if predicted is None or not measured else predicted / measured


def format_row(row: dict) -> str:
    cells = "  ".join(f"{name} x{row['ratios'][name]:.2f}" if row["ratios"][name] is not None
                      else f"{name} -" for name, _, _ in FIELDS)
    return f"{row['case']}: {cells} (replayed in {row['replay_s']:.3f} s)"


def format_rows(rows: list[dict]) -> str:
    """A markdown table: measured / predicted (ratio) per figure."""
    head = "| case | " + " | ".join(name for name, _, _ in FIELDS) + " |"
    lines = [head, "|" + " --- |" * (len(FIELDS) + 1)]
    for row in rows:
        cells = []
        for name, key, sub in FIELDS:
            m, p = _get(row["measured"], key, sub), _get(row["predicted"], key, sub)
            ratio = row["ratios"][name]
            cells.append("-" if m is None or p is None or ratio is None or math.isnan(ratio)
                         else f"{m:.4g} / {p:.4g} (x{ratio:.2f})")
        lines.append(f"| {row['case']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
