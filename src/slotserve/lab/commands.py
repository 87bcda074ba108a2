"""`slotserve simulate`, `timeline`, `calibrate` and `plan`: argparse hooks for cli.py.

`simulate` alone is the seed's toy (`slotserve.lab.simulate`); `simulate --trace` replays a
real run or a workload through the real scheduler (`slotserve.lab.replay`).

Each `add_*_parser(subparsers)` adds one subcommand and sets `func` to a function that
takes the parsed args and returns an exit code (0 ok, 2 bad input).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from slotserve.lab.replay.cli import (  # noqa: F401  (cli.py plugs these in)
    add_calibrate_parser,
    add_plan_parser,
    add_replay_args,
    replay_requested,
    run_replay,
)
from slotserve.lab.simulate import POLICIES, SEED_TOY, SimRequest, simulate, summarize
from slotserve.lab.timeline import render_html, render_png, render_terminal

_TERMINAL_COLUMNS = 120  # iterations shown in the terminal when no window is given


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
    _add_chart_options(p)
    add_replay_args(p)
    p.set_defaults(func=run_simulate)
    return p


def add_timeline_parser(subparsers) -> argparse.ArgumentParser:
    """`slotserve timeline`: draw a trace file from the simulator or the engine."""
    p = subparsers.add_parser(
        "timeline", help="draw a trace (simulator or engine) as slot-strip charts",
        description="Draw a trace JSON: slot strip, utilisation and per-request Gantt.")
    p.add_argument("trace", metavar="TRACE.json")
    p.add_argument("other", metavar="OTHER.json", nargs="?",
                   help="a second trace (e.g. the first's replay): drawn below it in the "
                        "terminal, beside it in HTML and PNG (the same as --compare)")
    p.add_argument("--compare", metavar="OTHER.json",
                   help="a second trace drawn beside the first (HTML and PNG)")
    p.add_argument("--start", type=int, help="first iteration index to draw")
    p.add_argument("--end", type=int, help="iteration index to stop before (exclusive)")
    p.add_argument("--gantt", action="store_true", help="terminal: a row per request too")
    _add_chart_options(p)
    p.set_defaults(func=run_timeline)
    return p


def _add_chart_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--html", metavar="FILE.html", help="write a self-contained HTML chart")
    p.add_argument("--png", metavar="FILE.png", help="write a PNG chart")
    p.add_argument("--png-size", type=_size, default=(1200, 800), metavar="WxH",
                   help="PNG size in pixels (default 1200x800)")
    p.add_argument("--color", action=argparse.BooleanOptionalAction, default=None,
                   help="ANSI colors in the printed strip: --color forces them on, --no-color "
                        "off (default: on only when stdout is a terminal and NO_COLOR is unset "
                        "or empty)")


def run_simulate(args: argparse.Namespace) -> int:
    """Simulate each policy, print its strip and numbers, write the requested files."""
    try:
        if replay_requested(args):
            return run_replay(args, _write_charts)
        requests = _requests_from_args(args)
        policy = args.policy or "both"
        if policy not in (*POLICIES, "both"):
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)} or both for the "
                             f"toy, got {policy!r}")
        policies = POLICIES if policy == "both" else (policy,)
        traces = [simulate(requests, args.slots, p, args.prefill_iterations)
                  for p in policies]
        for trace in traces:
            print(render_terminal(trace, color=_use_color(args)))
            print(_summary_text(trace))
        if args.out:
            _write_traces(traces, Path(args.out))
        _write_charts(args, traces[0], traces[1] if len(traces) == 2 else None)
    except (ValueError, OSError) as err:
        return _fail("simulate", err)
    return 0


def run_timeline(args: argparse.Namespace) -> int:
    """Print a trace's strip (a window of it if long), then the second trace's if one is
    given, and write the requested charts (the pair beside each other)."""
    try:
        if args.other and args.compare:
            raise ValueError("give the second trace once: OTHER.json or --compare OTHER.json")
        paths = [args.trace] + [p for p in (args.other or args.compare,) if p]
        traces = [_load_json(path) for path in paths]
        for path, trace in zip(paths, traces):
            if len(traces) > 1:
                print(f"== {path}")
            _print_strip(args, trace)
        _write_charts(args, traces[0], traces[1] if len(traces) > 1 else None,
                      args.start, args.end)
    except (ValueError, KeyError, TypeError, OSError) as err:
        return _fail("timeline", err)
    return 0


def _print_strip(args: argparse.Namespace, trace: dict) -> None:
    """The terminal strip of a trace: --start/--end, else its first _TERMINAL_COLUMNS."""
    text_end = args.end
    if args.start is None and args.end is None \
            and len(trace["iterations"]) > _TERMINAL_COLUMNS:
        text_end = trace["iterations"][_TERMINAL_COLUMNS]["index"]
    print(render_terminal(trace, color=_use_color(args), start=args.start, end=text_end,
                          gantt_rows=args.gantt))
    if text_end != args.end:
        print(f"(terminal: the first {_TERMINAL_COLUMNS} iterations; "
              "--start/--end pick another window)")


def _fail(command: str, err: Exception) -> int:
    detail = f"missing field {err}" if isinstance(err, KeyError) else str(err)
    print(f"slotserve {command}: error: {detail}", file=sys.stderr)
    return 2


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


def _write_charts(args, trace: dict, compare: dict | None, start: int | None = None,
                  end: int | None = None) -> None:
    if args.html:
        Path(args.html).write_text(render_html(trace, compare=compare, start=start, end=end))
        print(f"wrote {args.html}")
    if args.png:
        width, height = args.png_size
        render_png(trace, args.png, width, height, compare=compare, start=start, end=end)
        print(f"wrote {args.png}")


def _load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _use_color(args: argparse.Namespace) -> bool:
    """Whether the printed strip gets ANSI colors.

    NOTE: an explicit --color / --no-color wins; otherwise colors only when stdout is a
    terminal (a pipe or a file gets plain text) and NO_COLOR is unset or empty
    (https://no-color.org: a command-line flag overrides the variable)."""
    if args.color is not None:
        return args.color
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty and isatty())


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 2,8,3, got {text!r}") from None


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WxH like 1200x800, got {text!r}") from None
    return width, height
