"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.config_gate import RopeScaling
from slotserve.model.rope import rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.ops = ops  # the fused CPU kernels (model/cpu_ops.py) or None: torch's ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op; same math as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class WidenedEmbedding(nn.Module):
    """A token embedding kept in the 16-bit dtype its checkpoint stores (bf16 or fp16):
    (T,) ids -> (T, H) fp32, each row widened as it is looked up.

    NOTE (exact): every bf16 and fp16 value is an fp32 value, so the model computes as with
    the table widened to fp32, at half its memory (a 1B Llama's 128k x 2048 table: 0.5 GB
    instead of 1). The decode stack looks its rows up the same way.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        if weight.dtype not in (torch.bfloat16, torch.float16) or weight.dim() != 2:
            raise ValueError(f"a (V, H) bf16 or fp16 table, not {weight.dtype} "
                             f"{tuple(weight.shape)}")
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, H) fp32
        return F.embedding(ids, self.weight).float()


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the HF Llama convention), cos/sin cached for every position.

    scaling: the RoPE scaling (model/rope.py computes it as HF does), None: plain RoPE.
    local_theta: Gemma 3's sliding layers' base (plain RoPE): a second pair of tables,
    `local_tables`; None: one pair for every layer.
    NOTE: one module for both pairs, so `.float()` keeps every table fp32.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: RopeScaling | None = None, local_theta: float | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.scaling, self.local_theta = scaling, local_theta
        half = head_dim // 2
        self.register_buffer("cos", torch.empty(max_positions, half), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, half), persistent=False)
        local = (max_positions, half) if local_theta is not None else (0, half)
        self.register_buffer("cos_local", torch.empty(local), persistent=False)
        self.register_buffer("sin_local", torch.empty(local), persistent=False)
        self.reset_tables()

    @torch.no_grad()
    def reset_tables(self) -> None:
        """(Re)compute cos/sin in place, on whatever device the buffers live."""
        cos, sin = rope_tables(self.head_dim, self.max_positions, self.theta, self.scaling)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        if self.local_theta is not None:
            cos, sin = rope_tables(self.head_dim, self.max_positions, self.local_theta)
            self.cos_local.copy_(cos)
            self.sin_local.copy_(sin)

    def tables(self, positions: torch.Tensor, local: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of each token's position, (T, 1, hd/2) each: looked up once per forward.

        local: the sliding layers' tables (Gemma 3; only with local_theta)."""
        if local:
            return self.cos_local[positions].unsqueeze(1), self.sin_local[positions].unsqueeze(1)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: (T, n, hd) heads rotated by their tokens' positions' (cos, sin) -> a new tensor.

    Queries and keys of a token share one rotation: callers rotate them in one call.
    """
    cos, sin = rope
    x1, x2 = x.float().chunk(2, dim=-1)  # (T, n, hd/2) each
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class Linear(nn.Module):
    """y = x @ weight (+ bias), with `weight` stored (in_features, out_features).

    NOTE: transposed against nn.Linear on purpose: on this CPU, torch.mm over a contiguous
    (in, out) matrix runs the skinny decode matmuls 1.2-1.8x faster than F.linear's (out, in)
    layout (benchmarks/PERF.md). LlamaForCausalLM.load_hf_weights transposes HF tensors.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel = None  # a linear_kernels callable, once the weights are loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        if self.kernel is not None:
            return self.kernel(x)
        if self.bias is None:
            return x @ self.weight
        return torch.addmm(self.bias, x, self.weight)

    def cpp_weights(self, ops):
        """This layer's weights for the C++ DecodeStack of `ops` (model/cpu_ops.py)."""
        if self.kernel is not None:
            return self.kernel.cpp_weights(ops)
        return ops.linear_weights("plain", self.weight, None, self.bias)

    def use_kernel(self, kernel) -> None:
        """From now on run `kernel(x)`, which holds its own copy of the weights.

        NOTE: the parameters are released (one copy of the weights in memory, not two);
        a layer with a kernel cannot be loaded or moved again.
        """
        self.kernel = kernel
        del self.weight
        self.bias = None


# The MLP gate activations (HF's ACT2FN names): gelu_pytorch_tanh is GELU's tanh form.
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """Gated MLP (SwiGLU; GeGLU with a GELU activation), gate and up fused into one matmul.

    act: the gate's activation, a key of ACTIVATIONS; bias: on gate/up and down (Llama's
    mlp_bias). The fused CPU kernels run SiLU only; another activation runs in torch.
    """

    def __init__(self, hidden: int, intermediate: int, ops=None, act: str = "silu",
                 bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act_name, self.act = act, ACTIVATIONS[act]
        # the fused CPU kernels (model/cpu_ops.py) or None: torch's ops
        self.ops = ops if act == "silu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        gate_up = self.gate_up_proj(x)  # (T, 2I)
        if self.ops is not None:
            return self.down_proj(self.ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)  # (T, I) each
        return self.down_proj(self.act(gate) * up)
