"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a flat ragged batch.

All scheduled tokens of all requests are one (T, H) tensor: the linear layers see no
padding; only attention knows where one sequence ends, through AttentionMetadata.
"""

from __future__ import annotations

import torch
from torch import nn

from slotserve.attention.metadata import AttentionMetadata
from slotserve.attention.torch_paged import paged_attention, write_kv
from slotserve.config import ModelConfig
from slotserve.layer_windows import layer_window
from slotserve.model.kernels import REFERENCE, KernelSet
from slotserve.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, apply_rotary
from slotserve.model.linear_kernels import swap_linear_kernels


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops=None, window: int | None = None) -> None:
        super().__init__()
        self.window = window  # sliding window (positions a query reads), None: full
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.scale = self.head_dim ** -0.5
        self.ops = ops  # the fused CPU kernels (model/cpu_ops.py) or None: torch's ops

    def forward(self, x: torch.Tensor, rope: tuple, kv_cache: tuple,
                meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, q_size + 2 kv_size)
        # q and k side by side, rotated in one call: (T, nh + nkv, hd)
        qk = qkv[:, :self.q_size + self.kv_size].view(T, -1, self.head_dim)
        if self.ops is not None:
            self.ops.rotary_(qk, *rope)  # in place, inside qkv
        else:
            qk = apply_rotary(qk, rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # (T, nh|nkv, hd)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, self.ops)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale, self.ops,
                              self.window)  # (T, nh, hd)
        return self.o_proj(out.reshape(T, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops=None, window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = LlamaAttention(cfg, ops, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ops)

    def forward(self, x, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """forward(tokens) -> hidden states; compute_logits(selected hidden) -> logits.

    kernels: the KernelSet (model/kernels.py) it runs: its fused ops go to the norms, MLPs and
    attention here; its linear kernels and decode stack are built by load_hf_weights.
    """

    def __init__(self, cfg: ModelConfig, kernels: KernelSet = REFERENCE) -> None:
        super().__init__()
        self.config = cfg
        self.kernels = kernels
        ops = kernels.layer_ops
        # _weight given: nn.Embedding skips its random init (the weights are loaded next).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, ops, layer_window(cfg.sliding_windows, i))
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        # NOTE: a tied LM head is a transposed copy of the embedding, not the same tensor:
        # the head wants (H, V) for its matmul, the lookup wants (V, H).
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        # The C++ DecodeStack (csrc/decode_stack.cpp) runs the layers of all-decode iterations in
        # one call, once load_hf_weights built it (kernels.decode_stack); None: every layer
        # in Python.
        self.decode_stack = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.decode_stack is not None and meta.decode_only:
            group = meta.decode_groups[0]
            caches = [cache for kv_cache in kv_caches for cache in kv_cache]  # k0, v0, k1, ...
            return self.decode_stack.forward(input_ids, positions, caches, meta.slot_mapping,
                                             group.block_tables, group.context_lens)
        x = self.embed_tokens(input_ids)  # (T, H)
        rope = self.rotary.tables(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x)

    def build_decode_stack(self, ops):
        """The C++ DecodeStack of `ops` (the fused CPU kernels) over this model's weights.

        NOTE: it holds the same tensors (no copy) and calls the same kernels as the layers'
        forward with the same ops, in the same order: the two agree to the last bit. It looks
        the tokens up in the same embedding and RoPE tables.
        """
        cfg, first = self.config, self.layers[0]
        stack = ops.DecodeStack(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                self.norm.eps, first.self_attn.scale, self.norm.weight)
        stack.set_lookup_tables(self.embed_tokens.weight, self.rotary.cos, self.rotary.sin)
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                            *(linear.cpp_weights(ops) for linear in
                              (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)),
                            attn.window or 0)
        return stack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (S, H) -> (S, V) fp32
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter is set.

        Then the linear layers take the KernelSet's kernels (which keep their own copy of the
        weights) and the decode stack is built. NOTE: once only, and after any `.to()`: a
        layer with a kernel holds no weight parameter to load or move again.
        """
        loaded = set()
        for name, tensor in fuse_hf_weights(weights, self.config).items():
            module_name, kind = name.rsplit(".", 1)
            module = self.get_submodule(module_name)
            target = getattr(module, kind)
            if isinstance(module, Linear) and kind == "weight":
                tensor = tensor.t()
            if target.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(name)
        missing = {n for n, _ in self.named_parameters()} - loaded
        if missing:
            raise ValueError(f"weights missing: {sorted(missing)[:5]}")
        swap_linear_kernels(self, self.kernels)
        if self.kernels.decode_stack:
            self.decode_stack = self.build_decode_stack(self.kernels.ops)


def fuse_hf_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig
                    ) -> dict[str, torch.Tensor]:
    """HF Llama names -> this module's names (qkv_proj, gate_up_proj fused), HF layouts."""
    embed = weights["model.embed_tokens.weight"]
    fused: dict[str, torch.Tensor] = {
        "embed_tokens.weight": embed,
        "norm.weight": weights["model.norm.weight"],
        "lm_head.weight": embed if cfg.tie_word_embeddings else weights["lm_head.weight"],
    }
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        fused[dst + "self_attn.qkv_proj.weight"] = torch.cat(
            [weights[attn + f"{p}_proj.weight"] for p in "qkv"])
        if cfg.attention_bias:
            fused[dst + "self_attn.qkv_proj.bias"] = torch.cat(
                [weights[attn + f"{p}_proj.bias"] for p in "qkv"])
        fused[dst + "self_attn.o_proj.weight"] = weights[attn + "o_proj.weight"]
        fused[dst + "mlp.gate_up_proj.weight"] = torch.cat(
            [weights[src + "mlp.gate_proj.weight"], weights[src + "mlp.up_proj.weight"]])
        fused[dst + "mlp.down_proj.weight"] = weights[src + "mlp.down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            fused[dst + norm + ".weight"] = weights[src + norm + ".weight"]
    return fused
