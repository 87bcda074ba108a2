"""Presence, frequency and repetition penalties (issue 34, item 1).

The batched sampler's penalties are compared, bit for bit, with a plain per-token reference
in float32 (OpenAI's definition for presence / frequency over the completion's own tokens,
vLLM's / HF's multiplicative repetition penalty over prompt and output), over random logits
and histories; a row's result does not depend on the rest of the batch; an engine's greedy
completions take, at every step, the argmax of the reference applied to the logits it saw.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotserve.core.outputs import ScheduledSeq
from slotserve.runner.logit_shaping import (
    SequenceShaping,
    ShapingSpec,
    TokenCounts,
    apply_bias_and_penalties,
)
from slotserve.runner.sampler import Sampler
from slotserve.sampling import SamplingParams
from tests.conftest import random_prompts, tiny_engine

VOCAB = 40
SETTINGS = settings(deadline=None, database=None, derandomize=True, max_examples=200,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FLOAT32 = np.finfo(np.float32)


# --------------------------------------------------------------------------- reference
def reference_penalties(row: np.ndarray, prompt: list[int], outputs: list[int],
                        params: SamplingParams) -> np.ndarray:
    """One row, one token at a time, in float32: bias, repetition, frequency, presence."""
    out = row.astype(np.float32).copy()
    for token, bias in params.logit_bias:
        out[token] = np.float32(out[token] + np.float32(bias))
    p = np.float32(min(max(params.repetition_penalty, float(FLOAT32.tiny)), float(FLOAT32.max)))
    if params.repetition_penalty != 1.0:
        for token in set(prompt) | set(outputs):
            x = out[token]
            with np.errstate(over="ignore"):  # a huge p may overflow to -inf, as in torch
                out[token] = x / p if x > 0 else x * p
    for token, count in Counter(outputs).items():
        x = np.float32(out[token] - np.float32(params.frequency_penalty) * np.float32(count))
        out[token] = np.float32(x - np.float32(params.presence_penalty))
    return out


def shaping_for(params: SamplingParams, prompt: list[int], outputs: list[int],
                vocab: int = VOCAB) -> SequenceShaping | None:
    spec = ShapingSpec.build(params, None, vocab)
    return None if spec is None else SequenceShaping(spec, prompt, outputs)


# --------------------------------------------------------------------------- strategies
PENALTY = st.one_of(st.sampled_from([0.0, -2.0, 2.0, 0.5, -0.5, 1e-30]), st.floats(-2, 2))
REPETITION = st.one_of(st.sampled_from([1.0, 1.0, 1.3, 0.5, 2.0, 1e-300, 1e-40, 1e30, 1e300]),
                       st.floats(0.01, 10))
LOGIT = st.one_of(st.sampled_from([0.0, -0.0, float("-inf"), 1e30, -1e30, 1e-40]),
                  st.floats(-50, 50, width=32))


@st.composite
def penalty_params(draw) -> SamplingParams:
    bias = draw(st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=5))
    return SamplingParams(presence_penalty=draw(PENALTY), frequency_penalty=draw(PENALTY),
                          repetition_penalty=draw(REPETITION), logit_bias=bias,
                          temperature=draw(st.sampled_from([0.0, 1.0])))


@st.composite
def batch(draw):
    """Rows: (logits, prompt, outputs, params or None)."""
    rows = []
    for _ in range(draw(st.integers(1, 6))):
        logits = draw(st.lists(LOGIT, min_size=VOCAB, max_size=VOCAB))
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30))
        outputs = draw(st.lists(st.integers(0, VOCAB - 1), max_size=30))
        params = draw(st.one_of(st.none(), penalty_params()))
        rows.append((logits, prompt, outputs, params))
    return rows


def run_batch(rows) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    shaping = [None if p is None else shaping_for(p, prompt, out)
               for _, prompt, out, p in rows]
    return logits, apply_bias_and_penalties(logits, shaping)


# --------------------------------------------------------------------------- params
@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.01), ("presence_penalty", -3), ("presence_penalty", float("nan")),
    ("frequency_penalty", float("inf")), ("frequency_penalty", True), ("frequency_penalty", "1"),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("repetition_penalty", None),
])
def test_a_bad_penalty_names_its_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_penalties_at_their_bounds_are_accepted():
    params = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-300)
    assert params.penalized and params.shapes_logits
    assert not SamplingParams().penalized and not SamplingParams().shapes_logits
    assert SamplingParams(n=2, presence_penalty=1).for_choice(1).presence_penalty == 1


# --------------------------------------------------------------------------- counts
@SETTINGS
@given(st.lists(st.lists(st.integers(0, 20), max_size=8), max_size=8),
       st.frozensets(st.integers(0, 20)))
def test_token_counts_kept_incrementally_equal_a_recount(chunks, known):
    counts, tokens = TokenCounts(known), []
    for chunk in chunks:
        tokens.extend(chunk)
        counts.sync(tokens)
        ids, numbers = counts.items()
        assert dict(zip(ids.tolist(), numbers.tolist())) == Counter(tokens)
        assert counts.novel == list(dict.fromkeys(t for t in tokens if t not in known))


# --------------------------------------------------------------------------- sampler rows
@SETTINGS
@given(batch())
def test_penalties_equal_the_reference_bit_for_bit(rows):
    logits, out = run_batch(rows)
    for i, (row, prompt, outputs, params) in enumerate(rows):
        if params is None:
            assert torch.equal(out[i], logits[i])  # untouched
            continue
        expected = reference_penalties(np.array(row, dtype=np.float32), prompt, outputs, params)
        np.testing.assert_array_equal(out[i].numpy(), expected)
        assert not out[i].isnan().any()


@SETTINGS
@given(batch(), st.randoms(use_true_random=False))
def test_a_row_does_not_depend_on_the_rest_of_the_batch(rows, rng):
    _, together = run_batch(rows)
    order = list(range(len(rows)))
    rng.shuffle(order)
    _, shuffled = run_batch([rows[i] for i in order])
    for position, i in enumerate(order):
        assert torch.equal(shuffled[position], together[i])
        assert torch.equal(run_batch([rows[i]])[1][0], together[i])


def test_rows_without_penalties_cost_nothing():
    logits = torch.randn(3, VOCAB)
    assert apply_bias_and_penalties(logits, [None, None, None]) is logits
    spec = shaping_for(SamplingParams(), [1], [])
    assert spec is None  # nothing to shape: no state at all


def test_the_counts_follow_the_completion_as_it_grows():
    outputs: list[int] = []
    params = SamplingParams(frequency_penalty=1.0)
    state = shaping_for(params, [0], outputs)
    logits = torch.zeros(1, VOCAB)
    for step, token in enumerate([5, 5, 7, 5]):
        out = apply_bias_and_penalties(logits, [state])
        counts = Counter(outputs)
        assert out[0, 5].item() == -counts[5] and out[0, 7].item() == -counts[7], step
        outputs.append(token)  # NOTE: the engine appends to the list the state reads


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (1.0, 1)])
def test_greedy_and_sampled_rows_take_the_penalized_argmax(temperature, top_k):
    """Token 3 leads unpenalized; the frequency penalty on the output's 3s hands it to 4."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 3], logits[:, 4] = 5.0, 4.0
    penalized = SamplingParams(temperature=temperature, top_k=top_k, frequency_penalty=1.0)
    plain = SamplingParams(temperature=temperature, top_k=top_k)
    seqs = [ScheduledSeq(f"r{i}", [1], 0, [0], True, p, 2, "decode")
            for i, p in enumerate((penalized, plain))]
    shaping = [shaping_for(penalized, [1], [3, 3]), None]
    tokens, logprobs = Sampler(torch.device("cpu"))(logits, seqs, shaping=shaping)
    assert tokens == [4, 3]


def test_extreme_repetition_penalties_never_make_nan():
    logits = torch.tensor([[float("-inf"), 0.0, -0.0, 1e30, -1e30, 3.0]])
    for p in (1e-300, 1e300):
        state = shaping_for(SamplingParams(repetition_penalty=p), [0, 1, 2, 3, 4], [], 6)
        out = apply_bias_and_penalties(logits, [state])
        assert not out.isnan().any()
        assert out[0, 0] == float("-inf") and out[0, 5] == 3.0  # masked stays; unseen as is


# --------------------------------------------------------------------------- engine
class RecordingSampler:
    """Wraps the runner's sampler: keeps each call's logits and rows to check afterwards."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.calls: list[tuple[torch.Tensor, list[str], list[int]]] = []

    def __call__(self, logits, seqs, *args, **kwargs):
        tokens, logprobs = self.sampler(logits, seqs, *args, **kwargs)
        self.calls.append((logits.clone(), [s.request_id for s in seqs], list(tokens)))
        return tokens, logprobs


@pytest.mark.parametrize("num_blocks", [256, 12])  # 12: preemption and recompute
def test_engine_completions_follow_the_reference_at_every_step(tiny_llama, num_blocks):
    engine = tiny_engine(tiny_llama, max_num_seqs=6, num_blocks=num_blocks, block_size=8,
                         max_num_batched_tokens=64)
    recorder = RecordingSampler(engine.runner.sampler)
    engine.runner.sampler = recorder
    prompts = random_prompts(6, min_len=8, max_len=20, seed=3)
    prompts[0] = prompts[0][:4] * 4  # a repetitive prompt
    settings_ = [dict(), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
                 dict(repetition_penalty=1.8), dict(repetition_penalty=0.6, presence_penalty=-1),
                 dict(frequency_penalty=-0.5, logit_bias={"7": 3.0})]
    params = {f"r{i}": SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **kw)
              for i, kw in enumerate(settings_)}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params[f"r{i}"])
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    history: dict[str, list[int]] = {rid: [] for rid in params}
    changed = set()  # the requests whose penalties changed at least one greedy choice
    for logits, ids, tokens in recorder.calls:
        for row, (rid, token) in enumerate(zip(ids, tokens)):
            prompt = prompts[int(rid[1:])]
            expected = reference_penalties(logits[row].numpy(), prompt, history[rid],
                                           params[rid])
            assert token == int(np.argmax(expected)), (rid, len(history[rid]))
            if token != int(logits[row].argmax()):
                changed.add(rid)
            history[rid].append(token)
    assert history == outputs
    assert changed >= {"r1", "r2", "r3"}, changed
    if num_blocks == 12:
        assert engine.stats.preemptions > 0


@pytest.mark.parametrize("constrained", [False, True])
def test_the_model_logits_and_logprobs_stay_unshaped(constrained):
    """Shaping works on a copy: the caller's logits and the returned logprobs are the
    model's (vLLM's default), with or without a grammar mask first."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    original = logits.clone()
    params = SamplingParams(temperature=0, logprobs=2, frequency_penalty=2,
                            repetition_penalty=3.0, logit_bias={"4": -50})
    seqs = [ScheduledSeq(f"r{i}", [1], 0, [0], True, params, 3, "decode") for i in range(2)]
    shaping = [shaping_for(params, [1, 2], [4, 4, 5]) for _ in range(2)]
    allowed = ([1], torch.ones(1, VOCAB, dtype=torch.bool)) if constrained else None
    tokens, logprobs = Sampler(torch.device("cpu"))(logits, seqs, allowed, shaping=shaping)
    assert torch.equal(logits, original)
    model_logp = original.log_softmax(-1)
    for row, entry in enumerate(logprobs):
        assert entry[tokens[row]] == pytest.approx(float(model_logp[row, tokens[row]]))
    assert tokens == [int(np.argmax(reference_penalties(row.numpy(), [1, 2], [4, 4, 5], params)))
                      for row in original]
