"""Sampled speculative decoding keeps the output distribution (spec/verify.py): point-mass
proposal rejection sampling, checked with chi-square tests (scipy) on the verifier alone
(many trials) and on an engine (many seeds, speculation on against off)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from slotserve.core.outputs import ScheduledSeq
from slotserve.runner.sampler import Sampler
from slotserve.sampling import SamplingParams
from slotserve.spec.verify import accept_greedy, accept_sampled, target_probs
from tests.conftest import random_prompts, tiny_engine, tiny_hf_model
from tests.unit.test_spec_engine import OracleProposer, run

ALPHA = 1e-3  # a correct sampler fails one such test in a thousand


def test_greedy_acceptance_is_the_argmax_chain():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == (3, 8)
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == (1, 9)
    assert accept_greedy([5], [4, 1]) == (0, 4)
    assert accept_greedy([], [3]) == (0, 3)


@pytest.mark.parametrize("seed", [0, 1])
def test_each_position_keeps_the_target_distribution(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 6
    probs = torch.rand((3, vocab), generator=gen).pow(2)
    probs[1, 4] = 0.0  # a token the target never takes
    probs /= probs.sum(dim=-1, keepdim=True)
    drafts = [int(probs[0].argmax()), 4]  # the second has probability 0: always rejected
    trials = 20_000
    first, second = Counter(), Counter()
    for _ in range(trials):
        bonus = int(torch.multinomial(probs[2], 1, generator=gen))
        accepted, token = accept_sampled(drafts, probs, bonus, [gen, gen])
        out = [*drafts[:accepted], token]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    for counts, p in ((first, probs[0]), (second, probs[1])):
        observed = np.array([counts[t] for t in range(vocab)], dtype=float)
        expected = p.double().numpy()
        expected *= observed.sum() / expected.sum()  # NOTE: float32 rows sum to 1 +- 1e-7
        keep = expected > 0
        assert observed[~keep].sum() == 0, "a token of probability 0 came out"
        assert chisquare(observed[keep], expected[keep]).pvalue > ALPHA
    assert second[4] == 0 and sum(second.values()) > trials / 10


def test_target_probs_are_the_samplers():
    """A row's distribution as target_probs builds it is what the sampler samples from
    (temperature, top-k, top-p; min_tokens' masks)."""
    logits = torch.randn((2, 32), generator=torch.Generator().manual_seed(3)) * 3
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_tokens=3,
                            stop_token_ids=[int(logits[0].argmax())])
    rows = [ScheduledSeq("r", [1], 4, [0], True, params, n, "decode") for n in (2, 3)]
    probs = target_probs(logits, rows, eos_token_ids=())
    assert probs[0, int(logits[0].argmax())] == 0  # min_tokens not reached: masked
    assert probs[1, int(logits[1].argmax())] > 0
    sampler = Sampler(torch.device("cpu"), seed=0)
    draws = Counter(sampler(logits[:1].expand(4000, -1), [rows[0]] * 4000)[0])  # 4000 rows
    support = torch.nonzero(probs[0] > 0).flatten().tolist()
    assert set(draws) <= set(support)
    observed = np.array([draws[t] for t in support], dtype=float)
    expected = probs[0, support].double().numpy()
    expected *= observed.sum() / expected.sum()
    assert chisquare(observed, expected).pvalue > ALPHA


@pytest.mark.parametrize("shaping", [{}, {"presence_penalty": 1.0, "repetition_penalty": 1.5,
                                          "logit_bias": {3: 2.0}}], ids=["plain", "penalties"])
def test_engine_distribution_with_and_without_drafts(shaping):
    hf = tiny_hf_model("llama", seed=2)
    prompt = random_prompts(1, min_len=12, max_len=12, seed=4)[0]
    greedy = run(tiny_engine(hf), [prompt],
                 SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    draft = greedy[("r0", 0)][0]  # the most likely path: drafts accepted often, not always
    count = 300
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True, seed=s,
                             **shaping) for s in range(count)]
    settings = dict(max_num_seqs=64, num_blocks=400, block_size=8)
    off = run(tiny_engine(hf, **settings), [prompt] * count, params)
    engine = tiny_engine(hf, speculative_config='{"method": "suffix", '
                         '"num_speculative_tokens": 3}', **settings)

    class FixedPath(OracleProposer):
        def propose(self, seq_id, prompt_ids, output_ids, max_tokens):
            return list(draft[len(output_ids):len(output_ids) + max_tokens])

    engine.scheduler.speculator.proposer = FixedPath({})
    on = run(engine, [prompt] * count, params)
    spec = engine.scheduler.speculator
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    for position in (1, 2, 3):
        a = Counter(v[0][position] for v in off.values())
        b = Counter(v[0][position] for v in on.values())
        tokens = sorted(set(a) | set(b))
        table = np.array([[a[t] for t in tokens], [b[t] for t in tokens]])
        assert chi2_contingency(table).pvalue > ALPHA, (position, table)
