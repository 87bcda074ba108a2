"""The decoder of every family served (Llama 2/3, SmolLM2, Mistral, Qwen2/3, Gemma 2/3, Phi-3)
over a flat ragged batch.

All scheduled tokens of all requests are one (T, H) tensor: the linear layers see no
padding; only attention knows where one sequence ends, through AttentionMetadata. How a
family's block differs from Llama's is data (model/families.py), read here once at build.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from slotserve.attention.metadata import AttentionMetadata
from slotserve.attention.torch_paged import paged_attention, write_kv
from slotserve.config import ModelConfig
from slotserve.layer_windows import layer_window
from slotserve.loader.gguf_blocks import GGUFBlockTensor, dequantized
from slotserve.model.families import Family, decode_stack_gaps, family_of, torch_ops
from slotserve.model.kernels import REFERENCE, KernelSet
from slotserve.model.layers import (
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    WidenedEmbedding,
    apply_rotary,
)
from slotserve.model.linear_kernels import (
    BlockEmbedding,
    GGUFBlockLinear,
    LinearKernelSwap,
    gguf_block_kernel_available,
)
from slotserve.model.softcap_attention import softcapped_paged_attention


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, family: Family, ops=None,
                 window: int | None = None) -> None:
        super().__init__()
        self.window = window  # sliding window (positions a query reads), None: full
        # Gemma 3: a sliding layer rotates with its own base (the rotary's local tables)
        self.local_rope = window is not None and cfg.local_rope_theta is not None
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if family.qk_norm:  # (hd,) weights; over (T * heads, hd) rows (_norm_heads)
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
        self.qk_norm = family.qk_norm
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = cfg.attn_logit_softcapping
        self.ops = ops  # the fused CPU kernels (model/cpu_ops.py) or None: torch's ops

    def forward(self, x: torch.Tensor, ropes: dict, kv_cache: tuple,
                meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        rope = ropes[self.local_rope]
        qkv = self.qkv_proj(x)  # (T, q_size + 2 kv_size)
        # q and k side by side, rotated in one call: (T, nh + nkv, hd)
        qk = qkv[:, :self.q_size + self.kv_size].view(T, -1, self.head_dim)
        if self.qk_norm:  # Qwen3 / Gemma 3: each head's q and k normalized, before RoPE
            qk = torch.cat([_norm_heads(self.q_norm, qk[:, :self.num_heads]),
                            _norm_heads(self.k_norm, qk[:, self.num_heads:])], dim=1)
        if self.ops is not None:
            self.ops.rotary_(qk, *rope)  # in place (inside qkv, or the normalized copy)
        else:
            qk = apply_rotary(qk, rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # (T, nh|nkv, hd)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, self.ops)
        if self.softcap is not None:  # Gemma 2: no kernel soft-caps scores
            out = softcapped_paged_attention(q, k_cache, v_cache, meta, self.scale,
                                             self.softcap, self.window)
        else:
            out = paged_attention(q, k_cache, v_cache, meta, self.scale, self.ops,
                                  self.window)  # (T, nh, hd)
        return self.o_proj(out.reshape(T, self.q_size))


def _norm_heads(norm: RMSNorm, heads: torch.Tensor) -> torch.Tensor:
    """heads (T, n, hd), a strided view of qkv -> a normalized copy (T, n, hd): one RMSNorm
    row per head. NOTE: the fused rms_norm takes 2-D rows; the decode stack normalizes the
    same rows with the same kernel (norm_heads_rows), so the two agree to the last bit."""
    T, n, hd = heads.shape
    return norm(heads.reshape(T * n, hd)).view(T, n, hd)


class LlamaDecoderLayer(nn.Module):
    """x += attn_out(attn(input_layernorm(x))); x += mlp_out(mlp(mlp_in(x))).

    The Llama block: mlp_in is post_attention_layernorm, attn_out and mlp_out nothing.
    Sandwich norms (Gemma): attn_out is post_attention_layernorm, mlp_in / mlp_out
    pre_ / post_feedforward_layernorm. Every norm has its HF name (the weights load by it).
    """

    def __init__(self, cfg: ModelConfig, family: Family, ops=None,
                 window: int | None = None) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, ops)
        self.self_attn = LlamaAttention(cfg, family, ops, window)
        self.post_attention_layernorm = RMSNorm(h, eps, ops)
        self.mlp = GatedMLP(h, cfg.intermediate_size, ops, act=cfg.hidden_act,
                            bias=cfg.mlp_bias)
        if family.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, ops)
            self.post_feedforward_layernorm = RMSNorm(h, eps, ops)
            # NOTE: a tuple, so the norms are registered once, under their HF names
            self.roles = (self.post_attention_layernorm, self.pre_feedforward_layernorm,
                          self.post_feedforward_layernorm)
        else:
            self.roles = (_identity, self.post_attention_layernorm, _identity)

    def forward(self, x, ropes, kv_cache, meta):
        attn_out, mlp_in, mlp_out = self.roles
        x = x + attn_out(self.self_attn(self.input_layernorm(x), ropes, kv_cache, meta))
        return x + mlp_out(self.mlp(mlp_in(x)))


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class LlamaForCausalLM(nn.Module):
    """forward(tokens) -> hidden states; compute_logits(selected hidden) -> logits.

    kernels: the KernelSet (model/kernels.py) it runs: its fused ops go to the norms, MLPs and
    attention here; its linear kernels and decode stack are built by load_hf_weights. Where
    the family needs what the decode stack lacks, `self.kernels` is the set without it (and
    says so: KernelSet.for_model).
    """

    def __init__(self, cfg: ModelConfig, kernels: KernelSet = REFERENCE) -> None:
        super().__init__()
        self.config = cfg
        self.family = family = family_of(cfg)
        self.kernels = kernels = kernels.for_model(decode_stack_gaps(cfg), torch_ops(cfg))
        ops = kernels.layer_ops
        # _weight given: nn.Embedding skips its random init (the weights are loaded next).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        # Gemma: embeddings x sqrt(hidden), the factor in the model's dtype (as HF)
        self.embed_scale = math.sqrt(cfg.hidden_size) if family.embed_scale else None
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, cfg.local_rope_theta)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, family, ops, layer_window(cfg.sliding_windows, i))
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        # NOTE: a tied LM head is a transposed copy of the embedding, not the same tensor:
        # the head wants (H, V) for its matmul, the lookup wants (V, H).
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.final_softcap = cfg.final_logit_softcapping
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
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype)
        ropes = {False: self.rotary.tables(positions)}  # by "is a local (sliding) layer"
        if self.config.local_rope_theta is not None:
            ropes[True] = self.rotary.tables(positions, local=True)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, ropes, kv_cache, meta)
        return self.norm(x)

    def build_decode_stack(self, ops):
        """The C++ DecodeStack of `ops` (the fused CPU kernels) over this model's weights.

        NOTE: it holds the same tensors (no copy) and calls the same kernels as the layers'
        forward with the same ops, in the same order: the two agree to the last bit. It looks
        the tokens up in the same embedding and RoPE tables. Only for a model whose family
        it runs (model/families.decode_stack_gaps is empty).
        """
        cfg, first = self.config, self.layers[0]
        stack = ops.DecodeStack(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                self.norm.eps, first.self_attn.scale, self.norm.weight)
        rotary = self.rotary  # Gemma 3: the sliding layers' tables too
        local = ({"cos_local": rotary.cos_local, "sin_local": rotary.sin_local}
                 if cfg.local_rope_theta is not None else {})
        blocks = isinstance(self.embed_tokens, BlockEmbedding)
        table = self.embed_tokens.placeholder if blocks else self.embed_tokens.weight
        stack.set_lookup_tables(table, rotary.cos, rotary.sin, **local)
        if blocks:
            self.embed_tokens.set_in_stack(stack)
        stack.set_activation(cfg.hidden_act)  # Gemma's GeGLU: ATen's gelu, as GatedMLP
        if self.embed_scale is not None:
            stack.set_embedding_scale(self.embed_scale)
        for layer in self.layers:
            stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                            *(linear.cpp_weights(ops) for linear in (
                                layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                layer.mlp.gate_up_proj, layer.mlp.down_proj)),
                            layer.self_attn.window or 0, **self._stack_layer_extras(layer))
        return stack

    def _stack_layer_extras(self, layer: LlamaDecoderLayer) -> dict:
        """What DecodeStack.add_layer takes beyond the Llama block for this family's layer:
        q/k norms (Qwen3, Gemma 3: (hd,) weights; the stack's eps is theirs too), sandwich
        norms (Gemma) and the local RoPE tables (Gemma 3's sliding layers)."""
        attn, extras = layer.self_attn, {"local_rope": layer.self_attn.local_rope}
        if attn.qk_norm:
            extras.update(q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight)
        if self.family.sandwich_norms:
            extras.update(pre_feedforward_norm=layer.pre_feedforward_layernorm.weight,
                          post_feedforward_norm=layer.post_feedforward_layernorm.weight)
        return extras

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (S, H) -> (S, V) fp32
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:  # Gemma: cap * tanh(logits / cap), as HF
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter is set. GGUF
        block weights are dequantized as each is loaded unless the kernels run them
        (KernelSet.prepare_weight).

        Then the linear layers take the KernelSet's kernels (which keep their own copy of the
        weights) and the decode stack is built. NOTE: once only, and after any `.to()`: a
        layer with a kernel holds no weight parameter to load or move again.
        """
        loaded, embedding_blocks = set(), None
        swap = LinearKernelSwap(self, self.kernels)
        given = {}  # Linear name -> its weight, handed to its kernel as it is (swap.takes)
        for name, tensor in fuse_hf_weights(weights, self.config, self.kernels.prepare_weight):
            if name == "embed_tokens.weight":
                tensor = self.kernels.prepare_embedding(tensor)
                if self._looks_up_in_blocks(tensor):
                    embedding_blocks = tensor.source  # NOTE: never made fp32 (BlockEmbedding)
                    loaded.add(name)
                    continue
                tensor = dequantized(tensor)
                if self._looks_up_widened(tensor):
                    # NOTE: a copy: a loader's tensor may keep more than itself alive (a
                    # safetensors file's tensors are views of one mapping of the whole file)
                    self.embed_tokens = WidenedEmbedding(tensor.clone())
                    loaded.add(name)
                    continue
            module_name, kind = name.rsplit(".", 1)
            module = _submodule(self, module_name)
            target = getattr(module, kind, None)
            if target is None:  # NOTE: a tensor this config has no place for: HF ignores it
                continue
            if isinstance(module, Linear) and kind == "weight":
                tensor = tensor.t()
            if isinstance(module, RMSNorm) and self.family.norm_offset:
                # NOTE: Gemma's (1 + w), folded once, in fp32 as HF adds it
                tensor = tensor.float() + self.family.norm_offset
            if target.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            if isinstance(module, Linear) and kind == "weight" and swap.takes(tensor):
                given[module_name] = tensor  # NOTE: its kernel packs it: no fp32 copy first
            else:
                target.copy_(tensor)
            loaded.add(name)
            if isinstance(module, Linear) and _has_all_weights(module, module_name, loaded):
                swap.swap(module_name, module, given.pop(module_name, None))
        missing = {n for n, _ in self.named_parameters()} - loaded
        if missing:
            raise ValueError(f"weights missing: {sorted(missing)[:5]}")
        swap.finish()
        if embedding_blocks is not None:
            self.embed_tokens = BlockEmbedding(self._embedding_kernel(embedding_blocks),
                                               self.embed_tokens.weight.detach())
        if self.kernels.decode_stack:
            self.decode_stack = self.build_decode_stack(self.kernels.ops)

    def _looks_up_in_blocks(self, embedding: torch.Tensor) -> bool:
        """Whether the embedding (GGUF blocks) stays in its blocks, whatever the linears'
        kernels (BlockEmbedding: a row is the fp32 table's, so the model computes as with
        it, at the blocks' size): where the fused kernels run GGUF blocks (else it is
        dequantized to fp32)."""
        return (isinstance(embedding, GGUFBlockTensor)
                and gguf_block_kernel_available(self.kernels.ops))

    def _looks_up_widened(self, embedding: torch.Tensor) -> bool:
        """Whether the embedding stays in the 16-bit dtype it is stored in (WidenedEmbedding:
        exact, half the memory): a bf16 or fp16 table for an fp32 model on the CPU."""
        table = self.embed_tokens.weight
        return (type(embedding) is torch.Tensor and table.dtype == torch.float32
                and table.device.type == "cpu" and embedding.device.type == "cpu"
                and embedding.dtype in (torch.bfloat16, torch.float16))

    def _embedding_kernel(self, source) -> GGUFBlockLinear:
        """The tied LM head's block kernel (the same blocks: no second copy), else one of
        the table's own (source: its LazyBlocks)."""
        head = self.lm_head.kernel
        if self.config.tie_word_embeddings and isinstance(head, GGUFBlockLinear):
            return head
        return GGUFBlockLinear(source.load(), None, self.kernels.ops)


def _has_all_weights(linear: Linear, name: str, loaded: set[str]) -> bool:
    return f"{name}.weight" in loaded and (linear.bias is None or f"{name}.bias" in loaded)


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


# Per layer: this module's name <- the HF tensors fused into it (concatenated in this order).
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
# Per layer: names that are the same here and in HF (when the model has them).
_AS_IS = ("self_attn.o_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm",
          "pre_feedforward_layernorm", "post_feedforward_layernorm", "self_attn.q_norm",
          "self_attn.k_norm")


def fuse_hf_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig,
                    prepare: Callable[[torch.Tensor], torch.Tensor] = lambda w: w
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF names -> this module's names (qkv_proj, gate_up_proj fused), HF layouts and dtypes,
    each tensor yielded as `prepare` makes it (fused ones once fused: GGUF blocks' parts
    dequantized in one pass) but the embedding table, yielded as it is (the model may look
    its tokens up in its GGUF blocks; a tied head is prepared).

    Tensors HF already stores fused (Phi-3's qkv_proj, gate_up_proj: q, k, v and gate, up
    in this order too) are taken as they are; a tensor the model has no place for is left
    out (the loaders' shape checks name what is missing).
    NOTE: yielded one at a time, a layer's weights before its biases: a fused tensor exists
    while it is being loaded, not all of them at once.
    """
    embed = weights["model.embed_tokens.weight"]
    yield "embed_tokens.weight", embed  # NOTE: unprepared: it may be looked up in its blocks
    yield "norm.weight", prepare(weights["model.norm.weight"])
    yield "lm_head.weight", prepare(embed if cfg.tie_word_embeddings else weights["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            for name, parts in _FUSED.items():
                if f"{src}{name}.{kind}" in weights:
                    yield f"{dst}{name}.{kind}", prepare(weights[f"{src}{name}.{kind}"])
                elif f"{src}{parts[0]}.{kind}" in weights:
                    yield f"{dst}{name}.{kind}", prepare(torch.cat(
                        [weights[f"{src}{part}.{kind}"] for part in parts]))
            for name in _AS_IS:
                if f"{src}{name}.{kind}" in weights:
                    yield f"{dst}{name}.{kind}", prepare(weights[f"{src}{name}.{kind}"])
