"""`slotserve bench`: its arguments and the command (--compare, --sweep, --url, outputs)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from slotserve.config import Policy, engine_fields, values
from slotserve.engine_args import add_engine_args, engine_kwargs
from slotserve.lab.bench.report import format_detail, format_ratios, format_table, plot_knee
from slotserve.lab.bench.runner import run_bench
from slotserve.lab.bench.stats import BenchResult, BenchSampling, compare_ratios
from slotserve.lab.bench.targets import EngineTarget, OpenAITarget
from slotserve.lab.workload import (
    Workload,
    generate_workload,
    load_workload,
    multi_turn_workload,
    parallel_sampling_workload,
    save_workload,
    shared_prefix_workload,
    with_poisson_arrivals,
)

# --scenario: workloads with shared prefixes (what prefix caching saves).
SCENARIOS = ("shared-system-prompt", "multi-turn", "n4")

# Engine settings --sweep may vary: engine_config's integer settings.
SWEEPABLE = tuple(name for name, leaf in engine_fields().items() if leaf.base_type is int)


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """`slotserve bench`: measure throughput and latency of the engine or a server."""
    p = subparsers.add_parser(
        "bench", help="benchmark the engine (in-process) or an OpenAI-compatible server",
        description="Send a workload (generated or JSONL) to the in-process engine or, with "
                    "--url, to any OpenAI-compatible server; report throughput, TTFT, TPOT, "
                    "ITL, e2e and (engine) utilisation.")
    _add_workload_args(p)
    _add_target_args(p)
    _add_run_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_bench)
    return p


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", metavar="FILE.jsonl",
                   help='one request a line: {"prompt"|"messages", "max_tokens", "arrival"}')
    g.add_argument("--num-requests", type=int, default=64,
                   help="requests (multi-turn: conversations)")
    g.add_argument("--scenario", choices=SCENARIOS,
                   help="shared-system-prompt: every request behind one ~400-token system "
                        "prompt; multi-turn: conversations of 4-8 turns, each sent when the "
                        "previous answer arrives; n4: 4 completions of each prompt "
                        "(--output-len, default 32)")
    g.add_argument("--prompts", choices=["auto", "chat", "random"], default="auto",
                   help="built-in chat prompts or random token ids (auto: chat if the model "
                        "has a chat template or with --url)")
    g.add_argument("--prompt-len-min", type=int, default=16, help="random prompts (tokens)")
    g.add_argument("--prompt-len-max", type=int, default=128, help="random prompts (tokens)")
    g.add_argument("--output-len", type=int, default=None,
                   help="every output this long (default: lognormal lengths)")
    g.add_argument("--output-len-median", type=float, default=64)
    g.add_argument("--output-len-sigma", type=float, default=0.8)
    g.add_argument("--output-len-min", type=int, default=8)
    g.add_argument("--output-len-max", type=int, default=384)
    g.add_argument("--request-rate", type=_rate_list, default=None, metavar="R[,R...]",
                   help="Poisson arrivals at R req/s, several to sweep; inf: all at once "
                        "(default: inf, or the file's arrival times)")
    g.add_argument("--save-workload", metavar="FILE.jsonl", help="write the workload used")
    g.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="stop at EOS (default: ignore it, so output lengths are exact)")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server target (default: the in-process engine)")
    g.add_argument("--url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--served-model", help="model name sent (default: first of /v1/models)")
    g.add_argument("--api-key", default=None)


def _add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("runs and output")
    g.add_argument("--compare", type=_str_list, metavar="POLICY,POLICY",
                   help="run the same workload under each policy, e.g. static,continuous")
    g.add_argument("--sweep", type=_sweep_spec, metavar="FIELD=V,V,...",
                   help=f"run each value of an engine setting ({', '.join(SWEEPABLE)})")
    g.add_argument("--plot", metavar="KNEE.png",
                   help="with --sweep: output tokens/s against TPOT p50")
    g.add_argument("--out", metavar="RESULTS.json", help="write every result as JSON")
    g.add_argument("--trace", metavar="TRACE.json",
                   help="engine: write the iteration trace (several runs: TRACE.<run>.json)")
    g.add_argument("--no-progress", dest="progress", action="store_false")


def _rate_list(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of rates: {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0 (or inf): {text!r}")
    return rates


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _sweep_spec(text: str) -> tuple[str, list[int]]:
    name, _, values = text.partition("=")
    name = name.strip().replace("-", "_")
    if name not in SWEEPABLE:
        raise argparse.ArgumentTypeError(f"cannot sweep {name!r}; one of {', '.join(SWEEPABLE)}")
    try:
        return name, [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"sweep values must be integers: {text!r}") from None


def cmd_bench(args: argparse.Namespace) -> int:
    """Build the target and workload, run every (rate, variant), print and write results."""
    _check_args(args)
    target = _target(args)
    base = _workload(args, target)
    if args.save_workload:
        save_workload(base, args.save_workload)
    variants = _variants(args)
    results, ratios = [], []
    for rate in args.request_rate or [None]:
        workload = base if rate is None else with_poisson_arrivals(base, rate, args.seed)
        group = [_run_variant(args, target, workload, label, overrides, len(variants) > 1)
                 for label, overrides in variants]
        results += group
        if args.compare:
            ratios += [compare_ratios(group[0], other) for other in group[1:]]
    _print_results(results, ratios)
    _write_outputs(args, results, ratios)
    return 0


def _check_args(args: argparse.Namespace) -> None:
    if args.compare and args.sweep:
        raise ValueError("use --compare or --sweep, not both")
    if args.url and (args.compare or args.sweep):
        raise ValueError("--compare and --sweep change engine settings: not with --url")
    if args.plot and not args.sweep:
        raise ValueError("--plot draws a --sweep")
    for policy in args.compare or []:
        if policy not in values(Policy):
            raise ValueError(f"--compare: unknown policy {policy!r} "
                             f"({', '.join(values(Policy))})")


def _target(args: argparse.Namespace):
    if args.url:
        return OpenAITarget(args.url, args.endpoint, args.served_model, args.api_key)
    return EngineTarget.load(args.model, **engine_kwargs(args))


def _workload(args: argparse.Namespace, target) -> Workload:
    if args.workload:
        if args.scenario:
            raise ValueError("use --workload or --scenario, not both")
        return load_workload(args.workload)
    kind = args.prompts
    if kind == "auto":
        kind = "chat" if isinstance(target, OpenAITarget) or target.has_chat_template else "random"
    if kind == "random" and isinstance(target, OpenAITarget):
        raise ValueError("random token prompts need the model's vocabulary: in-process only")
    vocab = None if isinstance(target, OpenAITarget) else target.model_config.vocab_size
    if args.scenario:
        return _scenario(args, None if kind == "chat" else vocab)
    return generate_workload(
        args.num_requests, prompts=kind, output_len=args.output_len,
        output_len_median=args.output_len_median, output_len_sigma=args.output_len_sigma,
        output_len_min=args.output_len_min, output_len_max=args.output_len_max,
        prompt_len_min=args.prompt_len_min, prompt_len_max=args.prompt_len_max,
        vocab_size=vocab, seed=args.seed)


def _scenario(args: argparse.Namespace, vocab: int | None) -> Workload:
    """A --scenario workload: chat messages (vocab None) or token ids."""
    common = dict(output_len=args.output_len or 32, vocab_size=vocab, seed=args.seed)
    if args.scenario == "shared-system-prompt":
        return shared_prefix_workload(args.num_requests, **common)
    if args.scenario == "multi-turn":
        return multi_turn_workload(args.num_requests, **common)
    return parallel_sampling_workload(args.num_requests, n=4, **common)


def _variants(args: argparse.Namespace) -> list[tuple[str | None, dict]]:
    if args.compare:
        return [(policy, {"batching": policy}) for policy in args.compare]
    if args.sweep:
        name, values = args.sweep
        return [(f"{name}={v}", {name: v}) for v in values]
    return [(None, {})]


def _run_variant(args, target, workload: Workload, label: str | None, overrides: dict,
                 several: bool) -> BenchResult:
    if overrides:
        target = target.configured(**overrides)
    trace = args.trace
    if trace and (several or len(args.request_rate or []) > 1):
        rate = workload.params.get("request_rate")
        path = Path(trace)
        trace = str(path.with_name(f"{path.stem}.{label or 'run'}.rate{rate}{path.suffix}"))
    sampling = BenchSampling(args.temperature, args.ignore_eos)
    return run_bench(workload, target, sampling=sampling, label=label, progress=args.progress,
                     trace_path=trace)


def _print_results(results: list[BenchResult], ratios: list[dict]) -> None:
    if len(results) == 1:
        print(format_detail(results[0]))
        print()
    print(format_table(results))
    for r in ratios:
        print(format_ratios(r))
    for r in results:
        if r.errors and len(results) > 1:
            print(f"{r.label}: {r.failed} failed, e.g. {r.errors[0]}")


def _write_outputs(args, results: list[BenchResult], ratios: list[dict]) -> None:
    if args.out:
        mode = "compare" if args.compare else "sweep" if args.sweep else "single"
        report = {"mode": mode, "results": [r.to_dict() for r in results], "ratios": ratios}
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot_knee(results, args.sweep[0], args.plot)
        print(f"wrote {args.plot}")
