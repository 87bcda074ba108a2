"""KernelSet: which kernels a model runs, resolved once from the config and this machine.

`resolve_kernels(config)` reads EngineConfig's device, dtype, kernels and quantization, the
CPU's instructions and what the built extension (model/cpu_ops.py) supports, and returns a
frozen KernelSet. The model builder takes it (`model/registry.build_model`): the norms, MLPs
and attention get its fused ops when built, the linear layers their kernel and the model its
C++ DecodeStack when the weights are loaded. Nothing changes a model's kernels afterwards; a
benchmark that compares kernels builds one engine per KernelSet (`LLMEngine(kernel_set=...)`).

`describe()` is the start-up line's text, e.g. "bf16 weights (auto: avx512bf16 class);
linears: bf16 weight panels, ... + fused CPU ops (decodes: one C++ call for all layers); CPU
class avx512bf16 (from the CPU's flags)".
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
# SLOTSERVE_NO_AVX512_BF16=1: the CPU is taken to lack AVX512_BF16 (the older spelling of
# SLOTSERVE_CPU_ISA=avx512 where the CPU has more).
NO_BF16_ENV = "SLOTSERVE_NO_AVX512_BF16"
# SLOTSERVE_CPU_ISA=amx|avx512bf16|avx512|avx2|generic: run that CPU class's kernels on a
# CPU of that class or above (tests of each class's kernels, benchmarks timing each class on
# one machine); a class above this CPU's is an error.
CPU_ISA_ENV = "SLOTSERVE_CPU_ISA"
# SLOTSERVE_PREFILL_ATTENTION=sdpa|triton: the CUDA path's prefill attention: torch's SDPA over
# each chunk's gathered blocks (sdpa, the default) or gpu/triton_prefill.py's kernel, all the
# iteration's chunks in one launch (triton; NOTE: opt-in until timed on a GPU,
# benchmarks/GPU.md).
PREFILL_ATTENTION_ENV = "SLOTSERVE_PREFILL_ATTENTION"
PREFILL_ATTENTIONS = ("sdpa", "triton")

# The CPU classes, lowest first, and the /proc/cpuinfo flags each needs (with the lower
# classes'). A class picks its kernels (resolve_kernels):
# - generic: no AVX2 (or not x86): plain torch / MKL for the linears, the fused ops as built;
# - avx2 (AVX2 + FMA: older servers and laptops): the weight panels in AVX2 tiles (panels.h:
#   the same sums as the AVX-512 tiles, bit for bit), bf16 weights widened to fp32 in registers;
# - avx512 (AVX-512 F/BW, no BF16: Skylake, Ice Lake): the weight panels; bf16 weights are
#   widened to fp32 in registers;
# - avx512bf16 (AVX512_BF16, no AMX: AMD Zen 4/5, Cooper Lake): bf16 weights multiplied by
#   vdpbf16ps with x rounded to bf16 (from BF16_DOT_MIN_ROWS rows);
# - amx (AMX-BF16 and -TILE, Sapphire Rapids and later): bf16 weights widened below
#   BF16_AMX_MIN_ROWS rows, on AMX tiles from there.
CPU_CLASSES = ("generic", "avx2", "avx512", "avx512bf16", "amx")
CPU_CLASS_FLAGS = {
    "generic": frozenset(),
    "avx2": frozenset({"avx2", "fma"}),
    "avx512": frozenset({"avx512f", "avx512bw"}),
    "avx512bf16": frozenset({"avx512_bf16"}),
    "amx": frozenset({"amx_bf16", "amx_tile"}),
}
# NOTE: a class forced below this CPU's is built for its own instructions (model/cpu_ops.py:
# gcc's -march), so its fallbacks run as on such a CPU; the AVX-512 classes share the
# native build (their kernels differ in which of its instructions they use, not in code).
CPU_CLASS_MARCH = {"generic": "x86-64-v2", "avx2": "x86-64-v3"}

# quantization="auto": each class's weights, the fastest configuration that passes the
# quality bar (>= 97% teacher-forced greedy agreement with fp32) as measured by
# benchmarks/cpu_classes.py (benchmarks/results/cpu-classes-*.json, benchmarks/PERF.md).
# NOTE: avx2: bf16 since its bf16 panels (AVX2, widened: the avx512 class's sums, bit for
# bit, so its 99.6% agreement) ran a W-like batch (64 chat prompts x 32 tokens, in process,
# SLOTSERVE_CPU_ISA=avx2 on an AMD EPYC Zen 5) at 570-616 tok/s against 395-529 for the fp32
# panels and 347-362 for MKL's fp32 GEMM held to AVX2 (the class's default before); at batch
# 1 they read half the bytes.
AUTO_WEIGHTS = {"generic": "fp32", "avx2": "bf16", "avx512": "bf16", "avx512bf16": "bf16",
                "amx": "bf16"}

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
# The lm_head's weights under quantization="int8": bf16, not int8, as vLLM's quantization
# methods leave the lm_head unquantized and llama.cpp keeps output.weight at higher
# precision. NOTE: teacher-forced agreement with fp32, int8 lm_head -> bf16 lm_head: the
# real Gemma 3 270M (262k tied rows, 62% of its weights) 95.5% -> 97.4% (313 tokens; below
# the 97% bar before), SmolLM2-135M 97.1% -> 97.4% (2048 tokens); the price: the head's
# bytes double (a decode step reads ~436 MB of linear weights instead of ~268 on Gemma,
# ~163 instead of ~135 on SmolLM2; benchmarks/MODELS.md).
HEAD_UNDER_INT8 = "bf16"


def resolve_dtype(device: str, dtype: str | None) -> torch.dtype:
    """The model's dtype: `dtype` by name, or (None or "auto") float32 on the CPU and
    bfloat16 on CUDA."""
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU has AVX512_BF16 (`vdpbf16ps`): its class (cpu_class: the flags, or
    a class forced lower) is avx512bf16 or amx. False where /proc/cpuinfo cannot be read."""
    return cpu_class().at_least("avx512bf16")


@dataclass(frozen=True)
class CpuClass:
    """This machine's CPU class (CPU_CLASSES) for the kernels, and why (the start-up line)."""

    name: str
    reason: str

    @property
    def rank(self) -> int:
        return CPU_CLASSES.index(self.name)

    def at_least(self, name: str) -> bool:
        return self.rank >= CPU_CLASSES.index(name)

    @property
    def march(self) -> str:
        """The -march of the fused kernels' build (model/cpu_ops.py) for this class."""
        forced_down = self.name != detect_cpu_class(_cpu_flags())
        return CPU_CLASS_MARCH.get(self.name, cpu_ops.NATIVE) if forced_down else cpu_ops.NATIVE


def detect_cpu_class(flags: frozenset[str]) -> str:
    """The highest class whose flags (and every lower class's) the CPU lists."""
    found = "generic"
    needed: set[str] = set()
    for name in CPU_CLASSES[1:]:
        needed |= CPU_CLASS_FLAGS[name]
        if not needed <= flags:
            break
        found = name
    return found


def cpu_class(forced: str | None = None) -> CpuClass:
    """This CPU's class from its flags, or the one SLOTSERVE_CPU_ISA (or `forced`, which
    wins: benchmarks timing each class in one process) forces, down only.

    Raises ValueError (naming the variable) for an unknown class or one above this CPU's.
    """
    detected = detect_cpu_class(_cpu_flags())
    if forced is None:
        forced = os.environ.get(CPU_ISA_ENV, "").strip().lower()
    if not forced:
        if os.environ.get(NO_BF16_ENV, "0") not in ("", "0") and detected in ("avx512bf16",
                                                                               "amx"):
            return CpuClass("avx512", f"{NO_BF16_ENV}=1; the CPU: {detected}")
        return CpuClass(detected, "from the CPU's flags")
    if forced not in CPU_CLASSES:
        raise ValueError(f"{CPU_ISA_ENV}={forced!r}: must be one of {', '.join(CPU_CLASSES)}")
    if CPU_CLASSES.index(forced) > CPU_CLASSES.index(detected):
        missing = set().union(*(CPU_CLASS_FLAGS[c] for c in CPU_CLASSES[:CPU_CLASSES.index(
            forced) + 1])) - _cpu_flags()
        raise ValueError(f"{CPU_ISA_ENV}={forced}: this CPU is of class {detected} (no "
                         f"{', '.join(sorted(missing))}); a class can be forced down only")
    if forced == detected:
        return CpuClass(forced, f"{CPU_ISA_ENV}={forced}, the CPU's own")
    return CpuClass(forced, f"{CPU_ISA_ENV}={forced}; the CPU: {detected}")


@functools.cache
def cpuinfo_fields(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (model name, flags...), {} where it
    cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open(path) as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break  # NOTE: the first processor's block ends here
                key, colon, value = line.partition(":")
                if colon:
                    fields[key.strip()] = value.strip()
    except OSError:
        return {}
    return fields


@functools.cache
def _cpu_flags() -> frozenset[str]:
    return frozenset(cpuinfo_fields().get("flags", "").split())


@dataclass(frozen=True)
class KernelSet:
    """The kernels of one model; the default is plain torch everywhere (the reference).

    linear: the linear layers' kernel, a key of LINEAR_KERNELS.
    ops: the fused CPU kernels' module (model/cpu_ops.py), or None.
    fused_layers: norms, SiLU, RoPE, KV writes and decode attention through `ops`.
    decode_stack: all-decode iterations through ops.DecodeStack (needs fused_layers).
    amx_min_rows: bf16 panels: calls of this many rows or more run on AMX; 0: never.
    dot_min_rows: bf16 panels: calls of this many rows or more round x to bf16 and run
      vdpbf16ps; 0: never (at most one of amx_min_rows and dot_min_rows).
    weights: the linear layers' weights: "fp32", "bf16", "int8", "gguf", "q8_0" (float
        weights quantized to GGUF Q8_0 blocks as they load) or the model's dtype.
    reason: how the weights were chosen ("auto: amx class", "quantization=int8").
    gguf_types: the GGUF types of the linears kept in their file's blocks (weights="gguf";
        gguf_blocks.block_types): those run linear_kernels.GGUFBlockLinear, any float
        linear the `linear` kernel.
    cpu_class, cpu_reason: the CPU class the kernels were chosen for (cpu_class()), and why.
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
    dot_min_rows: int = 0
    cpu_class: str = ""
    cpu_reason: str = ""
    # the linear weights' bytes one decode step reads, once the model holds them (loaded)
    step_weight_bytes: int = 0
    # the lm_head's kernel where it is not `linear`'s (a key of LINEAR_KERNELS; "": the
    # same): int8 weights leave it in bf16 (resolve_kernels, HEAD_UNDER_INT8)
    head_linear: str = ""

    def __post_init__(self) -> None:
        if self.linear not in LINEAR_KERNELS:
            raise ValueError(f"linear must be one of {sorted(LINEAR_KERNELS)}, "
                             f"got {self.linear!r}")
        if self.head_linear and self.head_linear not in LINEAR_KERNELS:
            raise ValueError(f"head_linear must be one of {sorted(LINEAR_KERNELS)}, "
                             f"got {self.head_linear!r}")
        if self.ops is None and (self.fused_layers or self.linear in LINEARS_ON_OPS):
            raise ValueError(f"linear={self.linear!r} / fused_layers need the fused kernels")
        if self.decode_stack and not self.fused_layers:
            raise ValueError("decode_stack needs fused_layers (it runs the same kernels)")
        if self.gguf_types and self.ops is None:
            raise ValueError("GGUF block weights need the fused kernels")

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

    def loaded(self, model) -> KernelSet:
        """This set, knowing the bytes of linear weights a decode step of `model` (its
        weights loaded) reads, for the start-up line."""
        return dataclasses.replace(
            self, step_weight_bytes=linear_kernels.decode_step_weight_bytes(model))

    @property
    def layer_ops(self):
        """The ops the norms, MLPs and attention call; None: torch's."""
        return self.ops if self.fused_layers else None

    def linear_factory(self, kind: str | None = None):
        """(weight (in, out), bias) -> the linear kernel `kind` (a key of LINEAR_KERNELS;
        None: `linear`); None for plain torch."""
        lk, ops = linear_kernels, self.ops
        factory = {
            "reference": None,
            "panel": functools.partial(lk.PanelLinear, ops=ops),
            "mkl": lk.MKLPackedLinear,
            "bf16_panel": functools.partial(lk.Bf16PanelLinear, ops=ops,
                                            amx_min_rows=self.amx_min_rows,
                                            dot_min_rows=self.dot_min_rows),
            "bf16_rounded": lk.Bf16RoundedLinear,
            "int8": functools.partial(lk.Int8WeightOnlyLinear, ops=ops),
            "int8_torch": lk.Int8WeightOnlyLinear,
        }[kind or self.linear]
        if not self.gguf_types:
            return factory
        return _with_gguf_blocks(factory, ops, linear_kernels.activation_bits_for(self.gguf_types))

    def head_factory(self):
        """The lm_head's kernel factory: head_linear's where set, else linear_factory()."""
        return self.linear_factory(self.head_linear or None)

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight as this KernelSet's linears take it: a GGUF block weight as it is when it
        runs them, else its fp32 values (what quantization none/bf16/int8 do), made now: a
        model loading its weights one at a time holds one fp32 weight of a GGUF at a time,
        never the whole model in fp32 (nor an fp32 copy of it on disk). Under q8_0 a linear's
        weight is quantized to Q8_0 blocks (gguf_blocks.as_q8_0)."""
        if self.weights == "q8_0":
            return gguf_blocks.as_q8_0(weight)
        return weight if self.gguf_types else gguf_blocks.dequantized(weight)

    def prepare_embedding(self, table: torch.Tensor) -> torch.Tensor:
        """The embedding table as this set looks its rows up: as loaded (a GGUF's blocks stay
        blocks, a float table as stored), but quantized to Q8_0 blocks under q8_0 (as a Q8_0
        file's table)."""
        return gguf_blocks.as_q8_0(table) if self.weights == "q8_0" else table

    def _kernel_text(self, kind: str) -> str:
        """Linear kernel `kind` (a key of LINEAR_KERNELS) in words, with its bf16 mode."""
        text = LINEAR_KERNELS[kind]
        if kind == "bf16_panel" and self.amx_min_rows:
            text = (f"bf16 weight panels, fp32 activations below {self.amx_min_rows} rows, "
                    "AMX from there (fused CPU kernels)")
        if kind == "bf16_panel" and self.dot_min_rows == 1:
            text = "bf16 weight panels, x rounded to bf16, vdpbf16ps (fused CPU kernel)"
        elif kind == "bf16_panel" and self.dot_min_rows:
            text = (f"bf16 weight panels, fp32 activations below {self.dot_min_rows} rows, "
                    "x rounded to bf16 and vdpbf16ps from there (fused CPU kernel)")
        return text

    def describe_linears(self) -> str:
        """The linear kernel, the fused ops and the decode stack, in words."""
        text = self._kernel_text(self.linear)
        if self.head_linear:
            text += f"; lm_head: {self._kernel_text(self.head_linear)}"
        if self.gguf_types:  # NOTE: after the bf16 modes' texts, which replace `text`
            path = {"avx512vnni": "VNNI", "avx2": "AVX2"}.get(self.ops.quant_blocks_isa(),
                                                               "plain loops")
            bits = linear_kernels.activation_bits_for(self.gguf_types)
            activations = "int8" if bits == 8 else f"{bits}-bit"
            text = (f"GGUF blocks x {activations} activations ({path}, fused CPU kernel), other "
                    f"linears {text}")
        if self.fused_layers:
            text += f" + {getattr(self.ops, 'DESCRIPTION', 'fused CPU ops')}"
        if self.decode_stack:
            text += " (decodes: one C++ call for all layers)"
        if self.model_note:
            text += f" ({self.model_note})"
        return text

    def describe(self) -> str:
        """The start-up line's kernel text: the weights, why, and the kernels."""
        why = f" ({self.reason})" if self.reason else ""
        cpu = f"; CPU class {self.cpu_class} ({self.cpu_reason})" if self.cpu_class else ""
        if self.gguf_types:
            step = (f", {size_text(self.step_weight_bytes)} read per decode step"
                    if self.step_weight_bytes else "")
            weights = (f"GGUF {'/'.join(self.gguf_types)} weights as 4/6/8-bit code blocks"
                       if self.weights != "q8_0" else
                       "float weights quantized to GGUF Q8_0 blocks as they load")
            return (f"{weights} ({gguf_bytes_text(self.gguf_types)}){step}{why}; "
                    f"linears: {self.describe_linears()}{cpu}")
        return f"{self.weights} weights{why}; linears: {self.describe_linears()}{cpu}"


REFERENCE = KernelSet()


def keeps_gguf_blocks(config) -> bool:
    """Whether an EngineConfig serves a GGUF's quantized linears in their own blocks (the
    engine reads them in blocks either way, `load_model(keep_quantized=True)`, and otherwise
    dequantizes each as it loads it: KernelSet.prepare_weight): quantization="gguf", or
    "auto" for a model file the user names, as llama.cpp means it (a Q4_K_M file is served
    as Q4_K_M, at its own size), on the CPU with no dtype named and the fused kernels
    allowed. A GGUF without quantized linears (F32/F16/BF16) or an HF directory gets auto's
    class default all the same (no blocks to keep).

    NOTE: the embedded default model (model=None) keeps its class's default under auto: its
    Q4_1 blocks agree 97.1% with fp32 against bf16's 99.5%, and bf16 is what the benchmarks
    compare with other engines; `--quantization gguf` serves its blocks.
    """
    if config.quantization == "gguf":
        return True
    named_file = config.model is not None and not os.path.isdir(config.model)
    return (config.quantization == "auto" and named_file
            and torch.device(config.device).type == "cpu"
            and config.dtype in (None, "auto") and config.kernels != "reference")


def kernels_for(config, weights: dict[str, torch.Tensor] | None = None) -> KernelSet:
    """The KernelSet of an EngineConfig (see resolve_kernels); where `keeps_gguf_blocks`
    and `weights` hold GGUF block weights (`load_model(keep_quantized=True)`), one that runs
    them (see gguf_kernels), the rest as "auto" chooses."""
    gguf = keeps_gguf_blocks(config)
    kernels = resolve_kernels(config.kernels, "auto" if gguf else config.quantization,
                              config.device, config.dtype)
    if gguf and weights is not None:
        why = f"quantization={config.quantization}: the file's own types"
        return gguf_kernels(kernels, gguf_blocks.block_types(weights), why)
    return kernels


def gguf_kernels(kernels: KernelSet, types: tuple[str, ...],
                 why: str = "quantization=gguf: the file's own types") -> KernelSet:
    """`kernels` with the linears of GGUF types `types` kept in their blocks
    (linear_kernels.GGUFBlockLinear), where the fused kernels have it vectorised; else
    `kernels` unchanged (the blocks are then dequantized: KernelSet.prepare_weight).

    The decode stack (csrc/decode_stack.cpp, its `gguf_blocks` kind) runs the block kernel
    too: decodes stay one C++ call for all layers, as `kernels` has it.
    """
    if not types or not linear_kernels.gguf_block_kernel_available(kernels.ops):
        return kernels
    return dataclasses.replace(kernels, weights="gguf", gguf_types=types, reason=why)


def q8_0_kernels(kernels: KernelSet) -> KernelSet:
    """quantization="q8_0": `kernels` (auto's) with the linear weights quantized to GGUF
    Q8_0 blocks as they load (KernelSet.prepare_weight) and run by the block kernel with
    16-bit activations (linear_kernels.activation_bits_for; VNNI where the CPU has it), any linear
    whose width is no multiple of 32 by `kernels`' float kernel.

    Raises ValueError where the fused kernels do not run the blocks vectorised (no compiler,
    `--kernels reference`, a CPU below the avx2 class).
    """
    if not linear_kernels.gguf_block_kernel_available(kernels.ops):
        raise ValueError("quantization='q8_0' needs the fused CPU kernels' block kernel "
                         "(AVX2 or AVX512-VNNI), unavailable here; use bf16, int8 or none")
    return dataclasses.replace(kernels, weights="q8_0", gguf_types=(gguf_blocks.Q.Q8_0.name,),
                               reason="quantization=q8_0")


def gguf_bytes_text(types: tuple[str, ...]) -> str:
    """Memory per weight of GGUF types `types` as packed blocks, e.g. "0.75-1.25 bytes/weight".

    NOTE: per type; a fused gate/up of two types takes the wider codes and the shorter
    blocks of the two (a fused q/k/v keeps each type's: linear_kernels.SegmentedLinear).
    """
    sizes = sorted({round(gguf_blocks.type_bytes_per_weight(gguf_blocks.Q[t]), 3)
                    for t in types})
    low, high = sizes[0], sizes[-1]
    return f"{low:g} bytes/weight" if low == high else f"{low:g}-{high:g} bytes/weight"


def size_text(size: int) -> str:
    """Bytes in words: "512 KiB", "95.3 MiB", "4.21 GiB" (three significant digits, or
    the units of 100 and more)."""
    value, unit = float(size), "bytes"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"


def _with_gguf_blocks(factory, ops, activation_bits: int):
    """A linear factory: GGUFBlockLinear (its activations quantized to `activation_bits`) for
    a weight in GGUF blocks, else `factory`'s kernel (the fp32 weight panels where `factory`
    is None, plain torch)."""
    fallback = factory or functools.partial(linear_kernels.PanelLinear, ops=ops)

    def make(weight, bias):
        blocks = getattr(weight, gguf_blocks.BLOCKS_ATTRIBUTE, None)
        if isinstance(blocks, gguf_blocks.LazyBlocks):  # NOTE: made, packed, then dropped
            return linear_kernels.gguf_block_linear(blocks, bias, ops, activation_bits)
        if blocks is not None:
            return linear_kernels.GGUFBlockLinear(blocks, bias, ops, activation_bits)
        return fallback(weight, bias)

    return make


def resolve_kernels(kernels: str = "auto", quantization: str | None = "none",
                    device: str = "cpu", dtype: str | None = None,
                    cpu_isa: str | None = None) -> KernelSet:
    """The fastest kernels verified against the reference that the settings allow here.

    kernels: "reference" plain torch; "mkl" MKL's packed GEMM for fp32 linears; "auto" the
    fp32 weight panels where the fused kernels run vectorised (AVX-512, or AVX2 + FMA: the
    avx2 class and above), else MKL's packed GEMM. quantization (wins over
    kernels): "none"/None fp32, "bf16", "int8", "q8_0" (auto's set with the linear weights
    quantized to Q8_0 blocks: q8_0_kernels), or "auto": the CPU class's AUTO_WEIGHTS
    where its kernels are built and no dtype is named (None or "auto"), else fp32. The fused
    kernels apply (kernels != "reference") to a float32 model on the CPU only. The CPU
    class: cpu_class() (the CPU's flags, or SLOTSERVE_CPU_ISA, or cpu_isa; a ValueError for
    a class this CPU lacks).
    """
    model_dtype = resolve_dtype(device, dtype)
    if torch.device(device).type == "cuda":
        return cuda_kernels(kernels, quantization, model_dtype)
    cpu_fp32 = torch.device(device).type == "cpu" and model_dtype == torch.float32
    cpu = cpu_class(cpu_isa)
    ops = cpu_ops.load_cpu_ops(cpu.march) if kernels != "reference" and cpu_fp32 else None
    if quantization in ("bf16", "int8", "q8_0") and not cpu_fp32:
        raise ValueError(f"quantization={quantization!r} needs the model on the CPU in "
                         "float32 (the weights are quantized, activations stay float32)")
    if quantization == "q8_0":
        return q8_0_kernels(resolve_kernels(kernels, "auto", device, dtype, cpu_isa))
    if quantization == "auto":
        weights, reason = _auto_weights(kernels, cpu_fp32, ops, cpu, dtype)
    else:
        weights = "fp32" if quantization in ("none", None) else quantization
        reason = f"quantization={quantization or 'none'}"
    if not cpu_fp32:
        weights = str(model_dtype).removeprefix("torch.")
    fused = ops is not None
    linear = _linear_kernel(weights, kernels, cpu_fp32, ops, cpu)
    head = (_linear_kernel(HEAD_UNDER_INT8, kernels, cpu_fp32, ops, cpu)
            if weights == "int8" else "")
    # NOTE: an int8 set's bf16 lm_head widens its weights (fp32 activations, no AMX or
    # vdpbf16ps rows): its rows are the sampled ones only
    amx_rows, dot_rows = _bf16_many_rows(linear, ops, cpu)
    return KernelSet(linear, ops, fused_layers=fused, decode_stack=fused, amx_min_rows=amx_rows,
                     weights=weights, reason=reason, dot_min_rows=dot_rows,
                     cpu_class=cpu.name, cpu_reason=cpu.reason, head_linear=head)


def cuda_kernels(kernels: str, quantization: str | None, model_dtype: torch.dtype
                 ) -> KernelSet:
    """The kernels of a model on CUDA: auto: the Triton kernels (slotserve.gpu.triton_ops)
    for norms, RoPE, SiLU, K/V writes and decode attention, cuBLAS for the linears (torch's
    matmul), prefill attention through torch's SDPA (or Triton's: PREFILL_ATTENTION_ENV);
    reference: plain torch everywhere. The weights compute in the model's dtype
    (quantization has no GPU kernels)."""
    weights = str(model_dtype).removeprefix("torch.")
    if quantization not in ("auto", "none", None):
        raise ValueError(f"quantization={quantization!r} runs on the CPU only")
    prefill = prefill_attention_setting()
    if kernels == "reference":
        return KernelSet(weights=weights, reason="kernels=reference")
    ops, why_not = _triton_ops()
    if ops is None:
        return KernelSet(weights=weights, reason=f"{weights} on CUDA; torch's ops: {why_not}")
    return KernelSet(ops=with_prefill_attention(ops, prefill), fused_layers=True,
                     weights=weights, reason=f"{weights} on CUDA")


def prefill_attention_setting() -> str:
    """PREFILL_ATTENTION_ENV's value ("sdpa" when unset); a ValueError naming it otherwise."""
    value = os.environ.get(PREFILL_ATTENTION_ENV, "").strip().lower() or "sdpa"
    if value not in PREFILL_ATTENTIONS:
        raise ValueError(f"{PREFILL_ATTENTION_ENV}={value!r}: must be one of "
                         f"{', '.join(PREFILL_ATTENTIONS)}")
    return value


def with_prefill_attention(triton_ops, prefill: str):
    """The layer ops of a CUDA model: triton_ops itself (prefills through SDPA), or with
    prefill="triton" triton_ops plus the Triton prefill attention
    (gpu/triton_prefill.WITH_PREFILL, which attention/torch_paged.paged_attention calls)."""
    if prefill != "triton":
        return triton_ops
    from slotserve.gpu import triton_prefill

    return triton_prefill.WITH_PREFILL


def _triton_ops():
    """(slotserve.gpu.triton_ops, "") where they compile for this machine's GPU, else
    (None, why not). NOTE: Triton is imported only where a GPU is used."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    try:
        from slotserve.gpu import triton_ops
    except ImportError as error:
        return None, f"Triton is not installed ({error})"
    if triton_ops.INTERPRETED:
        return None, "TRITON_INTERPRET=1 (the kernels would run on the CPU)"
    return triton_ops, ""


def resolve_kv_cache_dtype(setting: str, kernels: KernelSet, model_dtype: torch.dtype
                           ) -> torch.dtype:
    """The KV cache's element type for CacheConfig.kv_cache_dtype.

    auto: bfloat16 where the linear weights are bf16 or int8 and the model float32 (the
    decode's other large read is the cache: at 64 sequences of a few hundred positions it
    outweighs the weights), else the model's dtype; float32 / bfloat16: as named; int8:
    torch.int8, attention/kv_int8.py's rows of codes and scales (opt-in, never auto).
    """
    if setting == "auto":
        quantized = (kernels.weights in ("bf16", "int8", "gguf", "q8_0")
                     and model_dtype == torch.float32)
        return torch.bfloat16 if quantized else model_dtype
    if setting == "int8":
        return torch.int8
    if setting not in DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto, int8 or one of {sorted(DTYPES)}, "
                         f"got {setting!r}")
    return DTYPES[setting]


def _auto_weights(kernels: str, cpu_fp32: bool, ops, cpu: CpuClass,
                  dtype: str | None = None) -> tuple[str, str]:
    """quantization="auto": (the weights, why): the class's AUTO_WEIGHTS where its kernels
    run here, else fp32.

    NOTE: a dtype named by the user (not None / "auto") is what the weights compute in, as
    vLLM's --dtype means: auto picks bf16 weights only when the dtype is left to it too.
    """
    if not cpu_fp32:
        return "fp32", "auto: the model is not float32 on the CPU"
    if dtype not in (None, "auto"):
        return "fp32", f"auto: dtype={dtype} named"
    if kernels != "auto":
        return "fp32", f"auto: kernels={kernels}"
    weights = AUTO_WEIGHTS[cpu.name]
    if weights == "fp32":
        return "fp32", f"auto: {cpu.name} class"
    if weights == "bf16" and not linear_kernels.bf16_panel_kernel_available(ops):
        return "fp32", "auto: the fused bf16 kernels are not built"
    if weights == "int8" and ops is None:
        return "fp32", "auto: the fused int8 kernel is not built"
    return weights, f"auto: {cpu.name} class"


def _panels_usable(ops, cpu: CpuClass) -> bool:
    """The weight-panel kernels: the avx2 class and above, the build vectorised (AVX-512F,
    or AVX2 + FMA).

    NOTE: on the avx2 class the AVX2 panels ran one forward's linears 1.5-4x faster than
    MKL's packed GEMM held to AVX2 at 1-64 rows, SmolLM2-135M's and Llama-3.2-1B's shapes
    (benchmarks/cpu_classes.py --cpu-isa avx2)."""
    return cpu.at_least("avx2") and linear_kernels.panel_kernel_available(ops)


def _linear_kernel(weights: str, kernels: str, cpu_fp32: bool, ops, cpu: CpuClass) -> str:
    if weights == "bf16":
        usable = cpu.at_least("avx2") and linear_kernels.bf16_panel_kernel_available(ops)
        return "bf16_panel" if usable else "bf16_rounded"
    if weights == "int8":
        return "int8" if ops is not None else "int8_torch"
    if kernels == "auto" and _panels_usable(ops, cpu):
        return "panel"
    if kernels != "reference" and cpu_fp32 and linear_kernels.mkl_packed_available():
        return "mkl"
    return "reference"


def _bf16_many_rows(linear: str, ops, cpu: CpuClass) -> tuple[int, int]:
    """bf16 panels: (amx_min_rows, dot_min_rows) of the CPU class: AMX from
    BF16_AMX_MIN_ROWS rows where the OS allows it (amx), vdpbf16ps from BF16_DOT_MIN_ROWS
    (avx512bf16, or amx without the tiles), widening only (avx512)."""
    if linear != "bf16_panel":
        return 0, 0
    if cpu.at_least("amx") and ops.amx_bf16_usable():
        return linear_kernels.BF16_AMX_MIN_ROWS, 0
    if cpu.at_least("avx512bf16") and ops.panel_bf16_vectorised()[1]:
        return 0, linear_kernels.BF16_DOT_MIN_ROWS
    return 0, 0
