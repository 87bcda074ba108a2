"""Read a Hugging Face model directory: config.json + *.safetensors (single file or sharded).

A malformed file (bad JSON, a missing key, a damaged safetensors file, a weight of the wrong
shape) raises ModelFileError naming the file and the problem.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from slotserve.config import ModelConfig
from slotserve.config_gate import UnsupportedConfig
from slotserve.loader.tokenizer import Tokenizer
from slotserve.loader.validation import ModelFileError, check_config, check_weight_shapes

INDEX_FILE = "model.safetensors.index.json"
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def load_hf_dir(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None]:
    """Config, weights (float32, or bfloat16/float16 as the file stores them) and tokenizer
    (None without tokenizer.json) of an HF directory."""
    config = hf_model_config(path)
    files = weight_files(path)
    weights = read_weights(files)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # NOTE: tied means absent, even if the file has it
    where = {name: os.path.basename(file) for file in files for name in _tensor_names(file)}
    check_weight_shapes(path, config, {name: tuple(t.shape) for name, t in weights.items()},
                        describe=lambda name: f"{name} (in {where[name]})" if name in where
                        else name)
    tokenizer = Tokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids)
    return config, weights, tokenizer


def hf_model_config(path: str) -> ModelConfig:
    """ModelConfig from config.json, with generation_config.json's EOS ids added."""
    config_file = os.path.join(path, "config.json")
    cfg = _read_json(config_file)
    if cfg is None:
        raise FileNotFoundError(f"{path} has no config.json (not a Hugging Face model directory)")
    try:
        config = ModelConfig.from_hf_dict(cfg, name=os.path.basename(os.path.normpath(path)))
    except UnsupportedConfig as exc:  # the config gate: names the key and its value
        raise ModelFileError(config_file, str(exc)) from None
    except KeyError as exc:
        raise ModelFileError(config_file, f"missing key {exc.args[0]}") from None
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise ModelFileError(config_file, f"bad value: {exc}") from None
    check_config(config_file, config)
    gen_eos = (_read_json(os.path.join(path, "generation_config.json")) or {}).get("eos_token_id")
    gen_eos = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
    eos = tuple(dict.fromkeys([*config.eos_token_ids, *gen_eos]))
    return dataclasses.replace(config, eos_token_ids=eos)


def weight_files(path: str) -> list[str]:
    """The directory's safetensors files: the shards its index names, else every *.safetensors."""
    index_file = os.path.join(path, INDEX_FILE)
    index = _read_json(index_file)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(shard, str) for shard in weight_map.values()):
            raise ModelFileError(index_file, "missing key weight_map (tensor name -> shard file)")
        shards = sorted(set(weight_map.values()))
        return [os.path.join(path, shard) for shard in shards]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    return files


def read_weights(files: list[str]) -> dict[str, torch.Tensor]:
    """All tensors of `files`, in their own dtype (float64 as float32); rotary `inv_freq`
    buffers are dropped.

    NOTE: bf16/fp16 stay as they are: the model widens each tensor as it copies it in
    (exactly), so the loading never holds an fp32 copy of the whole file.

    A tensor that is not float32, float16, bfloat16 or float64 raises ModelFileError.
    """
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in _load_file(file).items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if tensor.dtype not in WEIGHT_DTYPES:
                raise ModelFileError(file, f"tensor {name} has dtype {tensor.dtype}, not one of "
                                           f"{', '.join(str(d) for d in WEIGHT_DTYPES)}")
            weights[name] = tensor.float() if tensor.dtype == torch.float64 else tensor
    return weights


def _load_file(file: str) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; a damaged file raises ModelFileError.

    NOTE: the safetensors library checks the header (its size, JSON, dtypes, offsets against
    the file's size) before it maps anything; its errors are rewrapped to name the file.
    """
    try:
        return load_file(file)
    except SafetensorError as exc:
        raise ModelFileError(file, f"not a valid safetensors file: {exc}") from None


def _tensor_names(file: str) -> list[str]:
    with safe_open(file, framework="pt") as f:
        return list(f.keys())


def save_weights(weights: dict[str, torch.Tensor], file: str) -> None:
    """Write `weights` to one safetensors file (tensors made contiguous)."""
    save_file({name: t.contiguous() for name, t in weights.items()}, file)


def load_weights(file: str) -> dict[str, torch.Tensor]:
    """Read what `save_weights` wrote."""
    return _load_file(file)


def _read_json(path: str) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when there is no such file."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(path, f"invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelFileError(path, f"expected a JSON object, got {type(data).__name__}")
    return data
