"""Workloads with shared prefixes (what prefix caching is for): many requests behind one
system prompt, closed-loop multi-turn conversations, n completions of each prompt."""

from __future__ import annotations

import numpy as np

from slotserve.lab.workload.generate import random_token_prompts
from slotserve.lab.workload.prompts import CHAT_PROMPTS, FOLLOW_UPS, SYSTEM_PROMPT
from slotserve.lab.workload.requests import BenchRequest, Workload


def shared_prefix_workload(num_requests: int = 64, *, output_len: int = 32,
                           system_prompt: str = SYSTEM_PROMPT, prefix_len: int = 400,
                           suffix_len_min: int = 8, suffix_len_max: int = 24,
                           vocab_size: int | None = None, seed: int = 0) -> Workload:
    """Requests behind one shared system prompt, each with a short question, all at t=0.

    Chat (vocab_size None): messages [system_prompt, one of CHAT_PROMPTS]. Token ids
    (vocab_size given): one random prefix of `prefix_len` ids + a random suffix of
    [suffix_len_min, suffix_len_max] ids per request (for models without a tokenizer).
    """
    _check_count(num_requests, output_len)
    rng = np.random.default_rng(seed)
    if vocab_size is None:
        order = rng.permutation(len(CHAT_PROMPTS))
        bodies = [{"messages": [{"role": "system", "content": system_prompt},
                                {"role": "user", "content": CHAT_PROMPTS[order[i % len(order)]]}]}
                  for i in range(num_requests)]
    else:
        prefix = random_token_prompts(1, prefix_len, prefix_len, vocab_size, rng)[0]
        suffixes = random_token_prompts(num_requests, suffix_len_min, suffix_len_max,
                                        vocab_size, rng)
        bodies = [{"prompt": prefix + suffix} for suffix in suffixes]
    requests = tuple(BenchRequest(id=str(i), max_tokens=output_len, **body)
                     for i, body in enumerate(bodies))
    return Workload(requests, {"source": "shared-prefix", "num_requests": num_requests,
                               "output_len": output_len, "seed": seed, "request_rate": "inf",
                               "prompts": "chat" if vocab_size is None else "random"})


def multi_turn_workload(num_conversations: int = 8, *, turns_min: int = 4, turns_max: int = 8,
                        output_len: int = 32, stagger: float = 0.0,
                        vocab_size: int | None = None, turn_len_min: int = 8,
                        turn_len_max: int = 24, seed: int = 0) -> Workload:
    """Conversations of [turns_min, turns_max] turns, each turn sent when the previous
    answer arrives (closed loop; see `BenchRequest.next_turn`).

    Chat (vocab_size None): a first question from CHAT_PROMPTS, then FOLLOW_UPS. Token ids:
    random turns of [turn_len_min, turn_len_max] ids. stagger: seconds between the
    conversations' first turns (0: all start at t=0).
    """
    _check_count(num_conversations, output_len)
    if not 1 <= turns_min <= turns_max:
        raise ValueError(f"turns must satisfy 1 <= min <= max, got {turns_min}, {turns_max}")
    rng = np.random.default_rng(seed)
    counts = rng.integers(turns_min, turns_max + 1, size=num_conversations).tolist()
    requests = []
    for i, count in enumerate(counts):
        if vocab_size is None:
            first = CHAT_PROMPTS[int(rng.integers(len(CHAT_PROMPTS)))]
            follow = [FOLLOW_UPS[j] for j in rng.permutation(len(FOLLOW_UPS))[:count - 1]]
            body = {"messages": [{"role": "user", "content": first}], "turns": tuple(follow)}
        else:
            ids = random_token_prompts(count, turn_len_min, turn_len_max, vocab_size, rng)
            body = {"prompt": ids[0], "turns": tuple(ids[1:])}
        requests.append(BenchRequest(id=f"c{i}.t0", max_tokens=output_len,
                                     arrival=round(i * stagger, 6), **body))
    return Workload(tuple(requests), {
        "source": "multi-turn", "num_conversations": num_conversations,
        "turns": [turns_min, turns_max], "num_requests": sum(counts), "output_len": output_len,
        "seed": seed, "request_rate": "inf" if stagger == 0 else f"stagger {stagger}s",
        "prompts": "chat" if vocab_size is None else "random"})


def parallel_sampling_workload(num_requests: int = 16, *, n: int = 4, output_len: int = 32,
                               system_prompt: str = SYSTEM_PROMPT, vocab_size: int | None = None,
                               prompt_len: int = 200, seed: int = 0) -> Workload:
    """n completions of each prompt (all at t=0): the n completions share their prompt.

    Chat: each request is the system prompt + one of CHAT_PROMPTS (so the prompts also share
    the system prompt: caching saves both). Token ids: distinct random prompts of
    `prompt_len` ids (only the n completions of one prompt share it).
    """
    _check_count(num_requests, output_len)
    if vocab_size is None:
        base = shared_prefix_workload(num_requests, output_len=output_len,
                                      system_prompt=system_prompt, seed=seed)
        bodies = [{"messages": r.messages} for r in base.requests]
    else:
        rng = np.random.default_rng(seed)
        bodies = [{"prompt": ids} for ids in random_token_prompts(
            num_requests, prompt_len, prompt_len, vocab_size, rng)]
    requests = tuple(BenchRequest(id=str(i), max_tokens=output_len, n=n, **body)
                     for i, body in enumerate(bodies))
    return Workload(requests, {"source": f"n={n}", "num_requests": num_requests, "n": n,
                               "output_len": output_len, "seed": seed, "request_rate": "inf",
                               "prompts": "chat" if vocab_size is None else "random"})


def _check_count(count: int, output_len: int) -> None:
    if count < 1:
        raise ValueError(f"the number of requests must be >= 1, got {count}")
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
