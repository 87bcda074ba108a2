"""Soak: many requests of a mixed workload against a real `slotserve serve`; nothing is lost.

    .venv/bin/python -m benchmarks.soak --requests 1000 --concurrency 16 --json soak.json

Starts `slotserve serve` on loopback (the embedded SmolLM2-135M; or --url for a running
server, without the log and RSS checks) and warms it up: a burst of long prompts (so the
allocator reaches its high-water mark), then `--warmup` requests of the mix. Then
`--concurrency` clients send `--requests` requests: completions and chat, short to
~250-token prompts, greedy / seeded / free sampling (temperature, top_p), streaming or not,
n of 1-3, stop strings, 1 to `--max-tokens` (24) output tokens. A tenth of the clients
(`--disconnect`) leave at a random moment after sending: after a random delay, or
(streams) after a random number of events.

Checked (each failure is listed; the exit status is 1 if any):
- every request that was not cancelled completed: HTTP 200, n choices, finish_reason stop
  or length, no stop string in the text, usage consistent (total = prompt + completion,
  n <= completion <= n x max_tokens, = n x max_tokens when every choice hit the length);
- greedy outputs equal across repeats and equal to the offline API's (unless
  `--no-reference`), or differ first at a token the reference ranks in its top 5
  (the near-tie rule of docs/ARCHITECTURE.md); seeded outputs equal across repeats;
- every response echoes the client's X-Request-Id (header) and has the server's own id
  (`cmpl-...` / `chatcmpl-...`);
- server side (its log, by the client's X-Request-Id, which the server logs next to its own
  id): each completed request logged n "finished" lines and no "aborted"; each cancelled one
  was aborted, or had finished before the disconnect reached it; none has neither (lost);
- at the end: no request running or waiting, every KV block free, and the server's RSS
  within `--rss-tolerance` of its RSS after the warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from slotserve.lab.bench.server import ServerProcess, ServerStartError, cli_flags, scrape_metrics

REPO = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
# The server's engine settings (and the offline reference's: the same ones).
ENGINE_FLAGS = dict(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=512,
                    num_blocks=512, block_size=16, seed=0)
REQUEST_TIMEOUT_S = 300.0

WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars shine above "
         "quiet rivers and old mountains where people tell stories about time memory music "
         "science light water cities gardens machines oceans bread coffee trains letters "
         "café naïve über 東京 数据 😀 ✨ señor").split()
TOPICS = ("the sea", "a robot", "bread", "trains", "the moon", "a garden", "music", "rain",
          "a city at night", "coffee", "mathematics", "a library")
STOPS = ([".", "\n"], ["the"], [","], ["\n\n"], ["!", "?"])


# --------------------------------------------------------------------------- workload
@dataclass
class Spec:
    """One request of the workload."""

    index: int
    request_id: str  # sent as X-Request-Id (the server echoes and logs it, keeps its own id)
    endpoint: str  # "completions" | "chat"
    body: dict
    kind: str  # "greedy" | "seeded" | "free"
    case: int | None = None  # greedy / seeded: which pooled case (repeats share it)
    disconnect_after_s: float | None = None  # after the body is sent
    disconnect_after_events: int | None = None  # streams: after this many events

    @property
    def n(self) -> int:
        return self.body.get("n", 1)

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def cancels(self) -> bool:
        return self.disconnect_after_s is not None or self.disconnect_after_events is not None


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def prompt_text(rng: random.Random) -> str:
    """Short (3-10 words), medium (20-60) or long (100-180: up to ~250 tokens)."""
    size = rng.choices(((3, 10), (20, 60), (100, 180)), weights=(5, 3, 2))[0]
    return words(rng, rng.randint(*size))


def base_body(rng: random.Random, endpoint: str, max_tokens: int = 24) -> dict:
    """Prompt or messages, 1 to max_tokens tokens, sometimes ignore_eos and stop strings."""
    body: dict = {"model": MODEL, "max_tokens": rng.randint(1, max_tokens)}
    if endpoint == "completions":
        body["prompt"] = prompt_text(rng)
    else:
        body["messages"] = [{"role": "user",
                             "content": f"Write about {rng.choice(TOPICS)}. {prompt_text(rng)}"}]
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if rng.random() < 0.3:
        body["stop"] = rng.choice(STOPS)
    return body


def sampling(rng: random.Random, kind: str, case: int) -> dict:
    if kind == "greedy":
        return {"temperature": 0.0}
    params = {"temperature": round(rng.uniform(0.3, 1.2), 2),
              "top_p": rng.choice([1.0, 0.95, 0.8, 0.5])}
    if kind == "seeded":
        params["seed"] = 1000 + case
    return params


def pooled_cases(rng: random.Random, kind: str, count: int,
                 max_tokens: int) -> list[tuple[str, dict]]:
    """Greedy and seeded requests draw from a few cases, so each case repeats (in
    different batches): its outputs must agree."""
    cases = []
    for case in range(count):
        endpoint = rng.choice(["completions", "chat"])
        cases.append((endpoint, {**base_body(rng, endpoint, max_tokens),
                                 **sampling(rng, kind, case)}))
    return cases


def case_pools(rng: random.Random, max_tokens: int = 24) -> dict[str, list[tuple[str, dict]]]:
    """The greedy and seeded cases (12 and 8), the first thing drawn from the workload's rng."""
    return {"greedy": pooled_cases(rng, "greedy", 12, max_tokens),
            "seeded": pooled_cases(rng, "seeded", 8, max_tokens)}


def make_workload(count: int, seed: int = 0, disconnect: float = 0.1, run: str = "run",
                  max_tokens: int = 24) -> list[Spec]:
    """`count` request specs, the same for the same arguments."""
    rng = random.Random(seed)
    pools = case_pools(rng, max_tokens)
    specs = []
    for i in range(count):
        kind = rng.choices(["greedy", "seeded", "free"], weights=(35, 20, 45))[0]
        if kind == "free":
            case, endpoint = None, rng.choice(["completions", "chat"])
            body = {**base_body(rng, endpoint, max_tokens), **sampling(rng, kind, 0)}
        else:
            case = rng.randrange(len(pools[kind]))
            endpoint, body = pools[kind][case]
            body = dict(body)
        body["n"] = rng.choices([1, 2, 3], weights=(75, 18, 7))[0]
        if rng.random() < 0.5:
            body["stream"] = True
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        spec = Spec(i, f"soak-{run}-{i}", endpoint, body, kind, case)
        if rng.random() < disconnect:
            plan_disconnect(rng, spec)
        specs.append(spec)
    return specs


def peak_workload(num_blocks: int, slots: int = ENGINE_FLAGS["max_num_seqs"]) -> list[Spec]:
    """Long prompts (~250 tokens: 14+ blocks of 16), two tokens each, at least one per slot and
    enough to write every KV block: full prefill batches, a full batch of long contexts.

    NOTE: RSS after the warm-up is the soak's baseline, so the warm-up must reach what is
    bounded but grows on first use: the KV pool is zeroed lazily (calloc: a block's pages
    count once first written; the free queue hands blocks out in FIFO order), and the
    allocator's high-water mark. Measured: RSS then stays within ~4% over 1000 requests.
    """
    rng = random.Random(-1)
    count = max(slots, -(-num_blocks // 14))
    return [Spec(i, f"soak-peak-{i}", "completions",
                 {"model": MODEL, "prompt": words(rng, 200), "max_tokens": 2,
                  "ignore_eos": True}, "free") for i in range(count)]


def plan_disconnect(rng: random.Random, spec: Spec) -> None:
    """A random moment: a delay after sending (0-1.5 s), or for half the streams a number
    of events (0 to all of them, in which case the client may well stay to the end)."""
    if spec.stream and rng.random() < 0.5:
        spec.disconnect_after_events = rng.randint(0, spec.body["max_tokens"] * spec.n)
    else:
        spec.disconnect_after_s = round(rng.uniform(0.0, 1.5), 3)


# --------------------------------------------------------------------------- clients
@dataclass
class Result:
    """What one client saw."""

    spec: Spec
    outcome: str = "pending"  # completed | cancelled | error
    status: int | None = None
    response_id: str | None = None  # the server's id (`cmpl-...`)
    echoed_id: str | None = None  # the response's X-Request-Id header
    texts: dict[int, str] = field(default_factory=lambda: defaultdict(str))
    finish: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    usage: dict | None = None
    error: str | None = None
    events: int = 0
    done_marker: bool = False  # streams: `data: [DONE]` came
    seconds: float = 0.0


async def run_workload(url: str, specs: list[Spec], concurrency: int,
                       progress: bool = False) -> list[Result]:
    """Send every spec from `concurrency` clients (each sends its next when one ends)."""
    queue: asyncio.Queue = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S,
                                 limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                results.append(await run_one(client, queue.get_nowait()))
                if progress and len(results) % 50 == 0:
                    print(f"  {len(results)}/{len(specs)} requests", flush=True)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(results, key=lambda r: r.spec.index)


async def run_one(client: httpx.AsyncClient, spec: Spec) -> Result:
    """One request; the client leaves as its spec says."""
    result = Result(spec)
    sent = asyncio.Event()

    async def trace(event: str, info: dict) -> None:
        if event == "http11.send_request_body.complete":
            sent.set()

    start = time.monotonic()
    task = asyncio.ensure_future(exchange(client, spec, result, trace))
    leave = asyncio.ensure_future(leave_later(task, sent, spec.disconnect_after_s))
    try:
        await task
    except asyncio.CancelledError:
        result.outcome = "cancelled"
    except Exception as exc:  # every failure is a finding: reported, not raised
        result.outcome, result.error = "error", f"{type(exc).__name__}: {exc}"
    finally:
        leave.cancel()
    result.seconds = time.monotonic() - start
    return result


async def leave_later(task: asyncio.Task, sent: asyncio.Event, delay_s: float | None) -> None:
    """Cancel `task` (closing its connection) `delay_s` after the request went out.

    NOTE: counted from the sent body, so a cancelled request always reached the server:
    the server side must account for every one of them.
    """
    if delay_s is None:
        return
    await sent.wait()
    await asyncio.sleep(delay_s)
    task.cancel()


async def exchange(client: httpx.AsyncClient, spec: Spec, result: Result, trace) -> None:
    path = "/v1/completions" if spec.endpoint == "completions" else "/v1/chat/completions"
    headers = {"X-Request-Id": spec.request_id}
    extensions = {"trace": trace}
    if not spec.stream:
        response = await client.post(path, json=spec.body, headers=headers,
                                     extensions=extensions)
        result.echoed_id = response.headers.get("x-request-id")
        read_whole(response, spec, result)
        return
    async with client.stream("POST", path, json=spec.body, headers=headers,
                             extensions=extensions) as response:
        result.status = response.status_code
        result.echoed_id = response.headers.get("x-request-id")
        if response.status_code != 200:
            result.outcome, result.error = "error", (await response.aread()).decode()[:500]
            return
        if await read_events(response, spec, result):
            result.outcome = "cancelled"  # left after disconnect_after_events events
            return
    result.outcome = "completed"


def read_whole(response: httpx.Response, spec: Spec, result: Result) -> None:
    result.status = response.status_code
    if response.status_code != 200:
        result.outcome, result.error = "error", response.text[:500]
        return
    data = response.json()
    result.response_id, result.usage = data.get("id"), data.get("usage")
    for choice in data["choices"]:
        text = choice["text"] if spec.endpoint == "completions" else choice["message"]["content"]
        result.texts[choice["index"]] += text or ""
        result.finish[choice["index"]].append(choice["finish_reason"])
    result.outcome = "completed"


async def read_events(response: httpx.Response, spec: Spec, result: Result) -> bool:
    """Read the SSE events into `result`; True if the client left early (as planned)."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if result.events == spec.disconnect_after_events:
            return True
        result.events += 1
        payload = line[len("data: "):]
        if payload == "[DONE]":
            result.done_marker = True
            continue
        add_chunk(json.loads(payload), spec, result)
    return False


def add_chunk(data: dict, spec: Spec, result: Result) -> None:
    if "error" in data:
        result.error = json.dumps(data["error"])
        return
    result.response_id = data.get("id", result.response_id)
    if data.get("usage"):
        result.usage = data["usage"]
    for choice in data.get("choices", []):
        if spec.endpoint == "completions":
            text = choice.get("text") or ""
        else:
            text = (choice.get("delta") or {}).get("content") or ""
        result.texts[choice["index"]] += text
        if choice.get("finish_reason") is not None:
            result.finish[choice["index"]].append(choice["finish_reason"])


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


# --------------------------------------------------------------------------- the soak
@dataclass
class SoakReport:
    requests: int
    concurrency: int
    seconds: float
    outcomes: dict
    server_side: dict
    repeated_cases: dict
    greedy_near_ties: int
    preemptions: float
    success_delta: dict
    final_metrics: dict
    rss_after_warmup_mib: float | None
    rss_peak_mib: float | None
    rss_after_mib: float | None
    failures: list[str]

    def summary(self) -> str:
        lines = [f"{self.requests} requests, {self.concurrency} clients, {self.seconds:.1f}s",
                 f"client outcomes: {self.outcomes}",
                 f"server side: {self.server_side}",
                 f"repeated cases checked: {self.repeated_cases}, greedy near-ties "
                 f"(top-5 rule): {self.greedy_near_ties}",
                 f"completions by finish reason (metrics delta): {self.success_delta}",
                 f"preemptions: {self.preemptions:.0f}",
                 f"at the end: {self.final_metrics}"]
        if self.rss_after_mib is not None:
            lines.append(f"RSS: {self.rss_after_warmup_mib:.1f} MiB after warm-up, "
                         f"{self.rss_after_mib:.1f} MiB after the run "
                         f"({self.rss_after_mib / self.rss_after_warmup_mib - 1:+.1%}), "
                         f"{self.rss_peak_mib:.1f} MiB at most during it")
        lines.append(f"failures: {len(self.failures)}")
        lines += [f"  - {f}" for f in self.failures[:40]]
        return "\n".join(lines)


def soak(url: str, *, requests: int, concurrency: int = 16, disconnect: float = 0.1,
         seed: int = 0, warmup: int = 32, max_tokens: int = 24, pid: int | None = None,
         log_path: Path | None = None, reference_llm=None, rss_tolerance: float = 0.10,
         progress: bool = False) -> SoakReport:
    """Warm up (a burst of long prompts, then `warmup` requests of the mix), run the
    workload, check everything; the report lists the failures."""
    peak = peak_workload(int(scrape_metrics(url, timeout=30)["slotserve:kv_blocks_total"]))
    asyncio.run(run_workload(url, peak, ENGINE_FLAGS["max_num_seqs"]))
    asyncio.run(run_workload(url, make_workload(warmup, seed + 1, disconnect, "warmup",
                                                max_tokens), concurrency))
    before = wait_idle(url)
    rss_warm = rss_bytes(pid) if pid else None
    specs = make_workload(requests, seed, disconnect, f"s{seed}", max_tokens)
    start = time.monotonic()
    with RssSampler(pid) as sampler:
        results = asyncio.run(run_workload(url, specs, concurrency, progress))
    seconds = time.monotonic() - start
    after = wait_idle(url)
    rss_end = rss_bytes(pid) if pid else None
    failures: list[str] = []
    for r in results:
        if r.outcome == "completed":
            failures += [f"{r.spec.request_id}: {p}" for p in check_completed(r)]
        elif r.outcome != "cancelled":
            failures.append(f"{r.spec.request_id}: {r.outcome}: {r.error}")
    repeated = {}
    for kind in ("greedy", "seeded"):
        repeated[kind], problems = check_repeats(results, kind)
        failures += problems
    near = 0
    if reference_llm is not None:
        cases = case_pools(random.Random(seed), max_tokens)["greedy"]
        near, problems = check_greedy_reference(results, greedy_reference(reference_llm, cases))
        failures += problems
    server_side: Counter = Counter()
    if log_path is not None:
        server_side, problems = check_server_side(results, Path(log_path).read_text("utf-8",
                                                                                     "replace"))
        failures += problems
    failures += check_final(after, rss_warm, rss_end, rss_tolerance)
    delta = {k: v - success_counts(before).get(k, 0) for k, v in success_counts(after).items()}
    return SoakReport(
        requests=requests, concurrency=concurrency, seconds=seconds,
        outcomes=dict(Counter(r.outcome for r in results)), server_side=dict(server_side),
        repeated_cases=repeated, greedy_near_ties=near,
        preemptions=after["slotserve:num_preemptions_total"]
        - before["slotserve:num_preemptions_total"],
        success_delta=delta, final_metrics={k.removeprefix("slotserve:"): after[k] for k in (
            "slotserve:num_requests_running", "slotserve:num_requests_waiting",
            "slotserve:kv_blocks_free", "slotserve:kv_blocks_total")},
        rss_after_warmup_mib=rss_warm / 2**20 if rss_warm else None,
        rss_peak_mib=sampler.peak / 2**20 if pid else None,
        rss_after_mib=rss_end / 2**20 if rss_end else None, failures=failures)


def check_final(m: dict[str, float], rss_warm: int | None, rss_end: int | None,
                tolerance: float) -> list[str]:
    problems = []
    if m["slotserve:kv_blocks_free"] != m["slotserve:kv_blocks_total"]:
        problems.append(f"{m['slotserve:kv_blocks_free']:.0f} of "
                        f"{m['slotserve:kv_blocks_total']:.0f} KV blocks free at the end")
    for name in ("slotserve:num_requests_waiting", "slotserve:num_requests_running"):
        if m[name]:
            problems.append(f"{name} = {m[name]:.0f} at the end")
    if rss_warm and rss_end and rss_end > rss_warm * (1 + tolerance):
        problems.append(f"RSS grew {rss_end / rss_warm - 1:.1%} (> {tolerance:.0%}): "
                        f"{rss_warm / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB")
    return problems


# --------------------------------------------------------------------------- the server
def start_server(log_path: Path, extra: list[str]) -> ServerProcess:
    """`slotserve serve` with ENGINE_FLAGS on a free loopback port; waits for /health."""
    server = ServerProcess.launch(log_path, *cli_flags(**ENGINE_FLAGS), *extra, cwd=REPO)
    try:
        server.wait_ready()
    except ServerStartError:
        server.stop()
        raise
    return server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--disconnect", type=float, default=0.1, help="share of clients that leave")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=24, help="output tokens: 1 to this")
    ap.add_argument("--url", default=None, help="a running server (skips log and RSS checks)")
    ap.add_argument("--log", default="soak-server.log", help="the started server's log")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the offline API's greedy reference")
    ap.add_argument("--rss-tolerance", type=float, default=0.10)
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="the server's KV pool (default 512); e.g. 24 puts it under memory "
                         "pressure (preemptions), while the reference keeps the big pool")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    server, url, log_path = None, args.url, None
    if url is None:
        log_path = Path(args.log)
        extra = [] if args.num_blocks is None else [f"--num-blocks={args.num_blocks}"]
        server = start_server(log_path, extra)
        url = server.url
    try:
        report = soak(url, requests=args.requests, concurrency=args.concurrency,
                      disconnect=args.disconnect, seed=args.seed, warmup=args.warmup,
                      max_tokens=args.max_tokens,
                      pid=server.proc.pid if server else None, log_path=log_path,
                      reference_llm=None if args.no_reference else offline_llm(),
                      rss_tolerance=args.rss_tolerance, progress=True)
    finally:
        code = server.stop() if server else 0
    print(report.summary())
    if server:
        print(f"server exit code after SIGTERM: {code}")
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2, default=str))
    return 1 if report.failures or code != 0 else 0


def offline_llm():
    from slotserve import LLM

    return LLM(**ENGINE_FLAGS)


if __name__ == "__main__":
    sys.exit(main())
