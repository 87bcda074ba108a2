"""Benchmark workloads: which requests to send, how long each answer is, and when each arrives.

A workload is a list of `BenchRequest`s plus the parameters that made it (recorded in
reports). It is generated (`generate_workload`) or read from JSONL (`load_workload`), one
request a line::

    {"prompt": "text" | [token ids], "max_tokens": 64, "arrival": 0.25}
    {"messages": [{"role": "user", "content": "..."}], "max_tokens": 128}

`arrival` is seconds after the start of the run (0 or absent: at once). Output lengths are
exact when the benchmark sets `ignore_eos` (it does by default). Optional fields: `"n": 4`
(n completions of the prompt) and `"turns": [...]` (a multi-turn conversation: the follow-up
user messages, or token-id lists for token-id prompts, each sent when the previous answer
arrives; see `BenchRequest.next_turn`), and the scheduling-policy fields of a request
(`"tenant"`, `"priority"`, `"slo_ttft_ms"`, `"slo_tpot_ms"`: as the server's API takes them,
the tenant as OpenAI's `user`).

Workloads with shared prefixes (what prefix caching is for): `shared_prefix_workload` (many
requests behind one long system prompt), `multi_turn_workload` (closed-loop conversations)
and `parallel_sampling_workload` (n completions of each prompt).

Arrivals are offline (every request at t=0) or online: a Poisson process at `rate` requests/s,
i.e. exponential gaps of mean 1/rate (`with_poisson_arrivals`), re-timing the same requests so
that a sweep over rates sends identical prompts and lengths.

The package's parts: `requests` (the types), `prompts` (the built-in prompt sets),
`generate` (lengths, arrivals, `generate_workload`), `scenarios` (the shared-prefix
workloads), `jsonl` (files); every public name is re-exported here.
"""

from __future__ import annotations

from slotserve.lab.workload.generate import (
    generate_workload,
    lognormal_lengths,
    poisson_arrivals,
    random_token_prompts,
    rate_label,
    with_poisson_arrivals,
)
from slotserve.lab.workload.jsonl import load_workload, save_workload
from slotserve.lab.workload.prompts import CHAT_PROMPTS, FOLLOW_UPS, SYSTEM_PROMPT
from slotserve.lab.workload.requests import POLICY_DEFAULTS, BenchRequest, Workload
from slotserve.lab.workload.scenarios import (
    multi_turn_workload,
    parallel_sampling_workload,
    shared_prefix_workload,
)

__all__ = [
    "CHAT_PROMPTS", "FOLLOW_UPS", "POLICY_DEFAULTS", "SYSTEM_PROMPT", "BenchRequest",
    "Workload", "generate_workload", "load_workload", "lognormal_lengths",
    "multi_turn_workload", "parallel_sampling_workload", "poisson_arrivals",
    "random_token_prompts", "rate_label", "save_workload", "shared_prefix_workload",
    "with_poisson_arrivals",
]
