"""Synthetic workloads: output lengths, Poisson arrivals, random token prompts, and
`generate_workload`, which combines them."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from slotserve.lab.workload.prompts import CHAT_PROMPTS
from slotserve.lab.workload.requests import BenchRequest, Workload


def lognormal_lengths(count: int, median: float, sigma: float, low: int, high: int,
                      rng: np.random.Generator) -> list[int]:
    """`count` integer lengths, lognormal around `median` (sigma in log space), clipped."""
    if not 1 <= low <= high:
        raise ValueError(f"output length bounds must satisfy 1 <= min <= max, got {low}, {high}")
    if median <= 0 or sigma < 0:
        raise ValueError(f"lognormal needs median > 0 and sigma >= 0, got {median}, {sigma}")
    draws = rng.lognormal(mean=math.log(median), sigma=sigma, size=count)
    return np.clip(np.rint(draws), low, high).astype(int).tolist()


def poisson_arrivals(count: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Arrival times (s) of a Poisson process at `rate` req/s; the first request at t=0.

    rate=inf means offline: every request at t=0.
    """
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * count
    gaps = rng.exponential(1.0 / rate, size=count)
    gaps[0] = 0.0
    return np.round(np.cumsum(gaps), 6).tolist()


def random_token_prompts(count: int, low: int, high: int, vocab_size: int,
                         rng: np.random.Generator) -> list[list[int]]:
    """Prompts of random token ids (lengths uniform in [low, high]), avoiding ids 0-2."""
    if not 1 <= low <= high:
        raise ValueError(f"prompt length bounds must satisfy 1 <= min <= max, got {low}, {high}")
    if vocab_size <= 3:
        raise ValueError(f"vocab_size must be > 3, got {vocab_size}")
    lengths = rng.integers(low, high + 1, size=count)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in lengths]


def generate_workload(num_requests: int, *, prompts: str = "chat", output_len: int | None = None,
                      output_len_median: float = 64, output_len_sigma: float = 0.8,
                      output_len_min: int = 8, output_len_max: int = 384,
                      prompt_len_min: int = 16, prompt_len_max: int = 128,
                      vocab_size: int | None = None, request_rate: float = math.inf,
                      seed: int = 0) -> Workload:
    """A reproducible synthetic workload.

    prompts: "chat" (the built-in CHAT_PROMPTS as user messages, cycled in a shuffled order)
        or "random" (token ids of length in [prompt_len_min, prompt_len_max]; needs vocab_size).
    output_len: every answer this long; None draws lognormal lengths (median, sigma, clipped
        to [output_len_min, output_len_max]).
    request_rate: Poisson arrivals at this many req/s; inf: all at t=0 (offline).
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    bodies = _prompt_bodies(num_requests, prompts, prompt_len_min, prompt_len_max, vocab_size, rng)
    if output_len is not None:
        if output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {output_len}")
        lengths = [output_len] * num_requests
    else:
        lengths = lognormal_lengths(num_requests, output_len_median, output_len_sigma,
                                    output_len_min, output_len_max, rng)
    requests = tuple(BenchRequest(id=str(i), max_tokens=n, **body)
                     for i, (body, n) in enumerate(zip(bodies, lengths)))
    params = {"source": "generated", "num_requests": num_requests, "prompts": prompts,
              "seed": seed}
    params |= ({"output_len": output_len} if output_len is not None else {
        "output_len_median": output_len_median, "output_len_sigma": output_len_sigma,
        "output_len_min": output_len_min, "output_len_max": output_len_max})
    if prompts == "random":
        params |= {"prompt_len_min": prompt_len_min, "prompt_len_max": prompt_len_max}
    return with_poisson_arrivals(Workload(requests, params), request_rate, seed)


def _prompt_bodies(count: int, kind: str, low: int, high: int, vocab_size: int | None,
                   rng: np.random.Generator) -> list[dict]:
    if kind == "chat":
        order = rng.permutation(len(CHAT_PROMPTS))
        texts = [CHAT_PROMPTS[order[i % len(order)]] for i in range(count)]
        return [{"messages": [{"role": "user", "content": t}]} for t in texts]
    if kind == "random":
        if vocab_size is None:
            raise ValueError("random token prompts need the model's vocab_size")
        return [{"prompt": ids} for ids in random_token_prompts(count, low, high, vocab_size, rng)]
    raise ValueError(f"prompts must be 'chat' or 'random', got {kind!r}")


def with_poisson_arrivals(workload: Workload, rate: float, seed: int = 0) -> Workload:
    """The same requests, re-timed: Poisson arrivals at `rate` req/s (inf: all at t=0)."""
    # NOTE: a separate stream from the seed, so arrivals do not shift the prompts or lengths.
    rng = np.random.default_rng([seed, 1])
    times = poisson_arrivals(len(workload), rate, rng)
    requests = tuple(replace(r, arrival=t) for r, t in zip(workload.requests, times))
    return Workload(requests, {**workload.params, "request_rate": rate_label(rate)})


def rate_label(rate: float) -> float | str:
    """A rate as JSON can hold it: a number, or "inf" for offline."""
    return "inf" if math.isinf(rate) else rate
