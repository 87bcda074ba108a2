"""The embedded SmolLM2-135M-Instruct: greedy ids equal HF transformers on 3 chat prompts,
and text-level behaviour (stop strings, detokenization) on a real tokenizer."""

from __future__ import annotations

import torch

from slotserve import SamplingParams

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]
MAX_NEW = 24


def hf_greedy_with_top5(model, prompt_ids: list[int]):
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                         do_sample=False, output_scores=True, return_dict_in_generate=True,
                         eos_token_id=None, pad_token_id=2)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    top5 = [set(s[0].topk(5).indices.tolist()) for s in out.scores]
    return tokens, top5


def test_greedy_matches_hf_on_chat_prompts(smollm2_llm, smollm2_hf):
    tok = smollm2_llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True))
               for c in CHATS]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=5)
    outputs = smollm2_llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        expected, hf_top5 = hf_greedy_with_top5(smollm2_hf, prompt)
        ours = out.token_ids
        mismatch = next((i for i, (a, b) in enumerate(zip(ours, expected)) if a != b), None)
        if mismatch is not None:  # DESIGN.md: a near-tie may flip; it must be in the top-5
            assert ours[mismatch] in hf_top5[mismatch]
            assert expected[mismatch] in out.outputs[0].logprobs[mismatch]
        assert len(ours) == MAX_NEW


def test_chat_answer_is_sensible(smollm2_llm):
    out = smollm2_llm.chat(CHATS[0], SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_stop_string_cuts_text_before_it(smollm2_llm):
    chat = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    free = smollm2_llm.chat(chat, SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert "5" in free.text
    out = smollm2_llm.chat(chat, SamplingParams(max_tokens=40, temperature=0.0, stop=["5"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:free.text.index("5")]
    assert len(out.token_ids) < len(free.token_ids)


def test_streamed_deltas_add_up_to_the_text(smollm2_llm):
    engine = smollm2_llm.engine
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=[" the sea"])
    engine.add_request("stream-test", "Tell me about the ocean and the sea.", params)
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    assert final.finished
    assert "".join(deltas) == final.text
    assert " the sea" not in final.text
