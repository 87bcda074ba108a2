"""Speculative decoding's proposers (spec/proposers.py): n-gram prompt lookup against a
brute-force reference of vLLM's rule, suffix decoding over the sequence and the store of
recent outputs, the incremental token copy, and the planner's choice of draft counts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.spec.config import parse
from slotserve.spec.planner import (
    Candidate,
    LinearStepCost,
    Speculator,
    expected_tokens,
)
from slotserve.spec.proposers import (
    NgramIndex,
    NgramProposer,
    RecentOutputs,
    SuffixProposer,
    TokenHistory,
    longest_suffix_match,
    walk_most_frequent,
)

SETTINGS = settings(deadline=None, database=None, derandomize=True, max_examples=300)
TOKENS = st.lists(st.integers(0, 4), min_size=0, max_size=40)


def reference_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's rule, spelled out: the longest n in [min_n, max_n] whose last-n tokens occur
    earlier (ending before the last token); the earliest such occurrence; k tokens after."""
    size = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > size - 1:
            continue
        suffix = tokens[size - n:]
        for start in range(0, size - n):  # the occurrence ends at start + n - 1 <= size - 2
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def ngram_proposal(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The n-gram proposer's answer for one sequence of these tokens."""
    return NgramProposer(min_n, max_n).propose("s", tokens, [], k)


@SETTINGS
@given(TOKENS, st.integers(1, 4), st.integers(0, 3), st.integers(1, 6))
def test_ngram_matches_the_reference(tokens, min_n, extra, k):
    max_n = min_n + extra
    assert ngram_proposal(tokens, min_n, max_n, k) == reference_ngram(tokens, min_n, max_n, k)


@SETTINGS
@given(st.lists(st.integers(0, 3), min_size=1, max_size=12), TOKENS, st.integers(1, 3),
       st.integers(0, 3))
def test_ngram_index_grown_token_by_token_matches_the_reference(prompt, output, min_n, extra):
    """One proposer asked after every output token (its index grown, never rebuilt) answers
    as the reference does on the whole sequence; then a rewound sequence (a shorter
    output) and another prompt of the same id are indexed afresh."""
    max_n = min_n + extra
    proposer = NgramProposer(min_n, max_n)
    for i in range(len(output) + 1):
        got = proposer.propose("s", prompt, output[:i], 4)
        assert got == reference_ngram(prompt + output[:i], min_n, max_n, 4)
    rewound = output[:len(output) // 2]
    assert proposer.propose("s", prompt, rewound, 4) == \
        reference_ngram(prompt + rewound, min_n, max_n, 4)
    other = [*prompt, 3]
    assert proposer.propose("s", other, output, 4) == \
        reference_ngram(other + output, min_n, max_n, 4)


def test_ngram_index_keeps_each_ngrams_ends():
    index = NgramIndex(2)
    index.sync([1, 2, 3, 1, 2], [1, 2])
    assert index.tokens == [1, 2, 3, 1, 2, 1, 2]
    assert index.longest_match(4) == (2, 1)  # [1, 2] ends at 1, 4 and 6: the earliest
    index.sync([1, 2, 3, 1, 2], [1, 2, 3])
    assert index.longest_match(4) == (3, 2)  # [1, 2, 3]: only at 2 ([2, 1, 2, 3] never)


@SETTINGS
@given(TOKENS, st.integers(1, 6))
def test_longest_suffix_match_is_the_longest(tokens, max_len):
    arr = np.array(tokens, dtype=np.int64)
    length, ends = longest_suffix_match(arr, max_len)
    size = len(tokens)

    def match_at(end: int) -> int:
        m = 0
        while m < max_len and m <= end and tokens[end - m] == tokens[size - 1 - m]:
            m += 1
        return m

    lengths = [match_at(e) for e in range(size - 1)] if size >= 2 else []
    assert length == max(lengths, default=0)
    expected = [e for e, m in enumerate(lengths) if m == length] if length else []
    assert ends.tolist() == expected


def test_token_history_follows_appends_and_rebuilds_on_change():
    history = TokenHistory()
    prompt, output = [7] * 300, []
    for token in range(500):  # past the initial buffer and its doubling
        output.append(token)
        assert history.sync(prompt, output).tolist() == prompt + output
    assert history.sync([1, 2], [3]).tolist() == [1, 2, 3]  # another sequence: copied whole


def test_ngram_proposer_keeps_a_copy_per_sequence_and_forgets_it():
    proposer = NgramProposer(1, 3)
    prompt = [1, 2, 3, 4, 5]
    assert proposer.propose("a", prompt, [1, 2], 2) == [3, 4]
    assert proposer.propose("a", prompt, [1, 2, 3], 3) == [4, 5, 1]
    assert proposer.propose("b", [9, 9], [], 3) == [9]
    assert proposer.propose("a", prompt, [1, 2, 3], 0) == []
    proposer.finish("a", [1, 2, 3])
    proposer.forget("b")
    assert len(proposer) == 0
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)


def test_walk_follows_the_most_frequent_continuation_until_unlikely():
    tokens = np.array([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2])
    _, ends = longest_suffix_match(tokens, 8)
    drafts, score = walk_most_frequent([(tokens, ends + 1)], 5, min_prob=0.1)
    # after [1, 2]: 3 twice, 4 once -> 3 (p = 2/3); then 1 and 2 follow both (p stays
    # 2/3); then 3 and 4 once each (a tie: the smaller id, p = 1/3); then 1
    assert drafts == [3, 1, 2, 3, 1]
    assert score == pytest.approx(3 * 2 / 3 + 2 * 1 / 3)
    strict, _ = walk_most_frequent([(tokens, ends + 1)], 5, min_prob=0.9)
    assert strict == []  # the first step's 2/3 is below 0.9


def test_suffix_proposer_uses_its_own_sequence_and_recent_outputs():
    proposer = SuffixProposer(max_tree_depth=8, max_cached_requests=4, max_spec_factor=4.0,
                              min_token_prob=0.1)
    answer = [10, 11, 12, 13, 14, 15, 16]
    proposer.finish("first", answer)  # an earlier request's output joins the store
    assert len(proposer.store) == 1
    # a new sequence that starts the same answer: the store proposes its continuation
    assert proposer.propose("second", [1, 2, 3], [10, 11], 4) == [12, 13, 14, 15]
    # max_spec_factor x match length bounds the drafts (match of 2 tokens, factor 1: 2)
    short = SuffixProposer(8, 4, 1.0, 0.1)
    short.finish("first", answer)
    assert short.propose("x", [1], [10, 11], 8) == [12, 13]
    # its own prompt: copied text
    assert proposer.propose("third", [5, 6, 7, 8, 5, 6], [], 2) == [7, 8]


def test_recent_outputs_are_bounded():
    store = RecentOutputs(max_outputs=3, candidates=2)
    for i in range(50):
        store.add([100 + i, 1, 2, 3, 4])
    assert len(store) == 3
    length, sources = store.match(np.array([9, 1, 2]), 8)
    assert length == 2 and sources
    assert all(len(entries) <= 8 for entries in store._index.values())  # 4 x candidates
    store.add([1, 2])  # too short to index: ignored
    assert len(store) == 3


# --------------------------------------------------------------------------- planner
class FixedProposer:
    """Proposes `draft` (cut to the asked length) for every sequence; records calls."""

    def __init__(self, draft):
        self.draft = draft
        self.calls = []

    def propose(self, seq_id, prompt_ids, output_ids, max_tokens):
        self.calls.append((seq_id, max_tokens))
        return list(self.draft[:max_tokens])

    def finish(self, seq_id, output_ids):
        pass

    def forget(self, seq_id):
        pass


def candidates(count: int, max_tokens: int = 8) -> list[Candidate]:
    return [Candidate(f"s{i}", [1, 2], [3], max_tokens) for i in range(count)]


def test_fixed_length_within_budget_and_caps():
    spec = Speculator(parse({"method": "ngram", "num_speculative_tokens": 4}),
                      proposer=FixedProposer(list(range(10))))
    drafts = spec.plan(candidates(3, max_tokens=3), budget=100, planned_tokens=3,
                       producing=3)
    assert [len(d) for d in drafts.values()] == [3, 3, 3]  # the sequences' own cap
    drafts = spec.plan(candidates(3), budget=6, planned_tokens=3, producing=3)
    assert sum(len(d) for d in drafts.values()) == 6  # the budget


def test_auto_speculates_at_batch_one_and_not_when_compute_bound():
    cost = LinearStepCost(overhead=32.0, per_token=1.0)
    spec = Speculator(parse({"method": "ngram"}), proposer=FixedProposer(list(range(10))),
                      step_cost=cost)
    small = spec.plan(candidates(1), budget=512, planned_tokens=1, producing=1)
    assert 1 <= len(small["s0"]) <= 8
    big = spec.plan(candidates(256), budget=512, planned_tokens=256, producing=256)
    assert big == {}  # nothing pays: the step is compute-bound
    # no proposal work when big; "auto" asks a sequence it plans drafts for once, for as
    # many as it may take (`Speculator._proposed_lengths`: a plan is capped to what it has)
    assert spec.proposer.calls == [("s0", 8)]


def test_auto_follows_the_acceptance_rate():
    cost = LinearStepCost(overhead=32.0, per_token=1.0)
    spec = Speculator(parse({"method": "ngram"}), proposer=FixedProposer(list(range(10))),
                      step_cost=cost)
    for _ in range(50):
        spec.observe("good", 4, 4)
        spec.observe("bad", 4, 0)
    assert spec.rate("good") > 0.95 and spec.rate("bad") < 0.05
    cands = [Candidate("good", [1], [2], 8), Candidate("bad", [1], [2], 8)]
    drafts = spec.plan(cands, budget=512, planned_tokens=8, producing=8)
    assert len(drafts.get("good", [])) >= 4 and "bad" not in drafts
    assert spec.num_drafts == 100 and spec.num_accepted_tokens == 200
    assert spec.accepted_per_position[:4] == [50] * 4
    spec.finish("good", [2], completed=True)
    assert spec.rate("good") == spec.rate("never-seen")  # the pooled fresh prior


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
