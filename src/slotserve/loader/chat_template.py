"""Chat templates: HF's Jinja templates rendered in a sandbox with the helpers they expect,
the `--chat-template` value (a file or an inline template, as vLLM reads it), and what a
template says about tool calls."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a chat template in a sandbox with the helpers HF templates expect."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


# Compiled templates kept (the model's and a --chat-template override: a handful at most).
COMPILED_TEMPLATES_KEPT = 8


@functools.lru_cache(maxsize=COMPILED_TEMPLATES_KEPT)
def compiled_chat_template(template: str) -> jinja2.Template:
    """compile_chat_template, cached by the template's text. NOTE: a compiled template is
    safe to render from several threads at once (jinja2 keeps no render state in it)."""
    return compile_chat_template(template)


# Characters that only a Jinja template (not a file path) holds: vLLM's test for "inline".
_JINJA_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """The template text of a `--chat-template` value: a file's contents, or the value
    itself when it is an inline Jinja template (as vLLM's `load_chat_template`: a value
    with `{`, `}` or a newline that is not a readable file is the template).

    ValueError: a value that looks like a path but cannot be read, an empty template, or
    one that does not compile (the message says which, and where).
    """
    try:
        with open(value, encoding="utf-8") as f:
            template = f.read()
    except (OSError, ValueError) as exc:  # ValueError: an embedded NUL
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"chat template {value!r} looks like a file path, but it "
                             f"could not be read: {exc}") from None
        template = value
    if not template.strip():
        raise ValueError(f"chat template {value!r} is empty")
    try:
        compile_chat_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template {value!r} does not compile: {exc.message} "
                         f"(line {exc.lineno})") from None
    return template


def renders_tool_calls(template: str | None) -> bool:
    """Whether a template shows an assistant turn's structured `tool_calls` (HF's
    convention: message.tool_calls[i].function.name / .arguments): such a template is given
    them as they are; others get each call as JSON text in the turn's content."""
    return bool(template) and "tool_calls" in template


# The tool-call formats a template may define, by the text that marks a call in it; the
# server parses a model's free-text calls in that format (tool_choice "auto").
TOOL_CALL_FORMATS = {"hermes": "<tool_call>"}


def tool_call_format(template: str | None) -> str | None:
    """The tool-call format the template teaches the model ("hermes": Qwen's, Hermes' and
    many others' `<tool_call>{"name": ..., "arguments": ...}</tool_call>`), or None."""
    if not template or "tools" not in template:
        return None
    return next((name for name, marker in TOOL_CALL_FORMATS.items() if marker in template),
                None)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # NOTE: like transformers: no HTML escaping (jinja's own tojson escapes <, >, &).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def hf_chat_template(path: str, cfg: Mapping[str, Any]) -> str | None:
    """The default chat template: tokenizer_config.json, chat_template.jinja or .json."""
    template = cfg.get("chat_template")
    if template is None and os.path.isfile(os.path.join(path, "chat_template.jinja")):
        with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
            template = f.read()
    if template is None:
        stored = _read_json_or_empty(os.path.join(path, "chat_template.json"))
        template = stored.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


def _read_json_or_empty(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
