"""Read a GGUF file: metadata -> ModelConfig, tensors -> float32 HF-named weights, tokenizer.

`read_gguf` is a small reader of our own: `gguf.GGUFReader` builds a numpy view per metadata
element and takes seconds on a 49k-token vocabulary; this takes ~0.1 s. Our own vectorized
numpy dequantizers cover F32, F16, BF16, Q8_0, Q4_0 and Q4_1 (the default model holds Q4_1,
Q8_0 and F32); every other type goes through `gguf.quants.dequantize`.
"""

from __future__ import annotations

import math
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
from slotserve.loader.gguf_vocab import gguf_eos_token_ids
from slotserve.loader.tokenizer import Tokenizer
from slotserve.loader.validation import ModelFileError, check_config, check_weight_shapes

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
    """Config, float32 weights (HF Llama names) and tokenizer of a GGUF file.

    A malformed file raises ModelFileError (a ValueError) naming the file and the problem.
    """
    path = os.fspath(path)
    meta, tensors = read_gguf(path)
    config = model_config(meta, tensors, name=_model_name(path), path=path)
    check_config(path, config)
    names = {_hf_name_in(path, t.name): t for t in tensors}
    gguf_names = {hf: t.name for hf, t in names.items()}
    check_weight_shapes(path, config, {hf: tuple(reversed(t.shape)) for hf, t in names.items()},
                        describe=lambda hf: gguf_names.get(hf, _gguf_name(hf)))
    tokenizer = _tokenizer(path, meta, config)  # NOTE: checked before the slow conversion
    weights = {hf: _convert(t, config) for hf, t in names.items()}
    return config, weights, tokenizer


def _hf_name_in(path: str, gguf_name: str) -> str:
    try:
        return hf_name(gguf_name)
    except ValueError as exc:
        raise ModelFileError(path, str(exc)) from None


def _gguf_name(hf: str) -> str:
    """The GGUF name of an HF weight name (for messages about missing tensors)."""
    for gguf, hf_base in _GLOBAL_NAMES.items():
        if hf.startswith(hf_base + "."):
            return gguf + hf.removeprefix(hf_base)
    _, _, layer, rest = hf.split(".", 3)
    base, _, kind = rest.rpartition(".")
    short = {v: k for k, v in _LAYER_NAMES.items()}.get(base, base)
    return f"blk.{layer}.{short}.{kind}"


def _tokenizer(path: str, meta: dict[str, Any], config: ModelConfig) -> Tokenizer | None:
    """The tokenizer of the metadata's `tokenizer.ggml.*` keys (None without them)."""
    if "tokenizer.ggml.model" not in meta:
        return None
    _check_tokenizer_metadata(path, meta, config.vocab_size)
    try:
        return Tokenizer.from_gguf_metadata(meta)
    except Exception as exc:  # NOTE: the `tokenizers` library raises plain Exceptions
        raise ModelFileError(path, f"bad tokenizer metadata: {exc}") from None


def _check_tokenizer_metadata(path: str, meta: dict[str, Any], vocab_size: int) -> None:
    """A ModelFileError unless the tokenizer keys have the types Tokenizer reads them as."""
    for key, item_type in (("tokens", str), ("merges", str), ("token_type", int)):
        values = meta.get(f"tokenizer.ggml.{key}", [])
        if not isinstance(values, list) or not all(type(v) is item_type for v in values):
            raise ModelFileError(path, f"tokenizer.ggml.{key} must be a list of "
                                       f"{item_type.__name__}")
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelFileError(path, "missing key tokenizer.ggml.tokens")
    if any(" " not in m for m in meta.get("tokenizer.ggml.merges", [])):
        raise ModelFileError(path, "tokenizer.ggml.merges holds an entry without a space")
    for key in ("bos", "eos", "eot", "eom"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and (type(token_id) is not int
                                     or not 0 <= token_id < vocab_size):
            raise ModelFileError(path, f"tokenizer.ggml.{key}_token_id {token_id!r} is not a "
                                       f"token id (vocabulary of {vocab_size})")
    for key in ("pre", "model", "chat_template"):
        value = meta.get(f"tokenizer.{'' if key == 'chat_template' else 'ggml.'}{key}")
        if value is not None and not isinstance(value, str):
            raise ModelFileError(path, f"tokenizer key {key} must be a string, not {value!r}")


# -- reading the file -------------------------------------------------------------------------

# GGUF metadata value types (gguf.GGUFValueType).
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_VERSIONS = (2, 3)
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays: deeper than any real file, shallow enough for recursion
# NOTE: the fewest bytes one item can take. Counts read from the header are checked against the
# bytes left before anything is allocated for them: a forged count fails, it never allocates.
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
_MIN_ITEM_BYTES = {_STRING: 8, _ARRAY: 12}


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
    """Sequential little-endian reads from a buffer, each checked against the buffer's end.

    Every problem is a ModelFileError naming the file and the byte where it was found.
    """

    def __init__(self, buf: Any, path: str) -> None:
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def fail(self, problem: str) -> ModelFileError:
        return ModelFileError(self.path, problem)

    def need(self, n: int, what: str) -> None:
        """A ModelFileError unless `n` more bytes (for `what`) are left."""
        if n > self.size - self.pos:
            raise self.fail(f"truncated: {what} at byte {self.pos} needs {n} bytes, "
                            f"the file has {self.size - self.pos} left")

    def scalar(self, fmt: str, what: str = "a value") -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str = "a string") -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} at byte {self.pos} is not UTF-8 ({exc.reason})") from None
        self.pos += n
        return text

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY:
            return self.array(what, depth + 1)
        if kind not in _SCALARS:
            raise self.fail(f"{what} has unknown value type {kind}")
        return self.scalar(_SCALARS[kind], what)

    def array(self, what: str, depth: int) -> list[Any]:
        if depth > _MAX_NESTING:
            raise self.fail(f"{what}: arrays nested deeper than {_MAX_NESTING}")
        kind, n = self.scalar("<I", what), self.scalar("<Q", what)
        if kind in (_STRING, _ARRAY):
            self.need(n * _MIN_ITEM_BYTES[kind], f"{what} ({n} items)")
            return [self.value(kind, what, depth) for _ in range(n)]
        if kind not in _SCALARS:
            raise self.fail(f"{what} is an array of unknown value type {kind}")
        dtype = np.dtype(_SCALARS[kind])
        self.need(n * dtype.itemsize, f"{what} ({n} items)")
        values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
        self.pos += values.nbytes
        return values.tolist()


def read_gguf(path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """Metadata (plain Python values) and tensors (memory-mapped) of a GGUF v2/v3 file.

    A malformed file raises ModelFileError (naming the file and the problem), whatever the
    damage: every count and offset is checked against the file's size before it is used.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _HEADER_BYTES:
            raise ModelFileError(path, f"truncated header: {size} bytes, a GGUF header has "
                                       f"{_HEADER_BYTES}")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf, path)
    magic = cur.scalar("<4s", "the magic")
    if magic != b"GGUF":
        raise cur.fail(f"bad magic {magic!r}: not a GGUF file")
    version = cur.scalar("<I", "the version")
    if version not in _VERSIONS:
        raise cur.fail(f"unsupported GGUF version {version} (supported: {_VERSIONS}, "
                       "little-endian)")
    n_tensors = cur.scalar("<Q", "the tensor count")
    n_kv = cur.scalar("<Q", "the metadata count")
    cur.need(n_kv * _MIN_KV_BYTES, f"{n_kv} metadata entries")
    meta = _read_metadata(cur, n_kv)
    cur.need(n_tensors * _MIN_TENSOR_INFO_BYTES, f"{n_tensors} tensor descriptions")
    infos = [_tensor_info(cur) for _ in range(n_tensors)]
    if len({info[0] for info in infos}) != len(infos):
        raise cur.fail("duplicate tensor names")
    align = meta.get("general.alignment", 32)
    if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
        raise cur.fail(f"general.alignment must be a power of two, not {align!r}")
    start = -(-cur.pos // align) * align  # NOTE: tensor data begins at the next aligned byte
    return meta, [_tensor(cur, start, align, *info) for info in infos]


def _read_metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}")
        if key in meta:
            raise cur.fail(f"duplicate metadata key {key!r}")
        meta[key] = cur.value(cur.scalar("<I", f"the type of {key!r}"), f"metadata {key!r}")
    return meta


def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cur.string("a tensor name")
    n_dims = cur.scalar("<I", f"tensor {name!r}'s dimension count")
    if not 1 <= n_dims <= _MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
    shape = tuple(cur.scalar("<Q", f"tensor {name!r}'s shape") for _ in range(n_dims))
    type_id = cur.scalar("<I", f"tensor {name!r}'s type")
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise cur.fail(f"tensor {name!r} has unknown type {type_id}") from None
    if qtype not in GGML_QUANT_SIZES:
        raise cur.fail(f"tensor {name!r} has unsupported type {qtype.name}")
    return name, shape, qtype, cur.scalar("<Q", f"tensor {name!r}'s offset")


def _tensor(cur: _Cursor, start: int, align: int, name: str, shape: tuple[int, ...],
            qtype: GGMLQuantizationType, offset: int) -> GGUFTensor:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if shape[0] % block_size:
        raise cur.fail(f"tensor {name!r}: row length {shape[0]} is not a multiple of "
                       f"{qtype.name}'s block size {block_size}")
    if offset % align:
        raise cur.fail(f"tensor {name!r}: offset {offset} is not a multiple of the alignment "
                       f"{align}")
    row_bytes = shape[0] // block_size * type_size
    rows = tuple(reversed(shape[1:]))
    count = row_bytes * math.prod(rows)  # NOTE: Python ints: a forged shape cannot overflow
    if start + offset + count > cur.size:
        raise cur.fail(f"tensor {name!r} out of bounds: bytes {start + offset} to "
                       f"{start + offset + count}, the file has {cur.size}")
    data = np.frombuffer(cur.buf, dtype=np.uint8, count=count, offset=start + offset)
    return GGUFTensor(name, shape, qtype, data.reshape(*rows, row_bytes))


# -- config -----------------------------------------------------------------------------------


def model_config(
    meta: dict[str, Any], tensors: list[GGUFTensor], name: str = "model",
    path: str = "GGUF file",
) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; tied embeddings when there is no `output.weight`.

    A missing or mistyped key raises ModelFileError naming `path`.
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelFileError(path, f"unsupported GGUF architecture {arch!r} "
                                   f"(supported: {SUPPORTED_ARCHS})")

    def key(suffix: str, default: Any = None, kind: type = int) -> Any:
        value = meta.get(f"{arch}.{suffix}", default)
        if value is None:
            raise ModelFileError(path, f"missing key {arch}.{suffix}")
        number = type(value) in (int, float) if kind is float else type(value) is int
        if not number or not math.isfinite(value) or value <= 0:
            raise ModelFileError(path, f"{arch}.{suffix} must be a positive "
                                       f"{'number' if kind is float else 'integer'}, "
                                       f"not {value!r}")
        return value

    shapes = {t.name: t.shape for t in tensors}
    embedding = shapes.get("token_embd.weight")
    if embedding is None or len(embedding) != 2:
        raise ModelFileError(path, "missing tensor token_embd.weight (2-D)" if embedding is None
                             else f"wrong shape for token_embd.weight: {embedding}")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    if f"{arch}.attention.key_length" not in meta and hidden % heads:
        raise ModelFileError(path, f"{arch}.embedding_length {hidden} is not a multiple of "
                                   f"{arch}.attention.head_count {heads}")
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ModelFileError(path, "partial rotary embeddings (rope.dimension_count != "
                                   "head_dim) unsupported")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=embedding[1],  # ne1: the embedding's rows
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", kind=float)),
        rope_theta=float(key("rope.freq_base", 10000.0, kind=float)),
        max_position_embeddings=key("context_length", 2048),
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias=arch == "qwen2",
        bos_token_id=bos if type(bos) is int else None,  # NOTE: checked with the tokenizer
        eos_token_ids=_eos_token_ids(path, meta),
        architecture=arch,
        name=name,
    )


def _eos_token_ids(path: str, meta: dict[str, Any]) -> tuple[int, ...]:
    try:
        return gguf_eos_token_ids(meta)
    except (TypeError, ValueError) as exc:
        raise ModelFileError(path, f"bad end-of-generation token metadata: {exc}") from None


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
