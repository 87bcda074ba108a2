"""Terminal chat: the conversation is kept, the reply is printed as its tokens stream.

Two backends give the same `stream(messages, max_tokens, temperature) -> Iterator[str]`:
`LocalChat` drives an in-process LLMEngine step by step; `RemoteChat` talks to a running
server through the official `openai` client.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

from slotserve.sampling import SamplingParams

PROMPT = "you> "
REPLY = "bot> "


class LocalChat:
    """Replies from an in-process engine (nothing else runs on it).

    chat_template: a Jinja template used instead of the model's; chat_template_kwargs: extra
    template variables (e.g. Qwen3's enable_thinking), as LLM.chat takes them.
    """

    def __init__(self, engine, chat_template: str | None = None,
                 chat_template_kwargs: dict | None = None) -> None:
        if engine.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        if chat_template is None and engine.tokenizer.chat_template is None:
            raise ValueError("this model has no chat template: give one with --chat-template")
        self.engine = engine
        self.chat_template = chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.model_name = engine.model_config.name
        self._ids = itertools.count()

    def stream(self, messages: list[dict], max_tokens: int, temperature: float
               ) -> Iterator[str]:
        prompt = self.engine.tokenizer.encode_chat(messages, add_generation_prompt=True,
                                                   chat_template=self.chat_template,
                                                   **self.chat_template_kwargs)
        request_id = f"chat-{next(self._ids)}"
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        self.engine.add_request(request_id, prompt, params)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    yield out.outputs[0].delta_text
        finally:  # NOTE: Ctrl-C or an early close aborts the reply and frees its blocks
            self.engine.abort_request(request_id)
            while self.engine.has_unfinished_requests():
                self.engine.step()


class RemoteChat:
    """Replies from a server's /v1/chat/completions, streamed (the server's chat template;
    chat_template_kwargs go with every request)."""

    def __init__(self, url: str, model_name: str | None = None, client=None,
                 api_key: str | None = None, chat_template_kwargs: dict | None = None) -> None:
        if client is None:
            from openai import OpenAI

            client = OpenAI(base_url=api_base(url), api_key=api_key or "slotserve")
        self.client = client
        self.model_name = model_name or client.models.list().data[0].id
        self.extra = ({"extra_body": {"chat_template_kwargs": chat_template_kwargs}}
                      if chat_template_kwargs else {})

    def stream(self, messages: list[dict], max_tokens: int, temperature: float
               ) -> Iterator[str]:
        chunks = self.client.chat.completions.create(
            model=self.model_name, messages=messages, max_tokens=max_tokens,
            temperature=temperature, stream=True, **self.extra)
        try:
            for chunk in chunks:
                for choice in chunk.choices:
                    if choice.delta.content:
                        yield choice.delta.content
        finally:
            chunks.close()  # an early close disconnects, which aborts the request


def api_base(url: str) -> str:
    """'http://host:8000' or 'http://host:8000/v1' -> 'http://host:8000/v1'."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def run_chat(backend, system: str | None = None, max_tokens: int = 512,
             temperature: float = 0.7, read: Callable[[str], str] = input,
             out: TextIO | None = None) -> list[dict]:
    """Read-reply loop until /exit or EOF; returns the conversation.

    /reset forgets the conversation (the system message stays). Ctrl-C during a reply
    stops that reply only.
    """
    out = out or sys.stdout
    opening = [{"role": "system", "content": system}] if system else []
    history = list(opening)
    while True:
        try:
            text = read(PROMPT).strip()
        except EOFError:
            out.write("\n")
            return history
        if text in ("/exit", "/quit"):
            return history
        if text == "/reset":
            history = list(opening)
            continue
        if text:
            history.append({"role": "user", "content": text})
            history.append({"role": "assistant", "content": _reply(backend, history,
                                                                     max_tokens, temperature,
                                                                     out)})


def _reply(backend, history: list[dict], max_tokens: int, temperature: float,
           out: TextIO) -> str:
    """Print the reply as it streams; return its text."""
    parts: list[str] = []
    out.write(REPLY)
    try:
        for delta in backend.stream(history, max_tokens, temperature):
            out.write(delta)
            out.flush()
            parts.append(delta)
    except KeyboardInterrupt:
        out.write(" [stopped]")
    out.write("\n")
    return "".join(parts)
