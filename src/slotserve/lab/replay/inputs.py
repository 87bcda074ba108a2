"""What a replay replays: a real run's trace, or a `slotserve bench` workload.

- A trace (`TraceRecorder.export`, `slotserve bench --trace`, `slotserve serve --trace`):
  each request's arrival (s), prompt length and recorded output length, and its tenant,
  priority and SLOs where the trace has them. Prompt token ids are
  not in a trace, so replayed prompts share no prefix (see `ReplayRequest`). Requests with
  no output recorded (still running when the trace was taken) are skipped.
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
from slotserve.lab.replay.simulator import ReplayRequest
from slotserve.lab.workload import Workload, load_workload, poisson_arrivals


def requests_from_trace(trace: dict) -> tuple[list[ReplayRequest], dict]:
    """(requests, a description) from an engine trace dict; ValueError if it is not one."""
    if not isinstance(trace, dict) or not isinstance(trace.get("requests"), list):
        raise ValueError("trace: expected a JSON object with a \"requests\" list")
    requests, skipped = [], 0
    for i, record in enumerate(trace["requests"]):
        try:
            output = record["output_tokens"]
            if not output:
                skipped += 1
                continue
            fields = {k: record[k] for k in POLICY_FIELDS if record.get(k) is not None}
            requests.append(ReplayRequest(str(record["id"]), int(record["prompt_tokens"]),
                                          int(output), float(record["arrival"]), **fields))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"trace: request {i}: {exc}") from None
    if not requests:
        raise ValueError("trace: no finished request to replay")
    start = min(r.arrival for r in requests)
    requests = [replace(r, arrival=round(r.arrival - start, 6)) for r in requests]
    info = {"source": "trace", "num_requests": len(requests), "skipped_unfinished": skipped,
            "trace_policy": trace.get("policy"), "trace_num_slots": trace.get("num_slots"),
            "trace_kv_blocks": trace.get("kv_blocks_total")}
    # NOTE: a replay's own trace also records every setting it ran with.
    if isinstance(trace.get("settings"), dict):
        info["trace_settings"] = dict(trace["settings"])
    return requests, info


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
