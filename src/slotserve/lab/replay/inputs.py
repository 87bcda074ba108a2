"""What a replay replays: a real run's trace, or a `slotserve bench` workload.

- A trace (`TraceRecorder.export`, `slotserve bench --trace`, `slotserve serve --trace`):
  each request's arrival (s), prompt length and recorded output length, and its tenant,
  priority and SLOs where the trace has them. Prompt token ids are not in a trace, but each
  request's prefix-cache hit (`cached_tokens`) is: when some request hit, the replayed
  prompts are rebuilt so that the same prefixes are shared (`shared_prefix_prompts`), else
  they share nothing (filler, see `ReplayRequest`). Requests with no output recorded (still
  running when the trace was taken) are skipped. A trace recorded with speculative decoding
  gives each request that verified drafts its acceptance rate, and the replay speculates
  (see `speculation`).
- A workload (JSONL, `slotserve.lab.workload`): token-id prompts are used as they are; text
  and chat prompts are tokenized (with the chat template for messages), which needs the
  model's tokenizer; the output length is `max_tokens` (bench ignores EOS by default); each
  request's tenant, priority and SLOs as the workload gives them.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from slotserve.engine.trace import POLICY_FIELDS
from slotserve.lab.replay.runner import FILLER_TOKEN
from slotserve.lab.replay.simulator import ReplayRequest
from slotserve.lab.replay.speculation import TRACE_DEFAULT_CONFIG, recorded_verifications
from slotserve.lab.workload import Workload, load_workload, poisson_arrivals
from slotserve.value_checks import is_int


def requests_from_trace(trace: dict) -> tuple[list[ReplayRequest], dict]:
    """(requests, a description) from an engine trace dict; ValueError if it is not one."""
    if not isinstance(trace, dict) or not isinstance(trace.get("requests"), list):
        raise ValueError("trace: expected a JSON object with a \"requests\" list")
    verifications = recorded_verifications(trace.get("iterations") or [])
    requests, cached, admitted, skipped = [], [], [], 0
    for i, record in enumerate(trace["requests"]):
        try:
            output = record["output_tokens"]
            if not output:
                skipped += 1
                continue
            fields = {k: record[k] for k in POLICY_FIELDS if record.get(k) is not None}
            fields["verifications"] = tuple(verifications.get(str(record["id"]), ()))
            requests.append(ReplayRequest(str(record["id"]), int(record["prompt_tokens"]),
                                          int(output), float(record["arrival"]), **fields))
            cached.append(_cached_tokens(record))
            admitted.append(_first_iteration(record))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"trace: request {i}: {exc}") from None
    if not requests:
        raise ValueError("trace: no finished request to replay")
    start = min(r.arrival for r in requests)
    requests = [replace(r, arrival=round(r.arrival - start, 6)) for r in requests]
    warm: list[tuple[str, tuple[int, ...]]] = []
    if any(cached):
        # NOTE: the order of service only where every request has it (an older trace, or
        # a record without the field: arrival order for all, not a mix of the two)
        order = None if None in admitted else admitted
        requests, warm = shared_prefix_prompts(requests, cached, order)
    info = {"source": "trace", "num_requests": len(requests), "skipped_unfinished": skipped,
            "cached_prompt_tokens": sum(cached),
            # NOTE: token ids (thousands): the commands take them out of the info they report
            "trace_cached_prefixes": warm,
            "trace_policy": trace.get("policy"), "trace_num_slots": trace.get("num_slots"),
            "trace_kv_blocks": trace.get("kv_blocks_total")}
    # NOTE: a replay's own trace also records every setting it ran with.
    if isinstance(trace.get("settings"), dict):
        info["trace_settings"] = dict(trace["settings"])
    if "planner_state" in trace:
        if not isinstance(trace["planner_state"], dict):
            raise ValueError("trace: planner_state must be an object")
        info["trace_planner_state"] = trace["planner_state"]
    if verifications:
        info["trace_speculation"] = speculation_totals(trace["iterations"])
        settings = info.setdefault("trace_settings", {})
        # NOTE: an engine trace does not say how it speculated: "auto", the default.
        if not settings.get("speculative_config"):
            settings["speculative_config"] = TRACE_DEFAULT_CONFIG
    return requests, info


def speculation_totals(iterations: list[dict]) -> dict:
    """Verifications, draft tokens proposed and accepted in a trace's iterations."""
    slots = [s for it in iterations for s in it.get("slots") or () if s and s.get("proposed")]
    return {"verifications": len(slots), "proposed": sum(s["proposed"] for s in slots),
            "accepted": sum(s.get("accepted", 0) for s in slots)}


def _cached_tokens(record: dict) -> int:
    value = record.get("cached_tokens") or 0
    if not is_int(value) or not 0 <= value < record["prompt_tokens"]:
        raise ValueError(f"cached_tokens must be an integer in [0, prompt_tokens), "
                         f"got {value!r}")
    return value


def _first_iteration(record: dict) -> int | None:
    value = record.get("first_iteration")
    if value is not None and (not is_int(value) or value < 0):
        raise ValueError(f"first_iteration must be a non-negative integer or null, "
                         f"got {value!r}")
    return value


# Token ids of rebuilt prompts (the fake runner never reads them; only block hashes do).
PREFIX_TOKEN_BASE = 1_000  # + the tenant's index: its shared prefix's tokens
UNIQUE_TOKEN_BASE = 1_000_000  # + the request's index: ends every shared prefix


def shared_prefix_prompts(requests: list[ReplayRequest], cached: list[int],
                          admitted: list[int | None] | None = None
                          ) -> tuple[list[ReplayRequest], list[tuple[str, tuple[int, ...]]]]:
    """Prompts whose prefix-cache hits reproduce the trace's: what the run computed; and
    the prefixes that were cached before the trace began (tenant, token ids), for the
    replay's prefix cache to start with (`replay`'s cached_prefixes).

    A trace records how many prompt tokens each request found cached (`cached[i]`), not
    what they were. The rebuilt prompt of a request that hit c tokens starts with the first
    c tokens of its tenant's shared prefix (one constant token per tenant), then a token of
    its own (so nothing after c is shared), then filler. The earliest-admitted request of a
    tenant with hits that found nothing cached itself computed the prefix the others hit:
    it gets the tenant's longest hit (at most its prompt less one token). Admitted means
    first scheduled (`admitted[i]`, the trace's `first_iteration`), then arrival: under
    the priority, deadline and fair policies a later arrival can be served first. Within
    one iteration a request that hit goes first: blocks are cached only after the forward
    that computed them, so nothing hits what its own iteration computes. Where a
    tenant's earliest-admitted request hit, the prefix was cached before the trace (an
    engine that served these prompts before, a server's trace ring): the tenant's longest
    hit is cached when the replay starts. The replay's own prefix cache then decides the
    hits, so they follow the replayed schedule: at more slots more requests share one
    iteration, as in a real run.
    NOTE: prefixes shared across tenants (global scope) are modelled per tenant.
    """
    tenants = list(dict.fromkeys(r.tenant for r in requests))
    longest = {t: max((c for r, c in zip(requests, cached) if r.tenant == t), default=0)
               for t in tenants}
    order = sorted(range(len(requests)),
                   key=lambda i: _admission_key(requests, cached, admitted, i))
    first = {}
    for i in order:
        first.setdefault(requests[i].tenant, i)
    warm = [t for t in tenants if cached[first[t]] > 0]
    sources = {}
    for i in order:
        tenant = requests[i].tenant
        if longest[tenant] and cached[i] == 0 and tenant not in sources and tenant not in warm:
            sources[tenant] = i
    rebuilt = []
    for i, request in enumerate(requests):
        shared = cached[i] or (longest[request.tenant] if sources.get(request.tenant) == i
                               else 0)
        shared = min(shared, request.prompt_tokens - 1)
        prefix = [PREFIX_TOKEN_BASE + tenants.index(request.tenant)] * shared
        tail = [FILLER_TOKEN] * (request.prompt_tokens - shared - 1)
        ids = (*prefix, UNIQUE_TOKEN_BASE + i, *tail)
        rebuilt.append(replace(request, prompt_token_ids=ids))
    prefixes = [(t, (PREFIX_TOKEN_BASE + tenants.index(t),) * longest[t]) for t in warm]
    return rebuilt, prefixes


def _admission_key(requests: list[ReplayRequest], cached: list[int],
                   admitted: list[int | None] | None, i: int) -> tuple[float, bool, float]:
    """Where request i stands in the order the run served the requests: its first scheduled
    iteration (None: last), a hit before a miss within it, then its arrival; arrival alone
    without `admitted`. NOTE: among equals a stable sort keeps the trace's order (arrival)."""
    if admitted is None:
        return (requests[i].arrival, False, 0.0)
    first = math.inf if admitted[i] is None else float(admitted[i])
    return (first, cached[i] == 0, requests[i].arrival)


def requests_from_workload(workload: Workload, tokenizer=None) -> list[ReplayRequest]:
    """One ReplayRequest per workload request (ids as the workload's)."""
    requests = []
    for r in workload.requests:
        ids = _prompt_ids(r, tokenizer)
        requests.append(ReplayRequest(r.id, len(ids), r.max_tokens, float(r.arrival),
                                      tuple(ids), **r.policy_fields()))
    return requests


def _prompt_ids(request, tokenizer) -> list[int]:
    if isinstance(request.prompt, list):
        return list(request.prompt)
    if tokenizer is None:
        raise ValueError(f"request {request.id!r}: text and chat prompts need the model's "
                         "tokenizer (load it with --model, or use token-id prompts)")
    if request.messages is not None:
        text = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(request.prompt)


def workload_needs_tokenizer(workload: Workload) -> bool:
    return any(not isinstance(r.prompt, list) for r in workload.requests)


def load_input(path: str | Path, tokenizer_loader=None) -> tuple[list[ReplayRequest], dict]:
    """A trace (.json object) or a workload (JSONL) from a file.

    tokenizer_loader: called (no arguments) only when a workload has text prompts.
    """
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None  # JSONL: a workload
    if isinstance(data, dict) and "requests" in data:
        return requests_from_trace(data)
    workload = load_workload(path)
    tokenizer = tokenizer_loader() if workload_needs_tokenizer(workload) and tokenizer_loader \
        else None
    return requests_from_workload(workload, tokenizer), dict(workload.params)


def scale_rate(requests: list[ReplayRequest], factor: float) -> list[ReplayRequest]:
    """The same requests arriving `factor` times as fast (arrival / factor)."""
    if not factor > 0 or math.isinf(factor):
        raise ValueError(f"rate scale must be a finite number > 0, got {factor!r}")
    return [replace(r, arrival=round(r.arrival / factor, 6)) for r in requests]


def with_poisson(requests: list[ReplayRequest], rate: float, seed: int = 0
                 ) -> list[ReplayRequest]:
    """Re-timed as `slotserve bench --request-rate` re-times a workload (same arrivals for
    the same seed): Poisson at `rate` req/s, in the requests' order; inf: all at t=0."""
    # NOTE: the same stream as workload.with_poisson_arrivals, so a plan's rate R is the
    # schedule `slotserve bench --request-rate R --seed S` sends.
    rng = np.random.default_rng([seed, 1])
    ordered = sorted(requests, key=lambda r: r.arrival)
    times = poisson_arrivals(len(ordered), rate, rng)
    return [replace(r, arrival=t) for r, t in zip(ordered, times)]
