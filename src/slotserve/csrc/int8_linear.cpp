// ---- int8 weights x int16 activations -----------------------------------------------
// Weight-only int8 would convert every weight to float (one core's vector units, not the
// memory, set the pace then). Instead each token's activations are quantized to int16 with
// one scale per token (|error| <= max|x| / 65534, finer than bfloat16's 8 bits), and the
// products are summed in int32 by AVX-512's 16-bit dot product: 32 weights per instruction
// (AVX2's: 16).


#include "common.h"
#include "ops.h"

#include <cfloat>
#include <utility>

namespace slotserve::kernels {

namespace {

constexpr int64_t INT16_MAX_Q = 32767;
// NOTE: a lane adds 2 products of at most 127 * 32767 per 32 inputs; flushing the int32
// lanes to float every FLUSH_EVERY inputs keeps them below 2^31 whatever the values.
constexpr int64_t FLUSH_EVERY = 4096;
// NOTE: AVX2's lanes are half as many, so a lane adds 2 products per 16 inputs: flushed twice
// as often, the same bound (512 products of at most 128 * 32767 < 2^31).
constexpr int64_t FLUSH_EVERY_AVX2 = FLUSH_EVERY / 2;
// NOTE: the weights are read once per step, straight from memory: asking for the bytes 4 KB
// ahead (later in this row or in the next rows) ran the model's int8 matmuls in 7.3 ms
// instead of 10.5 here (benchmarks/PERF.md). A prefetch past the end never faults.
constexpr int64_t PREFETCH_BYTES = 4096;

// x (T, in) fp32 -> int16 (T, in) and each row's scale, x ~= q * scale.
std::pair<torch::Tensor, torch::Tensor> quantize_rows_int16(const torch::Tensor& x) {
  const int64_t rows = x.size(0), in = x.size(1);
  auto q = torch::empty({rows, in}, x.options().dtype(kInt16));
  auto scales = torch::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  int16_t* qp = q.data_ptr<int16_t>();
  float* sp = scales.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * in;
    float top = 0.f, sum = 0.f;  // sum: NaN or inf if any x is (max would skip a NaN)
#pragma omp simd reduction(max : top) reduction(+ : sum)
    for (int64_t i = 0; i < in; ++i) {
      top = std::max(top, std::abs(xr[i]));
      sum += xr[i] * 0.f;
    }
    // NOTE: a non-finite row gets a NaN scale (its outputs NaN, as torch's would be); a
    // row too small to scale is a row of zeros.
    const bool usable = std::isfinite(sum) && top >= FLT_MIN;
    sp[r] = !std::isfinite(sum) ? NAN : usable ? top / INT16_MAX_Q : 0.f;
    const float inv = usable ? INT16_MAX_Q / top : 0.f;
#pragma omp simd
    for (int64_t i = 0; i < in; ++i) qp[r * in + i] = int16_t(std::nearbyint(xr[i] * inv));
  }
  return {q, scales};
}

#if defined(__AVX2__) && !defined(__AVX512BW__)
// The sum of a vector's 8 floats.
inline float sum_lanes(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}
#endif

// sum_i w[i] * x_t[i] for `tokens` (1..4) int16 rows x_t, as floats; one pass over w.
template <int TOKENS>
void dot_int8_int16(const int8_t* w, const int16_t* x, int64_t in, float* out) {
  int64_t i = 0;
#if defined(__AVX512BW__)
  __m512 total[TOKENS];
  for (int t = 0; t < TOKENS; ++t) total[t] = _mm512_setzero_ps();
  while (i + 32 <= in) {
    __m512i lanes[TOKENS];
    for (int t = 0; t < TOKENS; ++t) lanes[t] = _mm512_setzero_si512();
    const int64_t stop = std::min(in, i + FLUSH_EVERY);
    for (; i + 32 <= stop; i += 32) {
      __builtin_prefetch(w + i + PREFETCH_BYTES);
      const __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + i)));
      for (int t = 0; t < TOKENS; ++t) {
        const __m512i x16 = _mm512_loadu_si512(x + t * in + i);
#if defined(__AVX512VNNI__)
        lanes[t] = _mm512_dpwssd_epi32(lanes[t], w16, x16);
#else
        lanes[t] = _mm512_add_epi32(lanes[t], _mm512_madd_epi16(w16, x16));
#endif
      }
    }
    for (int t = 0; t < TOKENS; ++t)
      total[t] = _mm512_add_ps(total[t], _mm512_cvtepi32_ps(lanes[t]));
  }
  for (int t = 0; t < TOKENS; ++t) out[t] = _mm512_reduce_add_ps(total[t]);
#elif defined(__AVX2__)
  __m256 total[TOKENS];
  for (int t = 0; t < TOKENS; ++t) total[t] = _mm256_setzero_ps();
  while (i + 16 <= in) {
    __m256i lanes[TOKENS];
    for (int t = 0; t < TOKENS; ++t) lanes[t] = _mm256_setzero_si256();
    const int64_t stop = std::min(in, i + FLUSH_EVERY_AVX2);
    for (; i + 16 <= stop; i += 16) {
      __builtin_prefetch(w + i + PREFETCH_BYTES);
      const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + i)));
      for (int t = 0; t < TOKENS; ++t) {
        const __m256i x16 = _mm256_loadu_si256((const __m256i*)(x + t * in + i));
        lanes[t] = _mm256_add_epi32(lanes[t], _mm256_madd_epi16(w16, x16));
      }
    }
    for (int t = 0; t < TOKENS; ++t)
      total[t] = _mm256_add_ps(total[t], _mm256_cvtepi32_ps(lanes[t]));
  }
  for (int t = 0; t < TOKENS; ++t) out[t] = sum_lanes(total[t]);
#else
  for (int t = 0; t < TOKENS; ++t) out[t] = 0.f;
#endif
  // The tail (everything, without AVX2), summed exactly in int64 and added once.
  int64_t rest[TOKENS] = {};
  for (; i < in; ++i)
    for (int t = 0; t < TOKENS; ++t) rest[t] += int32_t(w[i]) * x[t * in + i];
  for (int t = 0; t < TOKENS; ++t) out[t] += float(rest[t]);
}

}  // namespace

// y (T, out) ~= x (T, in) @ (qweight (out, in) int8 * scales (out,))^T.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales) {
  check_cpu_float(x, "x");
  check_cpu_float(scales, "scales");
  TORCH_CHECK(qweight.scalar_type() == kInt8 && qweight.is_contiguous(),
              "qweight must be contiguous int8 (out, in)");
  x = x.contiguous();
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2, "x must be (T, in), qweight (out, in)");
  const int64_t tokens = x.size(0), in = x.size(1), outs = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == in, "x and qweight disagree on in_features");
  TORCH_CHECK(scales.numel() == outs && scales.is_contiguous(), "one scale per output");
  auto [xq, x_scales] = quantize_rows_int16(x);
  auto y = torch::empty({tokens, outs}, x.options());
  const int16_t* xp = xq.data_ptr<int16_t>();
  const float* xs = x_scales.data_ptr<float>();
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* ws = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // NOTE: tokens in fours, each weight row read once per four (the x rows stay in L1).
  parallel_for(0, outs, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = 0; t0 < tokens; t0 += 4) {
      const int64_t n = std::min<int64_t>(4, tokens - t0);
      for (int64_t o = begin; o < end; ++o) {
        float dots[4];
        const int8_t* w = wp + o * in;
        const int16_t* x0 = xp + t0 * in;
        if (n == 4) dot_int8_int16<4>(w, x0, in, dots);
        else if (n == 3) dot_int8_int16<3>(w, x0, in, dots);
        else if (n == 2) dot_int8_int16<2>(w, x0, in, dots);
        else dot_int8_int16<1>(w, x0, in, dots);
        for (int64_t t = 0; t < n; ++t) yp[(t0 + t) * outs + o] = dots[t] * xs[t0 + t] * ws[o];
      }
    }
  });
  return y;
}

}  // namespace slotserve::kernels
