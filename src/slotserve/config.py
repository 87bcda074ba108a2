"""Frozen configuration dataclasses: model shape, KV cache, scheduler, server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Policy = Literal["continuous", "static"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    name: str = "model"

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "model") -> ModelConfig:
        """Build from a Hugging Face `config.json` dict."""
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        model_type = cfg.get("model_type", "llama")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=model_type,
            name=name,
        )

    @property
    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + head


def _rope_theta(cfg: dict[str, Any]) -> float:
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_blocks` blocks of `block_size` token positions (all layers).

    When `num_blocks` is None the pool is sized from `memory_bytes`, or from free memory.
    enable_prefix_caching: full blocks of computed K/V are kept under a hash of their tokens
    (and everything before them) and shared by later requests with the same prefix (on by
    default, as in vLLM).
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration scheduler limits.

    max_num_seqs: slots in the running batch.
    max_num_batched_tokens: token budget of one iteration (prefill chunks + decodes).
    max_model_len: longest sequence (prompt + output) a request may reach.
    max_waiting: most sequences waiting for a slot (a request with n completions counts n);
        past it new requests are refused (HTTP 429). None: unbounded. NOTE: AsyncEngine
        enforces it (it reads it from here); the scheduler never refuses a request for it.
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    policy: Policy = "continuous"
    max_waiting: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.policy not in ("continuous", "static"):
            raise ValueError(f"policy must be 'continuous' or 'static', got {self.policy!r}")


KERNELS = ("auto", "mkl", "reference")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the model weights."""

    model: str | None = None  # path to an HF directory or a .gguf; None: embedded SmolLM2
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    # "auto": the fastest kernels verified against the reference for this device (on the
    # CPU: the fused kernels, fp32 linears over weight panels with AVX-512, else MKL's packed
    # GEMM); "mkl": the same but fp32 linears through MKL's packed GEMM (for comparisons);
    # "reference": plain torch ops everywhere.
    kernels: str = "auto"
    # "int8": int8 weight-only linears (CPU, opt-in); "bf16": the linears' weights rounded to
    # and stored in bfloat16, activations, norms, attention and KV cache fp32 (CPU, opt-in).
    # NOTE: not dtype="bfloat16", which runs the whole model (activations too) in bf16.
    quantization: str | None = None
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trace_capacity: int = 4096  # iterations kept in the trace ring buffer

    def __post_init__(self) -> None:
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.quantization not in (None, "int8", "bf16"):
            raise ValueError("quantization must be None, 'int8' or 'bf16', "
                             f"got {self.quantization!r}")
        if self.quantization and not self.device.startswith("cpu"):
            raise ValueError(f"quantization={self.quantization!r} runs on the CPU only; "
                             f"got device {self.device!r}")
