"""`slotserve replay`: a real run's trace (or a bench workload) through the real scheduler on a
modelled clock (`slotserve.lab.replay`).

The clock is a `slotserve calibrate` profile: `--profile`, else the one `calibrate` wrote last
on this machine; without either the command refuses (a replay in iterations is
`--clock iterations`, said out loud). `slotserve simulate --trace` is the older spelling.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from slotserve.commands.common import add_chart_options, fail, load_tokenizer, write_charts
from slotserve.engine_args import DeprecatedFlag
from slotserve.lab.replay.cost_model import UnitCost, load_profile
from slotserve.lab.replay.inputs import load_input, scale_rate, with_poisson
from slotserve.lab.replay.simulator import (
    ReplayResult,
    ReplaySettings,
    planner_state_for,
    replay,
)
from slotserve.paths import last_calibration_path

# Flags only a replay reads: `simulate` without --trace refuses them (replay_requested).
REPLAY_ONLY = ("max_num_seqs", "max_num_batched_tokens",
               "max_prefill_tokens_while_decoding", "hold_first_tokens", "num_blocks", "block_size",
               "max_model_len", "enable_prefix_caching", "scheduling_policy", "slo_ttft_ms",
               "slo_tpot_ms", "slo_reject", "rate_scale", "request_rate", "profile",
               "save_trace", "clock", "speculative_config")
# ReplaySettings fields a flag of the same name overrides (else the trace's, else default).
SETTINGS_FLAGS = ("max_num_seqs", "max_num_batched_tokens",
                  "max_prefill_tokens_while_decoding", "hold_first_tokens", "num_blocks",
                  "block_size", "max_model_len", "enable_prefix_caching", "scheduling_policy",
                  "slo_ttft_ms", "slo_tpot_ms", "slo_reject", "speculative_config")
# The model's settings a trace records that no flag changes (the replay keeps them).
RECORDED_ONLY = ("sliding_window",)
SECONDS, ITERATIONS = "seconds", "iterations"


def add_replay_parser(subparsers) -> argparse.ArgumentParser:
    """`slotserve replay TRACE`: predict a run on this machine's calibrated clock."""
    p = subparsers.add_parser(
        "replay", help="replay a real run's trace or a workload on a calibrated clock",
        description="Replay a real run's trace (`slotserve serve/bench --trace`) or a bench "
                    "workload through the real scheduler on the cost model `slotserve "
                    "calibrate` fit for this machine; print the predicted report.")
    p.add_argument("trace", metavar="TRACE.json|WORKLOAD.jsonl")
    add_batching_flag(p, default=None,
                      help="batching (admission) rule: continuous, static, or both "
                           "(default: the trace's)")
    p.add_argument("--out", metavar="FILE.json",
                   help="write the predicted results as `slotserve bench --out` does")
    add_chart_options(p)
    add_replay_flags(p.add_argument_group("replay"))
    p.set_defaults(func=cmd_replay)
    return p


def add_batching_flag(p, **spec) -> None:
    """--batching (the admission rule, as `serve`'s) with `spec`, and --policy, its former
    name, as a deprecated alias (a warning on stderr; NOTE: no default of its own)."""
    p.add_argument("--batching", dest="batching", **spec)
    kept = {k: v for k, v in spec.items() if k not in ("default", "help")}
    p.add_argument("--policy", dest="batching", action=DeprecatedFlag, new_flag="--batching",
                   default=argparse.SUPPRESS, help="deprecated: use --batching", **kept)


def add_replay_flags(g) -> None:
    """The settings and clock flags of a replay (engine names, as `slotserve bench`)."""
    _add_settings_args(g)
    g.add_argument("--rate-scale", type=float, default=None, metavar="K",
                   help="arrivals K times as fast (2: twice the request rate)")
    g.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="re-time the requests as Poisson arrivals at R req/s (inf: all at 0)")
    g.add_argument("--profile", metavar="PROFILE.json",
                   help="cost model from `slotserve calibrate` (default: the profile "
                        "calibrate wrote last on this machine: $SLOTSERVE_CALIBRATION, else "
                        "calibration.json in the cache folder, ~/.cache/slotserve)")
    g.add_argument("--clock", choices=(SECONDS, ITERATIONS), default=None,
                   help="seconds (default): a calibrated profile; iterations: one unit per "
                        "iteration, the seed's toy clock (times are not seconds)")
    g.add_argument("--save-trace", metavar="TRACE.json", help="write the replay's trace")
    g.add_argument("--model", default=None,
                   help="tokenizer for text/chat workloads (default: the embedded SmolLM2)")


def _add_settings_args(g) -> None:
    from slotserve.config import SchedulingPolicy

    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="slots (default: the trace's, else 32)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one iteration (default: the trace's, else 512)")
    g.add_argument("--max-prefill-tokens-while-decoding", type=int, default=None,
                   help="prefill tokens of an iteration that also runs decodes at most "
                   "(default: the trace's, else "
                   f"{ReplaySettings().max_prefill_tokens_while_decoding})")
    g.add_argument("--hold-first-tokens", action=argparse.BooleanOptionalAction, default=None,
                   help="a burst's first tokens held until its prompts are computed, as the "
                   "engine's (default: the trace's, else on)")
    g.add_argument("--num-blocks", type=int, default=None,
                   help="KV pool in blocks (default: the trace's, else enough for every slot)")
    g.add_argument("--block-size", type=int, default=None,
                   help="default: the trace's, else 16")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="default: the trace's, else 4096")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="prefix caching (default: the trace's, else on)")
    g.add_argument("--scheduling-policy", default=None,
                   choices=[str(p) for p in SchedulingPolicy],
                   help="queue order, as the engine's (default: the trace's, else fcfs); "
                        "the requests' tenant, priority and SLOs come from the trace")
    g.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="default TTFT SLO of a request without its own (default: the "
                        "trace's, else none)")
    g.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="default TPOT SLO of a request without its own (default: the "
                        "trace's, else none)")
    g.add_argument("--slo-reject", action=argparse.BooleanOptionalAction, default=None,
                   help="deadline: reject a waiting request that can no longer meet its TTFT "
                        "SLO (default: the trace's, else off)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, as serve's (vLLM's JSON), with drafts offered "
                        "and accepted where the trace's were (null: off; default: auto when "
                        "the trace verified drafts, else off)")


def cmd_replay(args: argparse.Namespace) -> int:
    try:
        return run_replay(args, replay_clock(args.profile, args.clock))
    except (ValueError, OSError) as err:
        return fail("replay", err)


def replay_clock(profile: str | None, clock: str | None):
    """The cost model a replay runs on: --profile, else this machine's last calibration;
    `clock="iterations"` the toy clock. ValueError when seconds are asked and no profile
    exists: a real trace is never replayed on the toy clock in silence."""
    if clock == ITERATIONS:
        if profile is not None:
            raise ValueError("--clock iterations and --profile: give one or the other")
        return UnitCost()
    if profile is not None:
        return load_profile(profile)
    last = last_calibration_path()
    if not last.exists():
        raise ValueError(f"no calibration on this machine ({last}): run `slotserve calibrate` "
                         "first, or pass --profile PROFILE.json, or --clock iterations for a "
                         "replay counted in iterations")
    print(f"clock: {last} (the last `slotserve calibrate` here)", file=sys.stderr)
    return load_profile(last)


def run_replay(args: argparse.Namespace, cost) -> int:
    """Replay `args.trace` on `cost`, print the predicted report, write the files asked."""
    from slotserve.lab.bench.report import format_detail, format_ratios, format_table
    from slotserve.lab.bench.stats import compare_ratios

    requests, info = load_input(args.trace, lambda: load_tokenizer(args.model))
    if args.rate_scale is not None:
        requests = scale_rate(requests, args.rate_scale)
        info["rate_scale"] = args.rate_scale
    if args.request_rate is not None:
        requests = with_poisson(requests, args.request_rate)
        info["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    base = settings_from_args(args, info)
    planner_state = planner_state_for(cost, info.pop("trace_planner_state", None))
    if planner_state is not None:
        info["planner_state"] = "the trace's"
    cached_prefixes = info.pop("trace_cached_prefixes", [])
    both = args.batching == "both"
    rules = ("static", "continuous") if both else (args.batching or base.batching,)
    results, started = [], time.perf_counter()
    for rule in rules:
        results.append(replay(requests, replace(base, batching=rule), cost, workload=info,
                              planner_state=planner_state, cached_prefixes=cached_prefixes))
    elapsed = time.perf_counter() - started
    reports = [r.bench_result() for r in results]
    if len(reports) == 1:
        print(format_detail(reports[0]))
        print()
    print(format_table(reports))
    ratios = [compare_ratios(reports[0], other) for other in reports[1:]]
    for r in ratios:
        print(format_ratios(r))
    unit = "iterations (the toy clock)" if isinstance(cost, UnitCost) else "s"
    print(f"replayed {len(requests)} requests, {sum(r.iterations for r in results)} "
          f"iterations in {elapsed:.3f} s; times are predicted {unit}")
    _write_replay_outputs(args, results, reports, ratios)
    return 0


def settings_from_args(args: argparse.Namespace, info: dict) -> ReplaySettings:
    """Each setting: its flag if given, else what the trace recorded, else the engine's
    default. NOTE: a flag overrides only its own setting (e.g. --max-num-seqs keeps the
    trace's KV pool: the pool is the machine's memory, not a function of the slots). The
    admission rule: --batching, else the trace header's `policy` (the trace format's name
    for it), else continuous."""
    recorded = {k: v for k, v in info.get("trace_settings", {}).items()
                if k in SETTINGS_FLAGS + RECORDED_ONLY and v is not None}
    header = {"max_num_seqs": info.get("trace_num_slots"),
              "num_blocks": info.get("trace_kv_blocks"), "batching": info.get("trace_policy")}
    recorded |= {k: v for k, v in header.items() if v is not None}
    flags = {k: getattr(args, k) for k in SETTINGS_FLAGS if getattr(args, k, None) is not None}
    if args.batching not in (None, "both"):
        flags["batching"] = args.batching
    return ReplaySettings(**(recorded | flags))


def _write_replay_outputs(args, results: list[ReplayResult], reports, ratios) -> None:
    if args.out:
        mode = "compare" if len(reports) > 1 else "single"
        report = {"mode": mode, "results": [r.to_dict() for r in reports], "ratios": ratios}
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    if args.save_trace:
        path = Path(args.save_trace)
        paths = [path] if len(results) == 1 else [
            path.with_suffix(f".{r.settings.batching}{path.suffix or '.json'}") for r in results]
        for result, p in zip(results, paths):
            p.write_text(json.dumps(result.trace) + "\n")
            print(f"wrote {p}")
    write_charts(args, results[0].trace, results[1].trace if len(results) > 1 else None)
