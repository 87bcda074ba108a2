// Fused per-token ops: RMSNorm, silu(gate) * up, rotate-half RoPE; each row's argmax.
//
// At batch 1 a decode step of SmolLM2-135M spent about a third of its time outside the
// matmuls, in some 25 small torch ops per layer (RMSNorm alone is 9 ops in torch 2.13's CPU
// build); these kernels (and the paged attention's) do the same math in one pass each.

#include "common.h"
#include "ops.h"

namespace slotserve::kernels {

namespace {

// yr (H,) = xr / rms(xr) * weight.
inline void rms_norm_row(const float* xr, const float* wp, float* yr, int64_t hidden,
                         double eps) {
  const float inv = 1.f / std::sqrt(dot(xr, xr, hidden) / hidden + float(eps));
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) yr[i] = xr[i] * inv * wp[i];
}

void check_rms_norm(const torch::Tensor& x, const torch::Tensor& weight) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && weight.numel() == x.size(1), "x must be (T, H), weight (H,)");
  check_cpu_float(weight, "weight");
}

// The index of x's first maximum, or of its first NaN if it holds one (numpy's and
// torch's argmax). Sixteen lanes each keep their first maximum; the first lane of the
// overall maximum wins; a NaN sends the row to the scalar loop.
inline int64_t argmax_row(const float* x, int64_t n) {
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 best = _mm512_loadu_ps(x);
    __m512i index = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i best_at = index;
    const __m512i sixteen = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    int64_t i = 16;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      index = _mm512_add_epi32(index, sixteen);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 above = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, above, v);
      best_at = _mm512_mask_mov_epi32(best_at, above, index);
    }
    if (!nan) {
      float top = _mm512_reduce_max_ps(best);
      const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
      int64_t at = _mm512_mask_reduce_min_epi32(at_top, best_at);
      for (; i < n; ++i) {
        if (std::isnan(x[i])) return i;
        if (x[i] > top) top = x[i], at = i;
      }
      return at;
    }
  }
#endif
  int64_t at = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[at]) at = i;
  }
  return at;
}

}  // namespace

// logits (S, V) fp32 -> (S,) int64: each row's argmax (argmax_row), the rows in parallel.
torch::Tensor argmax_rows(torch::Tensor logits) {
  check_cpu_float(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be (S, V), V > 0");
  TORCH_CHECK(logits.size(1) < (int64_t(1) << 31), "at most 2^31 - 1 logits a row");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(kInt64));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(lp + r * vocab, vocab);
  });
  return out;
}

// y (rows, H) = x / rms(x) * weight, row by row.
void rms_norm_rows(const float* x, const float* weight, float* y, int64_t rows, int64_t hidden,
                   double eps) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rms_norm_row(x + r * hidden, weight, y + r * hidden, hidden, eps);
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rms_norm(x, weight);
  x = x.contiguous();
  weight = weight.contiguous();
  auto y = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), x.size(0),
                x.size(1), eps);
  return y;
}

// x += delta in place, then y (rows, H) = rms_norm(x, weight): a layer's residual add and
// the norm after it in one pass (and one call). NOTE: the same fp32 add and the same norm as
// `x + delta` then rms_norm, to the last bit (tests/model/test_fused_ops.py).
void add_rms_norm_rows(float* x, const float* delta, const float* weight, float* y,
                       int64_t rows, int64_t hidden, double eps) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x + r * hidden;
      const float* dr = delta + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) xr[i] += dr[i];
      rms_norm_row(xr, weight, y + r * hidden, hidden, eps);
    }
  });
}

torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor delta, torch::Tensor weight,
                            double eps) {
  check_rms_norm(x, weight);
  check_cpu_float(delta, "delta");
  TORCH_CHECK(x.is_contiguous() && delta.sizes() == x.sizes(),
              "x must be contiguous, delta of x's shape");
  delta = delta.contiguous();
  weight = weight.contiguous();
  auto y = torch::empty_like(x);
  add_rms_norm_rows(x.data_ptr<float>(), delta.data_ptr<float>(), weight.data_ptr<float>(),
                    y.data_ptr<float>(), x.size(0), x.size(1), eps);
  return y;
}

// gate_up (rows, 2I) -> silu(gate) * up (rows, I).
void silu_mul_rows(const float* gate_up, float* y, int64_t rows, int64_t inter) {
  parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gate_up + r * 2 * inter;
      const float* up = gate + inter;
      float* yr = y + r * inter;
#if defined(__AVX2__) && defined(__FMA__)
      // NOTE: gcc left this loop scalar (vec_exp's std::nearbyint): SmolLM2's 30 layers took
      // 0.21 ms at 1 row, 9.4 ms at 64 on a Zen 3 (0.09, 4.7 here). The last lanes masked:
      // every element through exp8.
      for (int64_t i = 0; i < inter; i += 8) {
        const __m256i lanes = lanes_below(inter - i);
        const __m256 g = _mm256_maskload_ps(gate + i, lanes);
        const __m256 e = exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.f)));  // exp(-g)
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
        _mm256_maskstore_ps(yr + i, lanes,
                            _mm256_mul_ps(silu, _mm256_maskload_ps(up + i, lanes)));
      }
#else
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) yr[i] = gate[i] / (1.f + vec_exp(-gate[i])) * up[i];
#endif
    }
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_cpu_float(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be (T, 2I)");
  gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto y = torch::empty({rows, inter}, gate_up.options());
  silu_mul_rows(gate_up.data_ptr<float>(), y.data_ptr<float>(), rows, inter);
  return y;
}

// Rotate-half RoPE in place: each of `heads` heads (2 * half wide) of each token, by the
// token's cos, sin (half each, token after token).
void rotary_rows(float* x, int64_t tokens, int64_t heads, int64_t half, int64_t token_stride,
                 int64_t head_stride, const float* cos, const float* sin) {
  parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = x + t * token_stride + h * head_stride;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

// x: (T, n, hd) with a contiguous last dim (a view into the qkv output is fine); cos, sin:
// (T, hd/2) of each token's position.
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be (T, n, hd) with unit stride in hd");
  const int64_t tokens = x.size(0), half = x.size(2) / 2;
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even");
  check_cpu_float(cos, "cos");
  check_cpu_float(sin, "sin");
  TORCH_CHECK(cos.numel() == tokens * half && sin.numel() == tokens * half,
              "cos and sin must hold (T, hd/2) values");
  cos = cos.contiguous();
  sin = sin.contiguous();
  rotary_rows(x.data_ptr<float>(), tokens, x.size(1), half, x.stride(0), x.stride(1),
              cos.data_ptr<float>(), sin.data_ptr<float>());
}

}  // namespace slotserve::kernels
