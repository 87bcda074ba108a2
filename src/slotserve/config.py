"""Frozen configuration dataclasses: model shape, KV cache, scheduler, server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Policy = Literal["continuous", "static"]
SchedulingPolicy = Literal["fcfs", "priority", "deadline", "fair"]
SCHEDULING_POLICIES = ("fcfs", "priority", "deadline", "fair")


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
    policy: admission rule (continuous | static), combined with any scheduling policy.
    scheduling_policy: queue order (vLLM's --scheduling-policy), see core/queue_policy.py:
        fcfs (arrival order), priority (Request.priority, lower first; preempts strictly
        lower-priority running requests), deadline (least TTFT slack first, prefill chunks
        capped to keep running requests' TPOT SLO), fair (per-tenant virtual token counters).
    slo_ttft_ms / slo_tpot_ms: default SLOs of a request (None: none); a request's own
        `slo_ttft_ms` / `slo_tpot_ms` override them. Used by `deadline` to order and cap,
        and by every policy for goodput bookkeeping (`Request.met_slo`).
    slo_reject: under `deadline`, a waiting request that can no longer meet its TTFT
        deadline finishes with status FINISHED_REJECTED (finish_reason "rejected", error
        "slo: ...", for an HTTP 503) instead of being served last.
    tenant_weights: (tenant, weight) pairs (or a dict) for `fair`; unnamed tenants weigh 1.
    fair_input_weight / fair_output_weight: VTC's cost of a processed prompt token and of
        a generated token (the paper's w_p = 1, w_q = 2).
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    policy: Policy = "continuous"
    max_waiting: int | None = None
    scheduling_policy: SchedulingPolicy = "fcfs"
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_reject: bool = False
    tenant_weights: tuple[tuple[str, float], ...] = ()
    fair_input_weight: float = 1.0
    fair_output_weight: float = 2.0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.policy not in ("continuous", "static"):
            raise ValueError(f"policy must be 'continuous' or 'static', got {self.policy!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            check_slo_ms(name, getattr(self, name))
        if not isinstance(self.slo_reject, bool):
            raise ValueError(f"slo_reject must be a bool, got {self.slo_reject!r}")
        if self.slo_reject and self.scheduling_policy != "deadline":
            raise ValueError("slo_reject needs scheduling_policy='deadline', "
                             f"got {self.scheduling_policy!r}")
        for name in ("fair_input_weight", "fair_output_weight"):
            if not _is_number(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a number >= 0, got {getattr(self, name)!r}")
        if self.fair_input_weight == 0 and self.fair_output_weight == 0:
            raise ValueError("fair_input_weight and fair_output_weight must not both be 0")
        # NOTE: frozen, so a dict given by the caller is stored as sorted pairs (hashable).
        object.__setattr__(self, "tenant_weights", _tenant_weight_pairs(self.tenant_weights))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def check_slo_ms(name: str, value: Any) -> None:
    """ValueError naming the field unless value is None or a positive finite number."""
    if value is None:
        return
    if not _is_number(value) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive number of milliseconds or None, "
                         f"got {value!r}")


def _tenant_weight_pairs(weights: Any) -> tuple[tuple[str, float], ...]:
    try:
        pairs = list(weights.items()) if isinstance(weights, dict) else list(weights)
        pairs = [(tenant, weight) for tenant, weight in pairs]
    except (TypeError, ValueError):
        raise ValueError("tenant_weights must be a dict or (tenant, weight) pairs, "
                         f"got {weights!r}") from None
    for tenant, weight in pairs:
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"tenant_weights: tenant names must be non-empty strings, "
                             f"got {tenant!r}")
        if not _is_number(weight) or not 0 < weight < float("inf"):
            raise ValueError(f"tenant_weights: weight of {tenant!r} must be a positive "
                             f"number, got {weight!r}")
    if len({t for t, _ in pairs}) != len(pairs):
        raise ValueError("tenant_weights: a tenant is named twice")
    return tuple(sorted((t, float(w)) for t, w in pairs))


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
    quantization: str | None = None  # "int8": int8 weight-only linears (CPU, opt-in)
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trace_capacity: int = 4096  # iterations kept in the trace ring buffer

    def __post_init__(self) -> None:
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be None or 'int8', got {self.quantization!r}")
        if self.quantization and not self.device.startswith("cpu"):
            raise ValueError("quantization='int8' runs on the CPU only; "
                             f"got device {self.device!r}")
