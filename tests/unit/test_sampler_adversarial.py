"""The sampler under adversarial logits and extreme but valid SamplingParams (issue 14).

Hypothesis draws batches of rows (huge, tiny, tied, nearly all -inf logits; token 0 always
-inf or the lowest) with a mix of greedy and random rows and params at the edges of what
SamplingParams accepts. Whatever it draws, the sampler returns one in-range token per row,
never NaN, never a -inf token, never token 0, and each token inside the row's top-k / top-p /
min-p set (checked against a float64 reference of those sets, with a float32 tolerance).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotserve.core.outputs import ScheduledSeq
from slotserve.runner.sampler import Sampler
from slotserve.sampling import INT64_MAX, INT64_MIN, SamplingParams

FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny
NEG_INF = float("-inf")
SETTINGS = settings(deadline=None, database=None, derandomize=True, max_examples=300,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MASS_TOLERANCE = 1e-3  # float32 softmax / cumsum against the float64 reference

TEMPERATURES = st.one_of(
    st.sampled_from([0.0, 1e-50, 1e-6, 9.99e-6, 1e-5, 1.1e-5, 1e-3, 0.7, 1.0, 1e3, 1e4,
                     1e30, FLOAT32_MAX, 1e300]),
    st.floats(0, 10))
TOP_P = st.one_of(st.sampled_from([1e-300, 1e-50, FLOAT32_TINY, 1e-8, 0.5, 0.9, 1.0]),
                  st.floats(5e-324, 1.0))
MIN_P = st.one_of(st.sampled_from([0.0, 1e-50, 0.1, 0.5, 0.999, 1.0]), st.floats(0, 1))
SEEDS = st.one_of(st.none(), st.sampled_from([INT64_MIN, -1, 0, 1, INT64_MAX]),
                  st.integers(INT64_MIN, INT64_MAX))


@st.composite
def top_ks(draw, vocab: int) -> int:
    return draw(st.one_of(st.sampled_from([-1, 0, 1, 2, vocab - 1, vocab, vocab + 1, 2**31,
                                           INT64_MAX, 10**30, 10**400]),
                          st.integers(1, vocab + 2)))


@st.composite
def params(draw, vocab: int) -> SamplingParams:
    return SamplingParams(temperature=draw(TEMPERATURES), top_k=draw(top_ks(vocab)),
                          top_p=draw(TOP_P), min_p=draw(MIN_P), seed=draw(SEEDS))


@st.composite
def logit_row(draw, vocab: int) -> list[float]:
    """One row of float32-representable logits with a finite logit past token 0, and token 0
    at -inf or strictly the row's lowest (so that only a huge temperature or no filter at all
    may choose it, which the reference checks)."""
    kind = draw(st.sampled_from(["normal", "huge", "tiny", "ties", "one_finite", "few_finite"]))
    finite = {
        "normal": st.floats(-30, 30, width=32),
        "huge": st.sampled_from([FLOAT32_MAX, -FLOAT32_MAX, 1e38, -1e38, 1e30, 0.0]),
        "tiny": st.floats(-(2.0**-100), 2.0**-100, width=32),
        "ties": st.sampled_from([2.0, 2.0, 1.0, -5.0]),
    }.get(kind, st.floats(-1e4, 1e4, width=32))
    row = draw(st.lists(finite, min_size=vocab, max_size=vocab))
    if kind in ("one_finite", "few_finite"):
        keep = draw(st.sets(st.integers(1, vocab - 1), min_size=1,
                            max_size=1 if kind == "one_finite" else vocab - 1))
        row = [v if i in keep else NEG_INF for i, v in enumerate(row)]
    if not any(math.isfinite(v) for v in row[1:]):
        row[draw(st.integers(1, vocab - 1))] = 0.0
    low = min(row[1:])
    below = low - max(1.0, abs(low) / 2)  # strictly lower in float32 too, or -inf
    row[0] = NEG_INF if draw(st.booleans()) or below < -FLOAT32_MAX else below
    return row


@st.composite
def batches(draw) -> tuple[torch.Tensor, list[ScheduledSeq]]:
    vocab = draw(st.integers(2, 40))
    n_rows = draw(st.integers(1, 6))
    rows = [draw(logit_row(vocab)) for _ in range(n_rows)]
    seqs = [seq(str(i), draw(params(vocab)), draw(st.integers(0, 10**6)))
            for i in range(n_rows)]
    return torch.tensor(rows, dtype=torch.float32), seqs


def seq(rid: str, params: SamplingParams, step: int = 0) -> ScheduledSeq:
    return ScheduledSeq(rid, [1], 0, [0], True, params, step, "decode")


# --------------------------------------------------------------------------- the reference
def allowed(row: torch.Tensor, p: SamplingParams, token: int) -> tuple[bool, str]:
    """Whether `token` is inside the row's top-k, top-p and min-p sets (float64, tolerant
    by MASS_TOLERANCE where float32 rounding can move a boundary)."""
    if not math.isfinite(float(row[token])):
        return False, "a -inf token"
    vocab = row.numel()
    if p.greedy:
        return token == int(row.argmax()), "greedy: not the first argmax"
    # The row as the sampler scales it (float32: values that round together are ties).
    temperature = torch.tensor(min(p.temperature, FLOAT32_MAX), dtype=torch.float32)
    scaled = (row - row.max()) / temperature
    better = scaled > scaled[token]
    strictly_better = int(better.sum())
    k = p.top_k if 0 < p.top_k < vocab else vocab
    if strictly_better >= k:
        return False, f"outside top_k={k}: {strictly_better} better"
    weights = scaled.double().exp()
    top_k_mass = weights.sort(descending=True).values[:k].sum()
    better_mass = float(weights[better].sum() / top_k_mass)
    if strictly_better and better_mass >= float(torch.tensor(p.top_p)) + MASS_TOLERANCE:
        return False, f"outside top_p={p.top_p}: {better_mass} better"
    ratio = float(weights[token])  # to the max, which has weight 1
    if ratio < float(torch.tensor(p.min_p)) * (1 - MASS_TOLERANCE):
        return False, f"outside min_p={p.min_p}: ratio {ratio}"
    return True, ""


# --------------------------------------------------------------------------- property tests
@SETTINGS
@given(batch=batches())
def test_adversarial_batches_sample_allowed_tokens(batch):
    logits, seqs = batch
    before = logits.clone()

    tokens, logprobs = Sampler(torch.device("cpu"), seed=3)(logits, seqs)

    assert torch.equal(logits, before), "the sampler changed its input"
    assert logprobs == [None] * len(seqs)
    assert len(tokens) == len(seqs)
    for row, (token, s) in enumerate(zip(tokens, seqs)):
        assert 0 <= token < logits.shape[1], (token, s.sampling_params)
        assert token != 0 or math.isfinite(logits[row, 0]), "a -inf token 0"
        ok, why = allowed(logits[row], s.sampling_params, token)
        assert ok, (why, token, logits[row].tolist(), s.sampling_params)


@SETTINGS
@given(batch=batches(), data=st.data())
def test_seeded_rows_repeat_whatever_the_batch(batch, data):
    """The same seeded row gives the same token alone and inside any batch (edge seeds too)."""
    logits, seqs = batch
    row = data.draw(st.integers(0, len(seqs) - 1))
    target = seqs[row].sampling_params
    if target.seed is None:
        target = SamplingParams(temperature=target.temperature, top_k=target.top_k,
                                top_p=target.top_p, min_p=target.min_p,
                                seed=data.draw(SEEDS.filter(lambda s: s is not None)))
        seqs[row] = seq("x", target, seqs[row].num_output_tokens)
    sampler = Sampler(torch.device("cpu"))

    alone, _ = sampler(logits[row:row + 1], [seqs[row]])
    batch_tokens, _ = sampler(logits, seqs)
    again, _ = sampler(logits[row:row + 1], [seqs[row]])

    assert alone[0] == batch_tokens[row] == again[0]


@SETTINGS
@given(batch=batches())
def test_the_fused_argmax_samples_as_numpys(cpu_ops, batch):
    """The fused kernels' argmax (greedy rows and the race) picks what numpy's does."""
    logits, seqs = batch
    expected, _ = Sampler(torch.device("cpu"), seed=3)(logits, seqs)
    assert Sampler(torch.device("cpu"), seed=3, ops=cpu_ops)(logits, seqs)[0] == expected


# --------------------------------------------------------------------------- reported cases
def test_top_k_past_int64_is_all_of_the_vocabulary():
    """Issue 14: top_k=10**30 made torch.tensor overflow inside the runner."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    huge = [seq(str(i), SamplingParams(top_k=10**30, seed=i)) for i in range(3)]
    off = [seq(str(i), SamplingParams(top_k=0, seed=i)) for i in range(3)]
    sampler = Sampler(torch.device("cpu"))
    assert sampler(logits, huge)[0] == sampler(logits, off)[0]


@pytest.mark.parametrize("kwargs", [{"temperature": 1e-50}, {"top_p": 1e-50},
                                    {"top_p": 1e-300, "top_k": 10**30}, {"min_p": 1.0},
                                    {"temperature": 1e-6}])
def test_tiny_values_take_the_best_token_not_token_0(kwargs):
    """Issue 14: temperature / top_p of 1e-50 rounded to 0 in float32 and sampled token 0."""
    logits = torch.tensor([[-3.0, 1.0, 4.0, 2.0], [NEG_INF, 0.5, -1.0, 7.0]])
    seqs = [seq(str(i), SamplingParams(seed=i, **kwargs)) for i in range(2)]
    tokens, _ = Sampler(torch.device("cpu"))(logits, seqs)
    assert tokens == [2, 3]


def test_min_p_one_keeps_the_tied_maxima_only():
    logits = torch.tensor([[NEG_INF, 5.0, 1.0, 5.0, 4.999]]).repeat(400, 1)
    seqs = [seq(str(i), SamplingParams(min_p=1.0)) for i in range(400)]
    tokens, _ = Sampler(torch.device("cpu"), seed=0)(logits, seqs)
    assert set(tokens) == {1, 3}


def test_greedy_below_1e_5():
    assert SamplingParams(temperature=9.99e-6).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-5).greedy


def test_huge_temperature_is_uniform_over_the_finite_tokens():
    logits = torch.tensor([[NEG_INF, 30.0, -30.0, NEG_INF, 0.0]]).repeat(3000, 1)
    seqs = [seq(str(i), SamplingParams(temperature=1e300)) for i in range(3000)]
    tokens, _ = Sampler(torch.device("cpu"), seed=0)(logits, seqs)
    counts = torch.bincount(torch.tensor(tokens), minlength=5)
    assert counts[0] == counts[3] == 0 and counts[[1, 2, 4]].min() > 850


def test_non_finite_logits_in_random_rows():
    """A NaN counts as -inf; +inf tokens are the only ones left; an all -inf row samples."""
    logits = torch.tensor([[float("nan"), NEG_INF, 2.0, 1.0],
                           [1.0, float("inf"), 3.0, float("inf")],
                           [NEG_INF] * 4])
    seqs = [seq(str(i), SamplingParams(seed=i)) for i in range(3)]
    for step in range(20):
        seqs = [seq(s.request_id, s.sampling_params, step) for s in seqs]
        tokens, _ = Sampler(torch.device("cpu"))(logits, seqs)
        assert tokens[0] in (2, 3) and tokens[1] in (1, 3) and 0 <= tokens[2] < 4


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(("field", "value"), [
    ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", 10**30), ("stop_token_ids", [2**63]),
    ("stop_token_ids", [1, 10**30]), ("max_tokens", 2**63), ("temperature", float("inf")),
    ("temperature", 10**400), ("top_p", float("nan")), ("top_p", float("inf")),
    ("min_p", float("nan")), ("min_p", float("-inf")), ("top_k", 1.5), ("top_k", True),
])
def test_values_past_the_tensors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("kwargs", [
    {"seed": INT64_MIN}, {"seed": INT64_MAX}, {"stop_token_ids": [INT64_MAX]},
    {"max_tokens": INT64_MAX}, {"top_k": 10**400}, {"temperature": 1e300},
])
def test_edge_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_for_choice_wraps_seeds_within_int64():
    params = SamplingParams(seed=INT64_MAX, n=3)
    assert [params.for_choice(i).seed for i in range(3)] == [INT64_MAX, INT64_MIN, INT64_MIN + 1]
