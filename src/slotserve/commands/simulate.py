"""`slotserve simulate`: the seed's toy (`slotserve.lab.simulate`). With `--trace`, the older
spelling of `slotserve replay` (commands/replay.py), with the same clock rules."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from slotserve.commands.common import add_chart_options, fail, use_color, write_charts
from slotserve.commands.replay import (
    REPLAY_ONLY,
    add_batching_flag,
    add_replay_flags,
    replay_clock,
    run_replay,
)
from slotserve.lab.simulate import POLICIES, SEED_TOY, SimRequest, simulate, summarize
from slotserve.lab.timeline import render_terminal


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
    add_batching_flag(p, default=None,
                      help=f"batching (admission) rule: toy: {', '.join(POLICIES)} or both "
                           "(default); replay: continuous, static or both (default: the "
                           "trace's)")
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
    g = p.add_argument_group(
        "replay (with --trace): the older spelling of `slotserve replay TRACE`",
        "--out then writes the predicted results as `slotserve bench --out` does")
    g.add_argument("--trace", metavar="TRACE.json|WORKLOAD.jsonl",
                   help="replay a real run's trace (slotserve bench/serve --trace) or a "
                        "bench workload file: `slotserve replay TRACE`")
    add_replay_flags(g)
    p.set_defaults(func=run_simulate)
    return p


def run_simulate(args: argparse.Namespace) -> int:
    """Simulate each policy, print its strip and numbers, write the requested files."""
    try:
        if replay_requested(args):
            check_no_toy_flags(args)
            print("note: `slotserve simulate --trace T` is `slotserve replay T` now",
                  file=sys.stderr)
            return run_replay(args, replay_clock(args.profile, args.clock))
        requests = _requests_from_args(args)
        policy = args.batching or "both"
        if policy not in (*POLICIES, "both"):
            raise ValueError(f"--batching must be one of {', '.join(POLICIES)} or both for "
                             f"the toy, got {policy!r}")
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




def replay_requested(args: argparse.Namespace) -> bool:
    """Whether `simulate` should replay; ValueError if replay flags come without --trace."""
    if args.trace:
        return True
    given = [name for name in REPLAY_ONLY if getattr(args, name, None) is not None]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')} needs --trace (a trace or workload)")
    return False


def check_no_toy_flags(args: argparse.Namespace) -> None:
    """The toy's flags mean nothing to a replay: ValueError naming them."""
    if args.slots != 3 or args.lengths or args.arrivals or args.requests \
            or args.prefill_iterations:
        raise ValueError("--slots/--lengths/--arrivals/--requests/--prefill-iterations are "
                         "the toy's; with --trace use --max-num-seqs")
