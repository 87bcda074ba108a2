"""benchmarks.soak's workload: the server's engine settings and the mixed requests its clients
send (completions and chat, sampling kinds, n, stop strings, streaming, disconnects), and
the burst of long prompts that warms the server's allocator up."""

from __future__ import annotations

import random
from dataclasses import dataclass

MODEL = "SmolLM2-135M-Instruct"
# The server's engine settings (and the offline reference's: the same ones).
ENGINE_FLAGS = dict(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=512,
                    num_blocks=512, block_size=16, seed=0)

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
