// ---- fp32 linear over weight panels ---------------------------------------------------
// pack_panels and panel_linear; the layout, and why, in panels.h.

#include "ops.h"
#include "panels.h"

#include <utility>
#include <vector>

namespace slotserve::kernels {

// weight (out, in), any strides -> panels (ceil(out / 32), in, 32), the last one padded with
// zeros: panels[p, k, j] = weight[32 p + j, k]; into `out` where given (a part of the
// model's arena). One pass, panels in parallel (a model's load packs every linear: the torch
// ops this replaces made four copies of each weight).
torch::Tensor pack_panels(torch::Tensor weight, c10::optional<torch::Tensor> out) {
  TORCH_CHECK(weight.dim() == 2, "weight must be (out, in)");
  const int64_t outs = weight.size(0), in = weight.size(1);
  const int64_t panels = (outs + PANEL_WIDTH - 1) / PANEL_WIDTH;
  torch::Tensor packed = packed_destination(out, {panels, in, PANEL_WIDTH}, kFloat32);
  const int64_t out_stride = weight.stride(0), in_stride = weight.stride(1);
  float* dst = packed.data_ptr<float>();
  with_weight_values(weight, [&](const auto* w) {
    parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> block(PANEL_WIDTH * PACK_INPUTS);  // (outputs, inputs), widened
      for (int64_t p = begin; p < end; ++p) {
        float* panel = dst + p * in * PANEL_WIDTH;  // (in, PANEL_WIDTH)
        for (int64_t k0 = 0; k0 < in; k0 += PACK_INPUTS) {
          const int64_t n = std::min(PACK_INPUTS, in - k0);
          widen_block(w, out_stride, in_stride, p * PANEL_WIDTH, PANEL_WIDTH, outs, in, k0, n,
                      block.data());
          for (int64_t k = 0; k < n; ++k)
            for (int64_t j = 0; j < PANEL_WIDTH; ++j)
              panel[(k0 + k) * PANEL_WIDTH + j] = block[j * n + k];
        }
      }
    });
  });
  return packed;
}

namespace {

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// acc[r][v] += x[r, k_begin : k_end] . panel[k_begin : k_end, first + 8 v : + 8] for ROWS
// rows: VECS vectors of 8 outputs a row.
template <int ROWS, int VECS>
__attribute__((always_inline)) inline void walk_inputs_avx2(
    const float* x, const float* panel, int64_t in, int first, int64_t k_begin, int64_t k_end,
    __m256 (&acc)[ROWS][VECS]) {
  for (int64_t k = k_begin; k < k_end; ++k) {
    const float* w = panel + k * PANEL_WIDTH + first;  // input k's 8 VECS weights
    _mm_prefetch(reinterpret_cast<const char*>(w) + PANEL_PREFETCH_BYTES,
                 panel_prefetch_hint<ROWS>());
    if constexpr (VECS == 4)
      _mm_prefetch(reinterpret_cast<const char*>(w) + PANEL_PREFETCH_BYTES + 64,
                   panel_prefetch_hint<ROWS>());
    __m256 wv[VECS];
    SLOTSERVE_UNROLL
    for (int v = 0; v < VECS; ++v) wv[v] = _mm256_loadu_ps(w + 8 * v);
    SLOTSERVE_UNROLL
    for (int r = 0; r < ROWS; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * in + k);
      SLOTSERVE_UNROLL
      for (int v = 0; v < VECS; ++v) acc[r][v] = _mm256_fmadd_ps(a, wv[v], acc[r][v]);
    }
  }
}

// The AVX2 tile of up to PANEL_FULL_WIDTH_ROWS rows: the panel's 32 outputs at once (more
// walk the panel in halves, panel_halves_avx2).
template <int ROWS>
void panel_tile_avx2(const float* x, const float* panel, int64_t in, float* y, int64_t outs,
                     int64_t cols) {
  __m256 acc[ROWS][4];
  SLOTSERVE_UNROLL
  for (int r = 0; r < ROWS; ++r)
    SLOTSERVE_UNROLL
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  walk_inputs_avx2<ROWS, 4>(x, panel, in, 0, 0, in, acc);
  store_panel_vectors_avx2<ROWS, 4>(acc, y, outs, 0, cols);
}

// y (tokens, outs)[:, :cols] = x (tokens, in) . one panel for tokens > PANEL_FULL_WIDTH_ROWS
// (panels.h's walk_panel_in_halves_avx2).
void panel_halves_avx2(const float* x, const float* panel, int64_t in, float* y, int64_t outs,
                       int64_t cols, int64_t tokens) {
  walk_panel_in_halves_avx2(
      tokens, in, y, outs, cols,
      [&]<int ROWS>(int64_t row, int first, int64_t begin, int64_t end,
                    __m256 (&acc)[ROWS][2]) __attribute__((always_inline)) {
        walk_inputs_avx2<ROWS, 2>(x + row * in, panel, in, first, begin, end, acc);
      });
}
#endif

// y[r, :cols] = x[r, :] . panel for ROWS rows of x (row stride in), y's row stride outs.
template <int ROWS>
void panel_tile(const float* x, const float* panel, int64_t in, float* y, int64_t outs,
                int64_t cols) {
#if defined(__AVX512F__)
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; ++k) {
    const float* w = panel + k * PANEL_WIDTH;  // input k's 32 weights: two cache lines
    _mm_prefetch(reinterpret_cast<const char*>(w) + PANEL_PREFETCH_BYTES,
                 panel_prefetch_hint<ROWS>());
    _mm_prefetch(reinterpret_cast<const char*>(w) + PANEL_PREFETCH_BYTES + 64,
                 panel_prefetch_hint<ROWS>());
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * in + k]);
      acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
    }
  }
  store_panel_tile<ROWS>(acc, y, outs, cols);
#elif defined(__AVX2__) && defined(__FMA__)
  // NOTE: only tiles of up to PANEL_FULL_WIDTH_ROWS come here (panel_linear_into)
  panel_tile_avx2<std::min(ROWS, PANEL_FULL_WIDTH_ROWS)>(x, panel, in, y, outs, cols);
#else
  // The same sums in the same order, without AVX-512 or AVX2 (fma keeps each step's rounding).
  for (int r = 0; r < ROWS; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      float sum = 0.f;
      for (int64_t k = 0; k < in; ++k)
        sum = std::fma(x[r * in + k], panel[k * PANEL_WIDTH + j], sum);
      y[r * outs + j] = sum;
    }
#endif
}

template <int... R>
void panel_tile_of(int rows, const float* x, const float* panel, int64_t in, float* y,
                   int64_t outs, int64_t cols, std::integer_sequence<int, R...>) {
  ((rows == R + 1 ? (panel_tile<R + 1>(x, panel, in, y, outs, cols), 0) : 0), ...);
}

}  // namespace

// Whether panel_tile runs vectorised, AVX-512 or AVX2 + FMA (else the plain loops: right,
// but slower than MKL's GEMM, so model/linear_kernels.py then picks MKL).
bool panel_linear_vectorised() {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return true;
#else
  return false;
#endif
}

// y (T, out) = x (T, in) @ W^T, W given as pack_panels(W (out, in)).
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t out_features) {
  check_cpu_float(x, "x");
  check_cpu_float(panels, "panels");
  x = x.contiguous();
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == PANEL_WIDTH &&
                  panels.is_contiguous(), "x must be (T, in), panels from pack_panels");
  const int64_t tokens = x.size(0), in = x.size(1), num_panels = panels.size(0);
  TORCH_CHECK(panels.size(1) == in, "x and panels disagree on in_features");
  TORCH_CHECK(out_features > (num_panels - 1) * PANEL_WIDTH &&
                  out_features <= num_panels * PANEL_WIDTH, "out_features does not fit panels");
  auto y = torch::empty({tokens, out_features}, x.options());
  panel_linear_into(x.data_ptr<float>(), tokens, in, panels.data_ptr<float>(), num_panels,
                    out_features, y.data_ptr<float>());
  return y;
}

// y (tokens, out) = x (tokens, in) @ W^T on raw pointers (panels of in rows each).
void panel_linear_into(const float* x, int64_t tokens, int64_t in, const float* panels,
                       int64_t num_panels, int64_t out_features, float* y) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if (tokens > PANEL_FULL_WIDTH_ROWS) {
    for_each_panel(num_panels, out_features, [&](int64_t p, int64_t cols) {
      panel_halves_avx2(x, panels + p * in * PANEL_WIDTH, in, y + p * PANEL_WIDTH,
                        out_features, cols, tokens);
    });
    return;
  }
#endif
  for_each_panel_tile(tokens, num_panels, out_features,
                      [&](int64_t p, int64_t row, int rows, int64_t cols) {
    panel_tile_of(rows, x + row * in, panels + p * in * PANEL_WIDTH, in,
                  y + row * out_features + p * PANEL_WIDTH, out_features, cols,
                  std::make_integer_sequence<int, PANEL_TILE_ROWS>{});
  });
}

}  // namespace slotserve::kernels
