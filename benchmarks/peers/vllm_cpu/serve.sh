#!/usr/bin/env bash
# serve.sh PORT [more `vllm serve` args]: vLLM's OpenAI server for $MODEL_DIR (default: the
# converted SmolLM2) on 127.0.0.1:PORT, in the background; prints its PID. Ready once /health
# answers 200 (50-100 s warm, 2-4 min the first time: torch.compile). Log:
# $VLLM_DIR/serve-PORT.log. DTYPE=float32|bfloat16 (default float32). Both cores compute
# (VLLM_CPU_OMP_THREADS_BIND=0-1; its "auto" keeps one core for the API process).
# FORCE_CPU_ISA=avx2: run as on a CPU with AVX2 and no AVX-512 (force_isa/sitecustomize.py:
# vLLM's _C_AVX2 kernels; torch's, oneDNN's and MKL's AVX2 code; its own compile caches);
# avx512: AVX-512 without BF16 or AMX (_C_AVX512); avx512bf16: no AMX (_C, oneDNN held below
# AMX). The variables are benchmarks/vs_vllm.py's LIBRARY_ISA_ENV for the class.
set -euo pipefail
PORT=${1:?usage: serve.sh PORT [more vllm serve args]}; shift
VLLM_DIR=${VLLM_DIR:-/tmp/vllm-peer}
MODEL_DIR=${MODEL_DIR:-$VLLM_DIR/smollm2-hf}
export VLLM_CPU_KVCACHE_SPACE=${KV_GIB:-2}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
preload=""
for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 "$VLLM_DIR/venv/lib/libiomp5.so"; do
  [ -f "$lib" ] && preload="${preload:+$preload:}$lib"
done
export LD_PRELOAD="$preload"
export VLLM_HOST_IP=127.0.0.1 VLLM_LOOPBACK_IP=127.0.0.1   # its internal sockets on loopback
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_USE_AOT_COMPILE=${VLLM_USE_AOT_COMPILE:-0}     # its AOT cache fails to load on CPU
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$VLLM_DIR/vllm-cache}
case "${FORCE_CPU_ISA:-}" in
  "") ;;
  avx2)
    export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ;;
  avx512)
    export ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE MKL_ENABLE_INSTRUCTIONS=AVX512 ;;
  avx512bf16)
    export ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 ;;
  *) echo "FORCE_CPU_ISA=$FORCE_CPU_ISA: only avx2, avx512 or avx512bf16 can be forced" >&2; exit 2 ;;
esac
if [ -n "${FORCE_CPU_ISA:-}" ]; then
  export FORCE_CPU_ISA PYTHONPATH="$(cd "$(dirname "$0")" && pwd)/force_isa${PYTHONPATH:+:$PYTHONPATH}"
  export VLLM_CACHE_ROOT=$VLLM_CACHE_ROOT-$FORCE_CPU_ISA TORCHINDUCTOR_CACHE_DIR=$VLLM_DIR/inductor-$FORCE_CPU_ISA
fi
nohup "$VLLM_DIR/venv/bin/python" "$(dirname "$0")/vllm_cli.py" serve "$MODEL_DIR" \
  --served-model-name "${SERVED_NAME:-smollm2}" --host 127.0.0.1 --port "$PORT" \
  --dtype "${DTYPE:-float32}" --max-model-len "${MAX_MODEL_LEN:-4096}" "$@" \
  > "$VLLM_DIR/serve-$PORT.log" 2>&1 < /dev/null &
echo $!
