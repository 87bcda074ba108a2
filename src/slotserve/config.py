"""Configuration: every engine default, the names of the engine's strings, and the flat view.

- `CacheConfig`, `SchedulerConfig`, `EngineConfig`: frozen dataclasses, the one place each
  engine default lives. Each class docstring documents its fields as `name: text` entries;
  the CLI's engine flags take their help from them.
- `Policy`, `SlotKind`, `FinishReason`: str-valued enums, so they compare equal to, format as
  and JSON-encode as their plain string values ("continuous", "prefill", "stop").
- The flat view: `engine_fields()` names every leaf setting of EngineConfig once
  (`max_num_seqs`, `kv_cache_memory`, ...); `engine_config(**flat)` builds an EngineConfig
  from those names, and `slotserve.engine_args` makes one CLI flag of each. A new field in
  one of the dataclasses gets both without further code (see slotserve.flat_config).
"""

from __future__ import annotations

import enum
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from slotserve.config_gate import (
    RopeScaling,
    check_hf_config,
    family_value,
    rope_scaling_from_json,
    rope_settings,
)
from slotserve.flat_config import FlatField, build_flat, flat_fields
from slotserve.layer_windows import hf_layer_windows
from slotserve.spec.config import SpeculativeConfig
from slotserve.spec.config import parse as parse_speculative_config
from slotserve.value_checks import is_int


class _StrEnum(str, enum.Enum):
    """A str-valued enum: equal to its value, and formatted / JSON-encoded as it."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Policy(_StrEnum):
    """Admission rule: continuous admits every iteration, static only into an empty batch.

    See core/policy.py.
    """

    CONTINUOUS = "continuous"  # admit every iteration (Orca's iteration-level scheduling)
    STATIC = "static"  # admit only into an empty batch, which runs until all of it finishes


class SchedulingPolicy(_StrEnum):
    """Queue order (vLLM's --scheduling-policy); see core/queue_policy.py."""

    FCFS = "fcfs"  # arrival order
    PRIORITY = "priority"  # Request.priority, lower first; preempts strictly lower ones
    DEADLINE = "deadline"  # least TTFT slack first; prefill capped to keep TPOT SLOs
    FAIR = "fair"  # per-tenant virtual token counters (VTC)


class SlotKind(_StrEnum):
    """What a slot did in one iteration (`ScheduledSeq.kind`, the trace's cell kinds)."""

    PREFILL = "prefill"  # processed prompt tokens (a chunk, or all of them)
    DECODE = "decode"  # processed its last sampled token
    STALLED = "stalled"  # holds its slot but got no tokens this iteration


class FinishReason(_StrEnum):
    """Why a completion finished. NOTE: the values of request.RequestStatus's finished
    members (a test checks); "stop" and "length" are OpenAI's finish_reason values."""

    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or the model/pool length cap
    ABORT = "abort"
    ERROR = "error"
    REJECTED = "rejected"  # the deadline policy gave up on it (slo_reject): HTTP 503


def values(enum_type: type[enum.Enum]) -> tuple[str, ...]:
    """The string values of a str-valued enum, in definition order."""
    return tuple(member.value for member in enum_type)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and math of a decoder: the Llama block, and what a family changes in it.

    The family (model/families.py, by `architecture`: llama, mistral, qwen2, qwen3, gemma2,
    gemma3_text, phi3) says how its block differs (norm placement and offset, q/k norms,
    embedding scale); the values below come from its config (config_gate.py refuses what is
    not computed as HF computes it).
    """

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
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2: always)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    name: str = "model"
    # Each layer's sliding window (attention reads a query's last w positions) or None (full
    # causal attention); () when no layer has one. See slotserve/layer_windows.py.
    sliding_windows: tuple[int | None, ...] = ()
    # RoPE scaling of every layer (Gemma 3: of its full-attention layers), None: plain RoPE.
    rope_scaling: RopeScaling | None = None
    # Gemma 3: the sliding layers' RoPE base (plain RoPE); None: every layer as rope_theta.
    local_rope_theta: float | None = None
    o_bias: bool = False  # bias on the output projection (Llama/Qwen3/Gemma attention_bias)
    mlp_bias: bool = False  # bias on gate/up/down (Llama's mlp_bias)
    hidden_act: str = "silu"  # the MLP's gate activation (HF's ACT2FN name)
    attn_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2/3: cap * tanh(logits / cap)
    # Gemma: the attention scale is query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5)
    query_pre_attn_scalar: float | None = None

    def __post_init__(self) -> None:
        # NOTE: the converted-model cache gives JSON back: lists and a plain dict
        object.__setattr__(self, "sliding_windows", tuple(self.sliding_windows))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        object.__setattr__(self, "rope_scaling", rope_scaling_from_json(self.rope_scaling))

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "model") -> ModelConfig:
        """Build from a Hugging Face `config.json` dict.

        A key whose value is not computed as HF computes it raises UnsupportedConfig (a
        ValueError naming the key and value; config_gate.py's table).
        """
        check_hf_config(cfg)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        model_type = cfg.get("model_type", "llama")
        rope = rope_settings(cfg)
        bias = _biases(cfg, model_type)
        act_key = "hidden_activation" if model_type.startswith("gemma") else "hidden_act"
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=family_value(cfg, "head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope.theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(family_value(cfg, "tie_word_embeddings", False)),
            attention_bias=bias["qkv"],
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=model_type,
            name=name,
            sliding_windows=hf_layer_windows(cfg),
            rope_scaling=rope.scaling,
            local_rope_theta=rope.local_theta,
            o_bias=bias["o"],
            mlp_bias=bias["mlp"],
            hidden_act=family_value(cfg, act_key, "silu"),
            attn_logit_softcapping=_number(family_value(cfg, "attn_logit_softcapping")),
            final_logit_softcapping=_number(family_value(cfg, "final_logit_softcapping")),
            query_pre_attn_scalar=_number(family_value(cfg, "query_pre_attn_scalar")),
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


def _biases(cfg: dict[str, Any], model_type: str) -> dict[str, bool]:
    """Which projections have a bias, as each family's HF class builds them."""
    configured = bool(cfg.get("attention_bias", False))
    if model_type == "qwen2":  # NOTE: HF's Qwen2 ignores attention_bias: q/k/v always
        return {"qkv": True, "o": False, "mlp": False}
    if model_type in ("mistral", "phi3"):  # NOTE: no bias anywhere, whatever the config says
        return {"qkv": False, "o": False, "mlp": False}
    return {"qkv": configured, "o": configured,
            "mlp": model_type == "llama" and bool(cfg.get("mlp_bias", False))}


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_blocks` blocks of `block_size` token positions (all layers).

    block_size: token positions per KV block.
    num_blocks: KV pool size in blocks; default: from memory_bytes, or from free memory.
    memory_bytes: KV pool size in bytes (e.g. 1G); default: a share of free memory, capped
        at what max_num_seqs full-length sequences can use.
    enable_prefix_caching: keep full blocks of computed K/V under a hash of their tokens (and
        everything before them) and share them with later requests with the same prefix.
    prefix_cache_scope: who may share cached blocks. tenant: the request's tenant is part of
        the block hash chain, so a tenant never hits (in `cached_tokens` or in time) blocks
        another tenant computed; global: any request with the same tokens (and cache_salt)
        does. auto: tenant when `slotserve serve` requires API keys (tenants are then
        authenticated), else global (offline; a server without keys, whose `user` field
        anyone may claim). A request's cache_salt narrows either further. The n completions
        of one request always share (one tenant).
    kv_cache_dtype: the cached K/V's element type. auto: bfloat16 where the linear weights
        are bf16 or int8 on the CPU (half the bytes decode attention reads; K/V rounded to
        bf16 as stored), else the model's dtype (float32: the reference). int8 (CPU only,
        opt-in): symmetric int8 codes with an fp32 scale per 32 elements of each token's
        head (llama.cpp's q8_0 blocks; per 32 rather than one per token and head: 99.3%
        against 98.7% teacher-forced greedy agreement with fp32 on SmolLM2, bf16 99.9%),
        about 1.8x the blocks of bf16 in the same memory, dequantized as attention reads.
    """

    block_size: int = 16
    num_blocks: int | None = None
    # NOTE: flat name kv_cache_memory (engine_config's keyword and --kv-cache-memory).
    memory_bytes: int | None = field(default=None, metadata={"name": "kv_cache_memory"})
    enable_prefix_caching: bool = True
    prefix_cache_scope: Literal["auto", "tenant", "global"] = "auto"
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "int8"] = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(f"prefix_cache_scope must be one of {PREFIX_CACHE_SCOPES}, "
                             f"got {self.prefix_cache_scope!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.memory_bytes is not None and self.memory_bytes < 1:
            raise ValueError(f"memory_bytes must be >= 1, got {self.memory_bytes}")


    @property
    def tenant_scoped(self) -> bool:
        """Whether cached blocks are shared within a tenant only ("auto" counts as global:
        only `slotserve serve` knows whether keys authenticate tenants; see
        `resolve_prefix_cache_scope`)."""
        return self.prefix_cache_scope == "tenant"


PREFIX_CACHE_SCOPES = ("auto", "tenant", "global")


def resolve_prefix_cache_scope(scope: str, keys_required: bool) -> str:
    """CacheConfig.prefix_cache_scope's "auto" for a server: tenant when API keys are
    required (tenants are authenticated), else global; an explicit scope stays."""
    if scope != "auto":
        return scope
    return "tenant" if keys_required else "global"


# NOTE: off by default, by measurement (benchmarks/stall_free.py; docs/ARCHITECTURE.md has the
# figures): on W (64 chat prompts at t=0, 64 slots, budget 512) a cap did not lower TPOT
# p99 / p50 on the engine, and in replay only small caps did, at a cost in tok/s and TTFT.
DEFAULT_PREFILL_TOKENS_WHILE_DECODING: int | None = None
# Waiting sequences of a weight-1 tenant (a request with n completions counts n): deep
# enough for bursts of a busy client, small enough that one tenant's flood of queued work
# stays bounded in memory and in the time the others' requests wait behind it.
DEFAULT_MAX_WAITING_PER_TENANT: int | None = 256
MAX_SLO_MS = 3_600_000.0  # one hour: a request's SLOs above it are refused


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration scheduler limits.

    max_num_seqs: slots in the running batch.
    max_num_batched_tokens: token budget of one iteration (prefill chunks + decodes).
    max_prefill_tokens_while_decoding: most prompt tokens (prefill chunks) an iteration that
        also runs decodes may take, so admitting many prompts at once does not stall the
        running requests' decodes (stall-free batching, as Sarathi-Serve); an iteration with
        nothing to decode prefills at the whole budget. It bounds the time between two tokens;
        a request's mean TPOT gains only while the prompts' work is large next to its decodes.
        None: no cap.
    hold_first_tokens: a prompt's last token (the one that samples its first output token)
        waits while a request that arrived before that prompt was ready is still computing
        its own prompt, so a burst's first tokens come together and no request decodes
        through the others' prefill chunks (whose time would count in its TPOT). The hold
        ends as soon as an iteration plans no prompt work of those requests (a full batch,
        no free blocks): never a wait on what cannot run. Only a burst holds (at least two
        such requests, with more than one budget of prompt work left; online arrivals are
        left alone), and never a request with a TTFT SLO. On by default, by measurement
        (docs/ARCHITECTURE.md). False: each first token as soon as its prompt is computed.
    max_model_len: longest sequence (prompt + output) a request may reach.
    max_waiting: most sequences waiting for a slot (a request with n completions counts n);
        past it new requests are refused (HTTP 429). None: unbounded. NOTE: AsyncEngine
        enforces it (it reads it from here); the scheduler never refuses a request for it.
    policy: the batching (admission) rule: continuous (admit every iteration) or static
        (admit only into an empty batch, which runs until all of it finishes), combined with
        any scheduling policy. Its setting and flag: `batching`, --batching (formerly
        `policy`, --policy: still accepted for a release, with a warning).
    scheduling_policy: queue order (vLLM's --scheduling-policy), see core/queue_policy.py:
        fcfs (arrival order), priority (Request.priority, lower first; preempts strictly
        lower-priority running requests), deadline (least TTFT slack first, prefill chunks
        capped to keep running requests' TPOT SLO), fair (per-tenant virtual token counters).
    slo_ttft_ms / slo_tpot_ms: default SLOs of a request (None: none); a request's own
        `slo_ttft_ms` / `slo_tpot_ms` override them. Used by `deadline` to order and cap,
        and by every policy for goodput bookkeeping (`Request.met_slo`). At most 3600000
        (one hour), a request's too (larger: a ValueError naming the field, HTTP 400).
    min_slo_ttft_ms / min_slo_tpot_ms: floors a request's SLOs are raised to (no token
        comes faster; a smaller SLO means "as fast as possible" and must not starve others).
        Whatever the SLOs, `deadline` lets an iteration with decodes take at least one block
        (block_size tokens) of prefill, so one request's tiny TPOT SLO never stops other
        requests' prefill.
    slo_reject: under `deadline`, a waiting request that can no longer meet its TTFT
        deadline finishes with status FINISHED_REJECTED (finish_reason "rejected", error
        "slo: ...", for an HTTP 503) instead of being served last.
    tenant_weights: (tenant, weight) pairs (or a dict) for `fair`, the slot shares and the
        waiting bounds; unnamed tenants weigh 1.
    tenant_slot_share: while a tenant below its share of the slots has a request waiting,
        no other tenant holds more than its share: share = max_num_seqs x weight / the
        weights of the tenants with work (running or waiting), at least 1. Such a tenant's
        request is not admitted past its share, and a waiting tenant below its share, with
        no slot free, preempts (recompute) the running sequence its policy would give up
        first (fcfs: the newest) of the tenant furthest over its share. Under every
        scheduling policy (`priority` then preempts across tenants only so); one tenant
        alone uses every slot.
    max_waiting_per_tenant: most sequences one tenant of weight 1 may have waiting for a
        slot (weight w: w times as many, at least 1); past it the tenant's new requests get
        HTTP 429 (others' are unaffected). Besides the server's --max-waiting. None:
        unbounded. NOTE: AsyncEngine enforces it, as max_waiting.
    fair_input_weight / fair_output_weight: VTC's cost of a processed prompt token and of
        a generated token (the paper's w_p = 1, w_q = 2).
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_prefill_tokens_while_decoding: int | None = DEFAULT_PREFILL_TOKENS_WHILE_DECODING
    hold_first_tokens: bool = True
    max_model_len: int = 4096
    # NOTE: the setting is `batching` (one word per idea: "policy" also names the queue
    # order); the attribute keeps its name for the code that reads it.
    policy: Policy = field(default=Policy.CONTINUOUS,
                           metadata={"name": "batching", "deprecated_names": ("policy",)})
    # NOTE: no engine flag: `slotserve serve` has its own --max-waiting (only it enforces it).
    max_waiting: int | None = field(default=None, metadata={"flag": False})
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_reject: bool = False
    # NOTE: no engine flag (pairs); set from Python or a keys file's weights.
    tenant_weights: tuple[tuple[str, float], ...] = field(default=(), metadata={"flag": False})
    fair_input_weight: float = 1.0
    fair_output_weight: float = 2.0
    min_slo_ttft_ms: float = 1.0
    min_slo_tpot_ms: float = 1.0
    tenant_slot_share: bool = True
    max_waiting_per_tenant: int | None = DEFAULT_MAX_WAITING_PER_TENANT

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        cap = self.max_prefill_tokens_while_decoding
        if cap is not None and (not is_int(cap) or cap < 1):
            raise ValueError("max_prefill_tokens_while_decoding must be an integer >= 1 or "
                             f"None, got {cap!r}")
        object.__setattr__(self, "policy", _member(Policy, "policy", self.policy))
        object.__setattr__(self, "scheduling_policy", _member(
            SchedulingPolicy, "scheduling_policy", self.scheduling_policy))
        for name in ("slo_ttft_ms", "slo_tpot_ms", "min_slo_ttft_ms", "min_slo_tpot_ms"):
            check_slo_ms(name, getattr(self, name))
        for name in ("min_slo_ttft_ms", "min_slo_tpot_ms"):
            if getattr(self, name) is None:
                raise ValueError(f"{name} must be a positive number of milliseconds")
        for name in ("tenant_slot_share", "hold_first_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        bound = self.max_waiting_per_tenant
        if bound is not None and (not is_int(bound) or bound < 1):
            raise ValueError(f"max_waiting_per_tenant must be an integer >= 1 or None, "
                             f"got {bound!r}")
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
    """An int or float, not a bool, and not NaN (inf and ints past 1e308 pass)."""
    return (is_int(value) or isinstance(value, float)) and value == value


class SchedulingFieldError(ValueError):
    """A bad scheduling field of a request; `field` names it (the server's 400 `param`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_policy_fields(priority: Any, tenant: Any, slo_ttft_ms: Any,
                        slo_tpot_ms: Any) -> None:
    """A request's scheduling-policy fields; SchedulingFieldError (a ValueError) naming the
    first bad one. NOTE: the one definition of these checks: `SchedulingFields` (core/
    scheduling_fields.py) checks itself with it, and the lab's request records call it."""
    if not is_int(priority):
        raise SchedulingFieldError("priority", f"priority must be an integer, got {priority!r}")
    if not isinstance(tenant, str) or not tenant:
        raise SchedulingFieldError("tenant", f"tenant must be a non-empty string, got {tenant!r}")
    for name, value in (("slo_ttft_ms", slo_ttft_ms), ("slo_tpot_ms", slo_tpot_ms)):
        try:
            check_slo_ms(name, value)
        except ValueError as exc:
            raise SchedulingFieldError(name, str(exc)) from None


def check_slo_ms(name: str, value: Any) -> None:
    """ValueError naming the field unless value is None or a positive number of at most
    MAX_SLO_MS (one hour; NOTE: a huge TTFT SLO would otherwise be a request's way ahead of
    every request without one under `deadline`)."""
    if value is None:
        return
    if not _is_number(value) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive number of milliseconds or None, "
                         f"got {value!r}")
    if value > MAX_SLO_MS:
        raise ValueError(f"{name} must be at most {MAX_SLO_MS:.0f} ms (one hour), "
                         f"got {value!r}")


def tenant_weight(config: SchedulerConfig, tenant: str) -> float:
    """A tenant's weight (tenant_weights; unnamed tenants weigh 1)."""
    return dict(config.tenant_weights).get(tenant, 1.0)


def tenant_waiting_bound(config: SchedulerConfig, tenant: str) -> int | None:
    """Most sequences `tenant` may have waiting (max_waiting_per_tenant x its weight, at
    least 1); None: unbounded."""
    bound = config.max_waiting_per_tenant
    if bound is None:
        return None
    return max(1, int(bound * tenant_weight(config, tenant)))


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



# NOTE: the one line that picks the default weights: "auto" (bf16 where the CPU has
# AVX512_BF16, model/kernels.py) or "none" (fp32 everywhere).
DEFAULT_QUANTIZATION = "auto"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the model weights.

    model: HF model directory or .gguf file; default: the embedded SmolLM2-135M-Instruct.
    device: cpu or cuda.
    dtype: of weights, activations and KV cache; default: float32 on CPU, bfloat16 on CUDA.
    kernels: auto: the fastest kernels verified against the reference for this device (on
        the CPU: the fused kernels, fp32 linears over weight panels with AVX-512, else
        MKL's packed GEMM); mkl: the same but fp32 linears through MKL's packed GEMM;
        reference: plain torch ops everywhere.
    quantization: the linear layers' weights. auto: for a GGUF file named by `model` whose
        linears are quantized, the file's own types (as gguf below, llama.cpp's meaning);
        else the fastest choice of the CPU's class that passes the 97% agreement bar
        (amx, avx512bf16, avx512: bf16; avx2, generic: fp32; docs/kernels.md); both only
        when no dtype is named (a named dtype keeps its weights: dtype=float32 computes in
        fp32); none: fp32 weights, the reference the tests compare against; bf16: weights
        stored in bfloat16, activations, norms, attention and KV cache fp32 (CPU; NOTE: not
        dtype=bfloat16, which runs the whole model in bf16); int8: int8 weight-only linear
        layers on the CPU; gguf: a GGUF's quantized linear weights in the file's own blocks
        (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_NL, int8 activations, 16-bit
        where every block weight is Q8_0, AVX512-VNNI or AVX2; no fp32 copy of the model; a
        file with another quantized type is dequantized, with a warning); q8_0: every linear
        weight and the embedding (an HF directory's, or a GGUF's dequantized) quantized to
        Q8_0 as they load, as llama.cpp's llama-quantize does, and run as gguf's blocks
        (1.125 bytes/weight in memory; 16-bit activations). Greedy
        agreement with fp32 in benchmarks/PERF.md.
    seed: seed of the sampler's random generator.
    trace_capacity: iterations kept in the trace ring buffer.
    speculative_config: speculative decoding, as vLLM's JSON: {"method": "ngram",
        "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5} (method
        ngram: prompt lookup; suffix: suffix decoding over the sequence and recent outputs);
        "num_speculative_tokens": "auto" (the default) lets the scheduler pick each
        sequence's number every iteration from the step cost and its acceptance (none when
        the batch is compute-bound). Greedy output is unchanged, sampled output keeps its
        distribution; a structured output's drafts are cut to what its grammar accepts.
        None: off. See slotserve/spec/config.py for every key.
    enforce_eager: on CUDA, run decode-only iterations eagerly, not as the CUDA graphs
        captured at start (a few padded batch sizes up to max_num_seqs), as vLLM's flag.
    """

    model: str | None = None
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    kernels: Literal["auto", "mkl", "reference"] = "auto"
    quantization: Literal["auto", "none", "bf16", "int8", "gguf", "q8_0"] = DEFAULT_QUANTIZATION
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trace_capacity: int = 4096
    # NOTE: stored as canonical JSON text (a dict or a SpeculativeConfig is accepted too);
    # `speculative` is the parsed form.
    speculative_config: str | None = None
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        speculative = parse_speculative_config(self.speculative_config)  # ValueError naming it
        object.__setattr__(self, "speculative_config",
                           None if speculative is None else speculative.to_json())
        if self.quantization is None:  # NOTE: None, the fp32 spelling before "auto" existed
            object.__setattr__(self, "quantization", "none")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        if (self.quantization in ("bf16", "int8", "gguf", "q8_0")
                and not self.device.startswith("cpu")):
            raise ValueError(f"quantization={self.quantization!r} runs on the CPU only; "
                             f"got device {self.device!r}")
        if self.cache.kv_cache_dtype == "int8" and not self.device.startswith("cpu"):
            # NOTE: only the CPU's kernels and torch paths read an int8 cache (not Triton's)
            raise ValueError(f"kv_cache_dtype='int8' runs on the CPU only; "
                             f"got device {self.device!r}")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative_config (None: speculation off)."""
        return parse_speculative_config(self.speculative_config)


KV_CACHE_DTYPES: tuple[str, ...] = typing.get_args(
    typing.get_type_hints(CacheConfig)["kv_cache_dtype"])
KERNELS: tuple[str, ...] = typing.get_args(typing.get_type_hints(EngineConfig)["kernels"])
QUANTIZATIONS: tuple[str, ...] = typing.get_args(
    typing.get_type_hints(EngineConfig)["quantization"])


def _member(enum_type: type[enum.Enum], name: str, value: Any) -> Any:
    """value as a member of enum_type; ValueError naming the field otherwise."""
    try:
        return enum_type(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {values(enum_type)}, got {value!r}") from None


# --------------------------------------------------------------------------- flat view
def engine_fields() -> dict[str, FlatField]:
    """The flat view of EngineConfig: every setting by its flat name."""
    return dict(_ENGINE_FIELDS)


def engine_config(model: str | None = None, **settings: Any) -> EngineConfig:
    """An EngineConfig from flat settings, the names the CLI flags use (`max_num_seqs`,
    `kv_cache_memory`, `batching`, ...: see engine_fields()). Defaults: the dataclasses'.
    A deprecated name (`policy`) sets its setting, with a DeprecationWarning."""
    return build_flat(EngineConfig, model=model, **settings)


_ENGINE_FIELDS = flat_fields(EngineConfig)
