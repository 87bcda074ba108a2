"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the HF Llama convention), cos/sin cached for every position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.register_buffer("cos", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.reset_tables()

    @torch.no_grad()
    def reset_tables(self) -> None:
        """(Re)compute cos/sin in place, on whatever device the buffers live."""
        d = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        t = torch.arange(self.max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # (P, hd/2)
        self.cos.copy_(freqs.cos())
        self.sin.copy_(freqs.sin())

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of each token's position, (T, 1, hd/2) each: looked up once per forward."""
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


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, ops=None) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.ops = ops  # the fused CPU kernels (model/cpu_ops.py) or None: torch's ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        gate_up = self.gate_up_proj(x)  # (T, 2I)
        if self.ops is not None:
            return self.down_proj(self.ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)  # (T, I) each
        return self.down_proj(F.silu(gate) * up)
