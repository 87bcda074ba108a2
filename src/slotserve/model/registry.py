"""Which module builds which architecture."""

from __future__ import annotations

from torch import nn

from slotserve.config import ModelConfig
from slotserve.model.families import FAMILIES
from slotserve.model.kernels import REFERENCE, KernelSet
from slotserve.model.llama import LlamaForCausalLM

# Every family is the Llama decoder with its differences as data (model/families.py).
ARCHITECTURES = {name: LlamaForCausalLM for name in FAMILIES}


def build_model(cfg: ModelConfig, kernels: KernelSet = REFERENCE) -> nn.Module:
    """An uninitialised model running `kernels` (model/kernels.py): every parameter is
    torch.empty, its weights are loaded next (load_hf_weights, which builds the kernels).

    NOTE: no random init and no meta device (its first use imports torch's meta kernels,
    about 2 s of start-up).
    """
    try:
        cls = ARCHITECTURES[cfg.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}; "
                         f"supported: {sorted(ARCHITECTURES)}") from None
    return cls(cfg, kernels)
