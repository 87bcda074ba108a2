"""`slotserve` command line: serve | generate | chat | bench | simulate | replay | timeline |
calibrate | plan."""

from __future__ import annotations

import argparse
import sys

from slotserve.commands import (
    bench,
    calibrate,
    chat,
    generate,
    plan,
    replay,
    serve,
    simulate,
    timeline,
)
from slotserve.engine_args import check_engine_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slotserve", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    # NOTE: each subcommand is one module of slotserve.commands; none imports this module.
    for add_parser in (generate.add_generate_parser, serve.add_serve_parser,
                       chat.add_chat_parser, bench.add_bench_parser,
                       simulate.add_simulate_parser, replay.add_replay_parser,
                       timeline.add_timeline_parser,
                       calibrate.add_calibrate_parser, plan.add_plan_parser):
        add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_engine_args(parser, args)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"slotserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
