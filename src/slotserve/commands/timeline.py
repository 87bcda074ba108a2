"""`slotserve timeline`: draw a trace file from the simulator or the engine."""

from __future__ import annotations

import argparse
import json

from slotserve.commands.common import add_chart_options, fail, use_color, write_charts
from slotserve.lab.timeline import render_terminal

_TERMINAL_COLUMNS = 120  # iterations shown in the terminal when no window is given


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
    add_chart_options(p)
    p.set_defaults(func=run_timeline)
    return p


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
        write_charts(args, traces[0], traces[1] if len(traces) > 1 else None,
                      args.start, args.end)
    except (ValueError, KeyError, TypeError, OSError) as err:
        return fail("timeline", err)
    return 0


def _print_strip(args: argparse.Namespace, trace: dict) -> None:
    """The terminal strip of a trace: --start/--end, else its first _TERMINAL_COLUMNS."""
    text_end = args.end
    if args.start is None and args.end is None \
            and len(trace["iterations"]) > _TERMINAL_COLUMNS:
        text_end = trace["iterations"][_TERMINAL_COLUMNS]["index"]
    print(render_terminal(trace, color=use_color(args), start=args.start, end=text_end,
                          gantt_rows=args.gantt))
    if text_end != args.end:
        print(f"(terminal: the first {_TERMINAL_COLUMNS} iterations; "
              "--start/--end pick another window)")


def _load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
