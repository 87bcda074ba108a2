// The weight-panel layout shared by panel_linear.cpp, bf16_panels.cpp and bf16_amx.cpp,
// and the loops that walk it.
//
// A decode step multiplies 1-64 rows by skinny matrices (576 wide for SmolLM2-135M). MKL's
// packed GEMM took 1.1-1.9x its 1-row time at 2-16 rows, where a step should still cost
// one read of the weights (benchmarks/PERF.md: W's matmul bound). Here the weights
// are kept in panels of 32 output columns, each panel k-major (row k holds the panel's 32
// weights of input k), and a micro-tile of up to 12 rows of x keeps 12 x 32 outputs in
// registers while it walks the panel: the weights stream from memory once per call (the
// later tiles of a panel find it in L2), with software prefetch far ahead.
//
// NOTE: every output is the same sum in the same order (input 0, 1, 2, ... fused into one
// accumulator) whatever the number of rows or which tile a row falls in: a row's result
// does not depend on the batch it is in, to the last bit (tests/model/test_linear_kernels.py).
#pragma once

#include "common.h"

namespace slotserve::kernels {

constexpr int64_t PANEL_WIDTH = 32;  // outputs per panel: two 16-float vectors
constexpr int64_t PACK_INPUTS = 128;  // inputs a packer widens at a time (even: whole pairs)
#if defined(__AVX512F__)
constexpr int PANEL_TILE_ROWS = 12;  // 12 rows x 2 vectors = 24 accumulators (of 32 zmm)
#else
// NOTE: AVX2 has 16 ymm registers of 8 floats: a tile of up to 6 rows walks the panel in
// two halves of 16 outputs, 6 rows x 2 vectors = 12 accumulators (+ 2 weight vectors and a
// broadcast of x); tiles of few rows take the panel's 32 outputs at once (4 vectors a row,
// PANEL_FULL_WIDTH_ROWS). The same sums in the same order as the AVX-512 tiles. From 6 rows
// on they ran at AVX2's peak here (~140 GFLOP/s a core on Zen 5, half the AVX-512 tiles').
constexpr int PANEL_TILE_ROWS = 6;
#endif
// AVX2: tiles of up to this many rows keep 4 vectors (the panel's 32 outputs) per row.
// NOTE: SmolLM2-135M's layer linears (2 threads, AMD EPYC Zen 5, interleaved): at 3 rows
// 9.3 ms (fp32) / 5.5 ms (bf16) with the 32 outputs at once against 11.8 / 6.6 in two
// halves; at 2 rows 9.3 / 5.0 against 11.4 / 6.0 as 1-row tiles; 1 row level.
constexpr int PANEL_FULL_WIDTH_ROWS = 3;
constexpr int64_t PANEL_PREFETCH_BYTES = 8192;  // 8 KB ahead: 4 KB was slower at 4-16 rows

// NOTE: the prefetch hint of a tile of ROWS rows depends on the CPU, not on the kernel (each
// measured with engines interleaved on one host):
// - Sapphire Rapids and later (the amx class's CPUs; gcc's -march=native defines
//   __AMX_TILE__ there): up to 8 rows into L2 only (T1), leaving the L1's few fill buffers
//   to the loads: batch-1 layer linears 9.7-10.1 -> 8.1-9.3 ms per step with T1, 4 and 8
//   rows faster too, 12 not (T0 from 9 rows).
// - Ice Lake (the avx512 class): into L1 (T0) at every row count: SmolLM2 bf16 through the
//   engine (`benchmarks.engine_ab`, 7 rounds) batch 1 x1.04-1.06, 4 rows x1.04, 8 rows x1.03,
//   fp32 batch 1 x1.06 against T1 up to 8 rows.
// - Zen 3 (the avx2 class): level either way (1 row x1.00). Zen 4/5: not measured; T0.
#if defined(__AMX_TILE__)
constexpr int PANEL_L2_PREFETCH_MAX_ROWS = 8;
#else
constexpr int PANEL_L2_PREFETCH_MAX_ROWS = 0;
#endif
template <int ROWS>
constexpr _mm_hint panel_prefetch_hint() {
  return ROWS <= PANEL_L2_PREFETCH_MAX_ROWS ? _MM_HINT_T1 : _MM_HINT_T0;
}

// The tiles a call's rows go in: as even as possible (64 rows: 11 11 11 11 10 10, not
// 12 x 5 + 4), in row order.
struct RowTiles {
  int64_t count, base, extra;
  explicit RowTiles(int64_t tokens)
      : count((tokens + PANEL_TILE_ROWS - 1) / PANEL_TILE_ROWS),
        base(count ? tokens / count : 0),
        extra(count ? tokens % count : 0) {}
  int rows(int64_t tile) const { return int(base + (tile < extra ? 1 : 0)); }
  int64_t first_row(int64_t tile) const { return tile * base + std::min(tile, extra); }
};

// fn(panel, cols) for every panel, in parallel.
template <typename Fn>
void for_each_panel(int64_t num_panels, int64_t out_features, const Fn& fn) {
  parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      fn(p, std::min(PANEL_WIDTH, out_features - p * PANEL_WIDTH));
  });
}

// tile(panel, first row, rows, cols) for every panel (in parallel) and every tile of rows.
// NOTE: a panel's tiles go in row order, whatever the thread.
template <typename Tile>
void for_each_panel_tile(int64_t tokens, int64_t num_panels, int64_t out_features,
                         const Tile& tile) {
  if (tokens == 0) return;
  const RowTiles tiles(tokens);
  for_each_panel(num_panels, out_features, [&](int64_t p, int64_t cols) {
    for (int64_t t = 0; t < tiles.count; ++t) tile(p, tiles.first_row(t), tiles.rows(t), cols);
  });
}

#if defined(__AVX512F__)
// Store a tile's ROWS x 2 accumulators into y (row stride outs), only its first cols outputs.
template <int ROWS>
inline void store_panel_tile(__m512 (&acc)[ROWS][2], float* y, int64_t outs, int64_t cols) {
  const __mmask16 low = cols >= 16 ? 0xFFFF : __mmask16((1u << cols) - 1);
  const __mmask16 high = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : __mmask16((1u << (cols - 16)) - 1);
  for (int r = 0; r < ROWS; ++r) {
    _mm512_mask_storeu_ps(y + r * outs, low, acc[r][0]);
    _mm512_mask_storeu_ps(y + r * outs + 16, high, acc[r][1]);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// NOTE: the AVX2 tiles' loops over rows and vectors unrolled before gcc decides where the
// accumulators live: left to its later unrolling, it kept them in registers but also wrote
// all of them to the stack at every input.
#define SLOTSERVE_UNROLL _Pragma("GCC unroll 16")

// Store the first n (<= 8) outputs of v at y (none where n <= 0).
inline void store_panel_outputs_avx2(float* y, __m256 v, int64_t n) {
  if (n >= 8) {
    _mm256_storeu_ps(y, v);
  } else if (n > 0) {  // lanes 0 .. n - 1
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lanes), v);
  }
}

// y[r, first : first + 8 VECS] = acc[r] for ROWS rows (row stride outs), only the panel's
// first cols outputs.
template <int ROWS, int VECS>
inline void store_panel_vectors_avx2(const __m256 (&acc)[ROWS][VECS], float* y, int64_t outs,
                                     int first, int64_t cols) {
  SLOTSERVE_UNROLL
  for (int r = 0; r < ROWS; ++r)
    SLOTSERVE_UNROLL
    for (int v = 0; v < VECS; ++v)
      store_panel_outputs_avx2(y + r * outs + first + 8 * v, acc[r][v], cols - first - 8 * v);
}

// NOTE: a tile of more rows than PANEL_FULL_WIDTH_ROWS walks the panel in two halves of 16
// outputs. One half's walk down the whole panel, then the other's from L2, then the next
// tile's, left the memory idle while they multiplied: 4-6 rows streamed at 11.6-14 GB/s
// against 18-20 at 1-3 rows (Ice Lake, the avx2 build). So a group of up to
// PANEL_GROUP_TILES tiles walks the panel together, a chunk of PANEL_CHUNK_STEPS steps (input
// pairs of bf16, inputs of fp32: 128 bytes each) at a time: the chunk in L1, each tile's
// halves over it in turn, their sums kept in memory between chunks. The panel streams once
// per group; every output is still one sum in input order.
// Ice Lake, the avx2 build, SmolLM2-135M through the engine (`benchmarks.engine_ab`,
// benchmarks/results/engine-ab-avx2-panels-icelake.txt): bf16 batch 4 x1.24, 8 x1.18, 16
// x1.02; fp32 batch 4 x1.40, 8 x1.36; batch 1 level.
// A 3072 x 576 bf16 matmul streaming from memory: 4-8 rows x1.16-1.28, 12-20 x1.07-1.08.
// Chunks of 8 or 16 steps were no faster; groups of 11 tiles slower from 12 rows.
constexpr int64_t PANEL_CHUNK_STEPS = 32;  // 4 KB of the panel
constexpr int PANEL_GROUP_TILES = 4;  // up to 24 rows; their sums 3 KB

using HalfSums = __m256[PANEL_TILE_ROWS][2];  // a tile's sums over a half: rows x 2 vectors

template <int ROWS, typename Walk>
inline void walk_half_chunk_avx2(const Walk& walk, int64_t row, int first, int64_t begin,
                                 int64_t end, HalfSums& sums) {
  __m256 acc[ROWS][2];
  SLOTSERVE_UNROLL
  for (int r = 0; r < ROWS; ++r) acc[r][0] = sums[r][0], acc[r][1] = sums[r][1];
  walk.template operator()<ROWS>(row, first, begin, end, acc);
  SLOTSERVE_UNROLL
  for (int r = 0; r < ROWS; ++r) sums[r][0] = acc[r][0], sums[r][1] = acc[r][1];
}

template <typename Walk, int... R>
inline void walk_half_chunk_of(int rows, const Walk& walk, int64_t row, int first,
                               int64_t begin, int64_t end, HalfSums& sums,
                               std::integer_sequence<int, R...>) {
  ((rows == R + 1 ? (walk_half_chunk_avx2<R + 1>(walk, row, first, begin, end, sums), 0) : 0),
   ...);
}

// One panel's outputs y (tokens, outs)[:, :cols] for tokens > PANEL_FULL_WIDTH_ROWS rows, as
// the NOTE above: walk.operator()<ROWS>(first row, first output, first step, end step,
// __m256 (&acc)[ROWS][2]) adds the steps' products of a tile's rows to acc.
template <typename Walk>
void walk_panel_in_halves_avx2(int64_t tokens, int64_t steps, float* y, int64_t outs,
                               int64_t cols, const Walk& walk) {
  const RowTiles tiles(tokens);
  const int halves = cols > 16 ? 2 : 1;
  for (int64_t group = 0; group < tiles.count; group += PANEL_GROUP_TILES) {
    const int n = int(std::min<int64_t>(PANEL_GROUP_TILES, tiles.count - group));
    HalfSums sums[PANEL_GROUP_TILES][2];
    for (int t = 0; t < n; ++t)
      for (auto& half : sums[t])
        for (auto& row : half) row[0] = row[1] = _mm256_setzero_ps();
    for (int64_t begin = 0; begin < steps; begin += PANEL_CHUNK_STEPS) {
      const int64_t end = std::min(steps, begin + PANEL_CHUNK_STEPS);
      for (int t = 0; t < n; ++t)
        for (int h = 0; h < halves; ++h)
          walk_half_chunk_of(tiles.rows(group + t), walk, tiles.first_row(group + t), 16 * h,
                             begin, end, sums[t][h],
                             std::make_integer_sequence<int, PANEL_TILE_ROWS>{});
    }
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < halves; ++h)
        for (int r = 0; r < tiles.rows(group + t); ++r)
          for (int v = 0; v < 2; ++v)
            store_panel_outputs_avx2(y + (tiles.first_row(group + t) + r) * outs + 16 * h + 8 * v,
                                     sums[t][h][r][v], cols - 16 * h - 8 * v);
  }
}
#endif

// Input pairs of a panel: ceil(in / 2), rounded up to 16 (the AMX kernel's tile of pairs;
// the other kernels stop at the last real pair).
inline int64_t padded_pairs(int64_t in) { return ((in + 1) / 2 + 15) / 16 * 16; }

// NOTE: set by a test (set_force_plain_loops) to run the plain-loop fallbacks of the bf16
// kernels on a CPU that has the instructions: the path a CPU without them takes. Defined
// in bf16_panels.cpp, read there and in bf16_amx.cpp.
// The bf16 matmuls' input checks (bf16_panels.cpp), shared with bf16_amx.cpp.
void check_bf16_panels(const torch::Tensor& x, const torch::Tensor& panels,
                       int64_t out_features);

extern bool g_force_plain_loops;

// x (tokens, in) fp32 -> xb (rows, ldx) bf16 rounded to nearest even (as torch's
// .to(torch::kBFloat16), denormals aside: flushed to zero where vectorised, as vdpbf16ps and
// the tile multiply read them anyway), zero past `in` and past `tokens`. Defined in
// bf16_panels.cpp; the bf16-activation kernels (vdpbf16ps, AMX) round x with it.
void round_rows_to_bf16(const float* x, int64_t tokens, int64_t in, uint16_t* xb,
                        int64_t rows, int64_t ldx);

}  // namespace slotserve::kernels
