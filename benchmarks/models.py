"""Families x formats: fp32 equality with HF transformers, bf16 / int8 agreement with fp32,
batch-1 and W speed, on random-weight models of a realistic small shape. One command:

    .venv/bin/python -m benchmarks.models --out benchmarks/results/models.json
    .venv/bin/python -m benchmarks.models --quick --families llama,qwen3   # seconds: tiny shapes

For each family (Llama 3.x with llama3 RoPE scaling, Mistral with a sliding window, Qwen2,
Qwen3, Gemma 2, Gemma 3 text, Phi-3 with LongRoPE) a random model of ~100M parameters (hidden
768, 12 layers, vocabulary 32000, tied embeddings but Gemma's: see FAMILIES) is built with HF
transformers, saved as a safetensors directory and, where the GGUF loader reads the family's
architecture, written as an F32 GGUF file the way llama.cpp's convert_hf_to_gguf writes it.
Each format is loaded as a user's `--model` would load it, and measured:

- fp32 equality: greedy tokens of `quantization="none"` (default kernels) against HF
  transformers' `generate` on the same prompts: token-identical or not, and the first
  differing position (the output token's index, over all prompts);
- agreement: teacher-forced (`slotserve.lab.quality`): the bf16 and int8 engines' argmax
  after each of the fp32 engine's greedy tokens;
- speed with the default settings (`quantization="auto"`, default kernels), in process
  (`slotserve bench`'s EngineTarget): batch 1 (one request alone, a 64-token prompt, 32
  tokens: its TPOT, ms per output token after the first) and W (32 requests at once,
  64-token prompts, 32 output tokens each: output tok/s);
- equality and agreement: 6 prompts of 40-64 random token ids, 24 greedy tokens each.

NOTE: random weights, made larger than HF's init (matrices N(0, 0.08), 1-D parameters moved
by N(0, 0.1), as tests/model/test_families.py's tiny models) so greedy choices are separated;
still, their logits are flatter than a trained model's, so the agreement here is harsher than
on trained weights. Windows (Mistral, Gemma 2/3) are 32 tokens, so the prompts cross them.
Mistral has no GGUF architecture of its own: convert_hf_to_gguf writes it as `llama` without
its window, a different model, so its GGUF column is left out.
"""

from __future__ import annotations

import argparse
import gc
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from slotserve.config import engine_config
from slotserve.engine.llm_engine import LLMEngine, set_torch_threads
from slotserve.lab.bench import EngineTarget, generate_workload, run_bench, write_report
from slotserve.lab.quality import greedy_continuations, teacher_forced_agreement
from slotserve.loader import load_model

# -- shapes and families -----------------------------------------------------------------------

# ~100M parameters: 12 x 6.3M in the layers + a tied 32000 x 768 embedding (24.6M).
FULL_SHAPE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                  num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  head_dim=64)
QUICK_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
COMMON = dict(max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
WINDOW = 32  # the sliding windows: crossed by the prompts and by W's sequences


@dataclass(frozen=True)
class Family:
    """One family: its HF model_type, the config keys beyond the shape (functions of the
    shape's head_dim where the keys need it), and its GGUF architecture (None: no GGUF)."""

    label: str
    model_type: str
    keys: dict = field(default_factory=dict)
    gguf_arch: str | None = None
    gguf_note: str = ""


def longrope_factors(head_dim: int) -> dict:
    """Phi-3.5-mini-like LongRoPE: short factors near 1, long ones growing to ~16 (head_dim/2
    each), an original context of 4096 in a 128k model."""
    half = head_dim // 2
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.02 * i for i in range(half)],
            "long_factor": [1.0 + 15.0 * i / (half - 1) for i in range(half)]}


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
FAMILIES = {
    "llama": Family("Llama 3.x (llama3 RoPE)", "llama",
                    dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING,
                         max_position_embeddings=131072), gguf_arch="llama"),
    "mistral": Family(f"Mistral (window {WINDOW})", "mistral",
                      dict(rope_theta=1e6, sliding_window=WINDOW),
                      gguf_note="no GGUF architecture: written as llama without the window"),
    "qwen2": Family("Qwen2 (qkv bias)", "qwen2", dict(rope_theta=1e6), gguf_arch="qwen2"),
    "qwen3": Family("Qwen3 (q/k norms)", "qwen3", dict(rope_theta=1e6), gguf_arch="qwen3"),
    # NOTE: Gemma 2's converter writes no RoPE base: the HF default (10000) is kept. Gemma's
    # embeddings are scaled by sqrt(hidden): tied to random weights, the last token's own
    # logit dominates and greedy decoding repeats one token (equality and agreement then
    # mean nothing), so the Gemmas here have their own random lm_head (`output.weight`).
    "gemma2": Family(f"Gemma 2 (soft-caps, window {WINDOW})", "gemma2",
                     dict(sliding_window=WINDOW, attn_logit_softcapping=50.0,
                          final_logit_softcapping=30.0, tie_word_embeddings=False),
                     gguf_arch="gemma2"),
    "gemma3": Family(f"Gemma 3 text (window {WINDOW}, 5:1)", "gemma3_text",
                     dict(sliding_window=WINDOW, rope_theta=1e6, rope_local_base_freq=10000.0,
                          tie_word_embeddings=False),
                     gguf_arch="gemma3"),
    "phi3": Family("Phi-3 (LongRoPE)", "phi3",
                   dict(original_max_position_embeddings=4096, max_position_embeddings=131072),
                   gguf_arch="phi3"),
}


def hf_config_keys(family: Family, shape: dict) -> dict:
    """The HF config's keys: the shape, COMMON, the family's own (Gemma's query scale is the
    head_dim, as llama.cpp computes every Gemma but the 27B ones; Phi-3's LongRoPE factors
    are head_dim / 2 long)."""
    keys = {**shape, **COMMON, **family.keys}
    if family.model_type in ("gemma2", "gemma3_text"):
        keys["query_pre_attn_scalar"] = shape["head_dim"]
    if family.model_type == "phi3":
        keys["rope_scaling"] = longrope_factors(shape["head_dim"])
    return keys


def random_hf_model(family: Family, shape: dict, seed: int):
    """A random HF causal LM of the family: matrices N(0, 0.08), every 1-D parameter (norm
    weights, biases) moved by N(0, 0.1), so Gemma's (1 + w), q/k norms and biases matter."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(family.model_type, **hf_config_keys(family, shape))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """HF transformers' greedy continuation of `prompt` (max_new tokens, no EOS stop)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# -- GGUF, as convert_hf_to_gguf writes each architecture ---------------------------------------

_LLAMA_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
                "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_QK_NORMS = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_GEMMA_NAMES = {**_LLAMA_NAMES, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
GGUF_LAYER_NAMES = {
    "llama": _LLAMA_NAMES, "qwen2": _LLAMA_NAMES, "qwen3": {**_LLAMA_NAMES, **_QK_NORMS},
    "gemma2": _GEMMA_NAMES, "gemma3": {**_GEMMA_NAMES, **_QK_NORMS},
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"},
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_tensor_name(hf_name: str, arch: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    base, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{GGUF_LAYER_NAMES[arch][base]}.{kind}"


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K row order for `llama` files (the loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def llama3_rope_freqs(theta: float, dim: int, scaling: dict) -> np.ndarray:
    """The `rope_freqs` tensor convert_hf_to_gguf writes for a llama3-scaled Llama."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def rope_parameters(cfg) -> dict:
    """The RoPE base and scaling of an HF config (transformers 5: `rope_parameters`)."""
    params = getattr(cfg, "rope_parameters", None)
    if params is None:
        params = {"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
    # NOTE: Gemma 3's are per layer type; the file's own keys are the global layers'
    return params.get("full_attention", params)


def _write_gguf_metadata(writer, cfg, arch: str, head_dim: int) -> dict[str, np.ndarray]:
    """The `{arch}.*` keys; returns the config tensors (rope_freqs, LongRoPE factors)."""
    rope = rope_parameters(cfg)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch in ("qwen3", "gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch != "gemma2":  # NOTE: Gemma 2's converter writes no RoPE base (the default)
        writer.add_rope_freq_base(rope["rope_theta"])
    if arch in ("gemma2", "gemma3", "phi3") and getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    tensors = {}
    if arch == "llama" and rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_freqs(rope["rope_theta"], head_dim, rope)
    if arch == "phi3":
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        if rope.get("rope_type") == "longrope":  # convert_hf_to_gguf's Phi3MiniModel
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings)))
            tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], np.float32)
            tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], np.float32)
    return tensors


def write_gguf(path: Path, model, arch: str) -> None:
    """`model` as an F32 GGUF of `arch`, as convert_hf_to_gguf writes it (llama's Q/K rows
    permuted, Gemma's norms stored as 1 + w, config tensors); no tokenizer (token-id
    prompts)."""
    from gguf import GGUFWriter

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = GGUFWriter(str(path), arch)
    tensors = _write_gguf_metadata(writer, cfg, arch, head_dim)
    heads = {"self_attn.q_proj": cfg.num_attention_heads,
             "self_attn.k_proj": cfg.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        w = tensor.detach().float().numpy()
        base = ".".join(name.split(".")[3:-1])
        if arch == "llama" and base in heads and name.endswith(".weight"):
            w = permute_qk(w, heads[base])
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w + np.float32(1.0)  # NOTE: convert_hf_to_gguf stores Gemma's norms as 1 + w
        tensors[gguf_tensor_name(name, arch)] = w
    for name, w in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# -- measurements ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What is measured: the equality prompts and tokens, the speed workloads."""

    prompts: int = 6
    prompt_len: tuple[int, int] = (40, 64)
    new_tokens: int = 24
    batch1_prompt: int = 64
    batch1_tokens: int = 32
    w_requests: int = 32
    w_prompt: int = 64
    w_tokens: int = 32
    speed: bool = True


FULL_SETTINGS = Settings()
QUICK_SETTINGS = Settings(prompts=1, prompt_len=(40, 40), new_tokens=6, batch1_prompt=8,
                          batch1_tokens=4, w_requests=4, w_prompt=8, w_tokens=4)
MAX_MODEL_LEN = 512
QUALITY_POOL = dict(max_model_len=MAX_MODEL_LEN, num_blocks=256, block_size=16)


def equality_prompts(settings: Settings, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    low, high = settings.prompt_len
    return [rng.integers(3, vocab_size, size=int(n)).tolist()
            for n in rng.integers(low, high + 1, size=settings.prompts)]


def first_difference(ours: list[list[int]], theirs: list[list[int]]) -> int | None:
    """The earliest output index where any prompt's tokens differ (None: all identical)."""
    found = []
    for x, y in zip(ours, theirs, strict=True):
        at = next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
        if at is None and len(x) != len(y):
            at = min(len(x), len(y))
        if at is not None:
            found.append(at)
    return min(found) if found else None


def quality_engine(loaded, quantization: str) -> LLMEngine:
    config = engine_config(quantization=quantization, **QUALITY_POOL)
    return LLMEngine(config, loaded.config, loaded.weights, loaded.tokenizer)


def measure_speed(loaded, settings: Settings) -> dict:
    """Default settings (quantization "auto", default kernels): batch 1 and W, in process."""
    target = EngineTarget(loaded.config, loaded.weights, loaded.tokenizer,
                          dict(max_model_len=MAX_MODEL_LEN))
    vocab = loaded.config.vocab_size
    batch1 = run_bench(generate_workload(1, prompts="random", output_len=settings.batch1_tokens,
                                         prompt_len_min=settings.batch1_prompt,
                                         prompt_len_max=settings.batch1_prompt,
                                         vocab_size=vocab, seed=1), target, label="batch-1")
    wide = run_bench(generate_workload(settings.w_requests, prompts="random",
                                       output_len=settings.w_tokens,
                                       prompt_len_min=settings.w_prompt,
                                       prompt_len_max=settings.w_prompt, vocab_size=vocab,
                                       seed=2), target, label="W")
    for run in (batch1, wide):
        if run.failed:
            raise RuntimeError(f"{run.label}: {run.failed} requests failed: {run.errors}")
    return {"linear_kernel": wide.config["linear_kernel"],
            "max_num_seqs": wide.config["max_num_seqs"],
            "batch1_ms_per_token": batch1.tpot_ms.p50,
            "w_output_tok_s": wide.output_throughput,
            "w_duration_s": wide.duration_s}


def measure_format(path: str, hf_tokens: list[list[int]], prompts: list[list[int]],
                   settings: Settings) -> dict:
    """One model file or directory, loaded as `--model` loads it: fp32 equality with HF's
    tokens, bf16 / int8 teacher-forced agreement with the fp32 tokens, speed."""
    start = time.perf_counter()
    loaded = load_model(path, use_cache=False)
    fp32 = quality_engine(loaded, "none")
    ours = greedy_continuations(fp32, prompts, settings.new_tokens)
    del fp32
    diff = first_difference(ours, hf_tokens)
    result = {"fp32_equal": diff is None, "first_difference": diff,
              "prompts_equal": sum(int(a == b) for a, b in zip(ours, hf_tokens)),
              "prompts": len(prompts), "tokens": sum(len(t) for t in ours),
              # NOTE: a model that repeats one token agrees trivially: shown beside the rest
              "distinct_tokens": len({t for tokens in ours for t in tokens})}
    for quantization in ("bf16", "int8"):
        engine = quality_engine(loaded, quantization)
        result[f"{quantization}_agreement"] = teacher_forced_agreement(engine, prompts, ours)
        del engine
        gc.collect()
    if settings.speed:
        result.update(measure_speed(loaded, settings))
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def measure_family(name: str, shape: dict, settings: Settings, formats: tuple[str, ...],
                   folder: Path, seed: int) -> dict:
    """Build the family's random model, save it in each format, measure each."""
    family = FAMILIES[name]
    model = random_hf_model(family, shape, seed)
    params = sum(p.numel() for p in model.parameters())
    prompts = equality_prompts(settings, shape["vocab_size"])
    hf_tokens = [hf_greedy(model, p, settings.new_tokens) for p in prompts]
    report = {"family": name, "label": family.label, "model_type": family.model_type,
              "parameters": params, "config": hf_config_keys(family, shape), "formats": {}}
    if "hf" in formats:
        model.save_pretrained(folder / name)  # safetensors + config.json
        report["formats"]["hf"] = measure_format(str(folder / name), hf_tokens, prompts,
                                                 settings)
        shutil.rmtree(folder / name)
    if "gguf" in formats:
        if family.gguf_arch is None:
            report["formats"]["gguf"] = {"skipped": family.gguf_note}
        else:
            path = folder / f"{name}.gguf"
            write_gguf(path, model, family.gguf_arch)
            report["formats"]["gguf"] = {"arch": family.gguf_arch,
                                         **measure_format(str(path), hf_tokens, prompts,
                                                          settings)}
            path.unlink()
    del model
    gc.collect()
    return report


# -- the table ---------------------------------------------------------------------------------

FORMAT_LABELS = {"hf": "HF dir", "gguf": "GGUF"}


def _millions(count: int) -> str:
    return f"{count / 1e6:.0f}M" if count >= 1e7 else f"{count / 1e6:.2f}M"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _equality_cell(result: dict) -> str:
    if result["fp32_equal"]:
        return f"yes ({result['prompts']}/{result['prompts']} prompts)"
    return (f"**no**: {result['prompts_equal']}/{result['prompts']} prompts, first "
            f"difference at token {result['first_difference']}")


def markdown_table(families: list[dict]) -> str:
    """One row per family and format."""
    lines = ["| family | format | params | fp32 vs HF (greedy) | distinct / greedy tokens "
             "| bf16 / int8 vs fp32 (teacher-forced) | batch 1: ms / token | W: output tok/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for family in families:
        for fmt, result in family["formats"].items():
            head = (f"| {family['label']} | {FORMAT_LABELS[fmt]}"
                    f"{' (' + result['arch'] + ')' if 'arch' in result else ''} | "
                    f"{_millions(family['parameters'])} |")
            if "skipped" in result:
                lines.append(f"{head} - ({result['skipped']}) | - | - | - | - |")
                continue
            b1 = result.get("batch1_ms_per_token")
            w = result.get("w_output_tok_s")
            lines.append(f"{head} {_equality_cell(result)} | "
                         f"{result['distinct_tokens']} / {result['tokens']} | "
                         f"{_pct(result['bf16_agreement'])} /"
                         f" {_pct(result['int8_agreement'])} | "
                         f"{'-' if b1 is None else f'{b1:.1f}'} | "
                         f"{'-' if w is None else f'{w:.0f}'} |")
    return "\n".join(lines)


def run(families: list[str], formats: tuple[str, ...], quick: bool, speed: bool = True
        ) -> list[dict]:
    shape = QUICK_SHAPE if quick else FULL_SHAPE
    settings = QUICK_SETTINGS if quick else FULL_SETTINGS
    if not speed:
        settings = Settings(**{**settings.__dict__, "speed": False})
    set_torch_threads()
    reports = []
    with tempfile.TemporaryDirectory(prefix="slotserve-models-") as tmp:
        for i, name in enumerate(families):
            start = time.perf_counter()
            reports.append(measure_family(name, shape, settings, formats, Path(tmp), seed=40 + i))
            print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return reports


def settings_of(quick: bool, speed: bool) -> dict:
    settings = QUICK_SETTINGS if quick else FULL_SETTINGS
    return {"shape": QUICK_SHAPE if quick else FULL_SHAPE, "common": COMMON, "window": WINDOW,
            **settings.__dict__, "speed": speed and settings.speed, "quality_pool": QUALITY_POOL}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES),
                   help=f"comma-separated, from {', '.join(FAMILIES)} (default: all)")
    p.add_argument("--formats", default="hf,gguf", help="hf, gguf or both (default: both)")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes (hidden 64, 2 layers), 1 prompt, a few tokens: seconds")
    p.add_argument("--no-speed", action="store_true", help="equality and agreement only")
    p.add_argument("--out", default=None, help="the JSON report's path (default: none)")
    args = p.parse_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown or not args.families:
        p.error(f"--families: unknown {unknown} (known: {', '.join(FAMILIES)})")
    args.formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    if not args.formats or any(f not in FORMAT_LABELS for f in args.formats):
        p.error(f"--formats: {args.formats!r}: each must be hf or gguf")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    start = time.perf_counter()
    reports = run(args.families, args.formats, args.quick, speed=not args.no_speed)
    seconds = time.perf_counter() - start
    print(markdown_table(reports))
    print(f"\n{seconds:.0f} s in all", file=sys.stderr)
    if args.out:
        write_report(args.out, settings=settings_of(args.quick, not args.no_speed),
                     seconds=round(seconds, 1), families=reports)
    return reports


if __name__ == "__main__":
    main()
