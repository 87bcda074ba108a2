"""Run by every Python process of a vLLM peer that serve.sh starts with FORCE_CPU_ISA=CLASS
(serve.sh puts this directory first on PYTHONPATH): torch's CPU feature checks, which vLLM
consults to choose its kernels (its `_C_AVX2`, `_C_AVX512` or `_C` library, its attention
and linear paths), answer as on a CPU of that class: avx2 (AVX2, no AVX-512), avx512
(AVX-512 without BF16 or AMX: Skylake, Ice Lake), avx512bf16 (no AMX: Zen 4/5, Cooper
Lake). serve.sh also holds torch's own kernels (and the code torch.compile generates),
oneDNN's and MKL's matmuls to the class (for avx2: ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2), so the peer runs as on such a CPU,
as slotserve does with SLOTSERVE_CPU_ISA=CLASS and the same variables
(benchmarks/vs_vllm.py's LIBRARY_ISA_ENV).
"""

import os

# NOTE: what each class lacks; a check torch lacks is left alone.
AMX = ("_is_amx_tile_supported", "_is_amx_fp16_supported")
FORCED_OFF = {
    "avx2": ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
             *AMX),
    "avx512": ("_is_avx512_bf16_supported", *AMX),
    "avx512bf16": AMX,
}

_forced = os.environ.get("FORCE_CPU_ISA")
if _forced in FORCED_OFF:
    import torch.cpu

    for _name in FORCED_OFF[_forced]:
        if hasattr(torch.cpu, _name):
            setattr(torch.cpu, _name, lambda: False)
