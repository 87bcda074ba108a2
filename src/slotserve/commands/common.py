"""Helpers of more than one command: the chart flags of `simulate` and `timeline` (and
writing the charts), their error line, the replay's cost model and tokenizer (`simulate
--trace`, `plan`), the list flags of `calibrate` and `plan`, and the chat template flags of
`chat` and `generate`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from slotserve.lab.replay.cost_model import UnitCost, load_profile
from slotserve.lab.timeline import render_html, render_png


def fail(command: str, err: Exception) -> int:
    """Print the command's error line on stderr; the exit code of bad input (2)."""
    detail = f"missing field {err}" if isinstance(err, KeyError) else str(err)
    print(f"slotserve {command}: error: {detail}", file=sys.stderr)
    return 2


def add_chart_options(p: argparse.ArgumentParser) -> None:
    """--html, --png, --png-size and --color (`simulate`, `timeline`)."""
    p.add_argument("--html", metavar="FILE.html", help="write a self-contained HTML chart")
    p.add_argument("--png", metavar="FILE.png", help="write a PNG chart")
    p.add_argument("--png-size", type=_size, default=(1200, 800), metavar="WxH",
                   help="PNG size in pixels (default 1200x800)")
    p.add_argument("--color", action=argparse.BooleanOptionalAction, default=None,
                   help="ANSI colors in the printed strip: --color forces them on, --no-color "
                        "off (default: on only when stdout is a terminal and NO_COLOR is unset "
                        "or empty)")


def write_charts(args, trace: dict, compare: dict | None, start: int | None = None,
                  end: int | None = None) -> None:
    """Write the charts --html / --png ask for (`compare` drawn beside `trace`)."""
    if args.html:
        Path(args.html).write_text(render_html(trace, compare=compare, start=start, end=end))
        print(f"wrote {args.html}")
    if args.png:
        width, height = args.png_size
        render_png(trace, args.png, width, height, compare=compare, start=start, end=end)
        print(f"wrote {args.png}")


def use_color(args: argparse.Namespace) -> bool:
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


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WxH like 1200x800, got {text!r}") from None
    return width, height


def cost_model(profile: str | None):
    """The replay's clock: a `slotserve calibrate` profile, else one unit per iteration."""
    return UnitCost() if profile is None else load_profile(profile)


def load_tokenizer(model: str | None):
    """The model's tokenizer (text and chat workloads); ValueError if it has none."""
    from slotserve.loader import load_model

    tokenizer = load_model(model).tokenizer
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: use token-id prompts")
    return tokenizer


def int_tuple(text: str) -> tuple[int, ...]:
    """argparse type: "1,8,32" -> (1, 8, 32), each >= 1."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,32, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_chat_template_args(p: argparse.ArgumentParser) -> None:
    """--chat-template and --chat-template-kwargs (`chat`, `generate`): the template read as
    `slotserve serve --chat-template` reads it, the variables checked as a request's
    `chat_template_kwargs` are (a bad value exits 2, naming the flag)."""
    p.add_argument("--chat-template", type=chat_template_arg, default=None,
                   metavar="FILE_OR_TEMPLATE",
                   help="the Jinja chat template instead of the model's: a file, or the "
                        "template itself (as `slotserve serve --chat-template`; a value with "
                        "{, } or a newline that is no file is the template) (default: the "
                        "model's, from its tokenizer config or GGUF metadata)")
    p.add_argument("--chat-template-kwargs", type=chat_template_kwargs_arg, default=None,
                   metavar="JSON",
                   help="extra variables for the chat template, a JSON object, e.g. "
                        "'{\"enable_thinking\": false}' for Qwen3 (as a request's "
                        "chat_template_kwargs) (default: none)")


def chat_template_arg(text: str) -> str:
    """argparse type: a chat template file or inline template -> the template's text
    (loader.chat_template.load_chat_template: read and compiled, or an error)."""
    from slotserve.loader.chat_template import load_chat_template

    try:
        return load_chat_template(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def chat_template_kwargs_arg(text: str) -> dict:
    """argparse type: a JSON object of template variables, checked as the server checks a
    request's chat_template_kwargs (names, reserved variables, size and depth)."""
    from slotserve.server.protocol.errors import APIError
    from slotserve.server.protocol.requests import check_chat_template_kwargs

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    try:
        check_chat_template_kwargs(value)
    except APIError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return value
