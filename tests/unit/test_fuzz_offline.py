"""Hypothesis-driven inputs through the offline API (`slotserve.LLM`, the embedded model):
bad SamplingParams and prompts raise a clear ValueError and nothing else, good ones complete,
and the engine keeps working afterwards (`check_integrity()`, the same greedy output).

Bounded: a few hundred SamplingParams (no model), a few dozen generations of 1-3 tokens.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from slotserve import LLM, SamplingParams

MAX_MODEL_LEN = 128
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=MAX_MODEL_LEN,
              num_blocks=64, block_size=16, seed=0)
CANARY = "The capital of France is"
FUZZ = settings(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def canary(llm):
    """The greedy output of one prompt before any fuzzing."""
    return greedy(llm)


def greedy(llm: LLM) -> list[int]:
    out = llm.generate(CANARY, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    return out[0].outputs[0].token_ids


# --------------------------------------------------------------------------- strategies
ANYTHING = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5),
                     st.lists(st.integers(), max_size=3), st.lists(st.text(max_size=3),
                                                                   max_size=3))
NUMBERS = st.one_of(st.integers(-10**20, 10**20), st.floats(allow_nan=True, allow_infinity=True),
                    st.booleans())
INTS = st.one_of(st.integers(-10**20, 10**20), st.booleans(), st.floats(-5, 5))
STOPS = st.one_of(st.none(), st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3))
FIELDS = {
    "max_tokens": INTS, "temperature": NUMBERS, "top_p": NUMBERS, "top_k": INTS,
    "min_p": NUMBERS, "seed": st.one_of(st.none(), INTS), "stop": STOPS,
    "stop_token_ids": st.lists(INTS, max_size=3), "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), INTS), "n": INTS, "skip_special_tokens": st.booleans(),
}


@st.composite
def sampling_kwargs(draw, fields=FIELDS, odd=None, wild: float = 0.1) -> dict:
    """A few SamplingParams fields from `fields`; with probability `wild` a field is drawn
    from `odd` instead (default: any type at all)."""
    names = draw(st.sets(st.sampled_from(sorted(fields)), max_size=len(fields)))
    odd_ones = draw(st.sets(st.sampled_from(sorted(fields)), max_size=len(fields))
                    if draw(st.integers(0, 99)) >= 100 - 100 * wild else st.just(set()))
    return {name: draw((odd or {}).get(name, ANYTHING) if name in odd_ones else fields[name])
            for name in names}


# Valid small generations (each example costs at most a few tokens), odd values now and then.
RUNNABLE = {
    "max_tokens": st.integers(1, 3), "temperature": st.floats(0, 3.0),
    "top_p": st.floats(0.01, 1.0), "top_k": st.integers(-1, 60), "min_p": st.floats(0, 1),
    "seed": st.one_of(st.none(), st.integers(-2**70, 2**70)), "stop": STOPS,
    "stop_token_ids": st.lists(st.integers(0, 60_000), max_size=3),
    "ignore_eos": st.booleans(), "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "n": st.integers(1, 3), "skip_special_tokens": st.booleans(),
}
TOKEN_IDS = st.one_of(
    st.lists(st.integers(0, 49_151), min_size=1, max_size=40),
    st.lists(st.one_of(st.integers(-5, 49_160), st.integers(-2**70, 2**70), st.booleans(),
                       st.floats(-3, 3), st.none()), max_size=40))
PROMPTS = st.one_of(
    st.text(max_size=60),  # unicode, empty
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=30),
    st.integers(1, 60).map(lambda k: "lorem ipsum " * k),  # up to over max_model_len
    TOKEN_IDS,
    st.lists(st.integers(0, 49_151), min_size=MAX_MODEL_LEN - 2, max_size=MAX_MODEL_LEN + 2),
    st.lists(st.one_of(st.text(max_size=10), TOKEN_IDS), min_size=0, max_size=3),  # batches
)


# --------------------------------------------------------------------------- tests
@settings(FUZZ, max_examples=400)
@given(kwargs=sampling_kwargs())
@example(kwargs={"temperature": math.nan})
@example(kwargs={"n": True})
@example(kwargs={"stop": [""]})
@example(kwargs={"stop_token_ids": "12"})
def test_sampling_params_raise_only_value_errors(kwargs):
    try:
        params = SamplingParams(**kwargs)
    except ValueError as exc:
        assert str(exc).split(" ", 1)[0] in FIELDS, f"the message names no field: {exc}"
        return
    assert params.max_tokens >= 1 and 1 <= params.n <= 128


@pytest.mark.parametrize("kwargs", [{"stop": 5}, {"stop_token_ids": 7}, {"stop": True}])
def test_non_iterable_stop_is_a_value_error(kwargs):
    with pytest.raises(ValueError, match="^stop"):
        SamplingParams(**kwargs)


@settings(FUZZ, max_examples=40)
@given(prompt=PROMPTS, kwargs=sampling_kwargs(RUNNABLE, FIELDS, wild=0.05))
@example(prompt="", kwargs={})
@example(prompt=[], kwargs={})
@example(prompt=[-1, 5], kwargs={})
@example(prompt=[49_152], kwargs={})
@example(prompt="\ud800 lone surrogate", kwargs={})
@example(prompt="word " * 500, kwargs={})
@example(prompt=[7] * (MAX_MODEL_LEN - 1), kwargs={"max_tokens": 10**9})  # exactly 1 token
@example(prompt=[7] * MAX_MODEL_LEN, kwargs={})  # no room for an output token
def test_prompts_and_params_through_the_offline_api(llm, canary, prompt, kwargs):
    try:
        params = SamplingParams(**kwargs)
        outputs = llm.generate(prompt, params, use_tqdm=False)
    except ValueError as exc:
        event(f"ValueError: {str(exc).split(' ', 1)[0]}")
    else:
        event("generated")
        for out in outputs:
            assert len(out.outputs) == params.n
            for c in out.outputs:
                assert c.finish_reason in ("stop", "length"), (c.finish_reason, out.error)
                assert 1 <= len(c.token_ids) <= params.max_tokens
    llm.engine.check_integrity()
    assert not llm.engine.has_unfinished_requests()


def test_a_batch_with_one_bad_prompt_adds_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate(["fine", [1, 2, -3]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)  # 2 prompts, 1 params
    llm.engine.check_integrity()
    assert not llm.engine.has_unfinished_requests()


def test_the_engine_still_works_after_the_fuzz(llm, canary):
    assert greedy(llm) == canary
    llm.engine.check_integrity()
    pool = llm.engine.kv
    assert pool.num_free_blocks == pool.num_blocks
