"""logit_bias, allowed_token_ids and bad_words (issue 34, item 2): their validation (a
ValueError naming the field, in SamplingParams or at add_request against the vocabulary),
the sampler's masks against a plain reference, and what an engine's completions hold.
(logit_bias's arithmetic is checked bit for bit with the penalties in test_penalties.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotserve.core.outputs import ScheduledSeq
from slotserve.runner.logit_shaping import (
    SequenceShaping,
    ShapingSpec,
    apply_masks,
    bad_word_token_ids,
)
from slotserve.runner.sampler import Sampler
from slotserve.sampling import MAX_BAD_WORDS, SamplingParams
from tests.conftest import tiny_engine
from tests.unit.server_fixtures import text_engine, tiny_tokenizer

VOCAB = 30
NEG_INF = float("-inf")
SETTINGS = settings(deadline=None, database=None, derandomize=True, max_examples=150,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class WordTokenizer:
    """encode: each listed text -> its ids (what bad_word_token_ids asks of a tokenizer)."""

    def __init__(self, table: dict[str, list[int]]):
        self.table = table

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return self.table[text]


# --------------------------------------------------------------------------- params
@pytest.mark.parametrize("value,message", [
    ({"x": 1}, "keys must be token ids"), ({"-1": 1}, "keys must be token ids"),
    ({"1.0": 1}, "keys must be token ids"), ({" 1": 1}, "keys must be token ids"),
    ({"٣": 1}, "keys must be token ids"), ({True: 1}, "keys must be token ids"),
    ({"5": 1, "05": 2}, "gives token 5 twice"), ({"1": 100.5}, r"\[-100, 100\]"),
    ({"1": float("nan")}, r"\[-100, 100\]"), ({"1": "2"}, r"\[-100, 100\]"),
    ({str(i): 1 for i in range(301)}, "at most 300"), ("1:2", "a dict"),
    ({"9" * 400: 1}, "keys must be token ids"),
])
def test_a_bad_logit_bias_names_the_field(value, message):
    with pytest.raises(ValueError, match=f"^logit_bias .*{message}"):
        SamplingParams(logit_bias=value)


def test_logit_bias_is_kept_as_sorted_pairs_from_json_keys_or_ints():
    params = SamplingParams(logit_bias={"7": -100, 3: 2.5, "0": 100})
    assert params.logit_bias == ((0, 100.0), (3, 2.5), (7, -100.0))
    assert SamplingParams(logit_bias=params.logit_bias) == params  # dataclasses.replace
    assert SamplingParams(logit_bias={str(i): 1 for i in range(300)}).shapes_logits


@pytest.mark.parametrize("field,value", [
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", [True]),
    ("allowed_token_ids", [1.0]), ("allowed_token_ids", "12"), ("allowed_token_ids", 5),
    ("bad_words", "word"), ("bad_words", [""]), ("bad_words", ["  "]), ("bad_words", [3]),
    ("bad_words", ["x" * 101]), ("bad_words", ["w"] * (MAX_BAD_WORDS + 1)),
])
def test_bad_shaping_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {"512": 1.0}), ("allowed_token_ids", [3, 512]), ("bad_words", ["w"])])
def test_ids_past_the_vocabulary_are_refused_at_add_request(tiny_llama, field, value):
    """The tiny model has 512 rows and no tokenizer (bad_words needs one)."""
    engine = tiny_engine(tiny_llama, num_blocks=32)
    with pytest.raises(ValueError, match=f"^{field}"):
        engine.add_request("r", [5, 6, 7], SamplingParams(**{field: value}))
    assert not engine.has_unfinished_requests()


# --------------------------------------------------------------------------- bad words
def test_a_bad_word_is_banned_with_and_without_a_leading_space_as_vllm():
    tok = WordTokenizer({"cat": [5, 6], " cat": [7, 6], "dog": [8], " dog": [9, 8],
                         "a b": [1, 2], " a b": [1, 2]})
    assert bad_word_token_ids("cat", tok) == [[5, 6], [7, 6]]
    assert bad_word_token_ids("  cat", tok) == [[5, 6], [7, 6]]  # leading spaces dropped
    assert bad_word_token_ids("dog", tok) == [[8]]  # the spaced form has more tokens
    assert bad_word_token_ids("a b", tok) == [[1, 2]]  # the same first token


def test_the_last_token_is_banned_only_after_the_rest_of_the_word():
    tok = WordTokenizer({"abc": [1, 2, 3], " abc": [1, 2, 3], "z": [9], " z": [9]})
    spec = ShapingSpec.build(SamplingParams(bad_words=["abc", "z"]), tok, VOCAB)
    outputs: list[int] = []
    state = SequenceShaping(spec, [1, 2], outputs)  # the prompt does not count
    logits = torch.zeros(1, VOCAB)
    for history, banned in [([], {9}), ([1], {9}), ([1, 2], {9, 3}), ([2, 1, 2], {9, 3}),
                            ([1, 2, 4], {9}), ([1, 2, 3, 1, 2], {9, 3})]:
        outputs[:] = history
        out = apply_masks(logits, [state])
        assert set(np.flatnonzero(out[0].numpy() == NEG_INF)) == banned, history


# --------------------------------------------------------------------------- masks
@st.composite
def mask_rows(draw):
    rows = []
    for _ in range(draw(st.integers(1, 5))):
        logits = draw(st.lists(st.floats(-20, 20, width=32), min_size=VOCAB, max_size=VOCAB))
        allowed = draw(st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                     max_size=8)))
        banned = draw(st.lists(st.integers(0, VOCAB - 1), max_size=4))
        rows.append((logits, allowed, banned))
    return rows


def reference_masks(row: list[float], allowed: list[int] | None, banned: list[int]):
    out = np.array(row, dtype=np.float32)
    for token in range(VOCAB):
        if (allowed is not None and token not in allowed) or token in banned:
            out[token] = NEG_INF
    return out


@SETTINGS
@given(mask_rows())
def test_masks_equal_the_reference_and_leave_other_rows_alone(rows):
    tok = WordTokenizer({f"w{t}": [t] for t in range(VOCAB)}
                        | {f" w{t}": [t] for t in range(VOCAB)})
    logits = torch.tensor([r[0] for r in rows])
    shaping = []
    for _, allowed, banned in rows:
        params = SamplingParams(allowed_token_ids=allowed, bad_words=[f"w{t}" for t in banned])
        spec = ShapingSpec.build(params, tok, VOCAB)
        shaping.append(None if spec is None else SequenceShaping(spec, [0], []))
    try:
        out = apply_masks(logits, shaping)
    except ValueError as exc:  # only when a row's allowed tokens are all banned
        assert "leave no token" in str(exc)
        assert any(a is not None and set(a) <= set(b) for _, a, b in rows)
        return
    for i, (row, allowed, banned) in enumerate(rows):
        np.testing.assert_array_equal(out[i].numpy(), reference_masks(row, allowed, banned))
        if shaping[i] is None:
            assert torch.equal(out[i], logits[i])


def test_no_mask_no_copy():
    logits = torch.zeros(2, VOCAB)
    assert apply_masks(logits, [None, None]) is logits


@pytest.mark.parametrize("temperature", [0.0, 1.0, 50.0])
def test_sampled_tokens_stay_inside_allowed_token_ids(temperature):
    allowed = [2, 11, 17]
    params = SamplingParams(temperature=temperature, allowed_token_ids=allowed, seed=1)
    spec = ShapingSpec.build(params, None, VOCAB)
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0)) * 5
    seqs = [ScheduledSeq(f"r{i}", [1], 0, [0], True, params, i, "decode") for i in range(8)]
    shaping = [SequenceShaping(spec, [1], []) for _ in range(8)]
    tokens, logprobs = sampler(logits, seqs, shaping=shaping)
    assert set(tokens) <= set(allowed)


# --------------------------------------------------------------------------- engine
def _run(engine, prompts: dict[str, object], params: SamplingParams | dict):
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params[rid] if isinstance(params, dict) else params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_engine_completions_never_hold_a_bad_word(tiny_llama):
    tok = tiny_tokenizer()
    engine = text_engine(tiny_llama, tok, num_blocks=64)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = _run(engine, {"a": "the quick brown fox"}, greedy)["a"].outputs[0].token_ids
    # a word of two tokens from the unconstrained completion, that tokenizes back to them
    word = next(text for i in range(len(plain) - 1)
                if (text := tok.decode(plain[i:i + 2])).strip()
                and [plain[i:i + 2]] in [bad_word_token_ids(text, tok)[:1]])
    banned = bad_word_token_ids(word, tok)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, bad_words=[word])
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=3, ignore_eos=True,
                             bad_words=[word])
    done = _run(engine, {"b": "the quick brown fox", "c": "the quick brown fox"},
                {"b": params, "c": sampled})
    outputs = [done["b"].outputs[0].token_ids] + [c.token_ids for c in done["c"].outputs]
    assert outputs[0] != plain
    for tokens in outputs:
        assert len(tokens) == 40
        assert not any(_contains(tokens, ids) for ids in banned), (word, tokens)


def test_an_allowed_set_and_bad_words_that_leave_nothing_fail_only_that_request(tiny_llama):
    tok = tiny_tokenizer()
    engine = text_engine(tiny_llama, tok, num_blocks=64)
    (only,) = bad_word_token_ids("x", tok)  # a one-token word
    doomed = SamplingParams(max_tokens=5, temperature=0, allowed_token_ids=only,
                            bad_words=["x"])
    fine = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                          allowed_token_ids=[only[0], 50])
    done = _run(engine, {"doomed": "hello world", "fine": "hello world"},
                {"doomed": doomed, "fine": fine})
    assert done["doomed"].error and "leave no token" in done["doomed"].error
    assert not done["fine"].error
    assert set(done["fine"].outputs[0].token_ids) <= {only[0], 50}
    assert len(done["fine"].outputs[0].token_ids) == 5
