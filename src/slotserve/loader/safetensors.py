"""Read a Hugging Face model directory: config.json + *.safetensors (single file or sharded)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from slotserve.config import ModelConfig
from slotserve.loader.tokenizer import Tokenizer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
INDEX_FILE = "model.safetensors.index.json"


def load_hf_dir(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None]:
    """Config, float32 weights and tokenizer (None without tokenizer.json) of an HF directory."""
    config = hf_model_config(path)
    weights = read_weights(weight_files(path))
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # NOTE: tied means absent, even if the file has it
    tokenizer = Tokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids)
    return config, weights, tokenizer


def hf_model_config(path: str) -> ModelConfig:
    """ModelConfig from config.json, with generation_config.json's EOS ids added."""
    cfg = _read_json(os.path.join(path, "config.json"))
    if cfg is None:
        raise FileNotFoundError(f"{path} has no config.json (not a Hugging Face model directory)")
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} (supported: {SUPPORTED_MODEL_TYPES})"
        )
    config = ModelConfig.from_hf_dict(cfg, name=os.path.basename(os.path.normpath(path)))
    gen_eos = (_read_json(os.path.join(path, "generation_config.json")) or {}).get("eos_token_id")
    gen_eos = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
    eos = tuple(dict.fromkeys([*config.eos_token_ids, *gen_eos]))
    return dataclasses.replace(config, eos_token_ids=eos)


def weight_files(path: str) -> list[str]:
    """The directory's safetensors files: the shards its index names, else every *.safetensors."""
    index = _read_json(os.path.join(path, INDEX_FILE))
    if index is not None:
        shards = sorted(set(index["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    return files


def read_weights(files: list[str]) -> dict[str, torch.Tensor]:
    """All tensors of `files`, as float32; rotary `inv_freq` buffers are dropped."""
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(file).items():
            if not name.endswith("rotary_emb.inv_freq"):
                weights[name] = tensor.float()
    return weights


def save_weights(weights: dict[str, torch.Tensor], file: str) -> None:
    """Write `weights` to one safetensors file (tensors made contiguous)."""
    save_file({name: t.contiguous() for name, t in weights.items()}, file)


def load_weights(file: str) -> dict[str, torch.Tensor]:
    """Read what `save_weights` wrote."""
    return load_file(file)


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
