"""`slotserve simulate`: alone, the seed's toy (`slotserve.lab.simulate`); with `--trace`, a
replay of a real run or a workload through the real scheduler (`slotserve.lab.replay`)."""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

from slotserve.commands.common import (
    add_chart_options,
    cost_model,
    fail,
    load_tokenizer,
    use_color,
    write_charts,
)
from slotserve.lab.replay.cost_model import UnitCost
from slotserve.lab.replay.inputs import load_input, scale_rate, with_poisson
from slotserve.lab.replay.simulator import ReplayResult, ReplaySettings, replay
from slotserve.lab.simulate import POLICIES, SEED_TOY, SimRequest, simulate, summarize
from slotserve.lab.timeline import render_terminal

# Flags only a replay reads: without --trace they are an error (replay_requested).
REPLAY_ONLY = ("max_num_seqs", "max_num_batched_tokens",
               "max_prefill_tokens_while_decoding", "num_blocks", "block_size",
               "max_model_len", "enable_prefix_caching", "scheduling_policy", "slo_ttft_ms",
               "slo_tpot_ms", "slo_reject", "rate_scale", "request_rate", "profile",
               "save_trace")
# ReplaySettings fields a flag of the same name overrides (else the trace's, else default).
SETTINGS_FLAGS = ("max_num_seqs", "max_num_batched_tokens",
                  "max_prefill_tokens_while_decoding", "num_blocks", "block_size",
                  "max_model_len", "enable_prefix_caching", "scheduling_policy",
                  "slo_ttft_ms", "slo_tpot_ms", "slo_reject")


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    """`slotserve simulate`: the seed's slot model, or (--trace) a replay on the real
    scheduler."""
    p = subparsers.add_parser(
        "simulate", help="simulate static vs continuous batching on S slots, or replay a run",
        description="Simulate the seed's slot model (one token per slot per iteration). "
                    "Default: the seed's toy (6 requests, 3 slots), both policies. With "
                    "--trace: replay a real run's trace or a workload through the real "
                    "scheduler on a modelled clock.")
    p.add_argument("--slots", type=int, default=3, help="number of slots (default 3)")
    p.add_argument("--policy", default=None,
                   help=f"toy: {', '.join(POLICIES)} or both (default); replay: any policy "
                        "the scheduler accepts, or both (default: the trace's)")
    p.add_argument("--lengths", type=_int_list, metavar="N,N,...",
                   help="output lengths, one per request R1..Rn (default: the seed's toy)")
    p.add_argument("--arrivals", type=_int_list, metavar="T,T,...",
                   help="arrival iteration of each request (default: all 0)")
    p.add_argument("--requests", metavar="FILE.jsonl",
                   help='one request a line: {"id", "output_tokens", "arrival_iteration"}')
    p.add_argument("--prefill-iterations", type=int, default=0,
                   help="iterations of prefill before the first token (default 0, the seed)")
    p.add_argument("--out", metavar="FILE.json",
                   help="toy: write the trace (with both policies: TRACE.static.json and "
                        "TRACE.continuous.json); replay: the results JSON of `bench --out`")
    add_chart_options(p)
    add_replay_args(p)
    p.set_defaults(func=run_simulate)
    return p


def run_simulate(args: argparse.Namespace) -> int:
    """Simulate each policy, print its strip and numbers, write the requested files."""
    try:
        if replay_requested(args):
            return run_replay(args)
        requests = _requests_from_args(args)
        policy = args.policy or "both"
        if policy not in (*POLICIES, "both"):
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)} or both for the "
                             f"toy, got {policy!r}")
        policies = POLICIES if policy == "both" else (policy,)
        traces = [simulate(requests, args.slots, p, args.prefill_iterations)
                  for p in policies]
        for trace in traces:
            print(render_terminal(trace, color=use_color(args)))
            print(_summary_text(trace))
        if args.out:
            _write_traces(traces, Path(args.out))
        write_charts(args, traces[0], traces[1] if len(traces) == 2 else None)
    except (ValueError, OSError) as err:
        return fail("simulate", err)
    return 0


def load_requests_jsonl(path: str | Path) -> list[SimRequest]:
    """Requests from a JSONL file: {"id", "output_tokens", "arrival_iteration"} a line
    (`arrival_iteration` defaults to 0, optional `prompt_tokens`; blank lines skipped)."""
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            requests.append(SimRequest(
                id=str(row["id"]), output_tokens=row["output_tokens"],
                arrival_iteration=row.get("arrival_iteration", 0),
                prompt_tokens=row.get("prompt_tokens", 0)))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"{path}:{number}: {err}") from None
    return requests


def _requests_from_args(args: argparse.Namespace) -> list[SimRequest]:
    if args.requests and (args.lengths or args.arrivals):
        raise ValueError("--requests replaces --lengths/--arrivals; give one or the other")
    if args.requests:
        return load_requests_jsonl(args.requests)
    lengths = args.lengths or [r.output_tokens for r in SEED_TOY]
    arrivals = args.arrivals or [0] * len(lengths)
    if len(arrivals) != len(lengths):
        raise ValueError(f"--arrivals has {len(arrivals)} values, --lengths {len(lengths)}")
    return [SimRequest(f"R{i}", n, t) for i, (n, t) in enumerate(zip(lengths, arrivals), 1)]


def _summary_text(trace: dict) -> str:
    """Iterations, utilisation, and each request's arrival / wait / first / finish."""
    s = summarize(trace)
    lines = [f"{trace['policy']}: {s['iterations']} iterations, utilisation "
             f"{s['utilisation']:.0%} ({s['busy_slot_iterations']}/{s['slot_iterations']})",
             f"  {'request':<10}{'arrival':>8}{'wait':>6}{'first':>7}{'finish':>8}"]
    for r in s["requests"]:
        cols = [r["arrival_iteration"], r["wait_iterations"], r["first_iteration"],
                r["finish_iteration"]]
        a, w, f, e = ("-" if v is None else v for v in cols)
        lines.append(f"  {r['id']:<10}{a:>8}{w:>6}{f:>7}{e:>8}")
    return "\n".join(lines) + "\n"


def _write_traces(traces: list[dict], out: Path) -> None:
    if len(traces) == 1:
        paths = [out]
    else:
        paths = [out.with_suffix(f".{t['policy']}{out.suffix or '.json'}") for t in traces]
    for trace, path in zip(traces, paths):
        path.write_text(json.dumps(trace, indent=1) + "\n")
        print(f"wrote {path}")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 2,8,3, got {text!r}") from None


# ------------------------------------------------------------------ simulate --trace
def add_replay_args(p: argparse.ArgumentParser) -> None:
    """The replay flags of `slotserve simulate` (engine names, as `slotserve bench`)."""
    g = p.add_argument_group(
        "replay (with --trace): the real scheduler on a modelled clock",
        "--out then writes the predicted results as `slotserve bench --out` does")
    g.add_argument("--trace", metavar="TRACE.json|WORKLOAD.jsonl",
                   help="replay a real run's trace (slotserve bench/serve --trace) or a "
                        "bench workload file")
    _add_settings_args(g)
    g.add_argument("--rate-scale", type=float, default=None, metavar="K",
                   help="arrivals K times as fast (2: twice the request rate)")
    g.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="re-time the requests as Poisson arrivals at R req/s (inf: all at 0)")
    g.add_argument("--profile", metavar="PROFILE.json",
                   help="cost model from `slotserve calibrate` (default: one unit of time "
                        "per iteration, the seed's toy clock)")
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


def replay_requested(args: argparse.Namespace) -> bool:
    """Whether `simulate` should replay; ValueError if replay flags come without --trace."""
    if args.trace:
        return True
    given = [name for name in REPLAY_ONLY if getattr(args, name, None) is not None]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')} needs --trace (a trace or workload)")
    return False


def run_replay(args: argparse.Namespace) -> int:
    """`slotserve simulate --trace ...`: replay, print the predicted report, write files."""
    from slotserve.lab.bench.report import format_detail, format_ratios, format_table
    from slotserve.lab.bench.stats import compare_ratios

    if args.slots != 3 or args.lengths or args.arrivals or args.requests \
            or args.prefill_iterations:
        raise ValueError("--slots/--lengths/--arrivals/--requests/--prefill-iterations are "
                         "the toy's; with --trace use --max-num-seqs")
    requests, info = load_input(args.trace, lambda: load_tokenizer(args.model))
    if args.rate_scale is not None:
        requests = scale_rate(requests, args.rate_scale)
        info["rate_scale"] = args.rate_scale
    if args.request_rate is not None:
        requests = with_poisson(requests, args.request_rate)
        info["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    cost = cost_model(args.profile)
    base = settings_from_args(args, info)
    policies = ("static", "continuous") if args.policy == "both" else (args.policy or base.policy,)
    results, started = [], time.perf_counter()
    for policy in policies:
        results.append(replay(requests, replace(base, policy=policy), cost, workload=info))
    elapsed = time.perf_counter() - started
    reports = [r.bench_result() for r in results]
    if len(reports) == 1:
        print(format_detail(reports[0]))
        print()
    print(format_table(reports))
    ratios = [compare_ratios(reports[0], other) for other in reports[1:]]
    for r in ratios:
        print(format_ratios(r))
    unit = "iterations (unit cost: no --profile)" if isinstance(cost, UnitCost) else "s"
    print(f"replayed {len(requests)} requests, {sum(r.iterations for r in results)} "
          f"iterations in {elapsed:.3f} s; times are predicted {unit}")
    _write_replay_outputs(args, results, reports, ratios)
    return 0


def settings_from_args(args: argparse.Namespace, info: dict) -> ReplaySettings:
    """Each setting: its flag if given, else what the trace recorded, else the engine's
    default. NOTE: a flag overrides only its own setting (e.g. --max-num-seqs keeps the
    trace's KV pool: the pool is the machine's memory, not a function of the slots)."""
    recorded = {k: v for k, v in info.get("trace_settings", {}).items()
                if k in SETTINGS_FLAGS and v is not None}
    header = {"max_num_seqs": info.get("trace_num_slots"),
              "num_blocks": info.get("trace_kv_blocks"), "policy": info.get("trace_policy")}
    recorded |= {k: v for k, v in header.items() if v is not None}
    flags = {k: getattr(args, k) for k in SETTINGS_FLAGS if getattr(args, k, None) is not None}
    if args.policy not in (None, "both"):
        flags["policy"] = args.policy
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
            path.with_suffix(f".{r.settings.policy}{path.suffix or '.json'}") for r in results]
        for result, p in zip(results, paths):
            p.write_text(json.dumps(result.trace) + "\n")
            print(f"wrote {p}")
    write_charts(args, results[0].trace, results[1].trace if len(results) > 1 else None)
