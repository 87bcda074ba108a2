"""Read a GGUF file: metadata -> ModelConfig, tensors -> float32 HF-named weights, tokenizer.

`read_gguf` is a small reader of our own: `gguf.GGUFReader` builds a numpy view per metadata
element and takes seconds on a 49k-token vocabulary; this takes ~0.1 s. Our own vectorized
numpy dequantizers cover F32, F16, BF16, Q8_0, Q4_0 and Q4_1 (the default model holds Q4_1,
Q8_0 and F32); every other type goes through `gguf.quants.dequantize`.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from slotserve.config import ModelConfig
from slotserve.loader.tokenizer import Tokenizer, gguf_eos_token_ids

Q = GGMLQuantizationType
SUPPORTED_ARCHS = ("llama", "qwen2")

# GGUF tensor name (after `blk.N.`) -> HF Llama name (after `model.layers.N.`).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_gguf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None]:
    """Config, float32 weights (HF Llama names) and tokenizer of a GGUF file."""
    meta, tensors = read_gguf(path)
    config = model_config(meta, tensors, name=_model_name(path))
    weights = {hf_name(t.name): _convert(t, config) for t in tensors}
    tokenizer = Tokenizer.from_gguf_metadata(meta) if "tokenizer.ggml.model" in meta else None
    return config, weights, tokenizer


# -- reading the file -------------------------------------------------------------------------

# GGUF metadata value types (gguf.GGUFValueType).
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, its bytes not yet read (a view into the memory-mapped file).

    `shape` is GGUF's order: ne0 (the fastest-varying, a row's length) first.
    `data` is uint8, shaped `(ne[n-1], ..., ne1, bytes per row)`: one row of blocks per line.
    """

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data: np.ndarray


class _Cursor:
    """Sequential little-endian reads from a buffer."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        return self.scalar(_SCALARS[kind])

    def array(self) -> list[Any]:
        kind, n = self.scalar("<I"), self.scalar("<Q")
        if kind in (_STRING, _ARRAY):
            return [self.value(kind) for _ in range(n)]
        dtype = np.dtype(_SCALARS[kind])
        values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
        self.pos += values.nbytes
        return values.tolist()


def read_gguf(path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """Metadata (plain Python values) and tensors (memory-mapped) of a GGUF v2/v3 file."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf)
    if cur.scalar("<4s") != b"GGUF" or cur.scalar("<I") not in (2, 3):
        raise ValueError(f"{path}: not a little-endian GGUF v2/v3 file")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    meta = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("<I"))
    infos = [_tensor_info(cur) for _ in range(n_tensors)]
    align = meta.get("general.alignment", 32)
    start = -(-cur.pos // align) * align  # NOTE: tensor data begins at the next aligned byte
    return meta, [_tensor(buf, start, *info) for info in infos]


def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cur.string()
    shape = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
    return name, shape, GGMLQuantizationType(cur.scalar("<I")), cur.scalar("<Q")


def _tensor(buf: Any, start: int, name: str, shape: tuple[int, ...],
            qtype: GGMLQuantizationType, offset: int) -> GGUFTensor:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row_bytes = shape[0] // block_size * type_size
    rows = tuple(reversed(shape[1:]))
    count = row_bytes * int(np.prod(rows, dtype=np.int64))
    data = np.frombuffer(buf, dtype=np.uint8, count=count, offset=start + offset)
    return GGUFTensor(name, shape, qtype, data.reshape(*rows, row_bytes))


# -- config -----------------------------------------------------------------------------------


def model_config(
    meta: dict[str, Any], tensors: list[GGUFTensor], name: str = "model"
) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; tied embeddings when there is no `output.weight`."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {SUPPORTED_ARCHS})")

    def key(suffix: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{suffix}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{suffix}")
        return value

    shapes = {t.name: t.shape for t in tensors}
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embeddings (rope.dimension_count != head_dim) unsupported")
    return ModelConfig(
        vocab_size=shapes["token_embd.weight"][1],  # ne1: the embedding's rows
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=key("context_length", 2048),
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias=arch == "qwen2",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=gguf_eos_token_ids(meta),
        architecture=arch,
        name=name,
    )


def _model_name(path: str) -> str:
    return os.path.basename(path).removesuffix(".gguf")


# -- tensors ----------------------------------------------------------------------------------


def hf_name(gguf_name: str) -> str:
    """HF Llama name of a GGUF tensor.

    `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, `output.weight` ->
    `lm_head.weight`; a ValueError for anything else (e.g. `rope_freqs.weight`).
    """
    if m := _LAYER_RE.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(
        f"unsupported GGUF tensor {gguf_name!r} (e.g. rope_freqs: RoPE scaling is not supported)"
    )


def _convert(tensor: GGUFTensor, config: ModelConfig) -> torch.Tensor:
    """Dequantize one reader tensor to float32 in HF layout (Q/K rows un-permuted for llama)."""
    shape = tuple(reversed(tensor.shape))  # NOTE: GGUF lists ne0 (fastest) first
    weight = dequantize(tensor.data, tensor.tensor_type).numpy().reshape(shape)
    if config.architecture == "llama":
        if ".attn_q." in tensor.name:
            weight = unpermute_qk(weight, config.num_attention_heads)
        elif ".attn_k." in tensor.name:
            weight = unpermute_qk(weight, config.num_key_value_heads)
    return torch.from_numpy(np.ascontiguousarray(weight))


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's Q/K row permutation (interleaved rotary -> HF's rotate_half).

    llama.cpp permutes with `w.reshape(n_head, 2, d // n_head // 2, ...).swapaxes(1, 2)`;
    this reshapes to `(n_head, d // n_head // 2, 2, ...)` and swaps back.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# -- dequantization -----------------------------------------------------------------------------
# NOTE: numpy, not torch: single-threaded and predictable. torch's intra-op threads made these
# loops 5-10x slower on a busy 2-core machine (threads spinning against each other).


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """float32 values of a GGUF tensor's raw data, shaped like `gguf.quants.dequantize`'s result.

    `data` is a `GGUFTensor.data` (rows of bytes) or a `gguf.GGUFReader` tensor's `.data`
    (rows of bytes; an element array for float types). The result has shape
    `data.shape[:-1] + (values per row,)`.
    """
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row_bytes = data.shape[-1] * data.itemsize
    out_shape = (*data.shape[:-1], row_bytes // type_size * block_size)
    kernel = _KERNELS.get(qtype)
    if kernel is None:
        values = np.array(gguf_dequantize(data, qtype), dtype=np.float32)  # a writable copy
    else:
        values = kernel(np.asarray(data).view(np.uint8).reshape(-1, type_size))
    return torch.from_numpy(values.reshape(out_shape))


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of each block, as a (n_blocks, 1) float32 column."""
    return blocks[:, start:start + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) packed bytes -> (n, 32) float32: the 16 low nibbles, then the 16 high ones."""
    out = np.empty((qs.shape[0], 2 * qs.shape[1]), dtype=np.float32)
    np.bitwise_and(qs, 0x0F, out=out[:, :qs.shape[1]], casting="unsafe")
    np.right_shift(qs, 4, out=out[:, qs.shape[1]:], casting="unsafe")
    return out


def _deq_f32(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float32).copy()


def _deq_f16(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float16).astype(np.float32)


def _deq_bf16(blocks: np.ndarray) -> np.ndarray:
    return (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _deq_q8_0(blocks: np.ndarray) -> np.ndarray:
    # block: f16 scale d, 32 x int8 q; x = q * d
    out = blocks[:, 2:].view(np.int8).astype(np.float32)
    out *= _f16(blocks, 0)
    return out


def _deq_q4_0(blocks: np.ndarray) -> np.ndarray:
    # block: f16 scale d, 16 bytes of 4-bit q; x = (q - 8) * d
    out = _nibbles(blocks[:, 2:])
    out -= 8.0
    out *= _f16(blocks, 0)
    return out


def _deq_q4_1(blocks: np.ndarray) -> np.ndarray:
    # block: f16 scale d, f16 min m, 16 bytes of 4-bit q; x = d * q + m
    # NOTE: multiply, then add (never fused): bit-exact with gguf's numpy reference.
    out = _nibbles(blocks[:, 4:])
    out *= _f16(blocks, 0)
    out += _f16(blocks, 2)
    return out


_KERNELS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    Q.F32: _deq_f32,
    Q.F16: _deq_f16,
    Q.BF16: _deq_bf16,
    Q.Q8_0: _deq_q8_0,
    Q.Q4_0: _deq_q4_0,
    Q.Q4_1: _deq_q4_1,
}
