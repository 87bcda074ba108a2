"""The request types of a workload: `BenchRequest` (one request, its turns) and `Workload`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from slotserve.config import check_policy_fields
from slotserve.value_checks import is_int

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
        if not is_int(self.n) or self.n < 1:
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
