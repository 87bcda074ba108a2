"""`slotserve chat`: chat in the terminal, with an in-process engine or a server (--url)."""

from __future__ import annotations

import argparse
import os

from slotserve.commands.common import add_chat_template_args, fail
from slotserve.engine_args import add_engine_args, build_engine


def add_chat_parser(subparsers) -> None:
    p = subparsers.add_parser("chat", help="chat in the terminal (in-process, or with --url)")
    p.add_argument("--url", default=None,
                   help="a running slotserve / OpenAI-compatible server, e.g. "
                        "http://127.0.0.1:8000 (default: an in-process engine)")
    p.add_argument("--model-name", default=None,
                   help="with --url: the model to ask for (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("SLOTSERVE_API_KEY"),
                   help="with --url: the server's API key (default: $SLOTSERVE_API_KEY)")
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    add_chat_template_args(p)
    add_engine_args(p)
    # One conversation needs one slot; this also keeps the default KV pool small.
    p.set_defaults(func=cmd_chat, max_num_seqs=1)


def cmd_chat(args: argparse.Namespace) -> int:
    from slotserve.server.chat import LocalChat, RemoteChat, run_chat

    if args.url:
        if args.chat_template is not None:  # NOTE: a request cannot carry one (vLLM's can't)
            return fail("chat", ValueError(
                "--chat-template: with --url the server's template applies (start the server "
                "with `slotserve serve --chat-template`); --chat-template-kwargs do go along"))
        backend = RemoteChat(args.url, args.model_name, api_key=args.api_key,
                             chat_template_kwargs=args.chat_template_kwargs)
    else:
        print("loading the model...", flush=True)
        try:
            backend = LocalChat(build_engine(args), chat_template=args.chat_template,
                                chat_template_kwargs=args.chat_template_kwargs)
        except ValueError as exc:  # no template: the model has none and none was given
            return fail("chat", exc)
    print(f"chatting with {backend.model_name} (/exit or Ctrl-D quits, /reset forgets)")
    run_chat(backend, system=args.system, max_tokens=args.max_tokens,
             temperature=args.temperature)
    return 0
