// ---- bf16 panels on AMX (many rows) ---------------------------------------------------
// At 64+ rows a step is compute-bound: AMX's tile multiply (TDPBF16PS: a 16 x 32 bf16 tile
// of x times a 32 x 16 tile of weights into 16 x 16 fp32 sums) does in one instruction
// what takes 32 FMAs. The weight tiles are read straight from the bf16 panels (16 input
// pairs x 16 outputs, row stride one panel row), x is rounded to bf16 (round to nearest
// even), and the sums stay fp32 to the output. NOTE: like the vdpbf16ps mode each row's
// sums do not depend on the other rows (batch invariant among AMX calls), but they differ
// from the fp32-activation mode's: a caller that switches mode by row count gives up bit-
// for-bit batch invariance across that switch.

#include "ops.h"
#include "panels.h"

#include <ATen/cpu/Utils.h>

namespace slotserve::kernels {

namespace {

constexpr int64_t AMX_ROWS = 16, AMX_PAIRS = 16;  // one tile: 16 rows x 16 input pairs

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: sums (row block 0/1 x output half 0/1); 4, 5: x of row block 0/1; 6, 7: weights
// of output half 0/1. Sixteen input pairs per step (the panels are padded to that).
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// NOTE: an x tile's 16 rows are loaded at the row stride; a stride of a multiple of 4 KB
// (2048 or 8192 inputs: the 1B model's) puts all 16 rows in one L1 set, which holds 12, so
// each step's x tiles come from L2. An odd number of cache lines per row puts the 16 rows
// in 16 sets: a standalone 2x2 step loop at 2048 inputs took 105-108 ns per step at 4096
// bytes, 86-88 at 4160; at 1024 inputs 70-76 at 2048 bytes, 62-64 at 2112.
int64_t x_row_stride(int64_t inputs /* a multiple of 32 */) {
  const int64_t lines = inputs / 32;  // 32 bf16 = one 64-byte line
  return lines % 2 == 0 ? inputs + 32 : inputs;
}

// NOTE: the weight tiles stream from memory (a panel is read once per call, at its first
// block of rows): asking for the panel rows AMX_PREFETCH_BYTES ahead (into the next panel
// at its end, which the same thread takes next) made the 120 layer linears of SmolLM2 at
// 16 rows 5-8% faster here (13.5-14.4 -> 12.9-13.2 ms, interleaved). Into L2 (T1), not L1:
// L1 keeps the x tiles then; the 1B model's 16 layers of linears at 64-128 rows took
// 117-185 ms against 125-211 with T0 (the same at 16-32 rows; SmolLM2's the same or better).
constexpr int64_t AMX_STEP_BYTES = AMX_PAIRS * 2 * PANEL_WIDTH * 2;  // one step's weights
constexpr int64_t AMX_PREFETCH_BYTES = 4 * AMX_STEP_BYTES;
constexpr _mm_hint AMX_PREFETCH_HINT = _MM_HINT_T1;

// y[rows0 .. rows0 + 16 * ROW_TILES) x [p * 32, +cols) for ROW_TILES (1 or 2) tiles of 16
// rows of xb (bf16 rows of stride ldx elements, padded with zero rows), the weights of one
// panel; prefetch: ask for the weights ahead (the panel's first block of rows: later blocks
// find them in cache). NOTE: a block of 16 rows or fewer takes one row tile: half the tile
// multiplies and one load fewer a step for the same weight stream (the 1B model's linears
// at 16 rows 82-85 ms against 89, at 48 rows 109-115 against 122); a row's sums are the
// same either way (each sum tile sees the same multiplies in the same order).
template <int ROW_TILES>
void amx_panel_block(const uint16_t* xb, int64_t ldx, const uint16_t* panel, int64_t pairs16,
                     float* tmp /* 32 x 32 */, bool prefetch) {
  static_assert(ROW_TILES == 1 || ROW_TILES == 2, "one or two tiles of rows");
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (ROW_TILES == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kp = 0; kp < pairs16; kp += AMX_PAIRS) {
    const uint16_t* w = panel + kp * 2 * PANEL_WIDTH;
    if (prefetch) {
      const char* ahead = reinterpret_cast<const char*>(w) + AMX_PREFETCH_BYTES;
      for (int64_t line = 0; line < AMX_STEP_BYTES; line += 64)
        _mm_prefetch(ahead + line, AMX_PREFETCH_HINT);
    }
    _tile_loadd(6, w, 2 * PANEL_WIDTH * 2);
    _tile_loadd(7, w + PANEL_WIDTH, 2 * PANEL_WIDTH * 2);
    _tile_loadd(4, xb + 2 * kp, ldx * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (ROW_TILES == 2) {
      _tile_loadd(5, xb + AMX_ROWS * ldx + 2 * kp, ldx * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, tmp, 32 * 4);
  _tile_stored(1, tmp + 16, 32 * 4);
  if constexpr (ROW_TILES == 2) {
    _tile_stored(2, tmp + 16 * 32, 32 * 4);
    _tile_stored(3, tmp + 16 * 32 + 16, 32 * 4);
  }
}
#endif

}  // namespace

// Whether AMX-BF16 runs here: built with it, and the OS lets this process use the tiles.
bool amx_bf16_usable() {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  static const bool usable = at::cpu::init_amx();
  return usable && !g_force_plain_loops;
#else
  return false;
#endif
}

// y (T, out) = bf16(x) @ W^T on AMX, W as pack_panels_bf16(W); needs amx_bf16_usable().
torch::Tensor panel_linear_bf16_amx(torch::Tensor x, torch::Tensor panels,
                                    int64_t out_features) {
  TORCH_CHECK(amx_bf16_usable(), "AMX-BF16 is not usable here");
  x = x.contiguous();
  check_bf16_panels(x, panels, out_features);
  const int64_t tokens = x.size(0), in = x.size(1), num_panels = panels.size(0);
  const int64_t pairs16 = panels.size(1);
  auto y = torch::empty({tokens, out_features}, x.options());
  if (tokens == 0) return y;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  // x in bf16, zero-padded to a multiple of 16 rows (a last block of 16 rows or fewer reads
  // one row tile) and of 32 inputs
  const int64_t blocks = (tokens + 2 * AMX_ROWS - 1) / (2 * AMX_ROWS);
  const int64_t padded_rows = (tokens + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
  const int64_t ldx = x_row_stride(2 * pairs16);
  auto xb = torch::empty({padded_rows, ldx}, x.options().dtype(torch::kBFloat16));
  uint16_t* xbp = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
  round_rows_to_bf16(x.data_ptr<float>(), tokens, in, xbp, padded_rows, ldx);
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float tmp[2 * AMX_ROWS * PANEL_WIDTH];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(PANEL_WIDTH, out_features - p * PANEL_WIDTH);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t rows = std::min(2 * AMX_ROWS, tokens - b * 2 * AMX_ROWS);
        const uint16_t* xblock = xbp + b * 2 * AMX_ROWS * ldx;
        const uint16_t* panel = pp + p * pairs16 * 2 * PANEL_WIDTH;
        if (rows <= AMX_ROWS)
          amx_panel_block<1>(xblock, ldx, panel, pairs16, tmp, b == 0);
        else
          amx_panel_block<2>(xblock, ldx, panel, pairs16, tmp, b == 0);
        for (int64_t r = 0; r < rows; ++r)
          std::copy_n(tmp + r * PANEL_WIDTH, cols,
                      yp + (b * 2 * AMX_ROWS + r) * out_features + p * PANEL_WIDTH);
      }
    }
    _tile_release();
  });
#endif
  return y;
}

}  // namespace slotserve::kernels
