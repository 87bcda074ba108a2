"""The chaos benchmark's attacks in a request's body: hostile values and sizes of its fields
(issue 14's bad input, the other tenant's holes of issue 29, issue 34's fields at hostile
sizes), each answered by a status and, for a 200, checked content (benchmarks/chaos.py)."""

from __future__ import annotations

import json

from benchmarks.chaos_kit import (
    ADVERSARY_PROMPT,
    ATTACK_MAX_TOKENS,
    Context,
    Outcome,
    error_note,
    post,
    small,
    status_of,
)
from benchmarks.soak import MODEL


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
        return Outcome(r.status_code, error_note(r))
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
        return Outcome(r.status_code, error_note(r))
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
    return Outcome(r.status_code, error_note(r))


async def chat_template_kwargs_deep(ctx: Context) -> Outcome:
    """chat_template_kwargs nested 10,000 deep (the bound is 8; written as raw JSON, too deep
    for json.dumps): a 400, never a RecursionError's 500."""
    nested = '{"x":' * 10_000 + "{}" + "}" * 10_000
    body = (f'{{"model": {json.dumps(MODEL)}, "max_tokens": {ATTACK_MAX_TOKENS}, '
            f'"messages": [{{"role": "user", "content": "hi"}}], '
            f'"chat_template_kwargs": {{"deep": {nested}}}}}')
    r = await post(ctx, "template_kwargs", content=body.encode(), path="/v1/chat/completions")
    return Outcome(r.status_code, error_note(r))


async def chat_1mb(ctx: Context) -> Outcome:
    body = {"model": MODEL, "max_tokens": ATTACK_MAX_TOKENS,
            "messages": [{"role": "user", "content": "word " * 200_000}]}
    r = await post(ctx, "chat_1mb", body, path="/v1/chat/completions")
    return Outcome(r.status_code, error_note(r))


async def _responses(ctx: Context, name: str, **fields) -> Outcome:
    """A /v1/responses request with `fields` (chat's sampling and scheduling fields pass on
    to its chat request: the same bounds must hold there)."""
    body = {"model": MODEL, "input": ADVERSARY_PROMPT, "max_output_tokens": ATTACK_MAX_TOKENS,
            **fields}
    r = await post(ctx, name, body, path="/v1/responses")
    return Outcome(r.status_code, error_note(r))


async def responses_priority_outside_the_key(ctx: Context) -> Outcome:
    return await _responses(ctx, "responses_priority", priority=-(2**31))


async def responses_stop_many(ctx: Context) -> Outcome:
    return await _responses(ctx, "responses_stop", stop=[f"s{i}" for i in range(45_000)])


async def responses_logit_bias_huge(ctx: Context) -> Outcome:
    return await _responses(ctx, "responses_logit_bias",
                            logit_bias={str(i): 1.0 for i in range(60_000)})


async def body_2mb(ctx: Context) -> Outcome:
    r = await post(ctx, "body_2mb", small(prompt="word " * 400_000))
    return Outcome(r.status_code, error_note(r))
