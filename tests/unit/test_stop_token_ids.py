"""stop_token_ids (vLLM's request field) on both endpoints: a generated token among them ends
its choice with finish_reason "stop" (the token kept); ids outside the model's vocabulary
are refused by the engine (ValueError offline, 400 naming the field through the API)."""

from __future__ import annotations

import pytest

from slotserve.engine.async_engine import AsyncEngine
from slotserve.sampling import SamplingParams
from slotserve.server.limits import ServerLimits
from tests.conftest import tiny_engine
from tests.unit.server_fixtures import app_client, text_engine

MAX_TOKENS = 6
ENDPOINTS = [
    ("/v1/completions", {"prompt": "hello world"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.fixture(scope="module")
def served(tiny_llama):
    llm_engine = text_engine(tiny_llama, num_blocks=64, max_num_seqs=4)
    # NOTE: the stop-token cap raised to the vocabulary: a test stops on every token
    limits = ServerLimits(max_stop_token_ids=llm_engine.model_config.vocab_size)
    with app_client(AsyncEngine(llm_engine), limits=limits) as client:
        yield client, llm_engine.model_config.vocab_size


def _post(client, path: str, body: dict, **fields):
    return client.post(path, json={**body, "max_tokens": MAX_TOKENS, "temperature": 0,
                                   "ignore_eos": True, **fields})


@pytest.mark.parametrize("path,body", ENDPOINTS)
def test_a_stop_token_ends_the_choice_on_both_endpoints(served, path, body):
    client, vocab = served
    free = _post(client, path, body, stop_token_ids=[])
    assert free.status_code == 200, free.text
    assert free.json()["choices"][0]["finish_reason"] == "length"
    assert free.json()["usage"]["completion_tokens"] == MAX_TOKENS
    # every token of the vocabulary stops: the first one generated ends the choice
    r = _post(client, path, body, stop_token_ids=list(range(vocab)))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 1  # the stop token is kept


@pytest.mark.parametrize("path,body", ENDPOINTS)
@pytest.mark.parametrize("value", ["vocab", [-1], [1.5], ["2"], [True], 7])
def test_a_bad_stop_token_id_is_a_400_naming_the_field(served, path, body, value):
    client, vocab = served
    value = [vocab] if value == "vocab" else value
    r = _post(client, path, body, stop_token_ids=value)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("stop_token_ids"), r.json()


def test_the_engine_refuses_stop_token_ids_outside_the_vocabulary(tiny_llama):
    engine = tiny_engine(tiny_llama, num_blocks=16, max_num_seqs=2)
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"^stop_token_ids .*\[0, {vocab}\)"):
        engine.add_request("r", [5, 6, 7], SamplingParams(stop_token_ids=[3, vocab]))
    assert not engine.has_unfinished_requests()
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=2,
                                                       stop_token_ids=[vocab - 1]))
    assert engine.has_unfinished_requests()
