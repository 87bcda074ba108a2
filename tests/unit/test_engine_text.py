"""LLMEngine's output text: streaming deltas, the detokenizer's flush at the finish, and stop
strings. A scripted runner emits chosen token ids through a byte tokenizer (one token: one
byte), so an output can end inside a UTF-8 character."""

from __future__ import annotations

import pytest

from slotserve.config import ModelConfig, engine_config
from slotserve.core.outputs import RunnerOutput
from slotserve.engine.llm_engine import LLMEngine
from slotserve.sampling import SamplingParams

EOS = 2
FIRST_BYTE = 3  # ids 0..2 are special; id FIRST_BYTE + b is the byte b
MERGED = {300: b"!\xc3"}  # one token: a character and the first byte of the next


class ByteTokenizer:
    """Ids 3..258 are single bytes, then MERGED; decode replaces invalid UTF-8 with U+FFFD
    (as HF's does)."""

    eos_token_ids = (EOS,)

    def decode(self, ids, skip_special_tokens=True):
        data = b"".join(MERGED.get(i) or bytes([i - FIRST_BYTE]) for i in ids if i >= FIRST_BYTE)
        return data.decode("utf-8", errors="replace")


def byte_ids(data: bytes) -> list[int]:
    return [FIRST_BYTE + b for b in data]


def scripted_engine(hf_model, script: list[int]) -> LLMEngine:
    """An engine whose every sampled token is the next id of `script`."""
    cfg = ModelConfig.from_hf_dict(hf_model.config.to_dict())
    weights = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    engine = LLMEngine(engine_config(num_blocks=16, max_num_seqs=1, max_model_len=512), cfg,
                       weights, tokenizer=ByteTokenizer())
    tokens = iter(script)
    engine.runner.execute = lambda plan: RunnerOutput(
        {s.request_id: next(tokens) for s in plan.seqs if s.sample})
    return engine


def run(engine: LLMEngine, params: SamplingParams) -> list:
    """The request's completion outputs, one per step, up to the finished one."""
    engine.add_request("r", [5, 6, 7], params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o.outputs[0] for o in engine.step()]
    return outputs


@pytest.mark.parametrize("data", [
    "ok é".encode()[:-1],  # the last byte of "é" never comes
    "a\ufffd".encode(),  # a real U+FFFD ends the text
    b"ab\x80",  # a stray continuation byte
], ids=["partial", "replacement-char", "invalid-byte"])
def test_final_text_is_the_decode_of_all_tokens(tiny_llama, data):
    ids = byte_ids(data)
    engine = scripted_engine(tiny_llama, ids)
    outs = run(engine, SamplingParams(max_tokens=len(ids), temperature=0))
    final = outs[-1]
    assert final.finish_reason == "length" and final.token_ids == ids
    assert final.text == "".join(o.delta_text for o in outs) == data.decode(errors="replace")
    assert final.text.endswith("\ufffd")


def test_partial_character_before_eos_is_flushed(tiny_llama):
    ids = byte_ids("né".encode()[:-1]) + [EOS]
    outs = run(scripted_engine(tiny_llama, ids), SamplingParams(max_tokens=8, temperature=0))
    assert outs[-1].finish_reason == "stop" and outs[-1].text == "n\ufffd"


def test_a_character_split_across_tokens_is_held_back_until_complete(tiny_llama):
    ids = byte_ids("oé!".encode())
    outs = run(scripted_engine(tiny_llama, ids), SamplingParams(max_tokens=4, temperature=0))
    assert [o.delta_text for o in outs] == ["o", "", "é", "!"]
    assert outs[-1].text == "oé!"


def test_stop_string_in_the_flushed_text_still_cuts(tiny_llama):
    ids = byte_ids(b"x") + [300]  # "!" is held back with the partial character after it
    outs = run(scripted_engine(tiny_llama, ids),
               SamplingParams(max_tokens=3, temperature=0, stop=["!"]))
    assert outs[-1].text == "".join(o.delta_text for o in outs) == "x"


def test_an_aborted_request_is_flushed_too(tiny_llama):
    engine = scripted_engine(tiny_llama, byte_ids(b"o\xc3"))
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0))
    assert [o.outputs[0].text for o in engine.step() + engine.step()] == ["o", "o"]
    engine.abort_request("r")
    (out,) = engine.step()
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].text == "o\ufffd"


def test_a_stop_string_on_the_last_allowed_token_is_the_finish_reason(tiny_llama):
    ids = byte_ids(b"ab!")
    outs = run(scripted_engine(tiny_llama, ids),
               SamplingParams(max_tokens=len(ids), temperature=0, stop=["!"]))
    assert (outs[-1].finish_reason, outs[-1].text) == ("stop", "ab")
