"""Run by every Python process of a vLLM peer that serve.sh starts with FORCE_CPU_ISA=avx2
(serve.sh puts this directory first on PYTHONPATH): torch's CPU feature checks, which vLLM
consults to choose its kernels (its `_C_AVX2` library instead of `_C` / `_C_AVX512`, its
attention and linear paths), answer as on a CPU with AVX2 and no AVX-512. serve.sh also sets
ATEN_CPU_CAPABILITY=avx2 (torch's own kernels and the code torch.compile generates),
ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2 (oneDNN's and MKL's matmuls), so the
peer runs as on an older server CPU, as slotserve does with SLOTSERVE_CPU_ISA=avx2 (and the
same three variables: benchmarks/vs_vllm.py's LIBRARY_ISA_ENV).
"""

import os

# NOTE: AVX-512 and what needs it; a check torch lacks is left alone.
FORCED_OFF = ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
              "_is_amx_tile_supported", "_is_amx_fp16_supported")

if os.environ.get("FORCE_CPU_ISA") == "avx2":
    import torch.cpu

    for _name in FORCED_OFF:
        if hasattr(torch.cpu, _name):
            setattr(torch.cpu, _name, lambda: False)
