"""min_tokens (vLLM's): no EOS, stop token or stop string ends a completion before it has
min_tokens tokens. The sampler masks EOS and stop_token_ids per row; the engine skips its
stop checks; the API takes the field on both endpoints."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from slotserve.config import ModelConfig, engine_config
from slotserve.core.outputs import ScheduledSeq
from slotserve.engine.async_engine import AsyncEngine
from slotserve.engine.llm_engine import LLMEngine
from slotserve.runner.sampler import Sampler
from slotserve.sampling import SamplingParams
from tests.conftest import tiny_engine
from tests.unit.server_fixtures import app_client, text_engine

PROMPT = [5, 6, 7, 8]
EOS = 3


# --------------------------------------------------------------------------- params
@pytest.mark.parametrize("value", [-1, 9, 1.5, True, "2"])
def test_a_bad_min_tokens_names_the_field(value):
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=8, min_tokens=value)


def test_min_tokens_may_equal_max_tokens():
    assert SamplingParams(max_tokens=8, min_tokens=8).min_tokens == 8


# --------------------------------------------------------------------------- sampler
def _seq(params: SamplingParams, num_output_tokens: int) -> ScheduledSeq:
    return ScheduledSeq("r", [1], 0, [0], True, params, num_output_tokens, "decode")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sampler_masks_eos_and_stop_tokens_per_row_until_min_tokens(temperature):
    logits = torch.zeros(4, 16)
    logits[:, EOS] = 100.0  # EOS wins every row, greedy or sampled
    logits[:, 7] = 50.0  # then the stop token
    sampler = Sampler(torch.device("cpu"), seed=0, eos_token_ids=(EOS,))
    short = SamplingParams(temperature=temperature, min_tokens=2, stop_token_ids=[7])
    seqs = [_seq(short, 0), _seq(short, 1), _seq(short, 2),  # the third has its 2 tokens
            _seq(SamplingParams(temperature=temperature), 0)]
    tokens, _ = sampler(logits, seqs)
    assert tokens[0] not in (EOS, 7) and tokens[1] not in (EOS, 7)
    assert tokens[2] == EOS and tokens[3] == EOS


def test_ignore_eos_leaves_eos_to_the_sampler_and_a_full_mask_is_not_applied():
    sampler = Sampler(torch.device("cpu"), eos_token_ids=(EOS,))
    logits = torch.zeros(1, 16)
    logits[0, EOS] = 100.0
    params = SamplingParams(temperature=0, min_tokens=3, ignore_eos=True, stop_token_ids=[7])
    assert sampler(logits, [_seq(params, 0)])[0] == [EOS]
    # Every token a stop token (or past the vocabulary): the row keeps its logits.
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[*range(16), 10**6])
    assert sampler(logits, [_seq(params, 0)])[0] == [EOS]


# --------------------------------------------------------------------------- engine
def eos_is_greedy_engine(hf_model, **kwargs) -> tuple[LLMEngine, int]:
    """An engine on the tiny model whose EOS is the greedy first token after PROMPT."""
    probe = tiny_engine(hf_model, num_blocks=16, max_num_seqs=2)
    first = run(probe, SamplingParams(max_tokens=1, temperature=0))[0]
    cfg = ModelConfig.from_hf_dict({**hf_model.config.to_dict(), "eos_token_id": first})
    weights = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    engine = LLMEngine(engine_config(num_blocks=16, max_num_seqs=2, max_model_len=512,
                                     quantization="none"), cfg,  # NOTE: as the probe: fp32
                       weights)
    return engine, first


def run(engine: LLMEngine, params: SamplingParams, request_id: str = "r") -> list[int]:
    engine.add_request(request_id, PROMPT, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    engine.check_integrity()
    return final.outputs[0].token_ids if final.finish_reason != "stop" else (
        final.outputs[0].token_ids + ["stop"])


def test_a_prompt_that_would_stop_at_once_runs_to_min_tokens(tiny_llama):
    engine, eos = eos_is_greedy_engine(tiny_llama)
    assert run(engine, SamplingParams(max_tokens=8, temperature=0), "a") == [eos, "stop"]
    out = run(engine, SamplingParams(max_tokens=8, temperature=0, min_tokens=4), "b")
    assert len(out) >= 4 and eos not in out[:4]


def test_stop_token_ids_wait_for_min_tokens(tiny_llama):
    engine = tiny_engine(tiny_llama, num_blocks=16, max_num_seqs=2)
    first = run(engine, SamplingParams(max_tokens=1, temperature=0), "probe")[0]
    stop = dict(temperature=0, ignore_eos=True, stop_token_ids=[first])
    assert run(engine, SamplingParams(max_tokens=8, **stop), "a") == [first, "stop"]
    out = run(engine, SamplingParams(max_tokens=8, min_tokens=3, **stop), "b")
    assert len(out) >= 3 and first not in out[:3]
    # min_tokens == max_tokens: exactly max_tokens, none of them the stop token
    assert run(engine, SamplingParams(max_tokens=5, min_tokens=5, **stop), "c")[4] != "stop"


def test_the_engine_skips_its_stop_checks_before_min_tokens(tiny_llama):
    """A scripted runner (no sampler mask) emits EOS, a stop token and a stop string early."""
    from tests.unit.test_engine_text import EOS as SCRIPT_EOS
    from tests.unit.test_engine_text import byte_ids, run, scripted_engine

    stop_token = byte_ids(b"s")[0]
    script = [SCRIPT_EOS, *byte_ids(b"x!"), SCRIPT_EOS, *byte_ids(b"yz")]
    params = SamplingParams(max_tokens=8, temperature=0, stop=["!"],
                            stop_token_ids=[stop_token])
    assert run(scripted_engine(tiny_llama, script), params)[-1].token_ids == [SCRIPT_EOS]
    outs = run(scripted_engine(tiny_llama, script), replace(params, min_tokens=4))
    assert (outs[-1].token_ids, outs[-1].finish_reason) == (script[:4], "stop")  # the EOS
    assert outs[-1].text == "x!"  # the stop string came before min_tokens: not a stop
    outs = run(scripted_engine(tiny_llama, [stop_token] * 3), replace(params, min_tokens=2))
    assert (outs[-1].token_ids, outs[-1].finish_reason) == ([stop_token] * 2, "stop")


# --------------------------------------------------------------------------- API
@pytest.fixture(scope="module")
def client(tiny_llama):
    engine = AsyncEngine(text_engine(tiny_llama, num_blocks=64, max_num_seqs=4))
    with app_client(engine) as client:
        yield client


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hello world"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_stop_string_waits_for_min_tokens_through_the_api(client, path, body):
    body = {**body, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    free = client.post(path, json=body).json()["choices"][0]
    text = free["text"] if "text" in free else free["message"]["content"]
    stop = {**body, "stop": [text[0]]}  # it stops at the token that writes this character
    r = client.post(path, json=stop).json()
    stopped_at = r["usage"]["completion_tokens"]
    assert r["choices"][0]["finish_reason"] == "stop" and stopped_at <= 8
    r = client.post(path, json={**stop, "min_tokens": stopped_at + 3}).json()
    assert r["usage"]["completion_tokens"] >= stopped_at + 3


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 4}),
])
@pytest.mark.parametrize("value", [-1, 5, "2", 1.5])
def test_a_bad_min_tokens_is_a_400_naming_it(client, path, body, value):
    r = client.post(path, json={**body, "min_tokens": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "min_tokens"
