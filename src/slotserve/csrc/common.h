// Fused CPU kernels: each replaces several small eager torch ops (or, for the matmuls, a
// slower torch kernel). The torch code in slotserve/model/layers.py,
// slotserve/attention/torch_paged.py and slotserve/model/linear_kernels.py stays the
// reference: tests/model/test_fused_ops.py, tests/unit/test_paged_attention.py,
// tests/model/test_linear_kernels.py and tests/model/test_bf16_kernels.py check every kernel
// against it.
//
// One file per kernel family, compiled together into one extension by model/cpu_ops.py:
//   common.h            this file: the checks and small math every family uses
//   tensors.h           the slice of ATen the kernel files use
//   parallel.h/.cpp     parallel_for: the kernels' thread pool while the CPUs are busy, else
//                       OpenMP (see its NOTEs)
//   ops.h               the kernel entry points (tensors, and the raw forms the stack calls)
//   fused_ops.cpp       RMSNorm, SiLU * up, RoPE, each row's argmax
//   paged_attention.cpp storing new K/V in the paged cache, decode attention over it
//   int8_linear.cpp     int8 weights x int16 activations
//   quant_blocks.cpp    GGUF weights as blocks of 4/6/8-bit codes x int8 or 16-bit activations
//   gguf_unpack.cpp     a GGUF file's raw blocks unpacked at load (BlockWeights' arrays)
//   panels.h            the weight-panel layout shared by the three panel matmuls
//   panel_linear.cpp    fp32 weight panels
//   bf16_panels.cpp     bf16 weight panels (fp32 or bf16 activations)
//   bf16_amx.cpp        bf16 weight panels on AMX tiles (many rows)
//   decode_stack.h/.cpp every decoder layer of an all-decode iteration in one call
//   bindings.cpp        the Python module
//
// Plain loops, fp32 accumulation; `#pragma omp simd` lets the compiler vectorise the
// reductions (no -ffast-math: it would flush denormals for the whole process).
// NOTE: the kernel files include tensors.h (the slice of ATen they use), not
// <torch/extension.h> or <torch/types.h>: parsing those took most of each file's compile.
#pragma once

#include "tensors.h"

#include "parallel.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace slotserve::kernels {

inline void check_cpu_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == kFloat32, name, " must be float32");
}

// fn(values) with `weight`'s data typed as it is stored: float, c10::BFloat16 or c10::Half
// (a packer's source: each value read as float(values[i]), exact, so a 16-bit weight packs
// as its fp32 widening does, without that widened copy).
template <typename Fn>
void with_weight_values(const torch::Tensor& weight, Fn&& fn) {
  TORCH_CHECK(weight.device().is_cpu(), "weight must be on the CPU");
  switch (weight.scalar_type()) {
    case kFloat32: fn(weight.data_ptr<float>()); break;
    case torch::kBFloat16: fn(weight.data_ptr<c10::BFloat16>()); break;
    case torch::kHalf: fn(weight.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "weight must be float32, bfloat16 or float16, got ",
                         weight.scalar_type());
  }
}

// n values at v[0], v[stride], ... as fp32 in out[0 : n]: a packer's source row, widened
// exactly (bf16: its bits shifted; fp16: F16C's vcvtph2ps where the row is contiguous).
inline void widen_row(const float* v, int64_t n, int64_t stride, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = v[i * stride];
}
inline void widen_row(const c10::BFloat16* v, int64_t n, int64_t stride, float* out) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(v);
  for (int64_t i = 0; i < n; ++i) out[i] = std::bit_cast<float>(uint32_t(bits[i * stride]) << 16);
}
inline void widen_row(const c10::Half* v, int64_t n, int64_t stride, float* out) {
  int64_t i = 0;
#if defined(__F16C__)
  if (stride == 1)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i,
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i))));
#endif
  for (; i < n; ++i) out[i] = static_cast<float>(v[i * stride]);
}

// The packers' unit of work: `rows` outputs' weights for inputs [k0, k0 + n), widened into
// block (rows, n) (an output past `outs` or an input past `in`: zeros). NOTE: the packers
// widen a block this small (L1) and then write the panel's lines in order: writing each
// output's inputs across a panel in turn touched every line of it (128 KB-1 MB) once per
// output, from L2 or memory.
template <typename T>
void widen_block(const T* w, int64_t out_stride, int64_t in_stride, int64_t first_out,
                 int64_t rows, int64_t outs, int64_t in, int64_t k0, int64_t n, float* block) {
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t o = first_out + j;
    const int64_t filled = o < outs ? std::max<int64_t>(0, std::min(n, in - k0)) : 0;
    if (filled) widen_row(w + o * out_stride + k0 * in_stride, filled, in_stride, block + j * n);
    std::fill(block + j * n + filled, block + (j + 1) * n, 0.f);
  }
}

// `out` where given (checked: on the CPU, contiguous, this shape and dtype), else a new
// tensor of them: a packer's destination (a part of one arena, or its own).
inline torch::Tensor packed_destination(const c10::optional<torch::Tensor>& out,
                                        torch::IntArrayRef shape, torch::ScalarType dtype) {
  if (!out.has_value()) return torch::empty(shape, torch::dtype(dtype));
  const torch::Tensor& t = *out;
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() &&
                  t.sizes() == shape,
              "out must be a contiguous CPU tensor of ", c10::toString(dtype), " and shape ",
              shape, ", got ", t.scalar_type(), " ", t.sizes());
  return t;
}

// Every value of `indices` (int64, contiguous) in [0, size): slots, token ids, positions,
// all checked before a kernel writes or reads through them.
inline void check_indices(const torch::Tensor& indices, int64_t size, const char* what) {
  const int64_t* values = indices.data_ptr<int64_t>();
  for (int64_t i = 0; i < indices.numel(); ++i)
    TORCH_CHECK(values[i] >= 0 && values[i] < size, what, " out of range: ", values[i]);
}

// exp(x) in a form the compiler vectorises (std::exp stays a scalar libm call without
// -ffast-math): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial
// (relative error below 2e-7), times 2^n built in the exponent bits.
inline float vec_exp(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 in two parts (Cody-Waite)
  const float p =
      1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r / 720)))));
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

#if defined(__AVX2__) && defined(__FMA__)
// vec_exp of 8 lanes, its steps as gcc compiles the scalar form (fused multiply-adds where it
// contracts them): gcc leaves vec_exp's loops scalar (std::nearbyint). NaN stays NaN.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-87.f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                   _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_add_ps(_mm256_set1_ps(1.f / 120), _mm256_div_ps(r, _mm256_set1_ps(720.f)));
  p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(1.f));
  const __m256i two_n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// The lanes of a mask for the first min(n, 8) of 8 elements (maskload, maskstore).
inline __m256i lanes_below(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The largest of 8 lanes.
inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// The sum of 8 lanes.
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// An fp32 or bf16 element as fp32 (bf16 widens exactly).
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return float(x); }

// sum a[i] * b[i], b fp32 or bf16 (a bf16 KV cache's keys), in fp32.
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * to_float(b[i]);
  return s;
}

}  // namespace slotserve::kernels
