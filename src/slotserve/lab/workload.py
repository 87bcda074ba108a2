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
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from slotserve.config import check_policy_fields

# Varied short chat prompts: questions, instructions, code, lists, rewriting.
CHAT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "Give me three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "How do I boil an egg so the yolk stays soft?",
    "Write a Python function that reverses a string.",
    "Name five animals that live in the ocean.",
    "Why do we have seasons on Earth?",
    "Translate 'good morning, how are you?' into Spanish.",
    "What are the benefits of regular exercise?",
    "Write a short story opening about a lighthouse keeper.",
    "Explain what a hash table is to a beginner.",
    "List the planets of the solar system in order.",
    "What should I pack for a weekend hiking trip?",
    "Rewrite this sentence more politely: 'Send me the report now.'",
    "How does a bicycle stay upright while moving?",
    "Suggest a name for a small bakery that sells bread and coffee.",
    "What is photosynthesis?",
    "Write a limerick about a cat who loves cheese.",
    "Give me a simple recipe for tomato soup.",
    "What is the Pythagorean theorem? Give an example.",
    "Describe the water cycle step by step.",
)


POLICY_DEFAULTS = {"tenant": "default", "priority": 0, "slo_ttft_ms": None, "slo_tpot_ms": None}


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: a prompt (text, token ids) or chat messages, a length, a time.

    arrival: seconds after the start of the run at which the request is sent.
    n: completions of the prompt (sampled in parallel).
    turns: follow-up user turns of a conversation (closed loop): each is sent when the
        previous answer arrives, as the conversation so far + that answer + the turn
        (`next_turn`). User messages (str) for chat requests, token-id lists for token-id
        prompts. The first turn is `prompt` / `messages`.
    tenant, priority, slo_ttft_ms, slo_tpot_ms: the request's scheduling-policy fields (the
        engine's `add_request`, the API's `user`, `priority`, `slo_ttft_ms`, `slo_tpot_ms`).
    """

    id: str
    max_tokens: int
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    arrival: float = 0.0
    n: int = 1
    turns: tuple = ()
    tenant: str = "default"
    priority: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(f"request {self.id!r}: give exactly one of 'prompt' or 'messages'")
        if isinstance(self.prompt, (str, list)) and not self.prompt:
            raise ValueError(f"request {self.id!r}: 'prompt' must not be empty")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"request {self.id!r}: 'max_tokens' must be an integer >= 1, "
                             f"got {self.max_tokens!r}")
        if not isinstance(self.arrival, (int, float)) or not self.arrival >= 0:
            raise ValueError(f"request {self.id!r}: 'arrival' must be seconds >= 0, "
                             f"got {self.arrival!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"request {self.id!r}: 'n' must be an integer >= 1, got {self.n!r}")
        object.__setattr__(self, "turns", tuple(self.turns))
        self._check_turns()
        try:
            check_policy_fields(self.priority, self.tenant, self.slo_ttft_ms, self.slo_tpot_ms)
        except ValueError as exc:
            raise ValueError(f"request {self.id!r}: {exc}") from None

    def _check_turns(self) -> None:
        if not self.turns:
            return
        if self.n != 1:
            raise ValueError(f"request {self.id!r}: a multi-turn conversation needs n=1")
        kind = str if self.messages is not None else list
        if isinstance(self.prompt, str):
            raise ValueError(f"request {self.id!r}: 'turns' need 'messages' or token ids, "
                             "not a text prompt")
        if not all(isinstance(t, kind) and t for t in self.turns):
            what = "user messages (strings)" if kind is str else "token-id lists"
            raise ValueError(f"request {self.id!r}: 'turns' must be non-empty {what}")

    def policy_fields(self, only_set: bool = False) -> dict:
        """tenant, priority, slo_ttft_ms, slo_tpot_ms (the engine's add_request keywords);
        only_set: those that differ from the defaults."""
        return {k: getattr(self, k) for k, default in POLICY_DEFAULTS.items()
                if not only_set or getattr(self, k) != default}

    @property
    def num_turns(self) -> int:
        """Requests this entry sends: 1 + its follow-up turns."""
        return 1 + len(self.turns)

    def next_turn(self, answer_text: str, answer_ids: list[int]) -> BenchRequest | None:
        """The conversation's next request once this one's answer arrived (None: it ended).

        Chat: messages + the assistant's answer + the next user message. Token ids: prompt +
        the answer's ids + the next turn's ids. It is sent at once (arrival is the caller's).
        """
        if not self.turns:
            return None
        turn, rest = self.turns[0], self.turns[1:]
        base, _, index = self.id.rpartition(".t")
        next_id = f"{base}.t{int(index) + 1}" if base and index.isdigit() else f"{self.id}.t1"
        if self.messages is not None:
            messages = [*self.messages, {"role": "assistant", "content": answer_text},
                        {"role": "user", "content": turn}]
            return replace(self, id=next_id, messages=messages, turns=rest)
        return replace(self, id=next_id, prompt=[*self.prompt, *answer_ids, *turn], turns=rest)

    def to_dict(self) -> dict:
        """The JSONL form (no `id`: a request's id is its line number)."""
        body = {"messages": self.messages} if self.messages is not None else {
            "prompt": self.prompt}
        extra = {"n": self.n} if self.n != 1 else {}
        extra |= {"turns": list(self.turns)} if self.turns else {}
        extra |= self.policy_fields(only_set=True)
        return {**body, "max_tokens": self.max_tokens, "arrival": self.arrival, **extra}


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order, and the parameters that made them (for reports)."""

    requests: tuple[BenchRequest, ...]
    params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("a workload needs at least one request")
        ordered = tuple(sorted(self.requests, key=lambda r: r.arrival))
        object.__setattr__(self, "requests", ordered)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def total_max_tokens(self) -> int:
        return sum(r.max_tokens * r.n * r.num_turns for r in self.requests)

    @property
    def num_sends(self) -> int:
        """Requests sent in all: every turn of every conversation."""
        return sum(r.num_turns for r in self.requests)

    @property
    def num_completions(self) -> int:
        """Completions in all: n per request sent (the engine finishes each on its own)."""
        return sum(r.n * r.num_turns for r in self.requests)

    def chat_prompt_ids(self, tokenizer) -> list[list[int]]:
        """Each request's prompt token ids: its messages through the chat template (the
        template writes the special tokens, so encode adds none)."""
        return [tokenizer.encode(tokenizer.apply_chat_template(r.messages,
                                                               add_generation_prompt=True),
                                 add_special_tokens=False) for r in self.requests]

    @property
    def span(self) -> float:
        """Seconds from the first arrival to the last."""
        return self.requests[-1].arrival - self.requests[0].arrival


# ---------------------------------------------------------------------- generation
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


# ---------------------------------------------------------------------- shared prefixes
# A support assistant's system prompt: about 400 tokens with SmolLM2's tokenizer (the
# template adds a few more), so every request behind it shares that many tokens.
SYSTEM_PROMPT = " ".join((
    "You are Harbor, the customer support assistant of Lighthouse Outfitters, a shop that",
    "sells hiking, camping and sailing equipment online and in twelve stores.",
    "Follow these rules in every answer.",
    "1. Be friendly, brief and precise; answer the question that was asked before adding",
    "anything else, and never invent facts about products, prices or stock.",
    "2. Orders ship within two working days; standard delivery takes three to five working",
    "days, express delivery one to two. Delivery is free above fifty euros.",
    "3. Customers may return unused items within thirty days of delivery for a full refund;",
    "worn or used items can be exchanged only if they are faulty. Refunds reach the original",
    "payment method within ten working days after the return arrives at the warehouse.",
    "4. Every tent, sleeping bag and backpack carries a two-year warranty against defects in",
    "materials and workmanship; damage from misuse, fire or sharp objects is not covered.",
    "5. For sizing questions, ask for the customer's height, weight and usual size, and",
    "recommend the size chart on the product page; boots run half a size small.",
    "6. Never ask for full card numbers, passwords or security codes. If a customer shares",
    "one, tell them to remove it and to contact their bank if they are worried.",
    "7. If a question is about safety in the mountains or at sea, give general advice and",
    "tell the customer to check the local forecast and the rules of the area they visit.",
    "8. Store hours are nine to seven on weekdays and ten to five on Saturdays; stores are",
    "closed on Sundays and public holidays. Click and collect orders wait seven days.",
    "9. When you do not know the answer, say so and offer to pass the question to a human",
    "agent, who will reply by email within one working day.",
    "10. Write in the customer's language, use short paragraphs or lists, and end with a",
    "question only if you need more information to help.",
))

# Follow-up user messages of a conversation (multi-turn chat).
FOLLOW_UPS: tuple[str, ...] = (
    "Can you say that more briefly?",
    "Thanks. Can you give me an example?",
    "Why is that?",
    "What would you recommend for a beginner?",
    "Can you put that in a list?",
    "What are the most common mistakes?",
    "How would you explain this to a child?",
    "Is there anything else I should know?",
)


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


# ---------------------------------------------------------------------- JSONL
def load_workload(path: str | Path) -> Workload:
    """Read a JSONL workload (see the module docstring); ValueError names the bad line."""
    requests = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                requests.append(_parse_line(line, number, path))
    if not requests:
        raise ValueError(f"{path}: no requests")
    offline = all(r.arrival == 0 for r in requests)
    return Workload(tuple(requests), {"source": str(path), "num_requests": len(requests),
                                      "request_rate": "inf" if offline else "file"})


def _parse_line(line: str, number: int, path: str | Path) -> BenchRequest:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
    if not isinstance(item, dict) or "max_tokens" not in item:
        raise ValueError(f"{path}:{number}: expected an object with 'max_tokens'")
    try:
        return BenchRequest(id=str(number - 1), max_tokens=item["max_tokens"],
                            prompt=item.get("prompt"), messages=item.get("messages"),
                            arrival=float(item.get("arrival", 0.0)), n=item.get("n", 1),
                            turns=tuple(item.get("turns") or ()),
                            **{k: item[k] for k in POLICY_DEFAULTS if k in item})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}:{number}: {exc}") from None


def save_workload(workload: Workload, path: str | Path) -> None:
    """Write the workload as JSONL (load_workload reads it back)."""
    lines = (json.dumps(r.to_dict()) for r in workload.requests)
    Path(path).write_text("".join(line + "\n" for line in lines))
