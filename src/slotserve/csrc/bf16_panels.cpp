// ---- bf16 weight panels, fp32 accumulation ------------------------------------------
// The same panels of 32 outputs, with the weights rounded to bfloat16: half the bytes of
// the fp32 panels, which is what a decode step with few rows waits for. Input pairs are
// interleaved (the layout AVX512_BF16's vdpbf16ps multiplies): panel row kp holds, for each
// of the 32 outputs j, the weights of inputs 2kp and 2kp + 1 side by side, one 32-bit lane
// per output; 64 bf16 = two cache lines per input pair.
//
// Two ways to multiply (the caller picks one per layer; both keep outputs fp32):
// - fp32 activations (`bf16_activations` false): each lane is widened in registers (shift
//   or mask: a bf16 is the top half of an fp32) and multiplied by fp32 FMAs in the fp32
//   panels' order. NOTE: the result equals, to the last bit, panel_linear's on the
//   bf16-rounded weights; batch invariant like it.
// - bf16 activations (true): each row of x rounded to bf16 (round to nearest even), and
//   vdpbf16ps adds two products per lane and instruction (half the instructions). A row's
//   sums still do not depend on its batch or tile (batch invariant), but each activation
//   carries bf16's rounding (relative 2^-8) too.

#include "ops.h"
#include "panels.h"

#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

namespace slotserve::kernels {

// c10::BFloat16(f).x (round to nearest even; a NaN: 0x7FC0), written without a branch so
// that a loop of them vectorises.
inline uint16_t bf16_bits(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (u + ((u >> 16) & 1) + UINT32_C(0x7FFF)) >> 16;
  return (u & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000) ? uint16_t(0x7FC0)
                                                            : uint16_t(rounded);
}

// weight (out, in) fp32, bf16 or fp16, any strides -> panels (ceil(out / 32),
// padded_pairs(in), 64) bf16, zero padded: panels[p, kp, 2 j + e] = bf16(weight[32 p + j,
// 2 kp + e]), rounded to nearest even as torch's .to(bfloat16) (c10::BFloat16's conversion);
// into `out` where given. One pass, panels in parallel.
torch::Tensor pack_panels_bf16(torch::Tensor weight, c10::optional<torch::Tensor> out) {
  TORCH_CHECK(weight.dim() == 2, "weight must be (out, in)");
  const int64_t outs = weight.size(0), in = weight.size(1);
  const int64_t panels = (outs + PANEL_WIDTH - 1) / PANEL_WIDTH, pairs = padded_pairs(in);
  torch::Tensor packed =
      packed_destination(out, {panels, pairs, 2 * PANEL_WIDTH}, torch::kBFloat16);
  const int64_t out_stride = weight.stride(0), in_stride = weight.stride(1);
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  with_weight_values(weight, [&](const auto* w) {
    parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> block(PANEL_WIDTH * PACK_INPUTS);  // (outputs, inputs), widened
      std::vector<uint16_t> rounded(PANEL_WIDTH * PACK_INPUTS);  // the same, in bf16
      for (int64_t p = begin; p < end; ++p) {
        // (pairs, PANEL_WIDTH) of two bf16s: a pair of inputs of one output, 32 bits
        uint32_t* panel = reinterpret_cast<uint32_t*>(dst + p * pairs * 2 * PANEL_WIDTH);
        // NOTE: PACK_INPUTS is even: a block holds whole pairs (the padding's are zeros)
        for (int64_t k0 = 0; k0 < 2 * pairs; k0 += PACK_INPUTS) {
          const int64_t n = std::min(PACK_INPUTS, 2 * pairs - k0);
          widen_block(w, out_stride, in_stride, p * PANEL_WIDTH, PANEL_WIDTH, outs, in, k0, n,
                      block.data());
          for (int64_t i = 0; i < PANEL_WIDTH * n; ++i) rounded[i] = bf16_bits(block[i]);
          for (int64_t q = 0; q < n / 2; ++q)  // pair (k0 / 2 + q): inputs k0 + 2q, + 1
            for (int64_t j = 0; j < PANEL_WIDTH; ++j) {
              uint32_t both;
              std::memcpy(&both, &rounded[j * n + 2 * q], sizeof both);
              panel[(k0 / 2 + q) * PANEL_WIDTH + j] = both;
            }
        }
      }
    });
  });
  return packed;
}

// x (T, in) fp32 and panels from pack_panels_bf16 of a weight (out_features, in): the
// checks both bf16 matmuls (widened or on AMX) make before reading anything.
void check_bf16_panels(const torch::Tensor& x, const torch::Tensor& panels,
                       int64_t out_features) {
  check_cpu_float(x, "x");
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == torch::kBFloat16,
              "panels must be bfloat16 on the CPU");
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == 2 * PANEL_WIDTH &&
                  panels.is_contiguous(), "x must be (T, in), panels from pack_panels_bf16");
  TORCH_CHECK(panels.size(1) == padded_pairs(x.size(1)), "x and panels disagree on in_features");
  const int64_t num_panels = panels.size(0);
  TORCH_CHECK(out_features > (num_panels - 1) * PANEL_WIDTH &&
                  out_features <= num_panels * PANEL_WIDTH, "out_features does not fit panels");
}

bool g_force_plain_loops = false;  // NOTE: see its declaration in panels.h

// NOTE: written here rather than by torch ops (zeros, then a narrowed copy_): those cost
// ~10 us of a 32-row call's overhead.
void round_rows_to_bf16(const float* x, int64_t tokens, int64_t in, uint16_t* xb,
                        int64_t rows, int64_t ldx) {
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* out = xb + r * ldx;
    int64_t i = 0;
    if (r < tokens) {
      const float* row = x + r * in;
#if defined(__AVX512BF16__)
      for (; i + 16 <= in; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + i)));
#endif
      for (; i < in; ++i) out[i] = c10::BFloat16(row[i]).x;
    }
    std::fill(out + i, out + ldx, uint16_t(0));
  }
}

namespace {

inline float bf16_bits_to_float(uint16_t bits) {
  return std::bit_cast<float>(uint32_t(bits) << 16);
}

// The plain loops of both modes: input by input, fma in order. x: fp32 rows (row stride in)
// or, in bf16 mode, rows of bf16 bits (row stride 2 * pairs).
void panel_tile_bf16_plain(int rows, const float* x, const uint16_t* xb, const uint16_t* panel,
                           int64_t in, float* y, int64_t outs, int64_t cols) {
  const int64_t pairs = (in + 1) / 2;
  for (int r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      float sum = 0.f;
      for (int64_t k = 0; k < in; ++k) {
        const float a = xb ? bf16_bits_to_float(xb[r * 2 * pairs + k]) : x[r * in + k];
        const float w = bf16_bits_to_float(panel[(k / 2) * 2 * PANEL_WIDTH + 2 * j + k % 2]);
        sum = std::fma(a, w, sum);
      }
      y[r * outs + j] = sum;
    }
}

#if defined(__AVX512F__)
// y[r, :cols] = x[r, :] . panel for ROWS rows of fp32 x, widening the bf16 weights.
template <int ROWS>
void panel_tile_bf16_widen(const float* x, const uint16_t* panel, int64_t in, float* y,
                           int64_t outs, int64_t cols) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  const int64_t pairs = (in + 1) / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const uint16_t* w = panel + kp * 2 * PANEL_WIDTH;  // two cache lines
    _mm_prefetch(reinterpret_cast<const char*>(w) + PANEL_PREFETCH_BYTES,
                 panel_prefetch_hint<ROWS>());
    _mm_prefetch(reinterpret_cast<const char*>(w) + PANEL_PREFETCH_BYTES + 64,
                 panel_prefetch_hint<ROWS>());
    const __m512i v0 = _mm512_loadu_si512(w), v1 = _mm512_loadu_si512(w + 32);
    const int64_t k = 2 * kp;
    {  // input k: the low halves, shifted into place
      const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
      const __m512 w1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
      for (int r = 0; r < ROWS; ++r) {
        const __m512 a = _mm512_set1_ps(x[r * in + k]);
        acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
      }
    }
    if (k + 1 < in) {  // input k + 1: the high halves, masked
      const __m512 w0 = _mm512_castsi512_ps(_mm512_and_si512(v0, high));
      const __m512 w1 = _mm512_castsi512_ps(_mm512_and_si512(v1, high));
      for (int r = 0; r < ROWS; ++r) {
        const __m512 a = _mm512_set1_ps(x[r * in + k + 1]);
        acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
      }
    }
  }
  store_panel_tile<ROWS>(acc, y, outs, cols);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// acc[r][v] += x[r, 2 kp : 2 kp + 2] . the panel's outputs first + 8 v .. + 8 for the input
// pairs kp_begin .. kp_end, ROWS rows of fp32 x, widening the bf16 weights: VECS vectors of
// 8 outputs (8 input pairs) a row.
template <int ROWS, int VECS>
__attribute__((always_inline)) inline void walk_pairs_bf16_widen_avx2(
    const float* x, const uint16_t* panel, int64_t in, int first, int64_t kp_begin,
    int64_t kp_end, __m256 (&acc)[ROWS][VECS]) {
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  for (int64_t kp = kp_begin; kp < kp_end; ++kp) {
    const uint16_t* w = panel + kp * 2 * PANEL_WIDTH + 2 * first;  // 32 bytes a vector
    _mm_prefetch(reinterpret_cast<const char*>(w) + PANEL_PREFETCH_BYTES,
                 panel_prefetch_hint<ROWS>());
    if constexpr (VECS == 4)
      _mm_prefetch(reinterpret_cast<const char*>(w) + PANEL_PREFETCH_BYTES + 64,
                   panel_prefetch_hint<ROWS>());
    const int64_t k = 2 * kp;
    {  // input k: the low halves, shifted into place
      __m256 wv[VECS];
      SLOTSERVE_UNROLL
      for (int v = 0; v < VECS; ++v)
        wv[v] = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * v)), 16));
      SLOTSERVE_UNROLL
      for (int r = 0; r < ROWS; ++r) {
        const __m256 a = _mm256_broadcast_ss(x + r * in + k);
        SLOTSERVE_UNROLL
        for (int v = 0; v < VECS; ++v) acc[r][v] = _mm256_fmadd_ps(a, wv[v], acc[r][v]);
      }
    }
    if (k + 1 < in) {  // input k + 1: the high halves, masked
      // NOTE: the same weights loaded again (from L1) through a pointer gcc cannot see is w:
      // keeping the loaded vectors for this half left 12 accumulators too few registers,
      // and gcc kept one of them on the stack (a store and reload at every input).
      const uint16_t* again = w;
      asm("" : "+r"(again));
      __m256 wv[VECS];
      SLOTSERVE_UNROLL
      for (int v = 0; v < VECS; ++v)
        wv[v] = _mm256_castsi256_ps(_mm256_and_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(again + 16 * v)), high));
      SLOTSERVE_UNROLL
      for (int r = 0; r < ROWS; ++r) {
        const __m256 a = _mm256_broadcast_ss(x + r * in + k + 1);
        SLOTSERVE_UNROLL
        for (int v = 0; v < VECS; ++v) acc[r][v] = _mm256_fmadd_ps(a, wv[v], acc[r][v]);
      }
    }
  }
}

// The AVX2 tile of up to PANEL_FULL_WIDTH_ROWS rows: the panel's 32 outputs at once.
// NOTE: more rows walk the panel in halves, in panel_bf16_widen_halves: only the fewer
// come here (panel_linear_bf16_rows).
template <int ROWS>
void panel_tile_bf16_widen(const float* x, const uint16_t* panel, int64_t in, float* y,
                           int64_t outs, int64_t cols) {
  constexpr int rows = std::min(ROWS, PANEL_FULL_WIDTH_ROWS);
  __m256 acc[rows][4];
  SLOTSERVE_UNROLL
  for (int r = 0; r < rows; ++r)
    SLOTSERVE_UNROLL
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  walk_pairs_bf16_widen_avx2<rows, 4>(x, panel, in, 0, 0, (in + 1) / 2, acc);
  store_panel_vectors_avx2<rows, 4>(acc, y, outs, 0, cols);
}

// y (tokens, outs)[:, :cols] = x (tokens, in) . one panel for tokens > PANEL_FULL_WIDTH_ROWS
// (panels.h's walk_panel_in_halves_avx2).
void panel_bf16_widen_halves(const float* x, const uint16_t* panel, int64_t in, float* y,
                             int64_t outs, int64_t cols, int64_t tokens) {
  walk_panel_in_halves_avx2(
      tokens, (in + 1) / 2, y, outs, cols,
      [&]<int ROWS>(int64_t row, int first, int64_t begin, int64_t end,
                    __m256 (&acc)[ROWS][2]) __attribute__((always_inline)) {
        walk_pairs_bf16_widen_avx2<ROWS, 2>(x + row * in, panel, in, first, begin, end, acc);
      });
}
#endif

// Whether this build widens bf16 weights in vectors: AVX-512F, or AVX2 + FMA.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define SLOTSERVE_BF16_WIDEN_VECTORISED 1
#endif

#if defined(__AVX512BF16__)
// y[r, :cols] = xb[r, :] . panel for ROWS rows of bf16 x (pairs of inputs as one int32).
template <int ROWS>
void panel_tile_bf16_dot(const uint32_t* xb, const uint16_t* panel, int64_t pairs, float* y,
                         int64_t outs, int64_t cols) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const uint16_t* w = panel + kp * 2 * PANEL_WIDTH;
    _mm_prefetch(reinterpret_cast<const char*>(w) + PANEL_PREFETCH_BYTES,
                 panel_prefetch_hint<ROWS>());
    _mm_prefetch(reinterpret_cast<const char*>(w) + PANEL_PREFETCH_BYTES + 64,
                 panel_prefetch_hint<ROWS>());
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(xb[r * pairs + kp]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
    }
  }
  store_panel_tile<ROWS>(acc, y, outs, cols);
}
#endif

}  // namespace

// Which bf16 modes run vectorised here: (fp32 activations: AVX-512F or AVX2 + FMA; bf16
// activations: AVX512_BF16). Without, the plain loops: right, but slower than the fp32 panels.
std::tuple<bool, bool> panel_bf16_vectorised() {
#if defined(SLOTSERVE_BF16_WIDEN_VECTORISED)
  constexpr bool widen = true;
#else
  constexpr bool widen = false;
#endif
#if defined(__AVX512BF16__)
  constexpr bool dot = true;
#else
  constexpr bool dot = false;
#endif
  return {widen && !g_force_plain_loops, dot && !g_force_plain_loops};
}

void set_force_plain_loops(bool force) { g_force_plain_loops = force; }

namespace {

template <int... R>
void panel_tile_bf16_of(int rows, bool bf16_activations, const float* x, const uint16_t* xb,
                        const uint16_t* panel, int64_t in, float* y, int64_t outs,
                        int64_t cols, std::integer_sequence<int, R...>) {
  const int64_t pairs = (in + 1) / 2;
  if (g_force_plain_loops) {
    panel_tile_bf16_plain(rows, x, xb, panel, in, y, outs, cols);
    return;
  }
  if (bf16_activations) {
#if defined(__AVX512BF16__)
    const auto* xp = reinterpret_cast<const uint32_t*>(xb);
    ((rows == R + 1 ? (panel_tile_bf16_dot<R + 1>(xp, panel, pairs, y, outs, cols), 0) : 0),
     ...);
#else
    panel_tile_bf16_plain(rows, x, xb, panel, in, y, outs, cols);
#endif
    return;
  }
#if defined(SLOTSERVE_BF16_WIDEN_VECTORISED)
  ((rows == R + 1 ? (panel_tile_bf16_widen<R + 1>(x, panel, in, y, outs, cols), 0) : 0), ...);
#else
  panel_tile_bf16_plain(rows, x, xb, panel, in, y, outs, cols);
#endif
}

// y (tokens, out) = x @ W^T on raw pointers: x fp32 (tokens, in), or, when xb is given, its
// rows rounded to bf16 (tokens, 2 * ceil(in / 2), the odd input's partner zero).
void panel_linear_bf16_rows(const float* x, const uint16_t* xb, int64_t tokens, int64_t in,
                            const uint16_t* panels, int64_t num_panels, int64_t out_features,
                            float* y) {
  const int64_t pairs = (in + 1) / 2, pairs16 = padded_pairs(in);
#if !defined(__AVX512F__) && defined(SLOTSERVE_BF16_WIDEN_VECTORISED)
  if (xb == nullptr && !g_force_plain_loops && tokens > PANEL_FULL_WIDTH_ROWS) {
    for_each_panel(num_panels, out_features, [&](int64_t p, int64_t cols) {
      panel_bf16_widen_halves(x, panels + p * pairs16 * 2 * PANEL_WIDTH, in,
                              y + p * PANEL_WIDTH, out_features, cols, tokens);
    });
    return;
  }
#endif
  for_each_panel_tile(tokens, num_panels, out_features,
                      [&](int64_t p, int64_t row, int rows, int64_t cols) {
    panel_tile_bf16_of(rows, xb != nullptr, x + row * in, xb ? xb + row * 2 * pairs : nullptr,
                       panels + p * pairs16 * 2 * PANEL_WIDTH, in,
                       y + row * out_features + p * PANEL_WIDTH, out_features, cols,
                       std::make_integer_sequence<int, PANEL_TILE_ROWS>{});
  });
}

}  // namespace

// y (T, out) = x (T, in) @ W^T, W given as pack_panels_bf16(W (out, in)); x fp32, rounded
// to bf16 first when bf16_activations.
torch::Tensor panel_linear_bf16(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                                bool bf16_activations) {
  x = x.contiguous();
  check_bf16_panels(x, panels, out_features);
  auto y = torch::empty({x.size(0), out_features}, x.options());
  panel_linear_bf16_into(x.data_ptr<float>(), x.size(0), x.size(1),
                         reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>()),
                         panels.size(0), out_features, y.data_ptr<float>(), bf16_activations);
  return y;
}

void panel_linear_bf16_into(const float* x, int64_t tokens, int64_t in, const uint16_t* panels,
                            int64_t num_panels, int64_t out_features, float* y,
                            bool bf16_activations) {
  if (tokens == 0) return;
  if (!bf16_activations) {
    panel_linear_bf16_rows(x, nullptr, tokens, in, panels, num_panels, out_features, y);
    return;
  }
  // x rounded to bf16: (tokens, 2 * ceil(in / 2)), the odd input's partner zero.
  // NOTE: one buffer per calling thread, kept and grown: a fresh allocation of 64 rows of
  // 4864 inputs (600 KB) would be mapped and page-faulted anew on every call.
  thread_local std::vector<uint16_t> xb;
  const int64_t ldx = 2 * ((in + 1) / 2);
  if (int64_t(xb.size()) < tokens * ldx) xb.resize(tokens * ldx);
  round_rows_to_bf16(x, tokens, in, xb.data(), tokens, ldx);
  panel_linear_bf16_rows(x, xb.data(), tokens, in, panels, num_panels, out_features, y);
}

}  // namespace slotserve::kernels
