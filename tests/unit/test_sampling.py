"""SamplingParams validation and the sampler's filters, seeds and logprobs."""

from __future__ import annotations

import pytest
import torch

from slotserve.core.outputs import ScheduledSeq
from slotserve.runner.sampler import Sampler, apply_filters, argmax_rows
from slotserve.sampling import SamplingParams


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 1.5), ("temperature", -0.1),
    ("top_p", 0.0), ("top_p", 1.2), ("top_k", -2), ("min_p", 1.5), ("seed", "x"),
    ("logprobs", 21), ("n", 0), ("stop", [""]), ("temperature", float("nan")),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_accepts_a_string():
    assert SamplingParams(stop="END").stop == ("END",)


def seq(rid: str, params: SamplingParams, step: int = 0) -> ScheduledSeq:
    return ScheduledSeq(rid, [1], 0, [0], True, params, step, "decode")


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(torch.device("cpu"))
    for params in (SamplingParams(temperature=1.0, top_k=1),
                   SamplingParams(temperature=1.0, top_p=1e-6)):
        tokens, _ = sampler(logits, [seq(str(i), params) for i in range(4)])
        assert tokens == logits.argmax(-1).tolist()


def test_filters_keep_the_right_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda p: torch.isfinite(apply_filters(logits, [p]))[0].tolist()
    assert kept(SamplingParams(top_k=2)) == [True, True, False, False]
    assert kept(SamplingParams(top_p=0.8)) == [True, True, False, False]
    assert kept(SamplingParams(top_p=0.81)) == [True, True, True, False]
    assert kept(SamplingParams(min_p=0.5)) == [True, True, False, False]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    sampler = Sampler(torch.device("cpu"), seed=1)
    tokens, _ = sampler(logits, [seq(str(i), SamplingParams(temperature=1.0))
                                 for i in range(4000)])
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_seeded_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 100, generator=gen)
    params = SamplingParams(temperature=1.0, seed=42)
    sampler = Sampler(torch.device("cpu"))
    alone, _ = sampler(logits[2:3], [seq("x", params, step=3)])
    others = [seq(str(i), SamplingParams(temperature=1.0)) for i in range(5)]
    others[2] = seq("x", params, step=3)
    batch, _ = sampler(logits, others)
    assert batch[2] == alone[0]


def test_logprobs_top_n_and_sampled_token():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    _, logprobs = Sampler(torch.device("cpu"))(
        logits, [seq("a", SamplingParams(temperature=0.0, logprobs=2))])
    expected = logits.log_softmax(-1)[0]
    assert set(logprobs[0]) == {0, 1}
    assert logprobs[0][0] == pytest.approx(float(expected[0]))


def test_argmax_rows_equals_torch_on_ties_nan_and_inf():
    logits = torch.randn(6, 1000)
    logits[1, 5] = logits[1, 9] = 100.0  # a tie: the first
    logits[2, 7] = logits[2, 3] = float("nan")  # NaN wins, the first NaN
    logits[3] = float("-inf")
    logits[4, 2] = logits[4, 0] = float("inf")
    expected = logits.argmax(dim=-1)

    got = argmax_rows(logits)

    assert got.dtype == torch.int64 and torch.equal(got, expected)
    assert got.tolist()[1:5] == [5, 3, 0, 0]
    assert torch.equal(argmax_rows(logits[:, ::2]), logits[:, ::2].argmax(dim=-1))  # strided
    half = logits[:2].bfloat16()  # numpy has no bfloat16: torch's argmax then
    assert torch.equal(argmax_rows(half), half.argmax(dim=-1))
