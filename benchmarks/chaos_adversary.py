"""The chaos benchmark's adversary: every attack with the statuses it must get (ATTACKS), sent
one at a time beside the slow-loris clients, in a process of its own (benchmarks/chaos.py)."""

from __future__ import annotations

import asyncio

from benchmarks.chaos_attacks_clients import (
    SLOW_LORIS,
    disconnect_before_first_token,
    disconnect_mid_stream,
    foreign_host,
    malformed_json,
    metrics_without_admin,
    missing_key,
    reused_request_id,
    slow_loris,
    wrong_key,
)
from benchmarks.chaos_attacks_fields import (
    allowed_token_ids_150k,
    bad_words_150k,
    bad_words_million,
    body_2mb,
    cache_salt_huge,
    chat_1mb,
    chat_template_kwargs_deep,
    continuous_usage_wrong_type,
    echo_1mb,
    echo_long_prompt_scored,
    guided_regex_bad,
    guided_regex_unfollowable,
    json_schema_bad,
    logit_bias_huge,
    logprobs_huge,
    logprobs_volume,
    min_tokens_past_max,
    n_128,
    priority_huge,
    priority_outside_the_key,
    probe_victim_prefix,
    prompt_1mb,
    prompts_10k,
    prompts_past_the_queue,
    regex_slow_to_build,
    responses_logit_bias_huge,
    responses_priority_outside_the_key,
    responses_stop_many,
    seed_past_int64,
    slo_negative,
    slo_tpot_tiny,
    stop_huge,
    stop_many,
    stop_million,
    stop_token_ids_100k,
    stop_token_ids_past_vocab,
    temperature_tiny,
    tool_arguments_deep,
    top_k_huge,
    top_p_tiny,
    unknown_model,
    wrong_types,
)
from benchmarks.chaos_kit import REQUEST_TIMEOUT_S, Attack, Context, Outcome

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
    "chat_template_kwargs 10,000 deep": (chat_template_kwargs_deep, frozenset({400})),
    "/v1/responses: priority -2**31 (outside the key's range)": (
        responses_priority_outside_the_key, frozenset({400})),
    "/v1/responses: 45k stop strings": (responses_stop_many, frozenset({400})),
    "/v1/responses: logit_bias of 60k entries": (responses_logit_bias_huge, frozenset({400})),
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
