"""`slotserve generate`: complete one prompt and print the text."""

from __future__ import annotations

import argparse
import sys

from slotserve.commands.common import add_chat_template_args, fail
from slotserve.engine_args import add_engine_args, engine_kwargs


def cmd_generate(args: argparse.Namespace) -> int:
    """Complete one prompt. A model with a chat template (or one given by --chat-template)
    gets the prompt as a user message (the embedded model is an instruct model: as plain
    text it often answers nothing); --raw completes the text as it is."""
    from slotserve import LLM, SamplingParams

    template, template_kwargs = args.chat_template, args.chat_template_kwargs
    if args.raw and (template is not None or template_kwargs is not None):
        return fail("generate", ValueError("--raw completes the text as it is: no "
                                           "--chat-template or --chat-template-kwargs"))
    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sample_seed)
    as_chat = not args.raw and (template is not None or
                                getattr(llm.tokenizer, "chat_template", None) is not None)
    if template_kwargs is not None and not as_chat:
        return fail("generate", ValueError("--chat-template-kwargs: this model has no chat "
                                           "template (give one with --chat-template)"))
    if as_chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params,
                       chat_template=template, chat_template_kwargs=template_kwargs)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    completion = out.outputs[0]
    print(completion.text)
    note = _empty_output_note(completion, as_chat)
    if note:
        print(f"slotserve: {note}", file=sys.stderr)
    return 0


def _empty_output_note(completion, as_chat: bool) -> str | None:
    """Why the output is empty or stopped at once (for stderr), None when it is not."""
    if completion.text.strip() and len(completion.token_ids) > 1:
        return None
    how = ("the prompt went through the chat template" if as_chat else
           "the prompt was completed as plain text (--raw or no chat template)")
    return (f"the model stopped after {len(completion.token_ids)} token(s) "
            f"(finish reason {completion.finish_reason}) with "
            f"{'no text' if not completion.text.strip() else repr(completion.text)}; {how}")


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="complete one prompt and print the text")
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true",
                   help="complete the prompt as plain text (default: as a user message in the "
                        "model's chat template, when it has one)")
    add_chat_template_args(p)
    p.add_argument("--chat", action="store_true",
                   help="accepted for compatibility: the chat template is the default now")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sample-seed", type=int, default=None)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)
