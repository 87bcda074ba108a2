"""KernelSet: which kernels a model runs, resolved once from the config and this machine.

`resolve_kernels(config)` reads EngineConfig's device, dtype, kernels and quantization, the
CPU's instructions and what the built extension (model/cpu_ops.py) supports, and returns a
frozen KernelSet. The model builder takes it (`model/registry.build_model`): the norms, MLPs
and attention get its fused ops when built, the linear layers their kernel and the model its
C++ DecodeStack when the weights are loaded. Nothing changes a model's kernels afterwards; a
benchmark that compares kernels builds one engine per KernelSet (`LLMEngine(kernel_set=...)`).

`describe()` is the start-up line's text, e.g. "bf16 weights (auto: AVX512_BF16); linears:
bf16 weight panels, ... + fused CPU ops (decodes: one C++ call for all layers)".
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from slotserve.loader import gguf_blocks
from slotserve.model import cpu_ops, linear_kernels

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# SLOTSERVE_NO_AVX512_BF16=1: the CPU is taken to lack AVX512_BF16, so quantization="auto"
# picks fp32 (tests of the fallback, A/B runs).
NO_BF16_ENV = "SLOTSERVE_NO_AVX512_BF16"

# The linear layers' kernels: name -> what the start-up line says (bf16_panel: see below).
LINEAR_KERNELS = {
    "reference": "torch reference",
    "panel": "fp32 weight panels (fused CPU kernel)",
    "mkl": "fp32 MKL packed GEMM",
    "bf16_panel": "bf16 weight panels, fp32 activations (fused CPU kernel)",
    "bf16_rounded": "bf16-rounded weights (torch reference)",
    "int8": "int8 weights x int16 activations (fused CPU kernel)",
    "int8_torch": "int8 weight-only (bf16 activations)",
}
# Kernels that call the fused CPU kernels' module (KernelSet.ops must be set).
LINEARS_ON_OPS = ("panel", "bf16_panel", "int8")


def resolve_dtype(device: str, dtype: str | None) -> torch.dtype:
    """The model's dtype: `dtype` by name, or (None or "auto") float32 on the CPU and
    bfloat16 on CUDA."""
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU has AVX512_BF16 (`vdpbf16ps`): /proc/cpuinfo's flags, unless
    SLOTSERVE_NO_AVX512_BF16=1 forces it off. False where /proc/cpuinfo cannot be read."""
    if os.environ.get(NO_BF16_ENV, "0") not in ("", "0"):
        return False
    return "avx512_bf16" in _cpu_flags()


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next(line for line in cpuinfo if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.partition(":")[2].split())


@dataclass(frozen=True)
class KernelSet:
    """The kernels of one model; the default is plain torch everywhere (the reference).

    linear: the linear layers' kernel, a key of LINEAR_KERNELS.
    ops: the fused CPU kernels' module (model/cpu_ops.py), or None.
    fused_layers: norms, SiLU, RoPE, KV writes and decode attention through `ops`.
    decode_stack: all-decode iterations through ops.DecodeStack (needs fused_layers).
    amx_min_rows: bf16 panels: calls of this many rows or more run on AMX; 0: never.
    weights: the linear layers' weights: "fp32", "bf16", "int8", "gguf" or the model's dtype.
    reason: how the weights were chosen ("auto: AVX512_BF16", "quantization=int8").
    gguf_types: the GGUF types of the linears kept in their file's blocks (weights="gguf"):
        those run linear_kernels.GGUFBlockLinear, any float linear the `linear` kernel.
    """

    linear: str = "reference"
    ops: Any = dataclasses.field(default=None, repr=False)
    fused_layers: bool = False
    decode_stack: bool = False
    amx_min_rows: int = 0
    weights: str = "fp32"
    reason: str = ""
    model_note: str = ""  # what the model's family runs outside these kernels (for_model)
    gguf_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.linear not in LINEAR_KERNELS:
            raise ValueError(f"linear must be one of {sorted(LINEAR_KERNELS)}, "
                             f"got {self.linear!r}")
        if self.ops is None and (self.fused_layers or self.linear in LINEARS_ON_OPS):
            raise ValueError(f"linear={self.linear!r} / fused_layers need the fused kernels")
        if self.decode_stack and not self.fused_layers:
            raise ValueError("decode_stack needs fused_layers (it runs the same kernels)")
        if self.gguf_types and (self.ops is None or self.decode_stack):
            raise ValueError("GGUF block weights need the fused kernels and no decode stack")

    def for_model(self, stack_gaps: list[str], torch_ops: list[str]) -> KernelSet:
        """This set as a model with these needs runs it: no decode stack where it lacks
        something the model needs (`stack_gaps`, model/families.decode_stack_gaps), and a
        note of both for the start-up line."""
        notes = []
        if self.fused_layers and torch_ops:
            notes.append(f"torch for {', '.join(torch_ops)}")
        if self.decode_stack and stack_gaps:
            notes.append(f"decodes layer by layer (the decode stack lacks "
                         f"{', '.join(stack_gaps)})")
        if not notes:
            return self
        return dataclasses.replace(self, decode_stack=self.decode_stack and not stack_gaps,
                                   model_note="; ".join(notes))

    @property
    def layer_ops(self):
        """The ops the norms, MLPs and attention call; None: torch's."""
        return self.ops if self.fused_layers else None

    def linear_factory(self):
        """(weight (in, out), bias) -> the linear kernel; None for plain torch."""
        lk, ops = linear_kernels, self.ops
        factory = {
            "reference": None,
            "panel": functools.partial(lk.PanelLinear, ops=ops),
            "mkl": lk.MKLPackedLinear,
            "bf16_panel": functools.partial(lk.Bf16PanelLinear, ops=ops,
                                            amx_min_rows=self.amx_min_rows),
            "bf16_rounded": lk.Bf16RoundedLinear,
            "int8": functools.partial(lk.Int8WeightOnlyLinear, ops=ops),
            "int8_torch": lk.Int8WeightOnlyLinear,
        }[self.linear]
        return _with_gguf_blocks(factory, ops) if self.gguf_types else factory

    def prepare_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights as this KernelSet's linears take them: GGUF block weights as they are
        when it runs them, else dequantized to fp32 (what quantization none/bf16/int8 do)."""
        return weights if self.gguf_types else gguf_blocks.dequantize_all(weights)

    def describe_linears(self) -> str:
        """The linear kernel, the fused ops and the decode stack, in words."""
        text = LINEAR_KERNELS[self.linear]
        if self.gguf_types:
            text = (f"GGUF blocks x int8 activations (VNNI, fused CPU kernel), other linears "
                    f"{text}")
        if self.linear == "bf16_panel" and self.amx_min_rows:
            text = (f"bf16 weight panels, fp32 activations below {self.amx_min_rows} rows, "
                    "AMX from there (fused CPU kernels)")
        if self.fused_layers:
            text += " + fused CPU ops"
        if self.decode_stack:
            text += " (decodes: one C++ call for all layers)"
        if self.model_note:
            text += f" ({self.model_note})"
        return text

    def describe(self) -> str:
        """The start-up line's kernel text: the weights, why, and the kernels."""
        why = f" ({self.reason})" if self.reason else ""
        if self.gguf_types:
            return (f"GGUF {'/'.join(self.gguf_types)} weights as 4/8-bit code blocks "
                    f"({gguf_bytes_text(self.gguf_types)}){why}; "
                    f"linears: {self.describe_linears()}")
        return f"{self.weights} weights{why}; linears: {self.describe_linears()}"


REFERENCE = KernelSet()


def kernels_for(config, weights: dict[str, torch.Tensor] | None = None) -> KernelSet:
    """The KernelSet of an EngineConfig (see resolve_kernels); with quantization="auto" and
    `weights` holding GGUF block weights (`load_model(keep_quantized=True)`), one that runs
    them (see gguf_kernels)."""
    kernels = resolve_kernels(config.kernels, config.quantization, config.device,
                              config.dtype)
    if config.quantization == "auto" and weights is not None:
        return gguf_kernels(kernels, gguf_blocks.block_types(weights))
    return kernels


def gguf_kernels(kernels: KernelSet, types: tuple[str, ...]) -> KernelSet:
    """`kernels` with the linears of GGUF types `types` kept in their blocks
    (linear_kernels.GGUFBlockLinear), where the fused kernels have it vectorised; else
    `kernels` unchanged (the blocks are then dequantized: KernelSet.prepare_weights).

    NOTE: the decode stack (csrc/decode_stack.cpp) has no block kind yet: decodes run layer
    by layer in Python, the same kernels.
    """
    if not types or not linear_kernels.gguf_block_kernel_available(kernels.ops):
        return kernels
    return dataclasses.replace(kernels, decode_stack=False, weights="gguf", gguf_types=types,
                               reason="auto: the GGUF file's own types")


def gguf_bytes_text(types: tuple[str, ...]) -> str:
    """Memory per weight of GGUF types `types` as packed blocks, e.g. "0.75-1.25 bytes/weight".

    NOTE: per type; a fused q/k/v or gate/up of two types takes the wider codes and the
    shorter blocks of the two.
    """
    sizes = sorted({gguf_blocks.bytes_per_weight(*gguf_blocks.BLOCK_FORMATS[gguf_blocks.Q[t]])
                    for t in types})
    low, high = sizes[0], sizes[-1]
    return f"{low:g} bytes/weight" if low == high else f"{low:g}-{high:g} bytes/weight"


def _with_gguf_blocks(factory, ops):
    """A linear factory: GGUFBlockLinear for a weight in GGUF blocks, else `factory`'s kernel
    (the fp32 weight panels where `factory` is None, plain torch)."""
    fallback = factory or functools.partial(linear_kernels.PanelLinear, ops=ops)

    def make(weight, bias):
        blocks = getattr(weight, gguf_blocks.BLOCKS_ATTRIBUTE, None)
        if blocks is not None:
            return linear_kernels.GGUFBlockLinear(blocks, bias, ops)
        return fallback(weight, bias)

    return make


def resolve_kernels(kernels: str = "auto", quantization: str | None = "none",
                    device: str = "cpu", dtype: str | None = None) -> KernelSet:
    """The fastest kernels verified against the reference that the settings allow here.

    kernels: "reference" plain torch; "mkl" MKL's packed GEMM for fp32 linears; "auto" the
    fp32 weight panels where the fused kernels run with AVX-512. quantization (wins over
    kernels): "none"/None fp32, "bf16", "int8", or "auto": bf16 where the CPU has
    AVX512_BF16 and the bf16 panel kernel is built vectorised and no dtype is named (None or
    "auto"), else fp32. The fused kernels
    apply (kernels != "reference") to a float32 model on the CPU only.
    """
    model_dtype = resolve_dtype(device, dtype)
    cpu_fp32 = torch.device(device).type == "cpu" and model_dtype == torch.float32
    ops = cpu_ops.load_cpu_ops() if kernels != "reference" and cpu_fp32 else None
    if quantization in ("bf16", "int8") and not cpu_fp32:
        raise ValueError(f"quantization={quantization!r} needs the model on the CPU in "
                         "float32 (the weights are quantized, activations stay float32)")
    if quantization == "auto":
        weights, reason = _auto_weights(kernels, cpu_fp32, ops, dtype)
    else:
        weights = "fp32" if quantization in ("none", None) else quantization
        reason = f"quantization={quantization or 'none'}"
    if not cpu_fp32:
        weights = str(model_dtype).removeprefix("torch.")
    fused = ops is not None
    return KernelSet(_linear_kernel(weights, kernels, cpu_fp32, ops), ops, fused_layers=fused,
                     decode_stack=fused, amx_min_rows=_amx_min_rows(weights, ops),
                     weights=weights, reason=reason)


def resolve_kv_cache_dtype(setting: str, kernels: KernelSet, model_dtype: torch.dtype
                           ) -> torch.dtype:
    """The KV cache's element type for CacheConfig.kv_cache_dtype.

    auto: bfloat16 where the linear weights are bf16 or int8 and the model float32 (the
    decode's other large read is the cache: at 64 sequences of a few hundred positions it
    outweighs the weights), else the model's dtype; float32 / bfloat16: as named.
    """
    if setting == "auto":
        quantized = kernels.weights in ("bf16", "int8", "gguf") and model_dtype == torch.float32
        return torch.bfloat16 if quantized else model_dtype
    return DTYPES[setting]


def _auto_weights(kernels: str, cpu_fp32: bool, ops, dtype: str | None = None
                  ) -> tuple[str, str]:
    """quantization="auto": ("bf16" or "fp32", why).

    NOTE: a dtype named by the user (not None / "auto") is what the weights compute in, as
    vLLM's --dtype means: auto picks bf16 weights only when the dtype is left to it too.
    """
    if not cpu_fp32:
        return "fp32", "auto: the model is not float32 on the CPU"
    if dtype not in (None, "auto"):
        return "fp32", f"auto: dtype={dtype} named"
    if kernels != "auto":
        return "fp32", f"auto: kernels={kernels}"
    if not cpu_has_avx512_bf16():
        return "fp32", "auto: no AVX512_BF16"
    if not linear_kernels.bf16_panel_kernel_available(ops):
        return "fp32", "auto: the fused bf16 kernels are not built"
    return "bf16", "auto: AVX512_BF16"


def _linear_kernel(weights: str, kernels: str, cpu_fp32: bool, ops) -> str:
    if weights == "bf16":
        return "bf16_panel" if linear_kernels.bf16_panel_kernel_available(ops) else "bf16_rounded"
    if weights == "int8":
        return "int8" if ops is not None else "int8_torch"
    if kernels == "auto" and linear_kernels.panel_kernel_available(ops):
        return "panel"
    if kernels != "reference" and cpu_fp32 and linear_kernels.mkl_packed_available():
        return "mkl"
    return "reference"


def _amx_min_rows(weights: str, ops) -> int:
    """bf16 panels: from BF16_AMX_MIN_ROWS rows on AMX where the OS allows it."""
    usable = (weights == "bf16" and linear_kernels.bf16_panel_kernel_available(ops)
              and ops.amx_bf16_usable())
    return linear_kernels.BF16_AMX_MIN_ROWS if usable else 0
