"""Prompt logprobs (issue 34, item 3): computed in the prefill chunks that run anyway, exact
against log_softmax of HF transformers' full-sequence forward (tiny Llama, fp32), whatever the
chunking, the batch, preemption or the prefix cache (a request that asks bypasses it)."""

from __future__ import annotations

import json

import pytest
import torch

from slotserve.runner.prompt_logprobs import PromptLogprobs
from slotserve.sampling import SamplingParams
from tests.conftest import random_prompts, tiny_engine

TOL = 1e-4


def hf_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """(L - 1, V): log_softmax of HF's logits at positions 0..L-2 (each predicts the next)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)[:-1]


def run(engine, prompts, params_of) -> dict[str, object]:
    """Run every prompt to the end; the last output of each request (completion 0's)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params_of(i))
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].index == 0:
                last[out.request_id] = out
        engine.check_integrity()
    return last


def check_exact(out, prompt: list[int], expected: torch.Tensor, top_n: int) -> None:
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None and out.prompt_logprob_ranks[0] is None
    for pos, (entry, rank) in enumerate(zip(out.prompt_logprobs[1:],
                                           out.prompt_logprob_ranks[1:])):
        row = expected[pos]
        token = prompt[pos + 1]
        assert entry[token] == pytest.approx(float(row[token]), abs=TOL)
        top_vals, top_ids = row.topk(top_n)
        for t, v in zip(top_ids.tolist(), top_vals.tolist()):
            assert entry[t] == pytest.approx(v, abs=TOL)
        assert set(entry) == set(top_ids.tolist()) | {token}
        assert rank == int((row > row[token]).sum()) + 1


@pytest.mark.parametrize("budget", [512, 16])
def test_prompt_logprobs_equal_a_full_forward(tiny_llama, budget):
    prompts = random_prompts(5, min_len=2, max_len=60, seed=3)
    engine = tiny_engine(tiny_llama, max_num_seqs=4, max_num_batched_tokens=budget,
                         block_size=8)
    tops = [0, 1, 5, 20, 3]
    outs = run(engine, prompts, lambda i: SamplingParams(
        max_tokens=3, temperature=0, prompt_logprobs=tops[i]))
    for i, prompt in enumerate(prompts):
        check_exact(outs[f"r{i}"], prompt, hf_logprobs(tiny_llama, prompt), tops[i])


def test_requests_without_prompt_logprobs_get_none_and_the_same_tokens(tiny_llama):
    prompts = random_prompts(3, seed=4)
    plain = run(tiny_engine(tiny_llama), prompts,
                lambda i: SamplingParams(max_tokens=6, temperature=0))
    mixed = run(tiny_engine(tiny_llama), prompts, lambda i: SamplingParams(
        max_tokens=6, temperature=0, prompt_logprobs=2 if i == 1 else None))
    for rid, out in plain.items():
        assert out.prompt_logprobs is None
        assert mixed[rid].token_ids == out.token_ids
    assert mixed["r1"].prompt_logprobs is not None and mixed["r0"].prompt_logprobs is None


def test_one_token_prompt_has_only_none(tiny_llama):
    outs = run(tiny_engine(tiny_llama), [[7]], lambda i: SamplingParams(
        max_tokens=2, temperature=0, prompt_logprobs=3))
    assert outs["r0"].prompt_logprobs == [None]


def test_prefix_cache_hits_are_bypassed(tiny_llama):
    """A prompt computed before (so cached) still gets all its prompt logprobs, exact; a
    request without them still hits the cache."""
    prompt = random_prompts(1, min_len=40, max_len=40, seed=5)[0]
    engine = tiny_engine(tiny_llama, block_size=8, enable_prefix_caching=True)
    first = run(engine, [prompt], lambda i: SamplingParams(max_tokens=2, temperature=0))
    assert first["r0"].prompt_logprobs is None
    again = run(engine, [prompt], lambda i: SamplingParams(max_tokens=2, temperature=0,
                                                           prompt_logprobs=4))
    assert again["r0"].num_cached_tokens == 0
    check_exact(again["r0"], prompt, hf_logprobs(tiny_llama, prompt), 4)
    plain = run(engine, [prompt], lambda i: SamplingParams(max_tokens=2, temperature=0))
    assert plain["r0"].num_cached_tokens > 0


def test_n_completions_compute_them_once(tiny_llama):
    prompt = random_prompts(1, min_len=30, max_len=30, seed=6)[0]
    engine = tiny_engine(tiny_llama, block_size=8, enable_prefix_caching=True)
    engine.add_request("r", prompt, SamplingParams(max_tokens=3, temperature=0, n=3,
                                                   prompt_logprobs=2))
    by_index = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            by_index[out.outputs[0].index] = out
    check_exact(by_index[0], prompt, hf_logprobs(tiny_llama, prompt), 2)
    assert by_index[1].prompt_logprobs is None and by_index[2].prompt_logprobs is None


def test_preemption_keeps_them_exact(tiny_llama):
    """A KV pool too small for every prompt at once: requests are preempted mid-prefill or
    after it, and recompute; every entry is still exact (none twice, none missing)."""
    prompts = random_prompts(4, min_len=40, max_len=60, seed=7)
    engine = tiny_engine(tiny_llama, max_num_seqs=4, max_num_batched_tokens=16, block_size=8,
                         num_blocks=14, enable_prefix_caching=True)
    outs = run(engine, prompts, lambda i: SamplingParams(max_tokens=20, temperature=0,
                                                         ignore_eos=True, prompt_logprobs=1))
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        check_exact(outs[f"r{i}"], prompt, hf_logprobs(tiny_llama, prompt), 1)


def test_a_hole_in_the_positions_is_an_error():
    acc = PromptLogprobs([1, 2, 3, 4, 5], 1)
    assert acc.rows_to_compute(0, 2) == range(0, 2)
    with pytest.raises(ValueError, match="skipped"):
        acc.rows_to_compute(2, 2)
    acc.add(torch.zeros(4, 8).log_softmax(dim=-1), 0)
    assert acc.complete and acc.rows_to_compute(0, 5) == range(0)  # recomputed: nothing new
    assert acc.rows_to_compute(4, 1) == range(0)  # the last prompt row predicts nothing
    with pytest.raises(ValueError, match="after"):
        acc.add(torch.zeros(1, 8), 2)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_values_name_the_field(value):
    with pytest.raises(ValueError, match="^prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


# --------------------------------------------------------------------------- over HTTP
# echo, prompt_logprobs and prompt lists through the app (a tiny BPE tokenizer on the tiny
# Llama): exact against HF, in OpenAI's index order, admitted all or nothing.
@pytest.fixture(scope="module")
def served(tiny_llama):
    from slotserve.engine.async_engine import AsyncEngine
    from tests.unit.server_fixtures import app_client, text_engine

    engine = AsyncEngine(text_engine(tiny_llama, num_blocks=96, max_num_seqs=4,
                                     enable_prefix_caching=True))
    with app_client(engine) as client:
        yield client, engine


def complete(client, **body) -> dict:
    response = client.post("/v1/completions", json={"max_tokens": 3, "temperature": 0,
                                                     **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_with_logprobs_is_exact(served, tiny_llama):
    client, engine = served
    ids = engine.tokenizer.encode("the quick brown fox")
    complete(client, prompt=ids)  # NOTE: cached now; echo must bypass the cache
    answer = complete(client, prompt="the quick brown fox", echo=True, logprobs=2)
    choice = answer["choices"][0]
    plain = complete(client, prompt="the quick brown fox")["choices"][0]
    assert choice["text"] == "the quick brown fox" + plain["text"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = hf_logprobs(tiny_llama, ids)
    for pos, token in enumerate(ids[1:]):
        assert lp["token_logprobs"][pos + 1] == pytest.approx(float(expected[pos, token]),
                                                              abs=TOL)
        assert len(lp["top_logprobs"][pos + 1]) <= 3
        best = max(lp["top_logprobs"][pos + 1].values())
        assert best == pytest.approx(float(expected[pos].max()), abs=TOL)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert answer["usage"]["prompt_tokens"] == len(ids)


def test_prompt_logprobs_field_is_vllms(served, tiny_llama):
    client, engine = served
    ids = engine.tokenizer.encode("hello world, how are you")
    choice = complete(client, prompt=ids, prompt_logprobs=3)["choices"][0]
    assert choice["logprobs"] is None
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    expected = hf_logprobs(tiny_llama, ids)
    for pos, entry in enumerate(entries[1:]):
        token = ids[pos + 1]
        assert entry[str(token)]["logprob"] == pytest.approx(float(expected[pos, token]),
                                                             abs=TOL)
        assert entry[str(token)]["rank"] == int((expected[pos] > expected[pos, token]).sum()) + 1
        assert sorted(v["rank"] for v in entry.values())[:3] == [1, 2, 3]
        assert len(entry) in (3, 4)  # the top 3, and the prompt token if not among them


def test_streamed_echo_opens_each_choice_with_its_prompt(served):
    client, _ = served
    response = client.post("/v1/completions", json={
        "prompt": ["the quick", "hello"], "n": 2, "echo": True, "logprobs": 1,
        "max_tokens": 3, "temperature": 0, "stream": True})
    assert response.status_code == 200
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    first_text: dict[int, str] = {}
    text: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            first_text.setdefault(choice["index"], choice["text"])
            text[choice["index"]] = text.get(choice["index"], "") + choice["text"]
    assert first_text == {0: "the quick", 1: "the quick", 2: "hello", 3: "hello"}
    whole = complete(client, prompt=["the quick", "hello"], n=2, echo=True)
    assert text == {c["index"]: c["text"] for c in whole["choices"]}


def test_prompt_lists_answer_in_openai_order(served):
    client, _ = served
    prompts = ["the quick brown", "once upon a", "name three"]
    answer = complete(client, prompt=prompts, n=2, max_tokens=4)
    assert [c["index"] for c in answer["choices"]] == list(range(6))
    singles = [complete(client, prompt=prompt, max_tokens=4) for prompt in prompts]
    for i, single in enumerate(singles):
        for j in range(2):  # greedy: every completion of a prompt is the same
            assert answer["choices"][i * 2 + j]["text"] == single["choices"][0]["text"]
    usage = answer["usage"]
    assert usage["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert usage["completion_tokens"] == 2 * sum(s["usage"]["completion_tokens"]
                                                 for s in singles)


@pytest.mark.parametrize("body,param", [
    ({"prompt": []}, "prompt"), ({"prompt": ["a"] * 1025}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"), ({"prompt": "a", "prompt_logprobs": 21},
                                        "prompt_logprobs"),
    ({"prompt": ["a"] * 30, "logprobs": 20, "max_tokens": 500}, "logprobs"),  # x 30 prompts
])
def test_bad_prompt_lists_and_volumes_are_400s(served, body, param):
    client, _ = served
    response = client.post("/v1/completions", json={"max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_prompt_logprobs_volume_is_capped(tiny_llama):
    from fastapi.testclient import TestClient

    from slotserve.engine.async_engine import AsyncEngine
    from slotserve.server.api import ServerLimits, build_app
    from tests.unit.server_fixtures import text_engine

    engine = AsyncEngine(text_engine(tiny_llama, num_blocks=32))
    app = build_app(engine, "tiny", limits=ServerLimits(max_logprobs_volume=100))
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={"prompt": list(range(5, 60)),
                                                        "prompt_logprobs": 5})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt_logprobs"


def test_prompt_lists_are_admitted_all_or_none(tiny_llama):
    """3 prompts x n=2 against a waiting bound of 4 can never be queued: a 400 naming prompt
    before anything is admitted (the engine, started afterwards, runs nothing of them); 2 x 2
    fit and all four run."""
    from fastapi.testclient import TestClient

    from slotserve.engine.async_engine import AsyncEngine
    from slotserve.server.api import build_app
    from tests.unit.server_fixtures import text_engine

    engine = AsyncEngine(text_engine(tiny_llama, num_blocks=32), max_waiting=4)
    with TestClient(build_app(engine, "tiny"), raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt"
        assert engine.num_active == 0
        engine.start()
        try:
            ok = client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2,
                                                      "max_tokens": 2})
            assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
        finally:
            engine.stop()
    assert engine.engine.stats.prompt_tokens == 4 * 2  # "a", "b" with BOS, twice each
