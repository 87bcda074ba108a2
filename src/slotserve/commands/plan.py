"""`slotserve plan`: search settings and request rates in simulation for the best goodput."""

from __future__ import annotations

import argparse
import time

from slotserve.commands.common import cost_model, int_tuple, load_tokenizer
from slotserve.commands.replay import add_batching_flag
from slotserve.lab.replay.cost_model import UnitCost
from slotserve.lab.replay.inputs import load_input, requests_from_workload
from slotserve.lab.replay.simulator import ReplaySettings


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """`slotserve plan`: the settings and rate with the best goodput under SLOs."""
    p = subparsers.add_parser(
        "plan", help="search settings and request rates in simulation for the best goodput",
        description="Replay a workload at several request rates under every setting "
                    "(max_num_seqs x max_num_batched_tokens) and print the best by goodput: "
                    "requests meeting both SLOs per second.")
    p.add_argument("--slo-ttft-ms", type=float, required=True)
    p.add_argument("--slo-tpot-ms", type=float, required=True)
    p.add_argument("--workload", metavar="WORKLOAD.jsonl|TRACE.json",
                   help="default: W (64 chat requests, lognormal output lengths, seed 0)")
    p.add_argument("--profile", metavar="PROFILE.json",
                   help="cost model from `slotserve calibrate` (default: unit time; then "
                        "the SLOs are in iterations x 1000)")
    add_batching_flag(p, type=_str_tuple, default=("continuous",), metavar="B,B",
                      help="batching (admission) rules to try: continuous, static "
                           "(default: continuous)")
    p.add_argument("--max-num-seqs", type=int_tuple, default=(4, 8, 16, 32, 64),
                   metavar="N,N,...")
    p.add_argument("--max-num-batched-tokens", type=int_tuple, default=(256, 512, 1024),
                   metavar="N,N,...")
    p.add_argument("--rates", type=_float_tuple, default=None, metavar="R,R,...",
                   help="request rates to try (Poisson; inf: all at once)")
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding in every replay, as serve's (vLLM's JSON), "
                        "with drafts offered and accepted where the trace's were (null: off; "
                        "default: auto when the trace verified drafts, else off)")
    p.add_argument("--seed", type=int, default=0, help="arrival times (as bench's --seed)")
    p.add_argument("--model", default=None, help="tokenizer for text/chat workloads")
    p.add_argument("--top", type=int, default=8, help="settings shown")
    p.add_argument("--verify", action="store_true",
                   help="then run the winner for real (in-process engine, as `slotserve "
                        "bench`) and print predicted vs measured")
    p.set_defaults(func=cmd_plan)
    return p


def cmd_plan(args: argparse.Namespace) -> int:
    from slotserve.lab.replay.plan import DEFAULT_RATES, SLO, format_plan, search

    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    workload, info, cached_prefixes = None, {}, []
    if args.workload:
        requests, info = load_input(args.workload, lambda: load_tokenizer(args.model))
        cached_prefixes = info.pop("trace_cached_prefixes", [])
        if args.verify:
            workload = _workload_file(args.workload)
    else:
        workload = default_workload()
        requests = requests_from_workload(workload, load_tokenizer(args.model))
    cost = cost_model(args.profile)
    speculation = args.speculative_config if args.speculative_config is not None else \
        info.get("trace_settings", {}).get("speculative_config")
    base = ReplaySettings(num_blocks=args.num_blocks,
                          enable_prefix_caching=args.enable_prefix_caching,
                          speculative_config=speculation)
    started = time.perf_counter()
    candidates = search(requests, slo, cost, base=base, batching=args.batching,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        rates=args.rates or DEFAULT_RATES, seed=args.seed,
                        cached_prefixes=cached_prefixes)
    print(format_plan(candidates, slo, args.top))
    clock = "unit cost: no --profile" if isinstance(cost, UnitCost) else f"profile {args.profile}"
    print(f"({len(candidates)} replays of {len(requests)} requests in "
          f"{time.perf_counter() - started:.1f} s; {clock})")
    if args.verify:
        verify(candidates[0], workload, slo, args)
    return 0


def verify(winner, workload, slo, args: argparse.Namespace) -> None:
    """Run the winning settings and rate on the real engine; print predicted vs measured."""
    from slotserve.lab.bench.report import format_ratios, format_table
    from slotserve.lab.bench.stats import BenchSampling, compare_ratios, summarize
    from slotserve.lab.bench.targets import EngineTarget
    from slotserve.lab.replay.plan import score_records
    from slotserve.lab.workload import with_poisson_arrivals

    s = winner.settings
    target = EngineTarget.load(
        args.model, batching=s.batching, max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_prefill_tokens_while_decoding=s.max_prefill_tokens_while_decoding,
        hold_first_tokens=s.hold_first_tokens, max_model_len=s.max_model_len,
        block_size=s.block_size, num_blocks=s.resolved_num_blocks(),
        enable_prefix_caching=s.enable_prefix_caching,
        speculative_config=s.speculative_config, seed=args.seed)
    timed = with_poisson_arrivals(workload, winner.rate, args.seed)
    print(f"verifying: {len(timed)} requests at {timed.params['request_rate']} req/s on the "
          "engine ...", flush=True)
    run = target.run(timed, BenchSampling())
    run.config = {**run.config, "workload": dict(timed.params)}
    measured = summarize(run, "measured", target.name)
    predicted = winner.result.bench_result("predicted")
    print(format_table([predicted, measured]))
    print(format_ratios(compare_ratios(measured, predicted)))  # predicted / measured
    goodput, attainment = score_records(run.records, run.duration, slo)
    print(f"goodput: predicted {winner.goodput:.2f} req/s ({winner.attainment:.0%} meet the "
          f"SLOs), measured {goodput:.2f} req/s ({attainment:.0%})")


def _workload_file(path: str):
    from slotserve.lab.workload import load_workload

    try:
        return load_workload(path)
    except ValueError as exc:
        raise ValueError(f"--verify needs a workload file (prompts), not a trace: {exc}") \
            from None


def default_workload():
    """W: `slotserve bench`'s default workload (64 chat requests, seed 0)."""
    from slotserve.lab.workload import generate_workload

    return generate_workload(64, prompts="chat")


def _float_tuple(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4,inf, got {text!r}") \
            from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers > 0, got {text!r}")
    return values


def _str_tuple(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())
