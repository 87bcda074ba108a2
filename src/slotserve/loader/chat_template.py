"""Chat templates: HF's Jinja templates rendered in a sandbox with the helpers they expect."""

from __future__ import annotations

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
