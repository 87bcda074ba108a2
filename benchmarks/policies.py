"""Scheduling policies on the real engine and on the simulator (issue 18, "Show"), three
comparisons in one run:

1. flooding tenant, fcfs vs fair: tenant A sends 4x tenant B's rate, together 5x capacity
   (B alone 1x, above its fair half, so both stay backlogged); B's TTFT p50, B's share of
   the service in the iterations that begin with both tenants waiting, throughput.
   NOTE on B's TTFT ratio: with B at x times capacity, in the fluid limit FCFS makes a
   request arriving at t wait (5x - 1) t and fair share (B served at half the capacity)
   (2x - 1) t, a ratio of (5x - 1) / (2x - 1): 4 at x = 1, 3 at x = 2, 2.5 for a burst
   (x large); below x = 0.5 B is not backlogged under fair share. The 3x target needs
   0.5 < x < 2, and a run long enough that the start (A holding every slot when B comes)
   and Poisson noise do not dominate (simulated at x = 1, 3 seeds: 10 B requests gave
   x1.5-2.8, 16 gave x2.8-4.6, 20 gave x2.6-4.7).
2. goodput, fcfs vs deadline: short interactive requests with tight SLOs among long batch jobs,
   Poisson arrivals swept over rate; SLO attainment and goodput (requests meeting both SLOs
   per second), plotted; goodput at 90% attainment (DistServe's definition, interpolated).
3. priority, fcfs vs priority: high-priority requests' TTFT under load.

    python -m benchmarks.policies --out benchmarks/results/policies.json \\
        --plot benchmarks/results/policies-goodput.png     # SmolLM2, ~12 min (simulated)
    python -m benchmarks.policies --simulate-only          # the simulated half, seconds
    python -m benchmarks.policies --tiny       # a tiny random model: checks the script, fast

The engine runs in-process with a real-time arrival loop: a request is added (with its
tenant, priority and SLOs) when its arrival time comes, between `engine.step()` calls, and its
TTFT/TPOT come from the outputs' RequestMetrics. Every run drains (all requests finish).

Simulated: the same comparisons, settings, schedules and driver on `SimEngine`, the real
scheduler and policy objects on a virtual clock moved by the calibrated cost profile
(`--profile`, the replay simulator's; SmolLM2 on this machine by default). The simulation
calibrates itself the same way, so its rates and SLOs are the same multiples of its own
capacity and step. The report then lists, per figure, which policy is better measured and
simulated, and whether they agree; its `predicted_engine_seconds` is how long the real
run's engine time should be.

Sizing is relative to a calibration just before each comparison, because this CPU's speed
moves with other load: `capacity` (requests/s one engine serves when saturated, FCFS, requests
all at t=0) of each request shape, and `step` (median iteration time with the slots full of
decodes). Arrival rates are multiples of the capacity, SLOs multiples of the step (the
settings are the `Settings` fields, one flag each, recorded in the JSON). Policies of one
comparison run back to back on identically configured fresh engines over the same arrival
schedule; the goodput sweep alternates which policy goes first.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.policies_drive import FINISHED_OK, RunResult, calibrate, drive, met_slo, warm_up
from benchmarks.policies_engines import (
    Engine,
    EngineFactory,
    SimEngine,
    SimFactory,
    config_for,
    engine_factory,
)
from benchmarks.policies_report import format_report, plot_goodput
from benchmarks.policies_stats import (
    _at_least,
    _ratio,
    _within,
    agreement,
    attainment,
    better_of,
    goodput_at,
    latency_summary,
    share,
)
from benchmarks.policies_workloads import (
    BATCH,
    CHAT,
    INTERACTIVE,
    Settings,
    Shape,
    Slos,
    flood_schedule,
    mixed_schedule,
    mixed_shapes,
    priority_schedule,
    slos_from,
)
from slotserve.engine.llm_engine import set_torch_threads
from slotserve.lab.replay import load_profile

# NOTE: the pieces live in benchmarks/policies_*.py (workloads, engines, drive, stats,
# report); these names stay importable from here (tests, notebooks).
__all__ = ["BATCH", "CHAT", "DEFAULT_PROFILE", "INTERACTIVE", "REPO", "Settings", "SimEngine",
           "Slos", "agreement", "better_of", "config_for", "drive", "engine_factory",
           "flood_schedule", "format_report", "goodput_at", "main", "met_slo",
           "mixed_schedule", "plot_goodput", "priority_schedule", "run_all", "share"]

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROFILE = "benchmarks/results/replay-profile.json"  # SmolLM2 on this machine
SMOLLM2_VOCAB = 49152  # NOTE: --simulate-only draws the same prompts as the SmolLM2 run


# ---------------------------------------------------------------------- the comparisons


def run_flood(make: EngineFactory, s: Settings, capacity: float, vocab: int, log) -> dict:
    b_rate = s.flood_load * capacity / 5.0
    sched = flood_schedule(b_rate, s.flood_b_requests, vocab, s.seed)
    runs = {}
    for policy in ("fcfs", "fair"):
        log(f"flood: {policy}, {len(sched)} requests, B at {b_rate:.3f} req/s, A 4x")
        engine = make(policy)
        warm_up(engine, vocab)
        result = drive(engine, sched, backlog_tenants=("A", "B"))
        runs[policy] = flood_summary(result, engine)
        del engine
    fcfs, fair = runs["fcfs"], runs["fair"]
    targets = {
        "b_share_within_10pct_of_weight_share": _within(fair["backlogged_b_share"]["cost"],
                                                         0.5, 0.10),
        "b_ttft_p50_3x_better": _ratio(fcfs["B"]["ttft_p50_ms"], fair["B"]["ttft_p50_ms"]),
        "throughput_within_5pct": _ratio(fair["tokens_per_s"], fcfs["tokens_per_s"]),
    }
    targets["b_ttft_p50_3x_better"]["met"] = _at_least(targets["b_ttft_p50_3x_better"], 3.0)
    thr = targets["throughput_within_5pct"]
    thr["met"] = None if thr["ratio"] is None else thr["ratio"] >= 0.95
    return {"b_rate_rps": b_rate, "a_rate_rps": 4 * b_rate, "weights": {"A": 1.0, "B": 1.0},
            "runs": runs, "targets": targets}


def flood_summary(result: RunResult, engine: Engine) -> dict:
    cfg = engine.scheduler_config
    w_in, w_out = cfg.fair_input_weight, cfg.fair_output_weight
    out = {tenant: latency_summary([r for r in result.records if r.tenant == tenant])
           for tenant in ("A", "B")}
    out.update(
        duration_s=round(result.duration, 2),
        tokens_per_s=result.tokens_served / result.duration,
        output_tokens_per_s=sum(result.output_tokens.values()) / result.duration,
        backlogged_s=round(result.backlogged_seconds, 2),
        backlogged_b_share=share(result.backlogged_prompt, result.backlogged_output, "B",
                                 w_in, w_out),
        whole_run_b_share=share(result.prompt_tokens, result.output_tokens, "B", w_in, w_out),
        preemptions=result.preemptions,
        failed=sum(r.finish_reason not in FINISHED_OK for r in result.records))
    return out


def run_goodput(make: EngineFactory, s: Settings, capacity: float, slos: Slos, vocab: int,
                log) -> dict:
    engines = {policy: make(policy) for policy in ("fcfs", "deadline")}
    for engine in engines.values():
        warm_up(engine, vocab)
    points: dict[str, list[dict]] = {p: [] for p in engines}
    rates = [load * capacity for load in s.goodput_loads]
    for index, rate in enumerate(rates):
        sched = mixed_schedule(rate, s.goodput_requests, s.batch_fraction, slos, vocab, s.seed)
        order = list(engines) if index % 2 == 0 else list(reversed(engines))
        for policy in order:  # NOTE: alternating order spreads the host's drift over both
            log(f"goodput: {policy} at {rate:.3f} req/s ({s.goodput_loads[index]}x capacity)")
            result = drive(engines[policy], sched)
            points[policy].append(goodput_point(rate, s.goodput_loads[index], result))
    summary = {}
    for policy, pts in points.items():
        at90, note = goodput_at(rates, [p["attainment"] for p in pts])
        summary[policy] = {"goodput_at_90_rps": at90, "note": note}
    ratio = _ratio(summary["deadline"]["goodput_at_90_rps"], summary["fcfs"]["goodput_at_90_rps"])
    ratio["met"] = _at_least(ratio, 1.5)
    return {"rates_rps": rates, "loads": list(s.goodput_loads), "slos_ms": asdict(slos),
            "points": points, "goodput_at_90": summary,
            "targets": {"goodput_at_90_1p5x": ratio}}


def goodput_point(rate: float, load: float, result: RunResult) -> dict:
    recs = result.records
    classes = {kind: [r for r in recs if r.kind == kind] for kind in ("interactive", "batch")}
    return {"rate_rps": rate, "load": load, "requests": len(recs),
            "duration_s": round(result.duration, 2),
            "attainment": attainment(recs),
            "goodput_rps": sum(r.met_slo for r in recs) / result.duration,
            "output_tokens_per_s": sum(result.output_tokens.values()) / result.duration,
            "preemptions": result.preemptions,
            **{f"{kind}_attainment": attainment(rs) for kind, rs in classes.items()},
            **{kind: latency_summary(rs) for kind, rs in classes.items()}}


def run_priority(make: EngineFactory, s: Settings, capacity: float, vocab: int, log) -> dict:
    rate = s.priority_load * capacity
    sched = priority_schedule(rate, s.priority_requests, s.high_fraction, vocab, s.seed)
    runs = {}
    for policy in ("fcfs", "priority"):
        log(f"priority: {policy}, {len(sched)} requests at {rate:.3f} req/s")
        engine = make(policy)
        warm_up(engine, vocab)
        result = drive(engine, sched)
        runs[policy] = {kind: latency_summary([r for r in result.records if r.kind == kind])
                        for kind in ("high", "low")}
        runs[policy].update(duration_s=round(result.duration, 2), preemptions=result.preemptions,
                            output_tokens_per_s=sum(result.output_tokens.values())
                            / result.duration)
        del engine
    ratio = _ratio(runs["fcfs"]["high"]["ttft_p50_ms"], runs["priority"]["high"]["ttft_p50_ms"])
    return {"rate_rps": rate, "load": s.priority_load, "runs": runs,
            "high_ttft_p50_fcfs_over_priority": ratio["ratio"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny random model (checks the script)")
    p.add_argument("--out", default=None, help="JSON report path")
    p.add_argument("--plot", default=None, help="goodput plot path (PNG)")
    p.add_argument("--only", default="flood,goodput,priority",
                   help="comma-separated comparisons to run (default all three)")
    p.add_argument("--simulate-only", action="store_true",
                   help="only the simulated half: the replay simulator on --profile, no "
                        "model (seconds)")
    p.add_argument("--no-simulate", action="store_true",
                   help="only the measured half (no simulated column)")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help=f"the simulator's calibrated cost profile (default {DEFAULT_PROFILE}, "
                        "SmolLM2 on this machine, also under --tiny: then only the "
                        "rankings compare; `slotserve calibrate` writes one)")
    defaults = Settings()
    for name, value in asdict(defaults).items():
        kind = type(value[0]) if isinstance(value, tuple) else type(value)
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value,
                       nargs="+" if isinstance(value, tuple) else None)
    args = p.parse_args(argv)
    settings = Settings(**{k: tuple(v) if isinstance(v, list) else v
                           for k, v in vars(args).items() if k in asdict(defaults)})
    only = set(args.only.split(","))
    if not only <= {"flood", "goodput", "priority"}:
        p.error(f"--only: unknown comparison in {args.only!r}")
    if args.simulate_only and args.no_simulate:
        p.error("--simulate-only and --no-simulate exclude each other")
    simulate = "only" if args.simulate_only else "none" if args.no_simulate else "both"
    report = run_all(settings, tiny=args.tiny, only=only, simulate=simulate,
                     profile=args.profile)
    print(format_report(report))
    sim_goodput = report.get("simulated", {}).get("goodput")
    if args.plot and ("goodput" in report or sim_goodput):
        plot_goodput(report.get("goodput"), args.plot, sim_goodput)
    if args.out:
        from slotserve.lab.bench import write_report

        write_report(args.out, **report)
    return report


def run_all(s: Settings, tiny: bool = False, only: set[str] | None = None,
            log=None, simulate: str = "both", profile: str = DEFAULT_PROFILE) -> dict:
    """Calibrate, then run the chosen comparisons; the report as a dict (JSON-ready).

    simulate: "both" (measured on the engine, then simulated on the profile, and the
    rankings compared), "only" (simulated: no model is loaded, seconds) or "none"."""
    if simulate not in ("both", "only", "none"):
        raise ValueError(f"simulate must be 'both', 'only' or 'none', got {simulate!r}")
    only = only or {"flood", "goodput", "priority"}
    log = log or (lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr,
                                    flush=True))
    started = time.monotonic()
    report: dict = {"settings": asdict(s),
                    "shapes": {"chat": asdict(CHAT), "interactive": asdict(INTERACTIVE),
                               "batch": asdict(BATCH)}}
    vocab = 512 if tiny else SMOLLM2_VOCAB
    if simulate != "only":
        set_torch_threads()
        make, vocab, report["model"] = engine_factory(tiny, s)
        report.update(run_comparisons(make, s, vocab, only, log))
        report["targets"] = _targets(report)
    if simulate != "none":
        path = Path(profile)
        # NOTE: a relative path is tried from the current directory, then the checkout's.
        cost_model = load_profile(path if path.is_absolute() or path.exists() else REPO / path)
        sims = SimFactory(s, cost_model)
        simulated = run_comparisons(sims, s, vocab, only,
                                    lambda msg: log(f"simulated {msg}"))
        report["simulated"] = {"profile": profile, "cost_model": cost_model.describe(),
                               **simulated, "targets": _targets(simulated),
                               "predicted_engine_seconds": round(sims.seconds, 1)}
        if simulate == "both":
            report["agreement"] = agreement(report, simulated)
    report["wall_s"] = round(time.monotonic() - started, 1)
    return report


def _targets(sections: dict) -> dict:
    return {name: sections[name]["targets"] for name in ("flood", "goodput")
            if name in sections}


def run_comparisons(make: EngineFactory, s: Settings, vocab: int, only: set[str],
                    log) -> dict:
    """Each chosen comparison, after its own calibration, on engines from `make`."""
    out: dict = {}

    def calibrated(name: str, shapes: list[Shape], count: int, seed: int) -> dict:
        """NOTE: just before each comparison, as this host's speed drifts over minutes."""
        engine = make("fcfs")
        warm_up(engine, vocab)
        calibration = calibrate(engine, shapes, count, vocab, seed)
        log(f"{name}: calibration {calibration}")
        return calibration

    if "flood" in only:
        cal = calibrated("flood", [CHAT], s.calibration_requests, s.seed + 100)
        out["flood"] = {"calibration": cal,
                        **run_flood(make, s, cal["capacity_rps"], vocab, log)}
    if "goodput" in only:
        cal = calibrated("goodput", mixed_shapes(s.batch_fraction), 2 * s.calibration_requests,
                         s.seed + 200)
        out["goodput"] = {"calibration": cal,
                          **run_goodput(make, s, cal["capacity_rps"],
                                        slos_from(cal["step_s"], s), vocab, log)}
    if "priority" in only:
        cal = calibrated("priority", [CHAT], s.calibration_requests, s.seed + 100)
        out["priority"] = {"calibration": cal,
                           **run_priority(make, s, cal["capacity_rps"], vocab, log)}
    return out


if __name__ == "__main__":
    main()
