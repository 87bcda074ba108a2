"""Which module builds which architecture."""

from __future__ import annotations

import torch
from torch import nn

from slotserve.config import ModelConfig
from slotserve.model.layers import RotaryEmbedding
from slotserve.model.llama import LlamaForCausalLM

ARCHITECTURES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM,
                 "qwen2": LlamaForCausalLM, "smollm": LlamaForCausalLM}


def build_model(cfg: ModelConfig, device: torch.device) -> nn.Module:
    """An uninitialised model on `device`: its weights are loaded next, so no random init.

    NOTE: built on the meta device, then given real (empty) storage; only the RoPE tables
    are computed here.
    """
    try:
        cls = ARCHITECTURES[cfg.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}; "
                         f"supported: {sorted(ARCHITECTURES)}") from None
    with torch.device("meta"):
        model = cls(cfg)
    model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_tables()
    return model
