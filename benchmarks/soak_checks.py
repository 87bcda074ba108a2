"""benchmarks.soak's checks: each completed request's answer, repeats of one case, greedy
outputs against the offline API's, the server's log (nothing lost), and the server's state
and memory (RSS) at the end."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter, defaultdict

from benchmarks.soak_clients import Result
from slotserve.lab.bench.server import scrape_metrics


# --------------------------------------------------------------------------- checks
def check_completed(r: Result) -> list[str]:
    """What is wrong with a completed request (empty: nothing)."""
    spec, body, problems = r.spec, r.spec.body, []
    if r.error:
        return [f"error: {r.error}"]
    if spec.stream and not r.done_marker:
        problems.append("stream ended without data: [DONE]")
    prefix = "cmpl" if spec.endpoint == "completions" else "chatcmpl"
    if not (r.response_id or "").startswith(f"{prefix}-"):
        problems.append(f"id {r.response_id!r}, expected {prefix}-...")
    if r.echoed_id != spec.request_id:
        problems.append(f"X-Request-Id header {r.echoed_id!r}, expected {spec.request_id}")
    if sorted(r.finish) != list(range(spec.n)):
        problems.append(f"choices {sorted(r.finish)}, expected {spec.n}")
    for index, reasons in r.finish.items():
        if reasons not in (["stop"], ["length"]):
            problems.append(f"choice {index}: finish reasons {reasons}")
        if any(s in r.texts[index] for s in body.get("stop") or []):
            problems.append(f"choice {index}: a stop string is in the text")
        if body.get("ignore_eos") and not body.get("stop") and reasons != ["length"]:
            problems.append(f"choice {index}: ignore_eos without stop, but {reasons}")
    return problems + check_usage(r)


def check_usage(r: Result) -> list[str]:
    if r.usage is None:
        expected = not r.spec.stream or r.spec.body.get("stream_options")
        return ["usage missing"] if expected else []
    u, n, max_tokens = r.usage, r.spec.n, r.spec.body["max_tokens"]
    problems = []
    if u["total_tokens"] != u["prompt_tokens"] + u["completion_tokens"] or u["prompt_tokens"] < 1:
        problems.append(f"usage inconsistent: {u}")
    if not n <= u["completion_tokens"] <= n * max_tokens:
        problems.append(f"completion_tokens {u['completion_tokens']} outside [{n}, "
                        f"{n * max_tokens}]")
    all_length = all(reasons == ["length"] for reasons in r.finish.values())
    if all_length and u["completion_tokens"] != n * max_tokens:
        problems.append(f"every choice hit the length but completion_tokens is "
                        f"{u['completion_tokens']}, not {n * max_tokens}")
    return problems


def check_repeats(results: list[Result], kind: str) -> tuple[int, list[str]]:
    """Completed requests of one pooled case must give the same text per choice index
    (greedy: every index the same). Returns (cases seen repeated, problems)."""
    by_case: dict[int, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for r in results:
        if r.spec.kind == kind and r.outcome == "completed" and not r.error:
            for index, text in r.texts.items():
                by_case[r.spec.case][0 if kind == "greedy" else index].add(text)
    problems = [f"{kind} case {case}, choice {index}: {len(texts)} different outputs: "
                f"{sorted(texts)[:3]}"
                for case, choices in by_case.items() for index, texts in choices.items()
                if len(texts) > 1]
    return len(by_case), problems


# --------------------------------------------------------------------------- reference
def greedy_reference(llm, cases: list[tuple[str, dict]]) -> list[dict]:
    """The offline API's greedy output of each case: text, tokens' text ends, top-5s."""
    from slotserve import SamplingParams

    tok = llm.tokenizer
    prompts = [body["prompt"] if endpoint == "completions" else
               tok.apply_chat_template(body["messages"], add_generation_prompt=True)
               for endpoint, body in cases]
    params = [SamplingParams(temperature=0.0, max_tokens=body["max_tokens"],
                             stop=body.get("stop"), ignore_eos=body.get("ignore_eos", False),
                             logprobs=5) for _, body in cases]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [reference_entry(tok, out.outputs[0]) for out in outs]


def reference_entry(tok, completion) -> dict:
    ids = completion.token_ids
    prefixes = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    alternatives = [[tok.decode(ids[:i] + [alt]) for alt in (completion.logprobs[i] or {})]
                    for i in range(len(ids))]
    return {"text": completion.text, "prefixes": prefixes, "alternatives": alternatives}


def near_tie(ref: dict, text: str) -> bool:
    """The near-tie rule (docs/ARCHITECTURE.md), on text: where `text` first leaves the
    reference's tokens, it continues with one of the reference's top-5 tokens there."""
    for i, alternatives in enumerate(ref["alternatives"]):
        if not text.startswith(ref["prefixes"][i + 1]):
            return any(text.startswith(alt) or alt.startswith(text) for alt in alternatives)
    return True  # text extends the reference: the stop / length cut differs, not a token


def check_greedy_reference(results: list[Result], references: list[dict]) -> tuple[int, list]:
    """(greedy outputs that differ from the reference but within the top-5 rule, problems)."""
    near, problems = 0, []
    for r in results:
        if r.spec.kind != "greedy" or r.outcome != "completed" or r.error:
            continue
        ref = references[r.spec.case]
        for index, text in r.texts.items():
            if text == ref["text"]:
                continue
            if near_tie(ref, text):
                near += 1
            else:
                problems.append(f"{r.spec.request_id} choice {index}: {text!r} != offline "
                                f"{ref['text']!r}")
    return near, problems


# --------------------------------------------------------------------------- server side
# `finished cmpl-<hex>[#i] [tenant T, X-Request-Id C]: ..., <reason>` (server/generation.py) and
# `aborted cmpl-<hex> [tenant T, X-Request-Id C]: ...`; groups: what, i, C, reason.
LOG_LINE = re.compile(r"(finished|aborted) (?:chat)?cmpl-\S+?(?:#(\d+))? "
                      r"\[tenant [^,\]]+(?:, X-Request-Id (\S+?))?\]: .*?(\w+)?$")


def server_outcomes(log_text: str) -> dict[str, dict]:
    """client request id (X-Request-Id) -> {"finished": set of choice indices, "aborted":
    bool, "reasons": list}; lines without a client id are skipped."""
    seen: dict[str, dict] = defaultdict(lambda: {"finished": set(), "aborted": False,
                                                 "reasons": []})
    for line in log_text.splitlines():
        match = LOG_LINE.search(line)
        if not match:
            continue
        what, index, request_id, reason = match.groups()
        if request_id is None:
            continue
        if what == "aborted":
            seen[request_id]["aborted"] = True
        else:
            seen[request_id]["finished"].add(int(index or 0))
            seen[request_id]["reasons"].append(reason)
    return seen


def check_server_side(results: list[Result], log_text: str) -> tuple[Counter, list[str]]:
    """Each request's end as the server logged it; lost or contradictory ones are problems."""
    seen, counts, problems = server_outcomes(log_text), Counter(), []
    for r in results:
        entry = seen.get(r.spec.request_id)
        done = entry is not None and len(entry["finished"]) == r.spec.n
        aborted = entry is not None and entry["aborted"]
        if r.outcome == "completed" and not r.error:
            counts["completed: finished"] += 1
            if not done or aborted:
                problems.append(f"{r.spec.request_id}: completed, but the server logged {entry}")
        elif r.outcome == "cancelled":
            label = "aborted" if aborted else "finished before the disconnect" if done else None
            if label is None:
                problems.append(f"{r.spec.request_id}: cancelled, and the server logged "
                                f"neither its end nor an abort: lost")
            counts[f"cancelled: {label}"] += 1
    return counts, problems


def wait_idle(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Metrics once nothing runs or waits and every block is free (aborts land at the next
    iteration boundary), or the last ones read at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape_metrics(url, timeout=30)
        idle = (m["slotserve:num_requests_running"] == 0 == m["slotserve:num_requests_waiting"]
                and m["slotserve:kv_blocks_free"] == m["slotserve:kv_blocks_total"])
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class RssSampler:
    """The largest RSS of a process, sampled every `interval_s` in a thread."""

    def __init__(self, pid: int | None, interval_s: float = 1.0) -> None:
        self.pid, self.interval_s, self.peak = pid, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        if self.pid:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            self._stop.wait(self.interval_s)


def success_counts(m: dict[str, float]) -> dict[str, float]:
    prefix = 'slotserve:request_success_total{finished_reason="'
    return {k[len(prefix):-2]: v for k, v in m.items() if k.startswith(prefix)}
