"""`slotserve` command line: serve | generate | chat | bench | simulate | timeline | calibrate
| plan."""

from __future__ import annotations

import argparse
import sys

from slotserve.engine_args import add_engine_args, check_engine_args, engine_kwargs
from slotserve.lab.bench import add_bench_parser
from slotserve.lab.commands import (
    add_calibrate_parser,
    add_plan_parser,
    add_simulate_parser,
    add_timeline_parser,
)
from slotserve.server.commands import add_chat_parser, add_serve_parser


def cmd_generate(args: argparse.Namespace) -> int:
    from slotserve import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sample_seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.text)
    return 0


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="complete one prompt and print the text")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sample-seed", type=int, default=None)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slotserve", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    # NOTE: each subcommand is defined next to the code it drives; none imports this module.
    for add_parser in (add_generate_parser, add_serve_parser, add_chat_parser,
                       add_bench_parser, add_simulate_parser, add_timeline_parser,
                       add_calibrate_parser, add_plan_parser):
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
