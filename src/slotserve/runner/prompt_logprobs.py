"""Prompt logprobs (vLLM's `prompt_logprobs`, and `echo` with `logprobs`): the log-probability
of every prompt token given the tokens before it, with the top N at each position, computed
in the prefill chunks that run anyway (the logits of the prompt rows, only for the requests
that ask).

Row p of a prefill (position p) predicts token p + 1: a chunk at positions start..end gives
the entries of prompt tokens start + 1 .. end + 1 that are still prompt tokens. The last
prompt row is the one that samples the first output token; it predicts no prompt token.

NOTE (prefix cache): a cached prefix's rows never run, so a request that asks for prompt
logprobs must compute its whole prompt: the engine gives that completion a cache salt of its
own (`unique_salt`), so it neither finds nor feeds other requests' cached blocks; after a
preemption it finds only its own blocks, whose positions it has entries for already.
"""

from __future__ import annotations

import uuid

import torch

# Prompt rows whose logits are computed at once ((rows, vocab) fp32: 128 x 49,152 x 4 B =
# 25 MB for SmolLM2), so a 512-token chunk never holds all its rows' logits.
ROWS_PER_SLICE = 128


class PromptLogprobs:
    """One completion's prompt logprobs, filled chunk by chunk by the runner.

    entries[k]: {token id: logprob} for prompt token k + 1: the top `top_n` and the prompt
    token itself; ranks[k]: the prompt token's rank (1 = the most likely).
    """

    def __init__(self, prompt_token_ids: list[int], top_n: int) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.top_n = top_n
        self.entries: list[dict[int, float]] = []
        self.ranks: list[int] = []
        self._result: tuple[list, list] | None = None

    @property
    def num_positions(self) -> int:
        """The prompt positions that predict a prompt token (all but the last)."""
        return len(self.prompt_token_ids) - 1

    @property
    def complete(self) -> bool:
        return len(self.entries) == self.num_positions

    def rows_to_compute(self, start_pos: int, num_tokens: int) -> range:
        """The offsets, within a chunk at start_pos..start_pos + num_tokens - 1, of the rows
        whose entries are still missing. ValueError if the chunk starts past the next missing
        entry (its rows were skipped: the entries would have a hole)."""
        first = len(self.entries)
        end = min(start_pos + num_tokens, self.num_positions)
        if first >= end:
            return range(0)
        if start_pos > first:
            raise ValueError(f"prompt_logprobs: positions {first}..{start_pos - 1} were "
                             "skipped (a cached prefix); they cannot be computed now")
        return range(first - start_pos, end - start_pos)

    def add(self, logprobs: torch.Tensor, first_position: int) -> None:
        """Add the entries of consecutive rows (R, V) of log-probabilities, the first at
        position `first_position` (which must be the next missing one)."""
        if first_position != len(self.entries):
            raise ValueError(f"prompt_logprobs: entry {first_position} added after "
                             f"{len(self.entries)} entries")
        targets = torch.tensor(
            self.prompt_token_ids[first_position + 1:first_position + 1 + len(logprobs)],
            device=logprobs.device)
        target_lp = logprobs.gather(1, targets[:, None])  # (R, 1)
        ranks = (logprobs > target_lp).sum(dim=-1) + 1  # (R,)
        top_vals, top_ids = logprobs.topk(max(self.top_n, 1), dim=-1)
        for row, (token, lp) in enumerate(zip(targets.tolist(), target_lp[:, 0].tolist())):
            n = self.top_n
            entry = dict(zip(top_ids[row, :n].tolist(), top_vals[row, :n].tolist()))
            entry[token] = lp
            self.entries.append(entry)
        self.ranks.extend(ranks.tolist())

    def result(self) -> tuple[list[dict[int, float] | None], list[int | None]] | None:
        """([None, entry of token 1, ...], [None, rank of token 1, ...]) once every entry is
        in (vLLM's shape: the first token has nothing before it); None before. Built once:
        every output shares the lists."""
        if not self.complete:
            return None
        if self._result is None:
            self._result = [None, *self.entries], [None, *self.ranks]
        return self._result


def unique_salt(cache_salt: str | None) -> str:
    """A cache salt no other completion has (see the module NOTE on the prefix cache)."""
    return f"{cache_salt or ''}\x00prompt-logprobs-{uuid.uuid4().hex}"


def compute_prompt_logprobs(hidden: torch.Tensor, rows: list[tuple[PromptLogprobs, int, range]],
                            compute_logits) -> None:
    """Fill each accumulator from its rows of `hidden` (T, H).

    rows: (accumulator, the chunk's first flat row, the chunk offsets `rows_to_compute`
    gave); compute_logits: (R, H) -> (R, V) (the model's LM head).
    """
    for acc, chunk_row, offsets in rows:
        first_position = len(acc.entries)
        for begin in range(offsets.start, offsets.stop, ROWS_PER_SLICE):
            end = min(begin + ROWS_PER_SLICE, offsets.stop)
            logits = compute_logits(hidden[chunk_row + begin:chunk_row + end])  # (R, V)
            logprobs = logits.float().log_softmax(dim=-1)
            acc.add(logprobs, first_position + begin - offsets.start)
