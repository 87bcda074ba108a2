"""GGUF files of Qwen3, Gemma 2 and Phi-3: tiny random HF models written as llama.cpp's
convert_hf_to_gguf writes them (its architecture names, metadata keys and tensor names, Gemma's
norms stored as 1 + w, Phi-3's fused qkv / gate_up tensors and LongRoPE factor tensors), with
gguf-py's GGUFWriter, in float32. Loaded as a user would, each gives HF transformers' greedy
tokens on the fp32 path, the same config and weights as the model's HF safetensors directory,
and the same logprobs as that directory through our loader; what the loader does not compute
is refused naming the key or tensor."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from slotserve import SamplingParams
from slotserve.config import engine_config
from slotserve.engine.llm_engine import LLMEngine
from slotserve.loader import ModelFileError, load_model
from tests.conftest import random_prompts
from tests.model.test_families import COMMON, NEW_TOKENS, PROMPTS, tiny_hf
from tests.model.test_vs_hf import hf_greedy

# model_type -> the tiny HF config's keys beyond COMMON, each family's own keys set to values
# a GGUF can hold and that change the tokens (Gemma 2's query scale is head_dim's in llama.cpp
# for all but its 46-layer model; windows crossed by the prompts).
GGUF_FAMILY_CONFIGS = {
    "qwen3": dict(head_dim=32, rope_theta=1e6),
    "gemma2": dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=24,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "phi3": dict(sliding_window=24, original_max_position_embeddings=64,
                 rope_scaling={"rope_type": "longrope",
                               "short_factor": [1.0 + 0.2 * i for i in range(8)],
                               "long_factor": [4.0 + i for i in range(8)]}),
}
ARCH = {"qwen3": "qwen3", "gemma2": "gemma2", "phi3": "phi3"}
# HF name (after model.layers.N.) -> GGUF name (after blk.N.), per architecture, as
# convert_hf_to_gguf's tensor map writes them.
_COMMON_NAMES = {"self_attn.o_proj": "attn_output", "mlp.down_proj": "ffn_down",
                 "input_layernorm": "attn_norm"}
GGUF_NAMES = {
    "qwen3": {**_COMMON_NAMES, "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm"},
    "gemma2": {**_COMMON_NAMES, "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {**_COMMON_NAMES, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
             "post_attention_layernorm": "ffn_norm"},
}
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def gguf_tensor_name(hf: str, arch: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in globals_:
        return globals_[hf]
    _, _, layer, rest = hf.split(".", 3)
    base, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{GGUF_NAMES[arch][base]}.{kind}"


def rope_parameters(cfg) -> dict:
    """The RoPE base and scaling of an HF config (transformers 5: `rope_parameters`)."""
    params = getattr(cfg, "rope_parameters", None)
    if params is None:
        params = {"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
    return params


def write_gguf(path, model, arch: str, extra_meta: dict | None = None,
               extra_tensors: dict | None = None, skip: tuple[str, ...] = (),
               window: bool = True, vocabulary=None) -> None:
    """`model` as convert_hf_to_gguf writes it (float32), plus extra metadata / tensors,
    less the tensors in `skip` (and the sliding window's key unless `window`);
    vocabulary(writer) adds the tokenizer's keys."""
    cfg = model.config
    rope = rope_parameters(cfg)
    writer = GGUFWriter(str(path), arch)
    if vocabulary is not None:
        vocabulary(writer)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch in ("qwen3", "gemma2"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch != "gemma2":  # NOTE: Gemma 2's converter writes no RoPE base (the default)
        writer.add_rope_freq_base(rope["rope_theta"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        if window:
            writer.add_sliding_window(cfg.sliding_window)
    tensors = {}
    if arch == "phi3":
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        if cfg.sliding_window is not None:
            writer.add_sliding_window(cfg.sliding_window)
        scaling = rope if rope.get("rope_type", "default") != "default" else None
        if scaling is not None:  # convert_hf_to_gguf's Phi3MiniModel
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings)))
            tensors["rope_factors_long.weight"] = np.array(scaling["long_factor"], np.float32)
            tensors["rope_factors_short.weight"] = np.array(scaling["short_factor"], np.float32)
    for key, value in (extra_meta or {}).items():
        writer.add_uint32(key, value) if isinstance(value, int) else writer.add_string(key,
                                                                                       value)
    for name, tensor in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        w = tensor.float().numpy()
        if arch == "gemma2" and name.endswith("norm.weight"):
            w = w + np.float32(1.0)  # NOTE: convert_hf_to_gguf stores Gemma's norms as 1 + w
        tensors[gguf_tensor_name(name, arch)] = w
    tensors.update(extra_tensors or {})
    for name, w in tensors.items():
        if name not in skip:
            writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def engine_of(path: str) -> LLMEngine:
    """An fp32 engine on a model file or directory (no on-disk cache), a 16-token budget
    (chunked prefill) and small blocks."""
    loaded = load_model(path, use_cache=False)
    config = engine_config(quantization="none", block_size=8, num_blocks=128,
                           max_num_batched_tokens=16, max_model_len=256)
    return LLMEngine(config, loaded.config, loaded.weights, tokenizer=loaded.tokenizer)


# Past Phi-3's original context (64): its long factors (HF switches a whole forward to them,
# so only our two loaders are compared there).
LONG_PROMPT = random_prompts(1, min_len=90, max_len=90, seed=5)[0]


def generate(engine: LLMEngine, params: SamplingParams, prompts=PROMPTS) -> list:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[int(out.request_id)] = out.outputs[0]
    return [finals[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    """model_type -> (HF model, its safetensors directory, its GGUF file)."""
    files = {}
    for i, (model_type, overrides) in enumerate(GGUF_FAMILY_CONFIGS.items()):
        model = tiny_hf(model_type, seed=60 + i, **overrides)
        folder = tmp_path_factory.mktemp(model_type)
        model.save_pretrained(folder / "hf")
        write_gguf(folder / f"{model_type}.gguf", model, ARCH[model_type])
        files[model_type] = (model, str(folder / "hf"), str(folder / f"{model_type}.gguf"))
    return files


def as_float32(config) -> tuple:
    """The config's values that a GGUF stores as float32, rounded so."""
    scaling = config.rope_scaling
    factors = () if scaling is None else (scaling.short_factor, scaling.long_factor)
    return (np.float32(config.rms_norm_eps), *(tuple(np.float32(f) for f in fs)
                                               for fs in factors))


@pytest.mark.parametrize("model_type", list(GGUF_FAMILY_CONFIGS))
def test_gguf_config_and_weights_equal_the_hf_directory(family_files, model_type):
    _, hf_dir, gguf_path = family_files[model_type]
    from_hf, from_gguf = load_model(hf_dir), load_model(gguf_path, use_cache=False)
    # NOTE: GGUF holds eps and LongRoPE's factors as float32s; the model computes with
    # them in float32 either way (model/rope.py makes a float32 tensor of the factors)
    assert as_float32(from_gguf.config) == as_float32(from_hf.config)
    same_name = dataclasses.replace(from_gguf.config, name=from_hf.config.name,
                                    bos_token_id=from_hf.config.bos_token_id,
                                    eos_token_ids=from_hf.config.eos_token_ids,
                                    rms_norm_eps=from_hf.config.rms_norm_eps,
                                    rope_scaling=from_hf.config.rope_scaling)
    assert same_name == from_hf.config
    assert set(from_gguf.weights) == set(from_hf.weights)
    for name, weight in from_hf.weights.items():
        ours = from_gguf.weights[name]
        if model_type == "gemma2" and name.endswith("norm.weight"):
            # NOTE: (w + 1) - 1 in float32 (llama.cpp's storage undone) is w rounded; the
            # model computes with 1 + w again, which is bit-equal to HF's 1 + w
            assert torch.equal(ours + 1, weight + 1), name
        else:
            assert torch.equal(ours, weight), name


@pytest.mark.parametrize("model_type", list(GGUF_FAMILY_CONFIGS))
def test_gguf_greedy_matches_hf_and_the_hf_directory(family_files, model_type):
    """HF transformers' greedy tokens (ragged prompts, chunked prefill, windows crossed),
    and the same tokens and logprobs, to the bit, as the model's safetensors directory
    through our loader (also past Phi-3's original context: its long factors)."""
    hf_model, hf_dir, gguf_path = family_files[model_type]
    params = dataclasses.replace(GREEDY, logprobs=3)
    prompts = [*PROMPTS, LONG_PROMPT]
    from_gguf = generate(engine_of(gguf_path), params, prompts)
    from_dir = generate(engine_of(hf_dir), params, prompts)
    for prompt, ours, theirs in zip(prompts, from_gguf, from_dir):
        assert ours.token_ids == theirs.token_ids, len(prompt)
        assert ours.logprobs == theirs.logprobs, len(prompt)
    for prompt, ours in zip(PROMPTS, from_gguf):
        assert ours.token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS), len(prompt)


def test_the_tests_can_fail(family_files, tmp_path):
    """Without Gemma's +1 undone (a plain norm), the GGUF's tokens differ from HF's: the
    comparison above sees a norm off by one."""
    hf_model, _, _ = family_files["gemma2"]
    path = tmp_path / "gemma2-unshifted.gguf"
    write_gguf(path, hf_model, "gemma2")
    loaded = load_model(str(path), use_cache=False)
    shifted = {k: (v + 1 if k.endswith("norm.weight") else v)
               for k, v in loaded.weights.items()}
    config = engine_config(quantization="none", block_size=8, num_blocks=128,
                           max_num_batched_tokens=16, max_model_len=256)
    wrong = LLMEngine(config, loaded.config, shifted, tokenizer=None)
    outputs = generate(wrong, GREEDY)
    assert any(out.token_ids != hf_greedy(hf_model, prompt, NEW_TOKENS)
               for prompt, out in zip(PROMPTS, outputs))


@pytest.mark.parametrize("model_type, change, message", [
    ("qwen3", dict(extra_meta={"qwen3.expert_count": 8}), "qwen3.expert_count"),
    ("qwen3", dict(extra_meta={"qwen3.attention.scale": 1}), "qwen3.attention.scale"),
    ("qwen3", dict(extra_tensors={"blk.0.attn_q.bias": np.zeros(128, np.float32)}),
     "unexpected tensor blk.0.attn_q.bias"),
    ("qwen3", dict(skip=("blk.1.attn_k_norm.weight",)), "missing tensor blk.1.attn_k_norm"),
    ("qwen3", dict(extra_meta={"qwen3.attention.sliding_window": 8}), "sliding_window"),
    ("gemma2", dict(extra_meta={"gemma2.attention.sliding_window_pattern": "x"}),
     "sliding_window_pattern"),
    ("gemma2", dict(extra_tensors={"blk.0.attn_q_norm.weight": np.ones(32, np.float32)}),
     "GGUF tensor 'blk.0.attn_q_norm.weight'"),
    ("phi3", dict(skip=("rope_factors_long.weight",)), "missing tensor rope_factors_long"),
    ("phi3", dict(extra_tensors={"blk.0.ffn_gate.weight": np.zeros((128, 64), np.float32)}),
     "blk.0.ffn_gate.weight"),
    ("phi3", dict(extra_meta={"phi3.rope.scaling.type": "yarn"}), "phi3.rope.scaling.type"),
    ("gemma2", dict(window=False), "missing key gemma2.attention.sliding_window"),
])
def test_what_is_not_computed_is_refused(family_files, tmp_path, model_type, change, message):
    hf_model, _, _ = family_files[model_type]
    path = tmp_path / f"{model_type}.gguf"
    write_gguf(path, hf_model, ARCH[model_type], **change)
    with pytest.raises(ModelFileError, match=message.replace(".", r"\.")):
        load_model(str(path), use_cache=False)


assert COMMON["hidden_size"] == 64  # NOTE: the extra tensors' shapes above assume it


# -- the Llama-style SentencePiece vocabulary (Llama 2, Mistral v0.1, Phi-3 files) -------------

SPM_PIECES = ["\u2581", "\u2581t", "\u2581th", "\u2581the", "he", "th", "the", "\u2581a",
              "\u2581an", "an", "nd", "\u2581and", "er", "re", "\u2581re", "in", "\u2581in",
              "at", "\u2581at", "on", "\u2581on", "es", "st", "\u2581st", "ea", "ear",
              "\u2581\u2581", "\u2581\u2581\u2581", "\n", "\u2581w", "\u2581wh"]
SPM_TEXTS = ["the theatre and the rest", " leading space", "  two  spaces  ", "a\nb\n\nc",
             "ünïcödé ✓ 日本", "<|user|>\nwhat is the weather?<|end|>\n<|assistant|>",
             "", " ", "st stand instead earnest"]


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A tiny Llama-style SentencePiece vocabulary: <unk> <s> </s>, the 256 byte tokens, the
    letters, pieces with descending scores, and Phi-3's chat control tokens."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, *([6] * 256)]
    letters = sorted(set("abcdefghijklmnopqrstuvwxyz.,?!"))
    pieces = [*SPM_PIECES, *letters]
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0, 0.0, 0.0, *([0.0] * 256), *(-float(i) for i in range(len(pieces)))]
    for control in ("<|user|>", "<|assistant|>", "<|end|>"):
        tokens.append(control)
        types.append(3)
        scores.append(0.0)
    return tokens, scores, types


def spm_vocabulary(writer: GGUFWriter) -> None:
    """The SentencePiece vocabulary's keys, as llama.cpp writes them."""
    tokens, scores, types = spm_vocab()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(True)


def write_vocabulary_only(path, arch: str) -> None:
    """A GGUF with the vocabulary's metadata and no tensors (what a tokenizer reads)."""
    writer = GGUFWriter(str(path), arch)
    spm_vocabulary(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["phi3", "llama"])
def test_llama_sentencepiece_vocabulary_as_hf_reads_it(family_files, tmp_path, arch):
    """The ids and texts of HF transformers' tokenizer built from the same GGUF
    (AutoTokenizer.from_pretrained(..., gguf_file=...)): Phi-3's prefix space by normalizer,
    Llama's by Metaspace; byte fallback for what no piece covers; control tokens whole."""
    from transformers import AutoTokenizer

    from slotserve.loader.gguf_reader import read_gguf
    from slotserve.loader.tokenizer import Tokenizer

    path = tmp_path / f"{arch}-spm.gguf"
    write_vocabulary_only(path, arch)
    ours = Tokenizer.from_gguf_metadata(read_gguf(str(path))[0])
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in SPM_TEXTS:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert ours.encode(text) == theirs.encode(text), text  # BOS as HF adds it
    merged = ours.encode("the theatre", add_special_tokens=False)
    assert len(merged) < len("the theatre")  # the merges apply (not only letters)


def test_phi3_file_with_its_vocabulary_loads(family_files, tmp_path):
    """The whole file: weights, config and the SentencePiece tokenizer together."""
    hf_model, _, _ = family_files["phi3"]
    path = tmp_path / "phi3-spm.gguf"
    write_gguf(path, hf_model, "phi3", vocabulary=spm_vocabulary)
    loaded = load_model(str(path), use_cache=False)
    assert loaded.config.architecture == "phi3" and loaded.tokenizer is not None
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("the weather")) == "the weather"


# -- the GGUF keys' table: each key the loader reads changes the model or is refused ---------

# Values for keys a base file does not have (each one that must matter).
ABSENT_VALUES = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                 "rope.scale_linear": 4.0, "rope.scaling.attn_factor": 2.0,
                 "attention.sliding_window": 8, "attention.sliding_window_pattern": 3,
                 "rope.dimension_count": 16, "rope.freq_base": 1e5,
                 "attn_logit_softcapping": 7.0,
                 "final_logit_softcapping": 7.0}


def mutated(value):
    """A different value of the same type (doubled: sizes, eps, bases, windows, caps)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AssertionError(f"no mutation for {value!r}")
    return value * 2


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_every_read_gguf_key_changes_the_model_or_is_refused(family_files, tmp_path, arch):
    """config_gate's GGUF table, walked: a read key set to another value changes the
    ModelConfig or is a ModelFileError naming it (none is read and ignored); a harmless key
    changes nothing."""
    from slotserve.config_gate import GGUF_FAMILY_KEYS, GGUF_HARMLESS_KEYS, GGUF_READ_KEYS
    from slotserve.loader.gguf_config import model_config
    from slotserve.loader.gguf_reader import read_gguf

    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, family_files[arch][0], arch)
    meta, tensors = read_gguf(str(path))
    base = model_config(meta, tensors)
    for suffix in (*GGUF_READ_KEYS, *GGUF_FAMILY_KEYS.get(arch, ())):
        key = f"{arch}.{suffix}"
        value = mutated(meta[key]) if key in meta else ABSENT_VALUES[suffix]
        try:
            changed = model_config({**meta, key: value}, tensors)
        except ModelFileError as exc:
            assert key in str(exc) or suffix.split(".")[-1] in str(exc), (key, str(exc))
            continue
        assert changed != base, f"{key}={value!r} changed nothing"
    for suffix in GGUF_HARMLESS_KEYS:
        assert model_config({**meta, f"{arch}.{suffix}": 7}, tensors) == base, suffix
