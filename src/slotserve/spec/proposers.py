"""Draft-token proposers that need no second model (numpy, no torch).

- `NgramProposer` (vLLM's `ngram`, prompt lookup decoding): the longest n-gram (between
  prompt_lookup_min and prompt_lookup_max tokens) that ends the sequence and occurred earlier
  in its prompt or output proposes the tokens that followed its earliest occurrence.
- `SuffixProposer` (vLLM's `suffix`, Arctic Inference's suffix decoding): the longest suffix
  of the sequence (up to max_tree_depth tokens) is matched in the sequence itself and in a
  bounded store of recent outputs (`RecentOutputs`); from the matched occurrences it walks
  forward, each step taking the most frequent next token, while the path's estimated
  probability (the product of each step's frequency share) stays >= min_token_prob and the
  length <= max_spec_factor x match length. The source (sequence or store) whose path has the
  larger expected accepted length (the sum of the path's probabilities) wins.

Every proposer keeps a copy of each sequence's tokens, grown as output tokens arrive, so a
proposal costs no copy of the whole sequence: the n-gram proposer an index of its n-grams
(`NgramIndex`), the suffix proposer a numpy array (`TokenHistory`).

Interface (what `planner.Speculator` calls):
    propose(seq_id, prompt_ids, output_ids, max_tokens) -> list[int]  (maybe empty)
    finish(seq_id, output_ids)  # the sequence left; a suffix proposer remembers its output
    forget(seq_id)              # the sequence left, nothing to remember
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np

Copy = TypeVar("Copy")  # a proposer's copy of one sequence's tokens


class Proposer(Protocol):
    """What the speculator needs of a proposer (see the module docstring)."""

    def propose(self, seq_id: str, prompt_ids: Sequence[int], output_ids: Sequence[int],
                max_tokens: int) -> list[int]: ...

    def finish(self, seq_id: str, output_ids: Sequence[int]) -> None: ...

    def forget(self, seq_id: str) -> None: ...


class TokenHistory:
    """A growing int64 copy of one sequence's tokens (prompt, then output).

    NOTE: synced by length: a sequence only ever appends output tokens while it runs (a
    preempted one keeps them), so the tokens past the copy's length are the new ones; a
    sequence that got shorter (never, while running) is copied again whole.
    """

    def __init__(self) -> None:
        self._buf = np.empty(256, dtype=np.int64)
        self.size = 0

    def sync(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> np.ndarray:
        """The sequence's tokens as an array view (valid until the next sync)."""
        total = len(prompt_ids) + len(output_ids)
        if self.size > total or self.size < len(prompt_ids):
            self.size = 0
            self._append(prompt_ids)
        self._append(output_ids[self.size - len(prompt_ids):])
        return self._buf[:self.size]

    def _append(self, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        end = self.size + len(tokens)
        if end > len(self._buf):
            grown = np.empty(max(end, 2 * len(self._buf)), dtype=np.int64)
            grown[:self.size] = self._buf[:self.size]
            self._buf = grown
        self._buf[self.size:end] = tokens
        self.size = end


def longest_suffix_match(tokens: np.ndarray, max_len: int) -> tuple[int, np.ndarray]:
    """(m, ends): the longest m <= max_len such that the last m tokens also end at an earlier
    position e (tokens[e-m+1 : e+1] == tokens[-m:], e <= len - 2), and all such e, ascending.
    (0, empty) when the last token never occurred before.

    NOTE: the candidates only shrink as m grows, so the work is the number of earlier
    occurrences of the last token plus those of longer matches, not len x max_len.
    """
    n = len(tokens)
    if n < 2 or max_len < 1:
        return 0, np.empty(0, dtype=np.int64)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    length = 1 if ends.size else 0
    while ends.size and length < max_len:
        longer = ends[ends >= length]
        longer = longer[tokens[longer - length] == tokens[n - 1 - length]]
        if not longer.size:
            break
        ends = longer
        length += 1
    return length, ends


class _PerSequence(Generic[Copy]):
    """Each live sequence's copy of its tokens (what `make` builds: a TokenHistory, an
    NgramIndex), by sequence id."""

    def __init__(self, make: Callable[[], Copy]) -> None:
        self._make = make
        self._copies: dict[str, Copy] = {}

    def copy_of(self, seq_id: str) -> Copy:
        copy = self._copies.get(seq_id)
        if copy is None:
            copy = self._copies[seq_id] = self._make()
        return copy

    def forget(self, seq_id: str) -> None:
        self._copies.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._copies)


class NgramIndex:
    """One sequence's tokens (a list) and, for each n-gram of `n` tokens in them, the
    positions where it ends (ascending): an n-gram lookup costs a dict lookup and a walk
    over that n-gram's occurrences, not a pass over the sequence. Synced by length, as
    `TokenHistory` (rebuilt whole when the sequence is not its copy plus new tokens).

    NOTE: why: numpy passes over the sequence (`longest_suffix_match`) cost ~60 us a
    lookup on a few hundred tokens, and "auto" asks for a proposal on most iterations where
    its plan wants a draft, found or not: ~0.5% of a batch-1 decode on free text
    (SmolLM2-135M, AMX Xeon). A dict lookup and a few occurrences cost a few us.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._prompt_len = 0

    def sync(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Append the tokens past the copy (or copy the sequence again, see the class)."""
        total = len(prompt_ids) + len(output_ids)
        if len(self.tokens) > total or len(self.tokens) < len(prompt_ids) \
                or len(prompt_ids) != self._prompt_len:
            self.tokens, self._ends, self._prompt_len = [], {}, len(prompt_ids)
            self._extend(prompt_ids)
        self._extend(output_ids[len(self.tokens) - len(prompt_ids):])

    def _extend(self, new: Sequence[int]) -> None:
        tokens, n = self.tokens, self.n
        for token in new:
            tokens.append(int(token))
            if len(tokens) >= n:
                self._ends.setdefault(tuple(tokens[-n:]), []).append(len(tokens) - 1)

    def longest_match(self, max_n: int) -> tuple[int, int]:
        """(m, e): the longest m in [n, max_n] such that the last m tokens also end at an
        earlier position e (the earliest such e); (0, -1) when the last n never did."""
        tokens, size = self.tokens, len(self.tokens)
        if size < self.n + 1:
            return 0, -1
        ends = self._ends.get(tuple(tokens[-self.n:]), ())
        best, best_end = 0, -1
        for end in ends:
            if end >= size - 1:
                break  # NOTE: ascending: the rest is the sequence's own last position
            m = self.n
            while m < max_n and m <= end and tokens[end - m] == tokens[size - 1 - m]:
                m += 1
            if m > best:
                best, best_end = m, end
                if m == max_n:
                    break  # NOTE: the earliest of the longest
        return best, best_end


class NgramProposer(_PerSequence[NgramIndex]):
    """vLLM's `ngram` proposer (prompt lookup decoding); see the module docstring."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min} and {prompt_lookup_max}")
        super().__init__(lambda: NgramIndex(prompt_lookup_min))
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, seq_id: str, prompt_ids: Sequence[int], output_ids: Sequence[int],
                max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        index = self.copy_of(seq_id)
        index.sync(prompt_ids, output_ids)
        length, end = index.longest_match(self.max_n)
        return index.tokens[end + 1:end + 1 + max_tokens] if length else []

    def finish(self, seq_id: str, output_ids: Sequence[int]) -> None:
        self.forget(seq_id)


def walk_most_frequent(sources: list[tuple[np.ndarray, np.ndarray]], max_tokens: int,
                       min_prob: float) -> tuple[list[int], float]:
    """Follow matched occurrences forward, each step the most frequent next token.

    sources: (tokens, next positions) pairs: each position is where an occurrence of the
    matched context is followed. A step's probability is its token's share of the
    occurrences still followed; the path's is their product, and the walk stops before it
    falls below min_prob. Returns (tokens, score = sum of the path's probabilities, the
    expected number of them accepted if those estimates hold).
    """
    drafts: list[int] = []
    prob, score = 1.0, 0.0
    while len(drafts) < max_tokens:
        live = [(toks, pos[pos < len(toks)]) for toks, pos in sources]
        live = [(toks, pos) for toks, pos in live if pos.size]
        if not live:
            break
        nexts = np.concatenate([toks[pos] for toks, pos in live])
        token, share = _most_frequent(nexts)
        prob *= share
        if prob < min_prob:
            break
        drafts.append(token)
        score += prob
        sources = [(toks, pos[toks[pos] == token] + 1) for toks, pos in live]
    return drafts, score


def _most_frequent(values: np.ndarray) -> tuple[int, float]:
    """(the most frequent value, the smallest on ties; its share of the values)."""
    first = values[0]
    if (values == first).all():  # NOTE: the common case of a repetitive text, 5x faster
        return int(first), 1.0
    uniques, counts = np.unique(values, return_counts=True)
    best = int(counts.argmax())
    return int(uniques[best]), counts[best] / values.size


class RecentOutputs:
    """A bounded store of recent outputs for suffix decoding: the last `max_outputs` outputs
    (oldest evicted first), indexed by their token pairs.

    NOTE: bounded memory: each pair keeps at most 4 x `candidates` positions (only the most
    recent `candidates` are looked at), and the index is rebuilt from the live outputs once
    evicted outputs' tokens outnumber the live ones.
    """

    def __init__(self, max_outputs: int, candidates: int = 32) -> None:
        self.max_outputs = max_outputs
        self.candidates = candidates
        self._outputs: OrderedDict[int, np.ndarray] = OrderedDict()
        self._index: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._next_id = 0
        self._live_tokens = 0
        self._dead_tokens = 0

    def __len__(self) -> int:
        return len(self._outputs)

    def add(self, output_ids: Sequence[int]) -> None:
        if self.max_outputs <= 0 or len(output_ids) < 3:
            return
        tokens = np.asarray(output_ids, dtype=np.int64)
        key = self._next_id
        self._next_id += 1
        self._outputs[key] = tokens
        self._live_tokens += len(tokens)
        self._index_output(key, tokens)
        while len(self._outputs) > self.max_outputs:
            _, old = self._outputs.popitem(last=False)
            self._live_tokens -= len(old)
            self._dead_tokens += len(old)
        if self._dead_tokens > self._live_tokens:
            self._rebuild()

    def _index_output(self, key: int, tokens: np.ndarray) -> None:
        limit = 4 * self.candidates
        pairs = zip(tokens[:-1].tolist(), tokens[1:].tolist())
        for end, pair in enumerate(pairs, start=1):
            entries = self._index.setdefault(pair, [])
            entries.append((key, end))
            if len(entries) > limit:
                del entries[:len(entries) - self.candidates]

    def _rebuild(self) -> None:
        self._index.clear()
        for key, tokens in self._outputs.items():
            self._index_output(key, tokens)
        self._dead_tokens = 0

    def match(self, tokens: np.ndarray, max_len: int) -> tuple[int, list[tuple[np.ndarray,
                                                                              np.ndarray]]]:
        """(m, sources): the longest m <= max_len (>= 2) such that the sequence's last m
        tokens occur in a stored output, and for each output holding such occurrences its
        tokens and the positions following them (for `walk_most_frequent`); (0, [])."""
        if len(tokens) < 2 or max_len < 2:
            return 0, []
        entries = self._index.get((int(tokens[-2]), int(tokens[-1])))
        if not entries:
            return 0, []
        tail = tokens[-max_len:][::-1].tolist()  # the sequence backwards from its end
        best, found = 0, {}
        for key, end in reversed(entries[-self.candidates:]):
            stored = self._outputs.get(key)
            if stored is None:
                continue
            length = _backward_match(stored, end, tail)
            if length > best:
                best, found = length, {}
            if length == best:
                found.setdefault(key, []).append(end + 1)
        sources = [(self._outputs[k], np.array(sorted(p), dtype=np.int64))
                   for k, p in found.items()]
        return best, sources


def _backward_match(stored: np.ndarray, end: int, tail: list[int]) -> int:
    """How many of tail's tokens (the sequence backwards) match stored backwards from end."""
    length = 0
    limit = min(len(tail), end + 1)
    while length < limit and int(stored[end - length]) == tail[length]:
        length += 1
    return length


# The most recent occurrences of the matched suffix a walk follows (a repetitive sequence
# has thousands: following them all cost 0.3 ms a proposal, 64 of them 0.05 ms).
MAX_OCCURRENCES = 64


class SuffixProposer(_PerSequence[TokenHistory]):
    """vLLM's `suffix` proposer (suffix decoding); see the module docstring.

    NOTE: the walk over the sequence itself follows its MAX_OCCURRENCES most recent
    occurrences of the matched suffix, the store's its `candidates` most recent ones.
    """

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 1000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        super().__init__(TokenHistory)
        self.max_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.store = RecentOutputs(max_cached_requests)

    def propose(self, seq_id: str, prompt_ids: Sequence[int], output_ids: Sequence[int],
                max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        tokens = self.copy_of(seq_id).sync(prompt_ids, output_ids)
        best: tuple[list[int], float] = ([], 0.0)
        own_len, ends = longest_suffix_match(tokens, self.max_depth)
        ends = ends[-MAX_OCCURRENCES:]
        for length, sources in ((own_len, [(tokens, ends + 1)] if own_len else []),
                                self.store.match(tokens, self.max_depth)):
            if not length:
                continue
            cap = min(max_tokens, int(self.max_spec_factor * length))
            drafts, score = walk_most_frequent(sources, cap, self.min_token_prob)
            if score > best[1]:
                best = (drafts, score)
        return best[0]

    def finish(self, seq_id: str, output_ids: Sequence[int]) -> None:
        """The sequence finished: its output joins the store of recent outputs."""
        self.forget(seq_id)
        self.store.add(output_ids)
