"""Read a GGUF file: metadata -> ModelConfig, tensors -> HF-named weights, tokenizer.

The parts: `gguf_reader` (the bounds-checked file reader), `gguf_config` (ModelConfig from the
metadata), `gguf_dequant` (numpy dequantizers); this module maps tensor names, checks the
tokenizer metadata and converts the weights. The parts' public names are re-exported here.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import re
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from slotserve.config import ModelConfig
from slotserve.loader.gguf_blocks import (
    BLOCK_FORMATS,
    EMBEDDING,
    FLOAT_TYPES,
    HEAD,
    FileBlocks,
    GGUFBlockTensor,
    LazyBlocks,
    check_blocks,
    unpack_files,
)
from slotserve.loader.gguf_config import CONFIG_TENSORS, SUPPORTED_ARCHS, model_config
from slotserve.loader.gguf_dequant import dequantize
from slotserve.loader.gguf_reader import GGUFTensor, read_gguf
from slotserve.loader.tokenizer import Tokenizer
from slotserve.loader.validation import (
    ModelFileError,
    check_config,
    check_weight_shapes,
    expected_shapes,
)

__all__ = ["SUPPORTED_ARCHS", "GGUFTensor", "dequantize", "hf_name", "load_gguf",
           "model_config", "read_gguf", "unpermute_qk"]


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
# qwen3 (and gemma3): per-head q/k RMSNorms.
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# gemma2 / gemma3: the sandwich norms; `ffn_norm` is the norm before the MLP there.
_GEMMA2_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# phi3: convert_hf_to_gguf keeps HF's fused tensors: `attn_qkv` (q, k, v rows) and `ffn_up`
# (gate then up rows, HF's gate_up_proj); there is no `ffn_gate`.
_PHI3_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k not in ("attn_q", "attn_k", "attn_v",
                                                          "ffn_gate")},
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
_LAYER_NAMES_OF_ARCH = {
    "qwen3": {**_LAYER_NAMES, **_QK_NORM_NAMES},
    "gemma2": _GEMMA2_LAYER_NAMES,
    "gemma3": {**_GEMMA2_LAYER_NAMES, **_QK_NORM_NAMES},
    "phi3": _PHI3_LAYER_NAMES,
}
# The architectures whose RMSNorm weights convert_hf_to_gguf stores as 1 + w (Gemma's
# `(1 + w)` norm): the loader subtracts the 1 again (in float32, as HF's GGUF loader does), so
# the family's norm_offset adds it back.
_NORM_SHIFTED_ARCHS = ("gemma2", "gemma3")
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
log = logging.getLogger(__name__)
# read_gguf's result: the metadata and the tensors.
GGUFFile = tuple[dict[str, Any], list[GGUFTensor]]
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_gguf(path: str, keep_quantized: bool = False, gguf: GGUFFile | None = None
              ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None]:
    """Config, weights (HF Llama names; float32, F16 and BF16 tensors as stored but norms:
    `_convert`) and tokenizer of a GGUF file.

    keep_quantized: the linear layers' weights and the embedding table in quantized types
    stay in their blocks, as `gguf_blocks.GGUFBlockTensor`s: no fp32 copy of them is made.
    A type without a block form is then a ModelFileError.
    A malformed file raises ModelFileError (a ValueError) naming the file and the problem.
    gguf: read_gguf(path)'s result where the caller has it (load_model: the header of a
    large vocabulary takes ~0.5 s to read).
    """
    path = os.fspath(path)
    meta, tensors = read_gguf(path) if gguf is None else gguf
    config = model_config(meta, tensors, name=_model_name(path), path=path)
    check_config(path, config)
    arch = meta["general.architecture"]
    names = {_hf_name_in(path, t.name, arch): t for t in tensors if t.name not in CONFIG_TENSORS}
    gguf_names = {hf: t.name for hf, t in names.items()}
    check_weight_shapes(path, config, {hf: tuple(reversed(t.shape)) for hf, t in names.items()},
                        describe=lambda hf: gguf_names.get(hf, _gguf_name(hf, arch)))
    _check_no_extra_tensors(path, config, gguf_names)
    tokenizer = _tokenizer(path, meta, config)  # NOTE: checked before the slow conversion
    # NOTE: float tensors are views of the file, read as the model packs them (no copy)
    private = (_private_mapping(path) if any(_stored_as(t) for t in names.values())
               else None)
    weights = {hf: _block_tensor(t, config, path, arch)
               if keep_quantized and _kept_in_blocks(hf, t, config)
               else _convert(t, config, arch, private)
               for hf, t in names.items()}
    return config, weights, tokenizer


def quantized(gguf: GGUFFile) -> bool:
    """Whether a GGUF holds a tensor in a quantized type (one that is not F32, F16 or BF16):
    without one, reading the file is its conversion (nothing to cache)."""
    return any(t.tensor_type not in FLOAT_TYPES for t in gguf[1])


def blocks_kept(path: str, gguf: GGUFFile | None = None) -> bool:
    """Whether `load_gguf(path, keep_quantized=True)` keeps blocks: the file has a linear
    weight in a quantized type, and every such weight's type has a block form. NOTE: a type
    without one (the IQ types but IQ4_NL, TQ*) is logged, and the whole file is then
    dequantized as before. gguf: read_gguf(path)'s result where the caller has it.
    """
    _, tensors = read_gguf(path) if gguf is None else gguf
    quantized = [t for t in tensors if t.tensor_type not in FLOAT_TYPES
                 and t.name.endswith(".weight") and "norm" not in t.name]
    unsupported = [t for t in quantized if t.tensor_type not in BLOCK_FORMATS]
    if unsupported:
        log.warning("%s: tensor %s has type %s, which is not kept in blocks: the model is "
                    "dequantized to fp32 first (as with --quantization none/bf16)", path,
                    unsupported[0].name, unsupported[0].tensor_type.name)
    return bool(quantized) and not unsupported


def _hf_name_in(path: str, gguf_name: str, arch: str) -> str:
    try:
        return hf_name(gguf_name, arch)
    except ValueError as exc:
        raise ModelFileError(path, str(exc)) from None


def _check_no_extra_tensors(path: str, config: ModelConfig, gguf_names: dict[str, str]
                            ) -> None:
    """A ModelFileError naming the first tensor the model has no place for (a bias, a norm
    its family does not have, an LM head beside tied embeddings...): a weight left out
    would compute a different model."""
    expected = {name for name, _ in expected_shapes(config)}
    for hf, gguf in gguf_names.items():
        if hf not in expected:
            raise ModelFileError(path, f"unexpected tensor {gguf}: a {config.architecture} "
                                       "model of this config has no such weight")


def _gguf_name(hf: str, arch: str = "llama") -> str:
    """The GGUF name of an HF weight name (for messages about missing tensors)."""
    for gguf, hf_base in _GLOBAL_NAMES.items():
        if hf.startswith(hf_base + "."):
            return gguf + hf.removeprefix(hf_base)
    _, _, layer, rest = hf.split(".", 3)
    base, _, kind = rest.rpartition(".")
    layer_names = _LAYER_NAMES_OF_ARCH.get(arch, _LAYER_NAMES)
    short = {v: k for k, v in layer_names.items()}.get(base, base)
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
    for key, item_type in (("tokens", str), ("merges", str), ("token_type", int),
                           ("scores", float)):
        values = meta.get(f"tokenizer.ggml.{key}", [])
        if not isinstance(values, list) or not all(type(v) is item_type for v in values):
            raise ModelFileError(path, f"tokenizer.ggml.{key} must be a list of "
                                       f"{item_type.__name__}")
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelFileError(path, "missing key tokenizer.ggml.tokens")
    if any(" " not in m for m in meta.get("tokenizer.ggml.merges", [])):
        raise ModelFileError(path, "tokenizer.ggml.merges holds an entry without a space")
    for key in ("bos", "eos", "eot", "eom", "unknown"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and (type(token_id) is not int
                                     or not 0 <= token_id < vocab_size):
            raise ModelFileError(path, f"tokenizer.ggml.{key}_token_id {token_id!r} is not a "
                                       f"token id (vocabulary of {vocab_size})")
    for key in ("pre", "model", "chat_template"):
        value = meta.get(f"tokenizer.{'' if key == 'chat_template' else 'ggml.'}{key}")
        if value is not None and not isinstance(value, str):
            raise ModelFileError(path, f"tokenizer key {key} must be a string, not {value!r}")


def _model_name(path: str) -> str:
    return os.path.basename(path).removesuffix(".gguf")


# -- tensors ----------------------------------------------------------------------------------


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """HF name of a GGUF tensor of architecture `arch`.

    `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, `output.weight` ->
    `lm_head.weight` (gemma3: `blk.3.ffn_norm.weight` ->
    `model.layers.3.pre_feedforward_layernorm.weight`); a ValueError for anything else
    (`rope_freqs.weight` is config: gguf_config reads it).
    """
    layer_names = _LAYER_NAMES_OF_ARCH.get(arch, _LAYER_NAMES)
    if m := _LAYER_RE.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        if part in layer_names:
            return f"model.layers.{layer}.{layer_names[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(
        f"unsupported GGUF tensor {gguf_name!r} (not a tensor of the supported architectures)"
    )


# The float types a tensor is read in as stored (but norms, shifted in fp32): its bits' numpy
# type and its torch dtype. The model widens a 16-bit one as it loads it (exact), as an HF
# directory's bf16/fp16 tensors.
_AS_STORED = {Q.F16: (np.uint16, torch.float16), Q.BF16: (np.uint16, torch.bfloat16),
              Q.F32: (np.float32, torch.float32)}


def _stored_as(tensor: GGUFTensor) -> tuple | None:
    """(its bits' numpy type, its torch dtype) where a tensor is read as stored (_AS_STORED's
    types but norms, which are shifted in fp32), else None (dequantized to float32)."""
    return None if tensor.name.endswith("norm.weight") else _AS_STORED.get(tensor.tensor_type)


def _private_mapping(path: str) -> mmap.mmap | None:
    """A private (copy-on-write) mapping of the file: arrays over it are writable, never
    write the file, and cost no memory until read. None where the system refuses one (a
    strict overcommit policy counts it whole): the tensors are then copied out."""
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:
        log.info("%s: no private mapping (%s); its 16-bit tensors are copied", path, exc)
        return None


def _convert(tensor: GGUFTensor, config: ModelConfig, arch: str = "llama",
             private: mmap.mmap | None = None) -> torch.Tensor:
    """One reader tensor in HF layout (Q/K rows un-permuted for llama, Gemma's norms back to
    HF's w from llama.cpp's 1 + w): F32, F16 and BF16 as stored, every other type
    dequantized to float32. Such a tensor in the file's order is a view of `private` (the
    file's `_private_mapping`) where given, else a copy out of the file."""
    shape = tuple(reversed(tensor.shape))  # NOTE: GGUF lists ne0 (fastest) first
    norm = tensor.name.endswith("norm.weight")
    kept = _stored_as(tensor)
    if kept is not None and private is not None:
        bits = np.dtype(kept[0])
        weight = np.frombuffer(private, dtype=bits, count=tensor.data.nbytes // bits.itemsize,
                               offset=tensor.offset).reshape(shape)  # NOTE: the bits
    elif kept is not None:
        weight = np.array(tensor.data).view(kept[0]).reshape(shape)
        tensor.release()  # NOTE: copied: the file's pages are not needed again
    else:
        weight = dequantize(tensor.data, tensor.tensor_type).numpy().reshape(shape)
    if arch in _NORM_SHIFTED_ARCHS and norm:
        weight = weight - np.float32(1.0)
    if config.architecture == "llama":
        if ".attn_q." in tensor.name:
            weight = unpermute_qk(weight, config.num_attention_heads)
        elif ".attn_k." in tensor.name:
            weight = unpermute_qk(weight, config.num_key_value_heads)
    weight = torch.from_numpy(np.ascontiguousarray(weight))
    return weight if kept is None else weight.view(kept[1])


def _kept_in_blocks(hf: str, tensor: GGUFTensor, config: ModelConfig) -> bool:
    """Whether a tensor stays in its blocks under keep_quantized: a quantized linear weight
    or embedding table (the model looks its tokens up in the blocks: BlockEmbedding)."""
    kept = hf.endswith("_proj.weight") or hf in (HEAD, EMBEDDING)
    return kept and tensor.tensor_type not in FLOAT_TYPES


def _block_tensor(tensor: GGUFTensor, config: ModelConfig, path: str,
                  arch: str) -> GGUFBlockTensor:
    """A linear weight's blocks (rows: output features; Q/K rows un-permuted for llama),
    checked now and converted when its kernel packs it (LazyBlocks); kernels that do not
    run blocks take its fp32 values, dequantized from the file as `_convert` does.

    NOTE: the file's pages of the tensor are released after each read (GGUFTensor.release):
    a loading process holds the packed model and one weight's conversion, not the file.
    """
    check_blocks(tensor.data, tensor.tensor_type, tensor.name, path)
    tensor.release()
    rows, row_bytes = tensor.data.shape
    block, size = GGML_QUANT_SIZES[tensor.tensor_type]

    order = None
    if config.architecture == "llama":
        heads = {".attn_q.": config.num_attention_heads, ".attn_k.": config.num_key_value_heads}
        order = next((unpermute_qk(np.arange(rows), n_head)
                      for part, n_head in heads.items() if part in tensor.name), None)
    file = FileBlocks(tensor.data, tensor.tensor_type, tensor.name, path, order, tensor.release,
                      checked=True)

    def values() -> torch.Tensor:
        weight = _convert(tensor, config, arch)
        tensor.release()
        return weight

    shape = (rows, row_bytes // size * block)
    return GGUFBlockTensor(LazyBlocks((tensor.tensor_type.name,), shape,
                                      functools.partial(unpack_files, [file]), values=values,
                                      file=file))


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's Q/K row permutation (interleaved rotary -> HF's rotate_half).

    llama.cpp permutes with `w.reshape(n_head, 2, d // n_head // 2, ...).swapaxes(1, 2)`;
    this reshapes to `(n_head, d // n_head // 2, 2, ...)` and swaps back.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
