"""The only types that cross between scheduler and runner: plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from slotserve.sampling import SamplingParams


def is_decode_step(start_pos: int, num_new: int, samples: bool) -> bool:
    """Whether a chunk of `num_new` known tokens (draft tokens aside) at `start_pos` is a
    decode: one token after cached context that is the sequence's last, so the step samples
    the token after it.

    NOTE: the one definition of "decode" (the scheduler's prefill cap, drafts and trace
    kinds, the attention metadata, the decode graphs and the decode stack all use it). A
    preempted request's recompute cut to one-token chunks is a prefill until its last
    chunk: one token that samples nothing is a prefill chunk everywhere.
    """
    return num_new == 1 and start_pos > 0 and samples


# NOTE: the fused CPU path (attention/metadata.py) runs an iteration on the decode stack,
# every token a row that reads its own sequence's KV up to its position, when each sequence
# is a decode (maybe verified with drafts) or a prefill chunk of at most this many tokens
# (`runs_as_rows`); the replay's clock prices it so (lab/replay/cost_model.py).
ROW_CHUNK_TOKENS = 32


def runs_as_rows(seqs) -> bool:
    """Every sequence of an iteration is a decode or a chunk of at most ROW_CHUNK_TOKENS."""
    return all(s.is_decode or s.num_tokens <= ROW_CHUNK_TOKENS for s in seqs)


@dataclass
class ScheduledSeq:
    """One request's share of an iteration.

    token_ids are the new tokens to process, at positions start_pos .. start_pos+len-1.
    sample: this chunk ends at the request's last token, so one token is sampled after it.
    spec_token_ids: speculative decoding's draft tokens, the last len(spec_token_ids) of
    token_ids (a decode verified with them: logits at each of its 1 + k rows; the runner
    accepts a prefix of them and samples one token after it, `RunnerOutput.accepted`).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    sampling_params: SamplingParams
    num_output_tokens: int  # generated so far: the index of the token sampled now
    kind: str  # SlotKind.PREFILL or DECODE: the scheduler sets it as is_decode says
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Positions attended to after this iteration's tokens are written."""
        return self.start_pos + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """A decode (`is_decode_step`), maybe verified with draft tokens."""
        return is_decode_step(self.start_pos, len(self.token_ids) - len(self.spec_token_ids),
                              self.sample)

    @property
    def is_one_token_decode(self) -> bool:
        """A decode without drafts: one query row, the decode attention's and graphs' shape."""
        return self.is_decode and not self.spec_token_ids


@dataclass
class SlotState:
    """What one occupied slot did in an iteration (for the trace)."""

    request_id: str
    kind: str  # "prefill" | "decode" | "stalled"
    tokens: int
    proposed: int = 0  # draft tokens verified (speculative decoding), among `tokens`
    accepted: int = 0  # of those, accepted (set when the iteration's result is applied)


@dataclass
class SchedulerOutput:
    """The plan of one iteration."""

    iteration: int
    seqs: list[ScheduledSeq]
    slots: list[SlotState | None]
    preempted: list[str] = field(default_factory=list)
    num_waiting: int = 0
    kv_blocks_used: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(seq.num_tokens for seq in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class RunnerOutput:
    """What the forward pass produced: one sampled token per sampling request.

    logprobs[request_id] maps token id -> log-probability: the sampled token and the top-N.
    accepted[request_id]: for a request verified with draft tokens, the drafts accepted (a
    prefix of its spec_token_ids, maybe empty); they come before its sampled token, which
    was sampled after them. accepted_logprobs: their logprobs (when the request asks).
    """

    sampled: dict[str, int]
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    accepted: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)

    def merge(self, other: RunnerOutput) -> None:
        """Add another part of the same iteration's result (fault isolation's halves)."""
        self.sampled.update(other.sampled)
        self.logprobs.update(other.logprobs)
        self.accepted.update(other.accepted)
        self.accepted_logprobs.update(other.accepted_logprobs)
