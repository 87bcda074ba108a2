"""The one error a malformed model file raises, and the weight checks both loaders share."""

from __future__ import annotations

import os
from collections.abc import Iterator

from slotserve.config import ModelConfig
from slotserve.model.families import family_of
from slotserve.value_checks import is_int


class ModelFileError(ValueError):
    """A model file (GGUF, safetensors, or an HF directory's JSON) that cannot be loaded.

    The message names the file and what is wrong with it: truncated header, bad magic,
    unsupported version, missing key, tensor out of bounds, wrong shape, ...
    """

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path, self.problem = os.fspath(path), problem
        super().__init__(f"{self.path}: {problem}")


def expected_shapes(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every weight a model of `config` needs (lm_head only when untied).

    NOTE: a generator, layer by layer: a forged layer count (2**32) costs nothing until the
    first missing layer stops the check.
    """
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    family = family_of(config)
    yield "model.embed_tokens.weight", (vocab, h)
    yield "model.norm.weight", (h,)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (vocab, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        if family.fused_hf_weights:  # Phi-3: q/k/v and gate/up stored fused
            yield from {p + "self_attn.qkv_proj.weight": (q + 2 * kv, h),
                        p + "mlp.gate_up_proj.weight": (2 * inter, h)}.items()
        else:
            yield from {
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h)}.items()
        yield from {
            p + "self_attn.o_proj.weight": (h, q), p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        }.items()
        if config.attention_bias:
            yield from {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)}.items()
        if config.o_bias:
            yield p + "self_attn.o_proj.bias", (h,)
        if config.mlp_bias:
            yield from {p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,),
                        p + "mlp.down_proj.bias": (h,)}.items()
        if family.qk_norm:
            yield from {p + "self_attn.q_norm.weight": (config.head_dim,),
                        p + "self_attn.k_norm.weight": (config.head_dim,)}.items()
        if family.sandwich_norms:
            yield from {p + "pre_feedforward_layernorm.weight": (h,),
                        p + "post_feedforward_layernorm.weight": (h,)}.items()


def check_config(path: str, config: ModelConfig) -> None:
    """A ModelFileError unless `config`'s sizes are positive, its heads divide evenly and its
    head_dim is even (rotary embeddings rotate pairs)."""
    sizes = {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
             "intermediate_size": config.intermediate_size,
             "num_hidden_layers": config.num_hidden_layers,
             "num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim}
    for field, value in sizes.items():
        if not is_int(value) or value < 1:
            raise ModelFileError(path, f"{field} must be a positive integer, not {value!r}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ModelFileError(path, f"num_attention_heads ({config.num_attention_heads}) is not "
                                   f"a multiple of num_key_value_heads "
                                   f"({config.num_key_value_heads})")
    if config.head_dim % 2:
        raise ModelFileError(path, f"head_dim {config.head_dim} is odd (rotary embeddings need "
                                   "an even one)")


def check_weight_shapes(path: str, config: ModelConfig, shapes: dict[str, tuple[int, ...]],
                        describe=lambda name: name) -> None:
    """A ModelFileError for the first missing weight or wrong shape; extra weights pass.

    `shapes` maps HF names to the file's shapes (HF order); `describe` turns an HF name into
    the name the file uses, for the message.
    """
    for name, want in expected_shapes(config):
        if name not in shapes:
            raise ModelFileError(path, f"missing tensor {describe(name)}")
        if tuple(shapes[name]) != want:
            raise ModelFileError(path, f"wrong shape for {describe(name)}: "
                                       f"{tuple(shapes[name])}, expected {want}")
