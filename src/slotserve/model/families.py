"""How each model family's block differs from the Llama block: one frozen description each.

The Llama block: x += attn(norm(x)); x += mlp(norm(x)), RMSNorm weights used as they are,
no q/k norms, embeddings as looked up. A family changes some of that (`Family`); the values
a family reads from its config (biases, activation, soft-caps, query_pre_attn_scalar, RoPE
scaling, per-layer windows and RoPE bases) are ModelConfig fields (config_gate.py parses and
checks them). llama.py reads these descriptions; it has no per-family branches.

| family | what differs from Llama |
| --- | --- |
| llama, mistral, qwen2 | nothing (qwen2: q/k/v bias, from the config) |
| qwen3 | RMSNorm over each head's q and k, before RoPE |
| phi3 | HF stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` |
| gemma2 | RMSNorm weights (1 + w); norms after attention and MLP too; embeddings x sqrt(H) |
| gemma3_text | as gemma2, plus Gemma-style q/k norms |
"""

from __future__ import annotations

from dataclasses import dataclass

from slotserve.config import ModelConfig


@dataclass(frozen=True)
class Family:
    """One family's differences from the Llama block.

    norm_offset: RMSNorm multiplies by (norm_offset + w): Gemma's 1; folded into the weights
        at load (exact in fp32: HF computes 1.0 + w in fp32 too).
    sandwich_norms: Gemma: post_attention_layernorm normalizes the attention's output (not
        the residual), and pre_/post_feedforward_layernorm wrap the MLP.
    qk_norm: Qwen3 / Gemma 3: an RMSNorm (head_dim weights, the same offset) on each head's
        q and k after the projection, before RoPE.
    embed_scale: Gemma: embeddings x sqrt(hidden_size), the factor rounded to the model's dtype.
    fused_hf_weights: Phi-3: HF's checkpoint holds qkv_proj and gate_up_proj (split at load
        into q/k/v and gate/up names, then fused again as every family is).
    """

    name: str
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    qk_norm: bool = False
    embed_scale: bool = False
    fused_hf_weights: bool = False


LLAMA = Family("llama")
FAMILIES: dict[str, Family] = {
    "llama": LLAMA,
    "smollm": LLAMA,
    "mistral": Family("mistral"),
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3", qk_norm=True),
    "phi3": Family("phi3", fused_hf_weights=True),
    "gemma2": Family("gemma2", norm_offset=1.0, sandwich_norms=True, embed_scale=True),
    "gemma3_text": Family("gemma3_text", norm_offset=1.0, sandwich_norms=True, qk_norm=True,
                          embed_scale=True),
}


def family_of(cfg: ModelConfig) -> Family:
    """The Family of a ModelConfig's architecture; ValueError for an unknown one."""
    try:
        return FAMILIES[cfg.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}; "
                         f"supported: {sorted(FAMILIES)}") from None


# The MLP activations DecodeStack.set_activation takes (HF's names).
STACK_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")


def decode_stack_gaps(cfg: ModelConfig) -> list[str]:
    """What the C++ decode stack (csrc/decode_stack.cpp: the Llama block with SiLU or GELU,
    plain scaled attention, optional per-head q/k RMSNorms, sandwich norms, an embedding
    scale, a second RoPE table for sliding layers) cannot run for this model; empty: it runs
    it all (Qwen3 and Gemma 3 included; Gemma 2's soft-capped attention is not).

    NOTE: where this is not empty the model decodes layer by layer in Python, through the
    fused ops where they apply and torch elsewhere; the start-up line says why.
    """
    family_of(cfg)  # NOTE: every family's block shape is one the stack runs; checks the name
    gaps = []
    if cfg.hidden_act not in STACK_ACTIVATIONS:
        gaps.append(f"{cfg.hidden_act} MLP")
    if cfg.attn_logit_softcapping is not None:
        gaps.append("attention soft-capping")
    if cfg.o_bias or cfg.mlp_bias:
        gaps.append("o/MLP biases")
    return gaps


def torch_ops(cfg: ModelConfig) -> list[str]:
    """The ops of this model that run in torch even with the fused CPU kernels (they have
    no kernel for them)."""
    ops = []
    if cfg.hidden_act != "silu":
        ops.append(f"{cfg.hidden_act} MLP")
    if cfg.attn_logit_softcapping is not None:
        ops.append("soft-capped attention")
    return ops
