"""Model loading: a GGUF file or a Hugging Face directory -> config, weights, tokenizer.

    from slotserve.loader import load_model
    model = load_model()            # the embedded default model (SmolLM2-135M-Instruct, GGUF)
    model = load_model("path/to/hf_dir_or_file.gguf")

Weights use Hugging Face Llama names (`model.layers.0.self_attn.q_proj.weight`, ...), float32
(bf16/fp16 tensors of an HF directory or a GGUF as stored: the model widens them as it loads
them; a GGUF's quantized linears in their blocks with keep_quantized), on CPU; `lm_head.weight`
is absent when the embeddings are tied. Only a GGUF with a quantized type that has no block
form is converted through an on-disk cache (see `slotserve.loader.cache`).
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass

import torch

from slotserve.config import ModelConfig
from slotserve.loader.cache import cached_convert
from slotserve.loader.default_model import default_model_path
from slotserve.loader.detokenize import IncrementalDetokenizer
from slotserve.loader.gguf import blocks_kept, load_gguf, quantized
from slotserve.loader.gguf_blocks import GGUFBlockTensor
from slotserve.loader.gguf_reader import read_gguf
from slotserve.loader.safetensors import load_hf_dir
from slotserve.loader.tokenizer import Tokenizer
from slotserve.loader.validation import ModelFileError

__all__ = [
    "IncrementalDetokenizer",
    "LoadedModel",
    "ModelFileError",
    "Tokenizer",
    "default_model_path",
    "load_model",
]


@dataclass
class LoadedModel:
    """A model ready to hand to `slotserve.model`: shape, weights, tokenizer, where it came from."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF Llama names, float32 or 16-bit as stored, CPU
    tokenizer: Tokenizer | None  # None when an HF directory has no tokenizer files
    source: str  # the path loaded


def load_model(path: str | None = None, *, use_cache: bool = True,
               keep_quantized: bool = False) -> LoadedModel:
    """Load a `.gguf` file or a Hugging Face model directory; None loads the default model.

    `use_cache=False` converts a GGUF afresh and leaves the on-disk cache untouched.
    `keep_quantized=True`: a GGUF's quantized linear weights stay in their blocks
    (`gguf_blocks.GGUFBlockTensor`, for quantization="auto"); such a GGUF is read straight
    from the file, never through the fp32 cache (a file with a quantized type that has no
    block form is converted through the cache, with a warning). A GGUF of F32, F16 and BF16
    tensors only is read straight from the file, its 16-bit tensors as stored: no cache.
    A malformed model file raises ModelFileError (a ValueError) naming the file and the problem.
    """
    path = default_model_path() if path is None else os.fspath(path)
    if os.path.isdir(path):
        config, weights, tokenizer = load_hf_dir(path)
    elif os.path.isfile(path):
        _check_gguf(path)
        gguf = read_gguf(path)  # NOTE: read once, used twice
        if keep_quantized and blocks_kept(path, gguf):
            converted = load_gguf(path, keep_quantized=True, gguf=gguf)
        elif not quantized(gguf):  # NOTE: F32/F16/BF16 only: read as stored, no cache
            converted = load_gguf(path, gguf=gguf)
        else:
            convert = functools.partial(load_gguf, gguf=gguf)  # NOTE: the header read once
            converted = cached_convert(path, convert) if use_cache else convert(path)
        config, weights, tokenizer = converted
    else:
        raise FileNotFoundError(f"no model at {path!r} (expected a .gguf file or an HF directory)")
    loaded = LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=path)
    if any(isinstance(w, GGUFBlockTensor) for w in weights.values()):
        from slotserve.model.cpu_ops import release_unpack_memory

        # NOTE: the blocks are unpacked as the model loads them, into memory kept from one
        # weight to the next (csrc/gguf_unpack.cpp's NOTE (reused memory)); the loading is
        # done when its LoadedModel is dropped (LLMEngine.from_config)
        weakref.finalize(loaded, release_unpack_memory)
    return loaded


def _check_gguf(path: str) -> None:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelFileError(path, "not a GGUF file (bad magic; a model file must be .gguf)")
