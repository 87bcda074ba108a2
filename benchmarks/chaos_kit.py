"""The chaos benchmark's shared pieces: its keys and bounds, an attack's `Outcome`, the
`Context` the attacks share, and how the adversary builds and posts a request
(benchmarks/chaos.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from benchmarks.soak import MODEL

VICTIM_KEY, ADVERSARY_KEY, ADMIN_KEY = "victim-key-0123", "adversary-key-4567", "admin-key-89ab"
MAX_WAITING = 64  # n=128 can never be queued: 400
REQUEST_TIMEOUT_S = 120.0  # no request may hang: past this it is a failure
ATTACK_MAX_TOKENS = 4  # the adversary's accepted requests stay small ("a modest rate")
ADVERSARY_PROMPT = "The capital of France is"


@dataclass
class Outcome:
    """What one attack got: the HTTP status (None: no response, as planned) and a note."""

    status: int | None
    note: str = ""
    ok: bool = True  # beyond the status: its content checks passed


@dataclass
class Context:
    """What the attacks share: the server, the greedy reference, the phase's tag (victim ids
    are `victim-<tag>-<i>`)."""

    url: str
    greedy_text: str  # ADVERSARY_PROMPT, greedy, ATTACK_MAX_TOKENS tokens
    tag: str
    counter: int = 0
    probe_prompts: tuple[str, ...] = ("",)  # the victim's longest prompts (probe_prompts_of)
    probed: set = field(default_factory=set)  # the victim prompts this adversary sent

    @property
    def round(self) -> int:
        """The round of the phase (tags are `chaos<round>`)."""
        digits = "".join(ch for ch in self.tag if ch.isdigit())
        return int(digits) if digits else 0

    @property
    def live_victim_id(self) -> str:
        return f"victim-{self.tag}-0"

    def next_id(self, name: str) -> str:
        """A fresh X-Request-Id, unique over the whole run (the log is matched by it)."""
        self.counter += 1
        return f"adv-{self.tag}-{name}-{self.counter}"


AUTH = {"Authorization": f"Bearer {ADVERSARY_KEY}"}


def small(**fields) -> dict:
    """A valid small completion body, with `fields` over it."""
    return {"model": MODEL, "prompt": ADVERSARY_PROMPT, "max_tokens": ATTACK_MAX_TOKENS,
            **fields}


async def post(ctx: Context, name: str, body: dict | None = None, *, content: bytes | None = None,
               path: str = "/v1/completions", headers: dict | None = None) -> httpx.Response:
    """One request (`json=body`, or raw `content`), the adversary's key unless `headers`."""
    headers = {**AUTH, "X-Request-Id": ctx.next_id(name)} if headers is None else headers
    async with httpx.AsyncClient(base_url=ctx.url, timeout=REQUEST_TIMEOUT_S) as client:
        if content is not None:
            return await client.post(path, content=content,
                                     headers={**headers, "Content-Type": "application/json"})
        return await client.post(path, json=body, headers=headers)


def status_of(greedy: bool = False):
    """An attack that posts a body and keeps its status; greedy: a 200 must carry the greedy
    text of ADVERSARY_PROMPT."""
    def decorate(build: Callable[[Context], dict]):
        async def attack(ctx: Context) -> Outcome:
            r = await post(ctx, build.__name__, build(ctx))
            if r.status_code != 200:
                return Outcome(r.status_code, error_note(r))
            text = r.json()["choices"][0]["text"]
            ok = not greedy or text == ctx.greedy_text
            return Outcome(200, f"text {text!r}" + ("" if ok else " != greedy"), ok)
        return attack
    return decorate


def error_note(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"][:120]
    except (ValueError, KeyError, TypeError):
        return r.text[:120]


Attack = Callable[[Context], Awaitable[Outcome]]
