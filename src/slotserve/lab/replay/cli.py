"""Command-line pieces: `slotserve simulate --trace` (replay), `slotserve calibrate`,
`slotserve plan`. `slotserve.lab.commands` registers them."""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

from slotserve.lab.replay.cost_model import UnitCost, load_profile
from slotserve.lab.replay.inputs import (
    load_input,
    requests_from_workload,
    scale_rate,
    with_poisson,
)
from slotserve.lab.replay.simulator import ReplayResult, ReplaySettings, replay

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


def run_replay(args: argparse.Namespace, write_charts) -> int:
    """`slotserve simulate --trace ...`: replay, print the predicted report, write files."""
    from slotserve.lab.bench.report import format_detail, format_ratios, format_table
    from slotserve.lab.bench.stats import compare_ratios

    if args.slots != 3 or args.lengths or args.arrivals or args.requests \
            or args.prefill_iterations:
        raise ValueError("--slots/--lengths/--arrivals/--requests/--prefill-iterations are "
                         "the toy's; with --trace use --max-num-seqs")
    requests, info = load_input(args.trace, lambda: _tokenizer(args.model))
    if args.rate_scale is not None:
        requests = scale_rate(requests, args.rate_scale)
        info["rate_scale"] = args.rate_scale
    if args.request_rate is not None:
        requests = with_poisson(requests, args.request_rate)
        info["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    cost = _cost_model(args.profile)
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
    _write_replay_outputs(args, results, reports, ratios, write_charts)
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


def _write_replay_outputs(args, results: list[ReplayResult], reports, ratios,
                          write_charts) -> None:
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


def _cost_model(profile: str | None):
    return UnitCost() if profile is None else load_profile(profile)


def _tokenizer(model: str | None):
    from slotserve.loader import load_model

    tokenizer = load_model(model).tokenizer
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: use token-id prompts")
    return tokenizer


# ------------------------------------------------------------------ calibrate
def add_calibrate_parser(subparsers) -> argparse.ArgumentParser:
    """`slotserve calibrate`: time real iterations, fit the replay's cost model."""
    from slotserve.config import DEFAULT_QUANTIZATION, KERNELS, QUANTIZATIONS

    p = subparsers.add_parser(
        "calibrate", help="time real engine iterations and fit the simulator's cost model",
        description="Time real engine iterations over a grid of batch sizes, context lengths "
                    "and chunk sizes; fit seconds = base + a*prefill tokens + b*decode seqs "
                    "+ c*attention pairs + d*sampled rows; print the fit and its residuals; "
                    "write the profile for `slotserve simulate/plan --profile`.")
    p.add_argument("--out", metavar="PROFILE.json", default="profile.json")
    p.add_argument("--batch-sizes", type=_int_tuple, default=None, metavar="B,B,...")
    p.add_argument("--context-lens", type=_int_tuple, default=None, metavar="L,L,...")
    p.add_argument("--chunk-sizes", type=_int_tuple, default=None, metavar="C,C,...")
    p.add_argument("--decode-steps", type=int, default=None)
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    g.add_argument("--kernels", default="auto", choices=list(KERNELS))
    g.add_argument("--quantization", default=DEFAULT_QUANTIZATION, choices=QUANTIZATIONS,
                   help=f"weights, as `slotserve serve`'s (default: {DEFAULT_QUANTIZATION})")
    g.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_calibrate)
    return p


def cmd_calibrate(args: argparse.Namespace) -> int:
    from slotserve.lab.bench.targets import EngineTarget
    from slotserve.lab.replay.calibrate import (
        CalibrationGrid,
        calibrate,
        format_points,
        format_residuals,
    )

    overrides = {k: getattr(args, k) for k in ("batch_sizes", "context_lens", "chunk_sizes",
                                                "decode_steps") if getattr(args, k) is not None}
    grid = CalibrationGrid(**overrides)
    target = EngineTarget.load(args.model, device=args.device, dtype=args.dtype,
                               kernels=args.kernels, quantization=args.quantization,
                               seed=args.seed)
    print(f"calibrating {target.source} on {args.device} (kernels {args.kernels})")
    model, samples = calibrate(target, grid, seed=args.seed, log=print)
    print("fit (seconds per iteration = base + sum of coefficient x feature):")
    print(model.format())
    print("residuals:")
    print(format_residuals(model.meta["fit"]))
    print(format_points(model, samples))
    model.save(args.out)
    print(f"wrote {args.out} ({model.meta['seconds']} s)")
    return 0


# ------------------------------------------------------------------ plan
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
    p.add_argument("--policy", type=_str_tuple, default=("continuous",), metavar="P,P")
    p.add_argument("--max-num-seqs", type=_int_tuple, default=(4, 8, 16, 32, 64),
                   metavar="N,N,...")
    p.add_argument("--max-num-batched-tokens", type=_int_tuple, default=(256, 512, 1024),
                   metavar="N,N,...")
    p.add_argument("--rates", type=_float_tuple, default=None, metavar="R,R,...",
                   help="request rates to try (Poisson; inf: all at once)")
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
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
    workload = None
    if args.workload:
        requests, _ = load_input(args.workload, lambda: _tokenizer(args.model))
        if args.verify:
            workload = _workload_file(args.workload)
    else:
        workload = default_workload()
        requests = requests_from_workload(workload, _tokenizer(args.model))
    cost = _cost_model(args.profile)
    base = ReplaySettings(num_blocks=args.num_blocks,
                          enable_prefix_caching=args.enable_prefix_caching)
    started = time.perf_counter()
    candidates = search(requests, slo, cost, base=base, policies=args.policy,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        rates=args.rates or DEFAULT_RATES, seed=args.seed)
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
        args.model, policy=s.policy, max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_prefill_tokens_while_decoding=s.max_prefill_tokens_while_decoding,
        max_model_len=s.max_model_len, block_size=s.block_size, num_blocks=s.resolved_num_blocks(),
        enable_prefix_caching=s.enable_prefix_caching, seed=args.seed)
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


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,32, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


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

