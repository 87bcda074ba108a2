"""Chaos: a victim workload beside an adversary that sends every bad input it can; the victim
must not notice.

    .venv/bin/python -m benchmarks.chaos --victims 16 --rounds 3 --json chaos.json

Starts `slotserve serve` on loopback (the embedded SmolLM2-135M, the soak's engine settings)
with an API key for the victim, another for the adversary (two tenants, `--api-keys-file`),
an `--admin-key` (for /metrics) and `--max-waiting 64`. Then, `--rounds` times, interleaved
so that the machine's drift hits both alike:

- solo: the victim alone: `--victims` streaming greedy completions at once (distinct prompts,
  `--max-tokens` tokens each, ignore_eos), each with its own X-Request-Id;
- chaos: the same victim requests while the adversary (one client, one attack at a time,
  `--gap` seconds apart, cycling through ATTACKS until the victim is done and every attack
  ran at least once) sends: top_k 10**30, temperature 1e-50, top_p 1e-50, n=128, 45k stop
  strings, a 500k-character stop string, a 1 MB prompt (and chat message), a 2 MB body, a
  victim's live X-Request-Id, a seed past int64, logprobs 10**6, malformed JSON, wrong
  types, an unknown model, no key, a wrong key, /metrics with a non-admin key, a stream it
  leaves after two events, a request it leaves before the first token; the other tenant's
  holes of issue 29: the victim's prompt probed for a prefix-cache hit, a regex slow to
  build with n=16, a priority outside its key's range, 100k stop_token_ids, a logprobs
  volume past the cap, slo_tpot_ms 0.001, tool-call arguments nested 200k deep, a foreign
  Host header; issue 34's fields at hostile sizes: a logit_bias of 60k entries, 150k and
  10**6 bad_words, 10**6 stop strings, 150k allowed_token_ids, 10**4 prompts in one list,
  1000 prompts past the waiting bound, echo of a 1 MB prompt, a long prompt scored (echo,
  logprobs, max_tokens 0); and, through the whole phase, slow-loris uploads (a valid
  request's body dribbled a few bytes at a time, then abandoned; one without a key).

Checked (each failure is listed; exit status 1 if any):
- victim: 0 errors (HTTP 200, `[DONE]`, finish_reason length, max_tokens tokens, its
  X-Request-Id echoed), outputs equal to its solo run's, TPOT p99 (pooled over the rounds)
  within `--tpot-ratio` (1.25) of solo's;
- adversary: every attack answered as ATTACKS expects: bad input 4xx (status codes listed
  per attack), values that validation clamps by design (top_k past the vocabulary,
  temperature below 1e-5, tiny top_p, a reused X-Request-Id) 200, temperature 1e-50 and
  top_p 1e-50 with the greedy output; no 5xx, no hang (each request has a timeout); each
  stream left mid-way was aborted in the server's log;
- after: /health 200, nothing running or waiting and every KV block free (/metrics with the
  admin key: kv_blocks_free == kv_blocks_total), no traceback in the server's log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.soak import ENGINE_FLAGS, MODEL, REPO, WORDS, server_outcomes
from slotserve.lab.bench.server import (
    HOST,
    ServerProcess,
    ServerStartError,
    cli_flags,
    scrape_metrics,
)
from slotserve.percentile import percentile

VICTIM_KEY, ADVERSARY_KEY, ADMIN_KEY = "victim-key-0123", "adversary-key-4567", "admin-key-89ab"
MAX_WAITING = 64  # n=128 can never be queued: 400
REQUEST_TIMEOUT_S = 120.0  # no request may hang: past this it is a failure
ATTACK_MAX_TOKENS = 4  # the adversary's accepted requests stay small ("a modest rate")
ADVERSARY_PROMPT = "The capital of France is"


# --------------------------------------------------------------------------- the victim
@dataclass
class VictimResult:
    """One victim stream: its text, token count, chunk times, and what went wrong."""

    index: int
    request_id: str
    text: str = ""
    tokens: int = 0
    tpot_s: float | None = None
    errors: list[str] = field(default_factory=list)


def victim_bodies(count: int, max_tokens: int) -> list[dict]:
    """`count` distinct greedy prompts (12-30 words), each `max_tokens` tokens."""
    bodies = []
    for i in range(count):
        words = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12 + (i * 5) % 19))
        bodies.append({"model": MODEL, "prompt": f"Story {i}: {words}", "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    return bodies


async def run_victim(url: str, bodies: list[dict], tag: str) -> list[VictimResult]:
    """Every body at once, streaming; TPOT = (last token chunk - first) / (tokens - 1)."""
    headers = {"Authorization": f"Bearer {VICTIM_KEY}"}
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, headers=headers,
                                 limits=limits) as client:
        return await asyncio.gather(*(victim_stream(client, i, body, f"victim-{tag}-{i}")
                                      for i, body in enumerate(bodies)))


async def victim_stream(client: httpx.AsyncClient, index: int, body: dict,
                        request_id: str) -> VictimResult:
    result = VictimResult(index, request_id)
    times, done, finish = [], False, None
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"X-Request-Id": request_id}) as r:
            if r.status_code != 200:
                result.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                return result
            if r.headers.get("x-request-id") != request_id:
                result.errors.append(f"X-Request-Id echoed {r.headers.get('x-request-id')!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    result.errors.append(f"error event: {event['error']}")
                if event.get("usage"):
                    result.tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        result.text += choice["text"]
                        times.append(time.monotonic())
                    finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as exc:
        result.errors.append(f"{type(exc).__name__}: {exc}")
        return result
    if not done:
        result.errors.append("no [DONE]")
    if finish != "length" or result.tokens != body["max_tokens"]:
        result.errors.append(f"finish {finish!r} after {result.tokens} tokens")
    if len(times) >= 2 and result.tokens >= 2:
        result.tpot_s = (times[-1] - times[0]) / (result.tokens - 1)
    return result


# --------------------------------------------------------------------------- the adversary
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
                return Outcome(r.status_code, _error_note(r))
            text = r.json()["choices"][0]["text"]
            ok = not greedy or text == ctx.greedy_text
            return Outcome(200, f"text {text!r}" + ("" if ok else " != greedy"), ok)
        return attack
    return decorate


def _error_note(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"][:120]
    except (ValueError, KeyError, TypeError):
        return r.text[:120]


@status_of()
def top_k_huge(ctx):
    return small(top_k=10**30, temperature=1.0, seed=1)


@status_of(greedy=True)
def temperature_tiny(ctx):
    return small(temperature=1e-50)


@status_of(greedy=True)
def top_p_tiny(ctx):
    return small(temperature=1.0, top_p=1e-50)


@status_of()
def n_128(ctx):
    return small(n=128)


@status_of()
def stop_many(ctx):
    return small(stop=[f"s{i}" for i in range(45_000)])


@status_of()
def stop_huge(ctx):
    return small(stop=["x" * 500_000])


@status_of()
def prompt_1mb(ctx):
    return small(prompt="word " * 200_000)  # 1,000,000 bytes: under the 1 MiB body bound


@status_of()
def seed_past_int64(ctx):
    return small(seed=2**63)


@status_of()
def logprobs_huge(ctx):
    return small(logprobs=10**6)


@status_of()
def wrong_types(ctx):
    return small(max_tokens="many", temperature="hot")


@status_of()
def priority_huge(ctx):
    return small(priority=10**30)


@status_of()
def slo_negative(ctx):
    return small(slo_ttft_ms=-1)


@status_of()
def cache_salt_huge(ctx):
    return small(cache_salt="s" * 100_000)


@status_of()
def guided_regex_bad(ctx):
    return small(guided_regex="(unclosed")


@status_of()
def guided_regex_unfollowable(ctx):
    """A pattern llguidance cannot follow on SmolLM2's vocabulary (GrammarRejectedToken)."""
    return small(guided_regex="\U00085346WT")


@status_of()
def min_tokens_past_max(ctx):
    return small(min_tokens=ATTACK_MAX_TOKENS + 1)


@status_of()
def stop_token_ids_past_vocab(ctx):
    return small(stop_token_ids=[10**30, 2**40])


@status_of()
def continuous_usage_wrong_type(ctx):
    return small(stream=True, stream_options={"continuous_usage_stats": "always"})


@status_of()
def json_schema_bad(ctx):
    return small(response_format={"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": {"type": 7}}})


@status_of()
def unknown_model(ctx):
    return small(model="gpt-9-ultra")


# ------------------------------------------------------- the other tenant's holes (issue 29)
async def probe_victim_prefix(ctx: Context) -> Outcome:
    """One of the victim's prompts (cached by its runs), a different one each round: the
    adversary must get no prefix hit on it (`cached_tokens` 0), so it cannot tell what the
    victim sent. NOTE: a prompt this adversary already sent is in its own cache: a hit on
    it is its own."""
    prompt = ctx.probe_prompts[ctx.round % len(ctx.probe_prompts)]
    own = prompt in ctx.probed
    ctx.probed.add(prompt)
    r = await post(ctx, "probe", small(prompt=prompt, max_tokens=1))
    if r.status_code != 200:
        return Outcome(r.status_code, _error_note(r))
    cached = (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Outcome(200, f"cached_tokens {cached}" + (" (its own)" if own else ""),
                   cached == 0 or own)


@status_of()
def regex_slow_to_build(ctx):
    """A 9-byte regex whose automaton is large, 16 completions: built off the engine
    thread or refused, never a stall of the others."""
    return small(guided_regex="c{300000}", n=16)


@status_of()
def priority_outside_the_key(ctx):
    return small(priority=-(2**31))


@status_of()
def stop_token_ids_100k(ctx):
    """100k ids (0.7 MB, under the body bound): the count cap, not the body size, refuses."""
    return small(stop_token_ids=list(range(100, 100 + 100_000)))


@status_of()
def logprobs_volume(ctx):
    return small(n=64, max_tokens=400, logprobs=20)


@status_of()
def slo_tpot_tiny(ctx):
    """Under `deadline` this once stopped every prefill; any policy must take it calmly."""
    return small(slo_tpot_ms=0.001)


# ------------------------------------------------- issue 34's fields at hostile sizes
# A long prompt scored (echo, max_tokens 0): 360 tokens of the context's 512
ECHO_SCORED_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 40)


@status_of()
def logit_bias_huge(ctx):
    """60k entries (0.8 MB, under the body bound): refused at OpenAI's 300, not applied."""
    return small(logit_bias={str(i): 1.0 for i in range(60_000)})


@status_of()
def bad_words_150k(ctx):
    """150k words (0.75 MB): the count cap (100) refuses it before any is tokenized."""
    return small(bad_words=["w"] * 150_000)


@status_of()
def bad_words_million(ctx):
    """10**6 words: a 5 MB body, refused by its Content-Length before it is read."""
    return small(bad_words=["w"] * 1_000_000)


@status_of()
def stop_million(ctx):
    return small(stop=["s"] * 1_000_000)


@status_of()
def allowed_token_ids_150k(ctx):
    """150k allowed ids, each inside the vocabulary (repeats): served or refused, never a
    stall of the others (the mask is built once, at admission)."""
    return small(allowed_token_ids=[i % 1000 for i in range(150_000)])


@status_of()
def prompts_10k(ctx):
    return small(prompt=[ADVERSARY_PROMPT] * 10_000)


@status_of()
def prompts_past_the_queue(ctx):
    """1000 prompts (under --max-prompts): 1000 sequences can never wait in a queue of
    --max-waiting 64: refused before any is tokenized or queued (admitted one by one, they
    filled the shared queue: the next requests of every tenant got 429)."""
    return small(prompt=[f"{ADVERSARY_PROMPT} {i}" for i in range(1000)], max_tokens=1)


@status_of()
def echo_1mb(ctx):
    """A 1 MB prompt to score (echo, logprobs, max_tokens 0): refused by the byte
    pre-check, never tokenized nor run."""
    return small(prompt="word " * 200_000, echo=True, logprobs=5, max_tokens=0)


async def echo_long_prompt_scored(ctx: Context) -> Outcome:
    """A 360-token prompt scored (echo, logprobs 5, max_tokens 0): served, the prompt's
    logits computed in its prefill chunks beside the victim."""
    prompt = ECHO_SCORED_PROMPT
    r = await post(ctx, "echo_long", small(prompt=prompt, echo=True, logprobs=5, max_tokens=0))
    if r.status_code != 200:
        return Outcome(r.status_code, _error_note(r))
    answer = r.json()
    choice, usage = answer["choices"][0], answer["usage"]
    ok = (choice["text"] == prompt and usage["completion_tokens"] == 0
          and len(choice["logprobs"]["tokens"]) == usage["prompt_tokens"])
    return Outcome(200, f"{usage['prompt_tokens']} prompt tokens scored", ok)


async def tool_arguments_deep(ctx: Context) -> Outcome:
    """A chat history whose tool call's arguments nest 200,000 brackets deep: kept as text
    (200) or refused (400), never a RecursionError's 500."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "[" * 200_000}}
    body = {"model": MODEL, "max_tokens": ATTACK_MAX_TOKENS,
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
    r = await post(ctx, "deep_args", body, path="/v1/chat/completions")
    return Outcome(r.status_code, _error_note(r))


async def foreign_host(ctx: Context) -> Outcome:
    """A Host header naming another site (DNS rebinding from a web page)."""
    headers = {**AUTH, "X-Request-Id": ctx.next_id("host"), "Host": "evil.example"}
    r = await post(ctx, "host", small(), headers=headers)
    return Outcome(r.status_code, _error_note(r))


async def chat_1mb(ctx: Context) -> Outcome:
    body = {"model": MODEL, "max_tokens": ATTACK_MAX_TOKENS,
            "messages": [{"role": "user", "content": "word " * 200_000}]}
    r = await post(ctx, "chat_1mb", body, path="/v1/chat/completions")
    return Outcome(r.status_code, _error_note(r))


async def body_2mb(ctx: Context) -> Outcome:
    r = await post(ctx, "body_2mb", small(prompt="word " * 400_000))
    return Outcome(r.status_code, _error_note(r))


async def reused_request_id(ctx: Context) -> Outcome:
    """A victim's live X-Request-Id: the server's ids are its own, so both run."""
    headers = {**AUTH, "X-Request-Id": ctx.live_victim_id}
    r = await post(ctx, "reused", small(temperature=0.0), headers=headers)
    echoed = r.headers.get("x-request-id")
    return Outcome(r.status_code, f"echoed {echoed!r}", echoed == ctx.live_victim_id)


async def malformed_json(ctx: Context) -> Outcome:
    r = await post(ctx, "malformed", content=b'{"model": "x", "prompt": "Hi", "max_tokens": ')
    return Outcome(r.status_code, _error_note(r))


async def missing_key(ctx: Context) -> Outcome:
    r = await post(ctx, "nokey", small(), headers={})
    return Outcome(r.status_code, _error_note(r))


async def wrong_key(ctx: Context) -> Outcome:
    r = await post(ctx, "wrongkey", small(), headers={"Authorization": "Bearer not-a-key"})
    return Outcome(r.status_code, _error_note(r))


async def metrics_without_admin(ctx: Context) -> Outcome:
    async with httpx.AsyncClient(base_url=ctx.url, timeout=REQUEST_TIMEOUT_S) as client:
        r = await client.get("/metrics", headers=AUTH)
    return Outcome(r.status_code, _error_note(r))


async def disconnect_mid_stream(ctx: Context) -> Outcome:
    """A long stream, left after two events (the server must abort it)."""
    request_id = ctx.next_id("leave")
    headers = {**AUTH, "X-Request-Id": request_id}
    body = small(max_tokens=200, ignore_eos=True, stream=True)
    async with httpx.AsyncClient(base_url=ctx.url, timeout=REQUEST_TIMEOUT_S) as client:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            events = 0
            async for line in r.aiter_lines():
                events += line.startswith("data: ")
                if events == 2:
                    break
    return Outcome(r.status_code, f"left after {events} events: {request_id}")


async def disconnect_before_first_token(ctx: Context) -> Outcome:
    """A request abandoned 20 ms after it was sent (before or at its first token)."""
    task = asyncio.ensure_future(post(ctx, "gone", small(max_tokens=200, ignore_eos=True)))
    await asyncio.sleep(0.02)
    task.cancel()
    try:
        r = await task
    except asyncio.CancelledError:
        return Outcome(None, "abandoned")
    return Outcome(r.status_code, "answered before the client left")


Attack = Callable[[Context], Awaitable[Outcome]]
# name -> (the attack, the statuses it must get). None: no response (the client left).
ATTACKS: dict[str, tuple[Attack, frozenset]] = {
    "top_k 10**30 (clamped to the vocabulary)": (top_k_huge, frozenset({200})),
    "temperature 1e-50 (greedy)": (temperature_tiny, frozenset({200})),
    "top_p 1e-50 (the top token)": (top_p_tiny, frozenset({200})),
    "n=128 (past --max-waiting)": (n_128, frozenset({400})),
    "45k stop strings": (stop_many, frozenset({400})),
    "a 500k-character stop string": (stop_huge, frozenset({400})),
    "a 1 MB prompt": (prompt_1mb, frozenset({400})),
    "a 1 MB chat message": (chat_1mb, frozenset({400})),
    "a 2 MB body": (body_2mb, frozenset({413})),
    "a victim's live X-Request-Id": (reused_request_id, frozenset({200})),
    "seed 2**63": (seed_past_int64, frozenset({400})),
    "logprobs 10**6": (logprobs_huge, frozenset({400})),
    "malformed JSON": (malformed_json, frozenset({400})),
    "wrong types": (wrong_types, frozenset({400})),
    "unknown model": (unknown_model, frozenset({404})),
    "priority 10**30": (priority_huge, frozenset({400})),
    "slo_ttft_ms -1": (slo_negative, frozenset({400})),
    "a 100k-character cache_salt": (cache_salt_huge, frozenset({400})),
    "an unparsable guided_regex": (guided_regex_bad, frozenset({400})),
    "a regex the grammar engine cannot follow": (guided_regex_unfollowable, frozenset({400})),
    "a malformed json_schema": (json_schema_bad, frozenset({400})),
    "min_tokens above max_tokens": (min_tokens_past_max, frozenset({400})),
    "stop_token_ids past the vocabulary": (stop_token_ids_past_vocab, frozenset({400})),
    "continuous_usage_stats not a boolean": (continuous_usage_wrong_type, frozenset({400})),
    "no API key": (missing_key, frozenset({401})),
    "a wrong API key": (wrong_key, frozenset({401})),
    "/metrics with a non-admin key": (metrics_without_admin, frozenset({401})),
    "a stream left after 2 events": (disconnect_mid_stream, frozenset({200})),
    "a request left after 20 ms": (disconnect_before_first_token, frozenset({None, 200})),
    "the victim's prompt, probed for a prefix hit": (probe_victim_prefix, frozenset({200})),
    "guided_regex c{300000}, n=16": (regex_slow_to_build, frozenset({200, 400})),
    "priority -2**31 (outside the key's range)": (priority_outside_the_key, frozenset({400})),
    "100k stop_token_ids": (stop_token_ids_100k, frozenset({400})),
    "logprobs 20 x n=64 x 400 tokens": (logprobs_volume, frozenset({400})),
    "slo_tpot_ms 0.001": (slo_tpot_tiny, frozenset({200})),
    "tool-call arguments 200k brackets deep": (tool_arguments_deep, frozenset({200, 400})),
    "a foreign Host header": (foreign_host, frozenset({400, 421})),
    "logit_bias of 60k entries": (logit_bias_huge, frozenset({400})),
    "150k bad_words": (bad_words_150k, frozenset({400})),
    "10**6 bad_words (a 5 MB body)": (bad_words_million, frozenset({413})),
    "10**6 stop strings (a 5 MB body)": (stop_million, frozenset({413})),
    "150k allowed_token_ids": (allowed_token_ids_150k, frozenset({200, 400})),
    "10**4 prompts in one list": (prompts_10k, frozenset({400})),
    "1000 prompts (past --max-waiting 64)": (prompts_past_the_queue, frozenset({400})),
    "echo of a 1 MB prompt": (echo_1mb, frozenset({400})),
    "echo of a 360-token prompt, scored": (echo_long_prompt_scored, frozenset({200})),
}


async def run_adversary(ctx: Context, victim_done, gap_s: float,
                        min_passes: int) -> list[tuple[str, Outcome]]:
    """Cycle through ATTACKS, one at a time, until the victim is done and every attack ran
    `min_passes` times. An attack that raises (a timeout: a hang) is an outcome too."""
    outcomes, passes = [], 0
    while passes < min_passes or not victim_done.is_set():
        for name, (attack, _) in ATTACKS.items():
            try:
                outcome = await attack(ctx)
            except Exception as exc:  # a hang or a dropped connection: a finding
                outcome = Outcome(-1, f"{type(exc).__name__}: {exc}", ok=False)
            outcomes.append((name, outcome))
            await asyncio.sleep(gap_s)
            if passes >= min_passes and victim_done.is_set():
                break
        passes += 1
    return outcomes


async def slow_loris(url: str, key: str | None, until,
                     max_s: float) -> Outcome:
    """A valid request whose body comes 8 bytes every 0.2 s, abandoned when `until` is set
    (or after max_s). Without a key the server must refuse it at once: 401."""
    port = int(url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection(HOST, port)
    body = json.dumps(small(prompt="slow " * 2000)).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n"
            + (f"Authorization: Bearer {key}\r\n" if key else "") + "\r\n")
    writer.write(head.encode())
    sent, deadline = 0, time.monotonic() + max_s
    try:
        while not until.is_set() and time.monotonic() < deadline and sent < len(body) - 8:
            writer.write(body[sent:sent + 8])
            sent += 8
            await writer.drain()
            try:  # an answer (a refusal) ends the attack
                line = await asyncio.wait_for(reader.readline(), 0.2)
            except asyncio.TimeoutError:
                continue
            return Outcome(int(line.split()[1]) if line else None,
                           f"answered after {sent} body bytes")
        return Outcome(None, f"abandoned after {sent} of {len(body)} body bytes, no answer")
    except (ConnectionError, OSError) as exc:
        return Outcome(None, f"connection closed by the server after {sent} bytes: {exc}")
    finally:
        writer.transport.abort()  # a RST, not a polite close: the client just vanishes


SLOW_LORIS = {"slow-loris upload (abandoned)": (VICTIM_KEY, frozenset({None, 408})),
              "slow-loris upload without a key": (None, frozenset({401}))}


# --------------------------------------------------------------------------- one run
@dataclass
class ChaosReport:
    victims: int
    rounds: int
    max_tokens: int
    solo_tpot_ms: dict
    chaos_tpot_ms: dict
    tpot_p99_ratio: float | None
    tpot_p50_ratio: float | None
    victim_errors: int
    victim_outputs_differing: int
    attacks: dict  # name -> {"expect": [...], "statuses": {status: count}, "notes": [...]}
    attacks_sent: int
    health_after: int
    final_metrics: dict
    server_log: dict
    seconds: float
    failures: list[str]

    def summary(self) -> str:
        lines = [f"victim: {self.victims} streams x {self.rounds} rounds, {self.max_tokens} "
                 f"tokens; errors {self.victim_errors}, outputs differing from solo "
                 f"{self.victim_outputs_differing}",
                 f"TPOT ms solo {self.solo_tpot_ms}, chaos {self.chaos_tpot_ms}",
                 f"TPOT ratio chaos/solo: p99 {_x(self.tpot_p99_ratio)}, "
                 f"p50 {_x(self.tpot_p50_ratio)}",
                 f"adversary: {self.attacks_sent} requests"]
        for name, a in self.attacks.items():
            lines.append(f"  {name:<42} {a['statuses']} (expect {a['expect']})")
        lines += [f"after: /health {self.health_after}, {self.final_metrics}",
                  f"server log: {self.server_log}", f"{self.seconds:.1f}s",
                  f"failures: {len(self.failures)}"]
        lines += [f"  - {f}" for f in self.failures[:40]]
        return "\n".join(lines)


def _x(value: float | None) -> str:
    return "-" if value is None else f"x{value:.2f}"


def percentiles_ms(values: list[float]) -> dict:
    if not values:
        return {}
    ms = [v * 1000 for v in values]
    return {"p50": round(percentile(ms, 50), 1), "p99": round(percentile(ms, 99), 1),
            "max": round(max(ms), 1), "n": len(values)}


def chaos_phase(url: str, bodies: list[dict], tag: str, greedy_text: str, gap_s: float,
                min_passes: int) -> tuple[list[VictimResult], list[tuple[str, Outcome]]]:
    """The victim with the adversary (and its slow-loris clients) beside it.

    NOTE: the adversary is another process, as a hostile client would be: building its
    megabyte bodies must not stall the victim's event loop (that would stretch the victim's
    measured TPOT on the client side, not the server's)."""
    mp = multiprocessing.get_context("spawn")
    ready, done, results = mp.Event(), mp.Event(), mp.Queue()
    ctx = Context(url, greedy_text, tag, probe_prompts=probe_prompts_of(bodies))
    proc = mp.Process(target=adversary_process, daemon=True,
                      args=(ctx, gap_s, min_passes, ready, done, results))
    proc.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("the adversary process did not start")
        time.sleep(0.1)  # the attacks are under way when the victim starts
        victims = asyncio.run(run_victim(url, bodies, tag))
    finally:
        done.set()
        try:
            outcomes = results.get(timeout=2 * REQUEST_TIMEOUT_S)
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return victims, outcomes


def probe_prompts_of(bodies: list[dict]) -> tuple[str, ...]:
    """The victim's longest prompts (up to 8; each more than a KV block): what the prefix
    probe asks for, one a round."""
    return tuple(sorted((b["prompt"] for b in bodies), key=len)[-8:])


def adversary_process(ctx: Context, gap_s: float, min_passes: int, ready, done,
                      results) -> None:
    """The adversary's process: its outcomes (or its own failure) go into `results`."""
    try:
        results.put(asyncio.run(adversary(ctx, gap_s, min_passes, ready, done)))
    except BaseException as exc:
        results.put([("the adversary itself", Outcome(-1, repr(exc), ok=False))])
        raise


async def adversary(ctx: Context, gap_s: float, min_passes: int, ready,
                    done) -> list[tuple[str, Outcome]]:
    """The slow-loris clients (until `done`), and the attacks one at a time."""
    lorises = {name: asyncio.ensure_future(slow_loris(ctx.url, key, done, REQUEST_TIMEOUT_S))
               for name, (key, _) in SLOW_LORIS.items()}
    ready.set()
    outcomes = await run_adversary(ctx, done, gap_s, min_passes)
    for name, task in lorises.items():
        outcomes.append((name, await task))
    return outcomes


def greedy_reference(url: str) -> str:
    r = httpx.post(url + "/v1/completions", json=small(temperature=0.0),
                   headers=AUTH, timeout=REQUEST_TIMEOUT_S)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def chaos(url: str, *, victims: int = 16, rounds: int = 3, max_tokens: int = 64,
          gap_s: float = 0.25, min_passes: int = 1, tpot_ratio: float | None = 1.25,
          log_path: Path | None = None, progress: bool = False) -> ChaosReport:
    """Warm up, then `rounds` x (solo, chaos); check everything. tpot_ratio: the bound on
    chaos/solo TPOT p99 (None: reported, not checked)."""
    start = time.monotonic()
    bodies = victim_bodies(victims, max_tokens)
    asyncio.run(run_victim(url, bodies, "warmup"))
    greedy_text = greedy_reference(url)
    solo, attacked, outcomes = [], [], []
    for round_ in range(rounds):
        solo.append(asyncio.run(run_victim(url, bodies, f"solo{round_}")))
        victims_chaos, got = chaos_phase(url, bodies, f"chaos{round_}", greedy_text, gap_s,
                                         min_passes)
        attacked.append(victims_chaos)
        outcomes += got
        if progress:
            print(f"  round {round_ + 1}/{rounds}: {len(got)} attacks", flush=True)
    failures: list[str] = []
    errors, differing = check_victim(solo, attacked, failures)
    attacks = tally_attacks(outcomes, failures)
    solo_tpot = [r.tpot_s for run in solo for r in run if r.tpot_s is not None]
    chaos_tpot = [r.tpot_s for run in attacked for r in run if r.tpot_s is not None]
    s, c = percentiles_ms(solo_tpot), percentiles_ms(chaos_tpot)
    p99 = c["p99"] / s["p99"] if s and c else None
    p50 = c["p50"] / s["p50"] if s and c else None
    if tpot_ratio is not None and (p99 is None or p99 > tpot_ratio):
        failures.append(f"victim TPOT p99 chaos/solo {_x(p99)} > x{tpot_ratio}")
    health, final = check_after(url, failures)
    server_log = check_log(log_path, outcomes, failures) if log_path else {}
    return ChaosReport(victims, rounds, max_tokens, s, c, p99, p50, errors, differing, attacks,
                       len(outcomes), health, final, server_log, time.monotonic() - start,
                       failures)


def check_victim(solo: list[list[VictimResult]], attacked: list[list[VictimResult]],
                 failures: list[str]) -> tuple[int, int]:
    """(victim requests with errors, chaos outputs unlike the first solo run's)."""
    reference = {r.index: r.text for r in solo[0]}
    errors = differing = 0
    for run in solo + attacked:
        for r in run:
            if r.errors:
                errors += 1
                failures.append(f"{r.request_id}: {'; '.join(r.errors)}")
            elif r.text != reference[r.index]:
                differing += 1
                failures.append(f"{r.request_id}: {r.text!r} != solo {reference[r.index]!r}")
    return errors, differing


def tally_attacks(outcomes: list[tuple[str, Outcome]], failures: list[str]) -> dict:
    expected = {**{name: expect for name, (_, expect) in ATTACKS.items()},
                **{name: expect for name, (_, expect) in SLOW_LORIS.items()}}
    tally: dict = defaultdict(lambda: {"statuses": Counter(), "notes": []})
    for name, outcome in outcomes:
        entry = tally[name]
        entry["statuses"][str(outcome.status)] += 1
        if outcome.note and outcome.note not in entry["notes"] and len(entry["notes"]) < 2:
            entry["notes"].append(outcome.note)
        if outcome.status not in expected.get(name, ()) or not outcome.ok:
            failures.append(f"attack {name!r}: {outcome.status} ({outcome.note}), expected "
                            f"{sorted(map(str, expected.get(name, ())))}")
    missing = set(expected) - set(tally)
    failures += [f"attack {name!r} never ran" for name in sorted(missing)]
    return {name: {"expect": sorted(map(str, expected.get(name, ()))),
                   "statuses": dict(entry["statuses"]), "notes": entry["notes"]}
            for name, entry in tally.items()}


def admin_metrics(url: str) -> dict[str, float]:
    return scrape_metrics(url, timeout=30, headers={"Authorization": f"Bearer {ADMIN_KEY}"})


def check_after(url: str, failures: list[str], timeout_s: float = 30.0) -> tuple[int, dict]:
    """/health, then the metrics once idle (aborts land at the next iteration boundary)."""
    health = httpx.get(url + "/health", timeout=30).status_code
    if health != 200:
        failures.append(f"/health {health} after the run")
    deadline = time.monotonic() + timeout_s
    while True:
        m = admin_metrics(url)
        idle = (m["slotserve:num_requests_running"] == 0 == m["slotserve:num_requests_waiting"]
                and m["slotserve:kv_blocks_free"] == m["slotserve:kv_blocks_total"])
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    final = {k.removeprefix("slotserve:"): m[k] for k in (
        "slotserve:num_requests_running", "slotserve:num_requests_waiting",
        "slotserve:kv_blocks_free", "slotserve:kv_blocks_total", "slotserve:kv_cache_usage_perc")}
    if not idle:
        failures.append(f"not idle {timeout_s}s after the run: {final}")
    return health, final


def check_log(log_path: Path, outcomes: list[tuple[str, Outcome]],
              failures: list[str]) -> dict:
    """No traceback; every stream the adversary left mid-way was aborted by the server."""
    text = Path(log_path).read_text("utf-8", "replace")
    seen = server_outcomes(text)
    left = [o.note.rsplit(": ", 1)[1] for name, o in outcomes
            if name == "a stream left after 2 events" and o.status == 200]
    not_aborted = [rid for rid in left if not seen.get(rid, {}).get("aborted")]
    failures += [f"{rid}: left mid-stream, but the server logged no abort: {seen.get(rid)}"
                 for rid in not_aborted]
    tracebacks = text.count("Traceback")
    if tracebacks:
        failures.append(f"{tracebacks} tracebacks in the server log")
    return {"tracebacks": tracebacks, "streams_left": len(left),
            "streams_left_aborted": len(left) - len(not_aborted)}


# --------------------------------------------------------------------------- the server
def server_flags(keys_file: Path) -> list[str]:
    """The soak's engine settings, two tenants' keys, the admin key, --max-waiting."""
    return [*cli_flags(**ENGINE_FLAGS), f"--api-keys-file={keys_file}",
            f"--admin-key={ADMIN_KEY}", f"--max-waiting={MAX_WAITING}"]


def write_keys_file(path: Path) -> Path:
    path.write_text(f"{VICTIM_KEY} victim\n{ADVERSARY_KEY} adversary\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--victims", type=int, default=16, help="victim streams at once")
    ap.add_argument("--rounds", type=int, default=3, help="solo + chaos phases, interleaved")
    ap.add_argument("--max-tokens", type=int, default=64, help="each victim stream's tokens")
    ap.add_argument("--gap", type=float, default=0.25, help="seconds between attacks")
    ap.add_argument("--tpot-ratio", type=float, default=1.25,
                    help="bound on the victim's TPOT p99, chaos / solo")
    ap.add_argument("--log", default="chaos-server.log", help="the server's log")
    ap.add_argument("--json", default=None, help="write the report here (write_report)")
    args = ap.parse_args(argv)
    log_path = Path(args.log)
    keys = write_keys_file(log_path.with_name(log_path.stem + "-keys.txt"))
    server = ServerProcess.launch(log_path, *server_flags(keys), cwd=REPO)
    try:
        server.wait_ready()
        report = chaos(server.url, victims=args.victims, rounds=args.rounds,
                       max_tokens=args.max_tokens, gap_s=args.gap,
                       tpot_ratio=args.tpot_ratio, log_path=log_path, progress=True)
    except ServerStartError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        code = server.stop()
    print(report.summary())
    print(f"server exit code after SIGTERM: {code}")
    if args.json:
        from slotserve.lab.bench import write_report

        write_report(args.json, **asdict(report), exit_code=code)
    return 1 if report.failures or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
