"""Which module builds which architecture."""

from __future__ import annotations

from torch import nn

from slotserve.config import ModelConfig
from slotserve.model.llama import LlamaForCausalLM

ARCHITECTURES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM,
                 "qwen2": LlamaForCausalLM, "smollm": LlamaForCausalLM}


def build_model(cfg: ModelConfig) -> nn.Module:
    """An uninitialised model: every parameter is torch.empty, its weights are loaded next.

    NOTE: no random init and no meta device (its first use imports torch's meta kernels,
    about 2 s of start-up).
    """
    try:
        cls = ARCHITECTURES[cfg.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}; "
                         f"supported: {sorted(ARCHITECTURES)}") from None
    return cls(cfg)
