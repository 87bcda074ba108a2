"""The offline API on a tiny random model: bad input, seeds, stops, n, metrics, traces."""

from __future__ import annotations

import json

import pytest

from slotserve import SamplingParams
from tests.conftest import random_prompts, tiny_llm


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return tiny_llm(tiny_llama, block_size=8, num_blocks=64, max_model_len=128)


def test_bad_input_is_a_value_error_naming_the_field(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([list(range(3, 200))])  # beyond max_model_len=128
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1, 2, 10**6]])  # token id out of vocab
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("text needs a tokenizer")
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([[1, 2, 3]], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="top_p"):
        llm.generate([[1, 2, 3]], SamplingParams(top_p=0))
    # A rejected batch leaves nothing behind.
    llm.engine.check_integrity()
    assert not llm.engine.has_unfinished_requests()


def test_a_rejected_prompt_in_a_batch_rolls_back_the_batch(llm):
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], []])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_seed_reproducible_whatever_the_batch(llm):
    prompts = random_prompts(6, seed=11, max_len=30)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=123, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)] * 5
    batch = llm.generate(prompts, [seeded, *others])
    assert batch[0].token_ids == alone
    again = llm.generate([prompts[0]], seeded)[0].token_ids
    assert again == alone


def test_stop_token_ids_and_max_tokens(llm):
    prompt = random_prompts(1, seed=5)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0,
                                                 ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0,
                                                stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:first + 1]


def test_n_completions_and_metrics(llm):
    out = llm.generate([[3, 4, 5, 6]], SamplingParams(max_tokens=6, temperature=1.0, n=3,
                                                      seed=1, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 6 for o in out.outputs)
    m = out.outputs[0].metrics
    assert m.arrival <= m.scheduled <= m.first_token <= m.finished
    assert m.ttft > 0 and m.tpot > 0 and len(m.itls) == 5


def test_trace_written(llm, tmp_path):
    path = tmp_path / "trace.json"
    llm.generate(random_prompts(4, seed=2, max_len=20),
                 SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), trace=str(path))
    trace = json.loads(path.read_text())
    assert trace["version"] == 1 and trace["source"] == "engine"
    assert len(trace["requests"]) == 4
    assert all(len(it["slots"]) == trace["num_slots"] for it in trace["iterations"])
    assert all(r["finish_iteration"] is not None for r in trace["requests"])
