// ---- GGUF weights kept as blocks of small unsigned integers x int8 (or 16-bit) activations
// Every GGUF block format the loader keeps (loader/gguf_blocks.py) is re-packed to one form:
// for each output row, blocks of B (32, or 16 for Q6_K's sub-blocks) unsigned codes u with
// a scale d and min m per block, w = d * u + m (Q8_0: u = q + 128, m = -128 d; Q4_0:
// m = -8 d; Q4_K: d = d * sc, m = -dmin * mn; ...). Codes of 4 bits (Q4_0, Q4_1, Q4_K) stay
// 4 bits, two per byte; codes of 5 or 6 bits (Q5_*, Q6_K) take 6: their low 4 bits as the
// 4-bit codes', their top 2 in a second part of the block (as llama.cpp's ql/qh); Q8_0's a
// byte. IQ4_NL's 4-bit indices q stay 4 bits too
// (format QUANT_CODES_IQ4_NL, ops.h): the kernel looks them up as its codes
// u = kvalues_iq4nl[q] + 128 (m = -128 d, as Q8_0), one byte shuffle (vpshufb) per step:
// llama.cpp's iq4_nl dot product does the same lookup, to signed values.
//
// The activations are quantized per row and block of B, a = round(x / s) with
// s = max|x| / limit, to int8 (limit 127, as llama.cpp's q8_0 and q8_K) or to 16 bits
// (`activation_bits` 16: limit 32512 = 127 * 256, each a split into int8 halves,
// a = 256 h + l, h = (a + 128) >> 8 in [-127, 127], l in [-128, 127]), so that
//   y[t, o] = sum_b s[t, b] * (d[o, b] * sum_i u[o, b, i] a[t, b, i] + m[o, b] * sum_i a[t, b, i])
// where the inner sums are exact integers: AVX512-VNNI's vpdpbusd multiplies u8 (the codes,
// unsigned by construction: no sign trick needed) by s8 (the activations, or their halves:
// sum u a = 256 sum u h + sum u l, at most 32 * 255 * 32512 < 2^31) and adds groups of four
// into int32 lanes (16-bit codes' sums pass 2^24: their conversion to float rounds, the
// same on every path). 16 bits take 8-bit codes only (the caller's choice: Q8_0, whose own
// rounding is as fine as int8 activations', linear_kernels.GGUFBlockLinear) and twice the
// multiplies.
// Layout (as llama.cpp's repacked "interleaved" formats): panels of 16 output rows; in a
// panel, block b is B / 4 steps of 64 bytes, step k holding row j's codes 4k..4k+3 at bytes
// 4j..4j+3 (4-bit: steps 2k and 2k+1 share 64 bytes, low and high nibbles; 6-bit: those
// nibbles, then B * 4 bytes where steps 4k..4k+3 share 64 bytes, 2 top bits each). One vpdpbusd per
// step adds 4 products to each of the 16 rows' lanes, with one broadcast of 4 activations:
// the lanes are outputs, there is no horizontal sum. A panel's d and m: 16 each per block,
// in one of three formats (ops.h's QuantScaleFormat): fp16 where every value of the tensor
// is one (the legacy types' d, m, -8d, -16d, -128d: GGUF's own fp16 scales, widened
// exactly); for the K-quants, factored as the file stores them: an int8 factor per block
// and row (sc, mn; Q3_K's and Q6_K's one sc, their mins being -4 d sc and -32 d sc) and an
// fp16 d and m per 256-weight super-block and row (d, -dmin; Q6_K's m -32 d), multiplied in
// the kernel (exact: an fp16 times an integer of at most 8 bits); else fp32. Rows of a tile (up to 8 activation rows) reuse each loaded (and unpacked) step.
// NOTE (batch invariance): a row's lanes see the same operations in the same order whatever
// the tile or batch it is in; the AVX2 paths (no VNNI: vpmaddubsw for codes of 4 and 6 bits,
// 8-bit codes widened to int16 for vpmaddwd) and
// the plain-loop fallback get the same exact integer sums and do the same float operations
// (fma, mul) in the same order, so all three give the same bits.

#include "common.h"
#include "ops.h"

#include <atomic>
#include <bit>
#include <cfloat>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace slotserve::kernels {

namespace {

constexpr int64_t QB_ROWS = 16;  // output rows per panel (one int32 lane each)
constexpr int QB_TILE = 8;       // activation rows sharing one pass over a panel

// Code i of row j in a block of block_len codes in format `bits` (ops.h), as the kernels
// read it: the plain loops, the row lookup, and the layout pack_quant_blocks writes.
inline uint32_t code_of(const uint8_t* block, int64_t block_len, int64_t bits, int64_t j,
                        int64_t i) {
  const int64_t k = i / 4, at = 4 * j + i % 4;
  if (bits == 8) return block[64 * k + at];
  const uint8_t packed = block[64 * (k / 2) + at];
  const uint32_t low = (k & 1) ? packed >> 4 : packed & 0x0F;
  if (bits == QUANT_CODES_IQ4_NL) return IQ4_NL_CODES[low];
  if (bits == 4) return low;
  const uint8_t top = block[block_len * 8 + 64 * (k / 4) + at];  // bits == 6
  return low | (((top >> (2 * (k % 4))) & 0x03) << 4);
}

struct QuantBlockShape {
  int64_t in, blocks, block_len, bits, panels, out;  // bits: the codes' format (ops.h)
  int64_t block_bytes() const { return block_len * QB_ROWS * quant_codes_stored_bits(bits) / 8; }
};

// Bytes of one panel's factored scales (FactoredScales) for `blocks` blocks of block_len:
// 2 factors per block and row (shared: 1), then an fp16 d and m per super-block and row.
inline int64_t factored_panel_bytes(int64_t blocks, int64_t block_len, bool shared) {
  const int64_t supers = blocks * block_len / QK_K_WEIGHTS;
  return blocks * (shared ? 1 : 2) * QB_ROWS + supers * 2 * QB_ROWS * int64_t(sizeof(c10::Half));
}

QuantBlockShape shape_of(const torch::Tensor& codes, const torch::Tensor& sm, int64_t in,
                         int64_t out_features, int64_t block_len, int64_t bits) {
  TORCH_CHECK(block_len == 16 || block_len == 32, "block_len must be 16 or 32");
  TORCH_CHECK(quant_codes_format_known(bits), "bits must be 4, 6 or 8 (or ", QUANT_CODES_IQ4_NL,
              ": IQ4_NL's indices)");
  TORCH_CHECK(codes.scalar_type() == kUInt8 && codes.is_contiguous() && codes.dim() == 3,
              "codes must come from pack_quant_blocks");
  TORCH_CHECK(sm.device().is_cpu() && sm.is_contiguous(), "scales_mins must be on the CPU");
  const int64_t format = quant_scale_format(sm);  // throws for another dtype
  QuantBlockShape s{in, codes.size(1), block_len, bits, codes.size(0), out_features};
  TORCH_CHECK(s.blocks * block_len == in, "the blocks cover ", s.blocks * block_len,
              " inputs, not ", in);
  TORCH_CHECK(codes.size(2) == s.block_bytes(), "codes do not match block_len and bits");
  if (format == QUANT_SCALES_FACTORED || format == QUANT_SCALES_FACTORED_SHARED) {
    TORCH_CHECK(in % QK_K_WEIGHTS == 0, "factored scales need whole super-blocks of ",
                QK_K_WEIGHTS, " inputs");
    const bool shared = format == QUANT_SCALES_FACTORED_SHARED;
    TORCH_CHECK(sm.dim() == 2 && sm.size(0) == s.panels &&
                    sm.size(1) == factored_panel_bytes(s.blocks, block_len, shared),
                "scales_mins must come from pack_factored_scales");
  } else {
    TORCH_CHECK(sm.dim() == 4 && sm.size(0) == s.panels && sm.size(1) == s.blocks &&
                    sm.size(2) == 2 && sm.size(3) == QB_ROWS,
                "scales_mins must come from pack_quant_blocks");
  }
  TORCH_CHECK(out_features > (s.panels - 1) * QB_ROWS && out_features <= s.panels * QB_ROWS,
              "out_features does not fit the panels");
  return s;
}

// The activations' codes' largest magnitude: 127 for int8 codes; 127 * 256 for 16-bit ones,
// so that a code's high half h = (a + 128) >> 8 stays in [-127, 127] (and its low half
// l = a - 256 h in [-128, 127]).
inline float activation_limit(bool wide) { return wide ? 127.f * 256.f : 127.f; }

// Whether a block whose largest magnitude is `top` gets codes: not where limit / top
// overflows (top below ~4e-37, or ~1e-34 for 16-bit codes: a zero times an infinite
// 1 / s is NaN, which each path would turn into a different code), nor a denormal top.
// NOTE: such a block is codes of zero and scale 0 on every path.
inline bool quantizable(float top, float limit) {
  return top >= FLT_MIN && std::isfinite(limit / top);
}

// One row's activations per block: their codes (16-bit ones as two halves), the scale and
// the codes' sum (as float: exact, at most 32 * 32512).
struct QuantizedRows {
  std::vector<int8_t> a;     // (rows, in): int8 codes, or 16-bit codes' high halves h
  std::vector<int8_t> low;   // (rows, in): 16-bit codes' low halves l (a = 256 h + l)
  std::vector<float> scale;  // (rows, blocks)
  std::vector<float> sum;    // (rows, blocks)
};

// A code -> what the kernels read: itself (int8), or its halves (wide: code = 256 h + l).
inline void store_code(int32_t code, bool wide, int8_t* high, int8_t* low) {
  if (!wide) {
    *high = int8_t(code);
    return;
  }
  const int32_t h = (code + 128) >> 8;  // NOTE: an arithmetic shift: floor, for negatives too
  *high = int8_t(h);
  *low = int8_t(code - 256 * h);
}

// One block of n activations -> its codes, scale and codes' sum: a = round(x / s) (to
// nearest even), s = max|x| / activation_limit(wide). NOTE: a non-finite block makes its
// row's outputs NaN (as the fp32 matmul's would be); a block of (near-)zeros (quantizable:
// false) is codes of zero.
void quantize_block_plain(const float* x, int64_t n, bool wide, int8_t* high, int8_t* low,
                          float* scale, float* sum) {
  float top = 0.f, probe = 0.f;  // probe: NaN if any x is NaN or inf
  for (int64_t i = 0; i < n; ++i) {
    top = std::max(top, std::abs(x[i]));
    probe += x[i] * 0.f;
  }
  const float limit = activation_limit(wide);
  const bool usable = std::isfinite(probe) && quantizable(top, limit);
  const float inv = usable ? limit / top : 0.f;
  int32_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t code = int32_t(std::min(limit, std::max(-limit, std::nearbyint(x[i] * inv))));
    store_code(code, wide, high + i, low + i);
    total += code;
  }
  *scale = !std::isfinite(probe) ? NAN : usable ? top / limit : 0.f;
  *sum = float(total);
}

// quantize_block_vector: quantize_block_plain of a finite block of 16 or 32 activations in
// vectors, the same bits: the same max, the same one product x * (limit / top) rounded to
// nearest even and clamped, the same codes (or halves), an exact integer sum. A block with a
// non-finite value goes to the plain loop (false). At batch 1 the plain loop took ~1.7 us
// of a linear's ~58 (q8_0 SmolLM2 on the Ice Lake Xeon), on the calling thread while the
// others wait.
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool QUANTIZES_IN_VECTORS = true;
bool quantize_block_vector(const float* x, int64_t n, bool wide, int8_t* high, int8_t* low,
                           float* scale, float* sum) {
  const __m512 lo = _mm512_loadu_ps(x);
  const __m512 hi = n == 32 ? _mm512_loadu_ps(x + 16) : _mm512_setzero_ps();
  const __m512 magnitude_lo = _mm512_abs_ps(lo), magnitude_hi = _mm512_abs_ps(hi);
  // NaN and inf (exponent all ones) both fail "<= FLT_MAX" (an unordered compare is false)
  const __m512 finite_max = _mm512_set1_ps(FLT_MAX);
  if (_mm512_cmp_ps_mask(magnitude_lo, finite_max, _CMP_LE_OQ) != 0xFFFF ||
      _mm512_cmp_ps_mask(magnitude_hi, finite_max, _CMP_LE_OQ) != 0xFFFF)
    return false;
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(magnitude_lo, magnitude_hi));
  const float bound = activation_limit(wide);
  const bool usable = quantizable(top, bound);
  const __m512 inv = _mm512_set1_ps(usable ? bound / top : 0.f);
  const __m512 limit = _mm512_set1_ps(bound), floor = _mm512_set1_ps(-bound);
  const __m512i half_step = _mm512_set1_epi32(128);
  __m512i total = _mm512_setzero_si512();
  auto quantize16 = [&](__m512 v, int at) {  // 16 activations from `at`
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v, inv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i code = _mm512_cvtps_epi32(_mm512_min_ps(limit, _mm512_max_ps(floor, r)));
    if (wide) {
      const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(code, half_step), 8);
      const __m512i l = _mm512_sub_epi32(code, _mm512_slli_epi32(h, 8));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(high + at), _mm512_cvtepi32_epi8(h));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(low + at), _mm512_cvtepi32_epi8(l));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(high + at), _mm512_cvtepi32_epi8(code));
    }
    total = _mm512_add_epi32(total, code);
  };
  quantize16(lo, 0);
  if (n == 32) quantize16(hi, 16);
  *scale = usable ? top / bound : 0.f;
  *sum = float(_mm512_reduce_add_epi32(total));
  return true;
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr bool QUANTIZES_IN_VECTORS = true;

// 2 or 4 vectors of 8 int32 values, each in int8's range -> n bytes at `out`, in order.
inline void store_bytes_avx2(const __m256i values[4], int parts, int8_t* out) {
  // the packs interleave the 128-bit lanes, the permutation puts the groups of 4 back in order
  const __m256i packed = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(values[0], values[1]),
                         _mm256_packs_epi32(values[2], values[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (parts == 4) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
  else _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

bool quantize_block_vector(const float* x, int64_t n, bool wide, int8_t* high, int8_t* low,
                           float* scale, float* sum) {
  const int parts = int(n / 8);  // 2 or 4 vectors of 8
  const __m256 sign = _mm256_set1_ps(-0.f), finite_max = _mm256_set1_ps(FLT_MAX);
  __m256 v[4], top8 = _mm256_setzero_ps();
  for (int i = 0; i < parts; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    const __m256 magnitude = _mm256_andnot_ps(sign, v[i]);
    // NaN and inf fail "<= FLT_MAX" (an unordered compare is false)
    if (_mm256_movemask_ps(_mm256_cmp_ps(magnitude, finite_max, _CMP_LE_OQ)) != 0xFF)
      return false;
    top8 = _mm256_max_ps(top8, magnitude);
  }
  const float top = max8(top8);
  const float bound = activation_limit(wide);
  const bool usable = quantizable(top, bound);
  const __m256 inv = _mm256_set1_ps(usable ? bound / top : 0.f);
  const __m256 limit = _mm256_set1_ps(bound), floor = _mm256_set1_ps(-bound);
  const __m256i half_step = _mm256_set1_epi32(128);
  __m256i highs[4], lows[4];
  for (int i = 0; i < 4; ++i) highs[i] = lows[i] = _mm256_setzero_si256();
  __m256i total = _mm256_setzero_si256();
  for (int i = 0; i < parts; ++i) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i code = _mm256_cvtps_epi32(_mm256_min_ps(limit, _mm256_max_ps(floor, r)));
    highs[i] = code;
    if (wide) {
      highs[i] = _mm256_srai_epi32(_mm256_add_epi32(code, half_step), 8);
      lows[i] = _mm256_sub_epi32(code, _mm256_slli_epi32(highs[i], 8));
    }
    total = _mm256_add_epi32(total, code);
  }
  store_bytes_avx2(highs, parts, high);
  if (wide) store_bytes_avx2(lows, parts, low);
  __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
  sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1));
  *scale = usable ? top / bound : 0.f;
  *sum = float(_mm_cvtsi128_si32(sum4));
  return true;
}
#else
constexpr bool QUANTIZES_IN_VECTORS = false;
bool quantize_block_vector(const float*, int64_t, bool, int8_t*, int8_t*, float*, float*) {
  return false;
}
#endif

// x (rows, in) -> the rows' codes (wide: 16-bit ones, as halves), scales and sums per block
// of block_len, in a buffer of the calling thread's, kept and grown (a decode step
// quantizes ~120 times: no allocation each). plain: the plain loops only (force_plain: the vector path is tested against them).
// NOTE: valid until the calling thread's next call.
const QuantizedRows& quantize_activations(const float* x, int64_t rows, int64_t in,
                                          int64_t block_len, bool wide, bool plain) {
  thread_local QuantizedRows q;
  const int64_t blocks = in / block_len;
  if (int64_t(q.a.size()) < rows * in) q.a.resize(rows * in);
  if (wide && int64_t(q.low.size()) < rows * in) q.low.resize(rows * in);
  if (int64_t(q.scale.size()) < rows * blocks) {
    q.scale.resize(rows * blocks);
    q.sum.resize(rows * blocks);
  }
  for (int64_t at = 0; at < rows * blocks; ++at) {
    const float* xb = x + at * block_len;  // block b of row r: rows are in / block_len blocks
    int8_t* high = q.a.data() + at * block_len;
    int8_t* low = wide ? q.low.data() + at * block_len : nullptr;
    if (QUANTIZES_IN_VECTORS && !plain && (block_len == 16 || block_len == 32) &&
        quantize_block_vector(xb, block_len, wide, high, low, &q.scale[at], &q.sum[at]))
      continue;
    quantize_block_plain(xb, block_len, wide, high, low, &q.scale[at], &q.sum[at]);
  }
  return q;
}

// 16 (8) block scales or mins as fp32: stored fp32, or fp16 (widened exactly).
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif
#if defined(__AVX2__) && defined(__F16C__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// A panel's d and m per block and row, whatever their stored format: d(b, j), m(b, j) for
// row j of block b, and (vectorised) all 16 rows' (d16, m16), or 8 of them (d8, m8: h = 0, 1).
template <typename T>  // float or c10::Half: (blocks, 2, 16) per panel
struct PlainScales {
  const T* p;
  float d(int64_t b, int64_t j) const { return float(p[b * 2 * QB_ROWS + j]); }
  float m(int64_t b, int64_t j) const { return float(p[b * 2 * QB_ROWS + QB_ROWS + j]); }
#if defined(__AVX512F__)
  __m512 d16(int64_t b) const { return load16(p + b * 2 * QB_ROWS); }
  __m512 m16(int64_t b) const { return load16(p + b * 2 * QB_ROWS + QB_ROWS); }
#endif
#if defined(__AVX2__) && defined(__F16C__)
  __m256 d8(int64_t b, int h) const { return load8(p + b * 2 * QB_ROWS + 8 * h); }
  __m256 m8(int64_t b, int h) const { return load8(p + b * 2 * QB_ROWS + QB_ROWS + 8 * h); }
#endif
};

// The K-quants' factored scales: per panel, int8 factors (blocks, 2, 16), or (blocks, 16)
// where one factor serves the scale and the min (SHARED), then fp16 super-block scales
// (blocks / per_super, 2, 16); d = scale x factor, m likewise.
template <bool SHARED>
struct FactoredScales {
  static constexpr int64_t kStride = SHARED ? QB_ROWS : 2 * QB_ROWS;  // factors per block
  static constexpr int64_t kMinAt = SHARED ? 0 : QB_ROWS;  // the min factors' offset
  const int8_t* f;
  const c10::Half* s;
  int64_t super_shift;  // log2 of the blocks per 256-weight super-block (8 or 16)
  // NOTE: a shift, not b / per_super: a 64-bit division per block cost the 1-row kernel
  // more than its dot products
  const c10::Half* super_of(int64_t b) const { return s + (b >> super_shift) * 2 * QB_ROWS; }
  float d(int64_t b, int64_t j) const { return float(super_of(b)[j]) * float(f[b * kStride + j]); }
  float m(int64_t b, int64_t j) const {
    return float(super_of(b)[QB_ROWS + j]) * float(f[b * kStride + kMinAt + j]);
  }
#if defined(__AVX512F__)
  static __m512 widen16(const int8_t* q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(q))));
  }
  __m512 d16(int64_t b) const { return _mm512_mul_ps(load16(super_of(b)), widen16(f + b * kStride)); }
  __m512 m16(int64_t b) const {
    return _mm512_mul_ps(load16(super_of(b) + QB_ROWS), widen16(f + b * kStride + kMinAt));
  }
#endif
#if defined(__AVX2__) && defined(__F16C__)
  static __m256 widen8(const int8_t* q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(q))));
  }
  __m256 d8(int64_t b, int h) const {
    return _mm256_mul_ps(load8(super_of(b) + 8 * h), widen8(f + b * kStride + 8 * h));
  }
  __m256 m8(int64_t b, int h) const {
    return _mm256_mul_ps(load8(super_of(b) + QB_ROWS + 8 * h),
                         widen8(f + b * kStride + kMinAt + 8 * h));
  }
#endif
};

// NOTE: both AVX2 kernels prefetch every 64-byte line of a block 8 KB ahead (as the bf16
// panels): one line of each block 4 blocks ahead (1 KB) held the Zen 3's 1-row Q4_K kernel to
// ~16-23 GB/s of its ~30; this ~21-34 (benchmarks.gguf_kernel_ab, 8 and 16 KB alike).
// The VNNI kernel prefetches the same way. On the Ice Lake Xeon, builds alternating: through
// the engine (`benchmarks.engine_ab`) SmolLM2 as q8_0 batch 1 x1.07, 8 rows x1.13, 64 level,
// Gemma 3 270M's Q4_K_M file (`--model`) batch 1 x1.12, 8 x1.18, 64 x1.05; the linears alone
// with their weights out of the caches (`benchmarks.gguf_kernel_ab --flush-mb 128`) Q4_K
// x1.07-1.14 at 1 and 8 rows, Q5_0, Q6_K and Q8_0 x1.05-1.31, 64 rows level. 16 KB ahead:
// level with 8 (q8_0 through the engine).
constexpr int64_t QB_PREFETCH_BYTES = 8192;

inline void prefetch_block(const uint8_t* block, int64_t block_bytes) {
  for (int64_t line = 0; line < block_bytes; line += 64)
    __builtin_prefetch(block + QB_PREFETCH_BYTES + line);
}

// A block's codes, all of its L / 4 steps of 64 bytes (step k: rows' codes 4k..4k+3), as
// the VNNI kernel multiplies them: 4-bit codes unpacked from the 64 bytes steps 2k and 2k+1
// share (IQ4_NL: those indices looked up, the table in each 128-bit lane); 6-bit: those
// nibbles and their top 2 bits from the block's second part (64 bytes per 4 steps, step
// 4k+i's at bits 2i). NOTE: L and BITS are template constants: the steps unroll, each packed
// byte is loaded once, every shift is an immediate. The step-at-a-time loop before (a
// runtime step count, a branch and a reload per step, a variable shift, a division per
// block) held the 1-row kernel to ~25 GB/s on one core of the 2-core EPYC (AVX-512 VNNI)
// that reads ~43 GB/s; this form ~31 (Q4_K) and ~24 (Q6_K's blocks of 16), 2 cores
// ~60 and ~46 against ~46 and ~33 before (benchmarks/gguf_1row.py's roles, and a
// standalone copy of the loop).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int L, int BITS>
inline void block_codes(const uint8_t* block, __m512i w[L / 4]) {
  constexpr int steps = L / 4;
  if constexpr (BITS == 8) {
    for (int k = 0; k < steps; ++k) w[k] = _mm512_loadu_si512(block + 64 * k);
    return;
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int k2 = 0; k2 < steps / 2; ++k2) {
      const __m512i packed = _mm512_loadu_si512(block + 64 * k2);
      w[2 * k2] = _mm512_and_si512(packed, low);
      w[2 * k2 + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    }
    if constexpr (BITS == QUANT_CODES_IQ4_NL) {
      const __m512i table = _mm512_broadcast_i32x4(
          _mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_NL_CODES)));
      for (int k = 0; k < steps; ++k) w[k] = _mm512_shuffle_epi8(table, w[k]);
    } else if constexpr (BITS == 6) {
      // NOTE: 16-bit shifts; a byte's bits that cross into its neighbour are masked off
      const __m512i three = _mm512_set1_epi8(0x03), top_two = _mm512_set1_epi8(0x30);
      for (int k4 = 0; k4 < steps / 4; ++k4) {
        const __m512i tops = _mm512_loadu_si512(block + L * 8 + 64 * k4);
        const __m512i tops2 = _mm512_srli_epi16(tops, 2);
        w[4 * k4] =
            _mm512_or_si512(w[4 * k4], _mm512_slli_epi16(_mm512_and_si512(tops, three), 4));
        w[4 * k4 + 1] =
            _mm512_or_si512(w[4 * k4 + 1], _mm512_slli_epi16(_mm512_and_si512(tops2, three), 4));
        w[4 * k4 + 2] = _mm512_or_si512(w[4 * k4 + 2], _mm512_and_si512(tops, top_two));
        w[4 * k4 + 3] = _mm512_or_si512(w[4 * k4 + 3], _mm512_and_si512(tops2, top_two));
      }
    }
  }
}

// Rows t0..t0+N of y over one panel in blocks of L, vectorised.
template <int N, int L, int BITS, bool WIDE, typename SM>
void panel_rows_vnni(const uint8_t* codes, const SM& sm, const QuantizedRows& q,
                     const QuantBlockShape& s, int64_t t0, float* acc_out /* (N, 16) */) {
  constexpr int steps = L / 4;
  constexpr int64_t block_bytes = L * QB_ROWS * (BITS == 8 ? 8 : BITS == 6 ? 6 : 4) / 8;
  __m512 acc[N];
  for (int t = 0; t < N; ++t) acc[t] = _mm512_setzero_ps();
  const int8_t* rows_high[N];
  const int8_t* rows_low[N];
  for (int t = 0; t < N; ++t) {
    rows_high[t] = q.a.data() + (t0 + t) * s.in;
    rows_low[t] = WIDE ? q.low.data() + (t0 + t) * s.in : nullptr;
  }
  for (int64_t b = 0; b < s.blocks; ++b) {
    const uint8_t* block = codes + b * block_bytes;
    prefetch_block(block, block_bytes);
    __m512i w[steps];
    block_codes<L, BITS>(block, w);
    // wide: sum u a = 256 sum u h + sum u l, the high halves' dot products shifted, then the
    // low halves' added (one register per row: a tile of 8 rows keeps 8 + 8 + steps in 32)
    __m512i dots[N];
    for (int t = 0; t < N; ++t) dots[t] = _mm512_setzero_si512();
    auto add_products = [&](const int8_t* const* rows) {
      for (int k = 0; k < steps; ++k) {
        for (int t = 0; t < N; ++t) {
          int32_t four;
          std::memcpy(&four, rows[t] + b * L + 4 * k, 4);
          dots[t] = _mm512_dpbusd_epi32(dots[t], w[k], _mm512_set1_epi32(four));
        }
      }
    };
    add_products(rows_high);
    if constexpr (WIDE) {
      for (int t = 0; t < N; ++t) dots[t] = _mm512_slli_epi32(dots[t], 8);
      add_products(rows_low);
    }
    const __m512 d = sm.d16(b);
    const __m512 m = sm.m16(b);
    for (int t = 0; t < N; ++t) {
      const int64_t at = (t0 + t) * s.blocks + b;
      const __m512 part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[t]), d,
                                          _mm512_mul_ps(m, _mm512_set1_ps(q.sum[at])));
      acc[t] = _mm512_fmadd_ps(part, _mm512_set1_ps(q.scale[at]), acc[t]);
    }
  }
  for (int t = 0; t < N; ++t) _mm512_storeu_ps(acc_out + t * QB_ROWS, acc[t]);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 without VNNI (the avx2 CPU class's x86-64-v3 build, AVX-512 CPUs without VNNI), codes
// of 8 bits (Q8_0, IQ4_NL's looked-up levels; 4- and 6-bit ones: panel_rows_avx2_small): the
// codes of a step widened to int16 and multiplied by the activations (int16) with
// vpmaddwd, whose pairwise int32 sums are exact (|u a| <= 255 * 32512; no vpmaddubsw: its
// int16 sums saturate for 8-bit codes). A step's 64 bytes are 4 groups of 4 rows; each
// group's int32 lanes hold 2 partial sums per row, added pairwise at the block's end
// (vphaddd, then lanes put back in row order). NOTE: the integer sums are exact, so they
// equal VNNI's; the block's float operations are the same as panel_rows_vnni's, per lane,
// in the same order: the same bits.
constexpr int QB_TILE_AVX2 = 4;  // activation rows per pass (the 4 int32 sums each in registers)

template <int BITS>  // 8 or QUANT_CODES_IQ4_NL
inline void load_step_avx2(const uint8_t* block, int64_t k, __m256i w[4]) {
  static_assert(BITS == 8 || BITS == QUANT_CODES_IQ4_NL, "8-bit codes");
  const uint8_t* bytes = block + 64 * (BITS == 8 ? k : k / 2);  // IQ4_NL: steps share 64
  __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32));
  if constexpr (BITS == QUANT_CODES_IQ4_NL) {  // the indices, then their levels' codes
    const __m256i mask = _mm256_set1_epi8(0x0F);
    if (k & 1) {
      lo = _mm256_srli_epi16(lo, 4);
      hi = _mm256_srli_epi16(hi, 4);
    }
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_NL_CODES)));
    lo = _mm256_shuffle_epi8(table, _mm256_and_si256(lo, mask));
    hi = _mm256_shuffle_epi8(table, _mm256_and_si256(hi, mask));
  }
  w[0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo));  // rows 0-3, 4 codes each
  w[1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1));  // rows 4-7
  w[2] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi));  // rows 8-11
  w[3] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1));  // rows 12-15
}

// Rows t0..t0+N of y over one panel (N <= QB_TILE_AVX2), AVX2.
template <int N, int BITS, bool WIDE, typename SM>
void panel_rows_avx2(const uint8_t* codes, const SM& sm, const QuantizedRows& q,
                     const QuantBlockShape& s, int64_t t0, float* acc_out /* (N, 16) */) {
  __m256 acc[N][2];
  for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const __m256i row_order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  const int64_t steps = s.block_len / 4;
  for (int64_t b = 0; b < s.blocks; ++b) {
    const uint8_t* block = codes + b * s.block_bytes();
    prefetch_block(block, s.block_bytes());
    __m256i dots[N][4];
    for (int t = 0; t < N; ++t)
      for (int g = 0; g < 4; ++g) dots[t][g] = _mm256_setzero_si256();
    for (int64_t k = 0; k < steps; ++k) {
      __m256i w[4];
      load_step_avx2<BITS>(block, k, w);
      for (int t = 0; t < N; ++t) {
        const int64_t at = (t0 + t) * s.in + b * s.block_len + 4 * k;
        int32_t high, low = 0;
        std::memcpy(&high, q.a.data() + at, 4);
        if constexpr (WIDE) std::memcpy(&low, q.low.data() + at, 4);
        // the 4 activations' codes as int16 (wide: 256 h + l), once per row of codes:
        // (a0 a1 a2 a3) x 4
        __m128i codes16 = _mm_cvtepi8_epi16(_mm_cvtsi32_si128(high));
        if constexpr (WIDE)
          codes16 = _mm_add_epi16(_mm_slli_epi16(codes16, 8),
                                  _mm_cvtepi8_epi16(_mm_cvtsi32_si128(low)));
        const __m256i a = _mm256_broadcastq_epi64(codes16);
        for (int g = 0; g < 4; ++g)
          dots[t][g] = _mm256_add_epi32(dots[t][g], _mm256_madd_epi16(w[g], a));
      }
    }
    for (int t = 0; t < N; ++t) {
      const int64_t at = (t0 + t) * s.blocks + b;
      const __m256 sum = _mm256_set1_ps(q.sum[at]), scale = _mm256_set1_ps(q.scale[at]);
      for (int h = 0; h < 2; ++h) {  // rows 8h..8h+7
        // vphaddd within 128-bit lanes gives rows (0 1 4 5 2 3 6 7) of the 8
        const __m256i rows = _mm256_permutevar8x32_epi32(
            _mm256_hadd_epi32(dots[t][2 * h], dots[t][2 * h + 1]), row_order);
        const __m256 d = sm.d8(b, h);
        const __m256 m = sm.m8(b, h);
        const __m256 part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows), d, _mm256_mul_ps(m, sum));
        acc[t][h] = _mm256_fmadd_ps(part, scale, acc[t][h]);
      }
    }
  }
  for (int t = 0; t < N; ++t) {
    _mm256_storeu_ps(acc_out + t * QB_ROWS, acc[t][0]);
    _mm256_storeu_ps(acc_out + t * QB_ROWS + 8, acc[t][1]);
  }
}

// 4- and 6-bit codes (u <= 63) need no int16 widening: vpmaddubsw multiplies u8 codes by s8
// activations and adds pairs into int16, at most 2 * 63 * 127 = 16002, so two steps' pairs
// add without saturating (32004); 4-bit pairs (at most 3810) add over a whole block of 32
// (30480). vpmaddwd by ones then sums each row's int16 pairs into its int32 lane. A step's
// first 32 bytes are rows 0-7 (4 codes each), its last 32 rows 8-15: the lanes are rows, in
// order. Half the multiplies of the widening path above, no widening shuffles; the exact
// integer sums and the block's float operations are its, so the bits are the same.
template <int BITS>
inline void step_pair_avx2(const uint8_t* block, int k2, const uint8_t* tops, __m256i w[4]) {
  // w[0], w[1]: step 2 k2's rows 0-7 and 8-15; w[2], w[3]: step 2 k2 + 1's
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * k2));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * k2 + 32));
  w[0] = _mm256_and_si256(lo, mask);
  w[1] = _mm256_and_si256(hi, mask);
  w[2] = _mm256_and_si256(_mm256_srli_epi16(lo, 4), mask);
  w[3] = _mm256_and_si256(_mm256_srli_epi16(hi, 4), mask);
  if constexpr (BITS == 6) {
    // steps 4k4..4k4+3 share 64 bytes of top bits, step 4k4+i's at bits 2i (see block_codes);
    // NOTE: 16-bit shifts: a byte's bits that cross into its neighbour are masked off
    const uint8_t* top = tops + 64 * (k2 / 2);
    const __m256i t_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(top));
    const __m256i t_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(top + 32));
    const __m256i t_lo2 = _mm256_srli_epi16(t_lo, 2), t_hi2 = _mm256_srli_epi16(t_hi, 2);
    if ((k2 & 1) == 0) {  // steps 4k4 and 4k4+1: bits 0-1 and 2-3, moved to 4-5
      const __m256i three = _mm256_set1_epi8(0x03);
      w[0] = _mm256_or_si256(w[0], _mm256_slli_epi16(_mm256_and_si256(t_lo, three), 4));
      w[1] = _mm256_or_si256(w[1], _mm256_slli_epi16(_mm256_and_si256(t_hi, three), 4));
      w[2] = _mm256_or_si256(w[2], _mm256_slli_epi16(_mm256_and_si256(t_lo2, three), 4));
      w[3] = _mm256_or_si256(w[3], _mm256_slli_epi16(_mm256_and_si256(t_hi2, three), 4));
    } else {  // steps 4k4+2 and 4k4+3: bits 4-5 and 6-7
      const __m256i top_two = _mm256_set1_epi8(0x30);
      w[0] = _mm256_or_si256(w[0], _mm256_and_si256(t_lo, top_two));
      w[1] = _mm256_or_si256(w[1], _mm256_and_si256(t_hi, top_two));
      w[2] = _mm256_or_si256(w[2], _mm256_and_si256(t_lo2, top_two));
      w[3] = _mm256_or_si256(w[3], _mm256_and_si256(t_hi2, top_two));
    }
  }
}

// Rows t0..t0+N of y over one panel (N <= QB_TILE_AVX2) in blocks of L, codes of BITS 4 or 6.
template <int N, int L, int BITS, typename SM>
void panel_rows_avx2_small(const uint8_t* codes, const SM& sm, const QuantizedRows& q,
                           const QuantBlockShape& s, int64_t t0, float* acc_out /* (N, 16) */) {
  static_assert(BITS == 4 || BITS == 6, "codes of at most 6 bits");
  constexpr int pairs = L / 8;  // step pairs per block
  constexpr int64_t block_bytes = L * QB_ROWS * BITS / 8;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[N][2];
  for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < s.blocks; ++b) {
    const uint8_t* block = codes + b * block_bytes;
    prefetch_block(block, block_bytes);
    __m256i sums[N][2];  // 4-bit: int16 pairs over the block; 6-bit: int32 rows
    for (int t = 0; t < N; ++t) sums[t][0] = sums[t][1] = _mm256_setzero_si256();
    for (int k2 = 0; k2 < pairs; ++k2) {
      __m256i w[4];
      step_pair_avx2<BITS>(block, k2, block + L * 8, w);
      for (int t = 0; t < N; ++t) {
        int32_t four[2];  // the 8 activations of the two steps
        std::memcpy(four, q.a.data() + (t0 + t) * s.in + b * L + 8 * k2, 8);
        const __m256i a0 = _mm256_set1_epi32(four[0]), a1 = _mm256_set1_epi32(four[1]);
        for (int h = 0; h < 2; ++h) {
          const __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(w[h], a0),
                                                _mm256_maddubs_epi16(w[2 + h], a1));
          if constexpr (BITS == 4) sums[t][h] = _mm256_add_epi16(sums[t][h], both);
          else sums[t][h] = _mm256_add_epi32(sums[t][h], _mm256_madd_epi16(both, ones));
        }
      }
    }
    for (int t = 0; t < N; ++t) {
      const int64_t at = (t0 + t) * s.blocks + b;
      const __m256 sum = _mm256_set1_ps(q.sum[at]), scale = _mm256_set1_ps(q.scale[at]);
      for (int h = 0; h < 2; ++h) {  // rows 8h..8h+7
        const __m256i rows = BITS == 4 ? _mm256_madd_epi16(sums[t][h], ones) : sums[t][h];
        const __m256 part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows), sm.d8(b, h),
                                            _mm256_mul_ps(sm.m8(b, h), sum));
        acc[t][h] = _mm256_fmadd_ps(part, scale, acc[t][h]);
      }
    }
  }
  for (int t = 0; t < N; ++t) {
    _mm256_storeu_ps(acc_out + t * QB_ROWS, acc[t][0]);
    _mm256_storeu_ps(acc_out + t * QB_ROWS + 8, acc[t][1]);
  }
}
#endif

// The same as panel_rows_vnni, in plain loops (the same float operations in the same order).
template <typename SM>
void panel_rows_plain(const uint8_t* codes, const SM& sm, const QuantizedRows& q,
                      const QuantBlockShape& s, int64_t t0, int64_t n, bool wide,
                      float* acc_out) {
  for (int64_t t = 0; t < n; ++t) {
    float acc[QB_ROWS] = {};
    for (int64_t b = 0; b < s.blocks; ++b) {
      const uint8_t* block = codes + b * s.block_bytes();
      const int64_t first = (t0 + t) * s.in + b * s.block_len;
      const int8_t* high = q.a.data() + first;
      const int8_t* low = wide ? q.low.data() + first : nullptr;
      int32_t dots[QB_ROWS] = {};
      for (int64_t i = 0; i < s.block_len; ++i) {
        const int32_t a = wide ? 256 * int32_t(high[i]) + int32_t(low[i]) : int32_t(high[i]);
        for (int64_t j = 0; j < QB_ROWS; ++j)
          dots[j] += int32_t(code_of(block, s.block_len, s.bits, j, i)) * a;
      }
      const int64_t at = (t0 + t) * s.blocks + b;
      for (int64_t j = 0; j < QB_ROWS; ++j) {
        const float d = sm.d(b, j);
        const float m = sm.m(b, j);
        const float part = std::fma(float(dots[j]), d, m * q.sum[at]);
        acc[j] = std::fma(part, q.scale[at], acc[j]);
      }
    }
    std::copy_n(acc, QB_ROWS, acc_out + t * QB_ROWS);
  }
}

// wide: the activations' codes are 16-bit (8-bit codes only: quant_block_linear_into).
template <typename SM>
void panel_rows(const uint8_t* codes, const SM& sm, const QuantizedRows& q,
                const QuantBlockShape& s, int64_t t0, int64_t n, bool wide, bool plain,
                float* acc_out) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (!plain) {
    auto run = [&](auto bits, auto len, auto widths) {
      constexpr int B = decltype(bits)::value, L = decltype(len)::value;
      constexpr bool W = decltype(widths)::value;
      switch (n) {
        case 8: return panel_rows_vnni<8, L, B, W, SM>(codes, sm, q, s, t0, acc_out);
        case 7: return panel_rows_vnni<7, L, B, W, SM>(codes, sm, q, s, t0, acc_out);
        case 6: return panel_rows_vnni<6, L, B, W, SM>(codes, sm, q, s, t0, acc_out);
        case 5: return panel_rows_vnni<5, L, B, W, SM>(codes, sm, q, s, t0, acc_out);
        case 4: return panel_rows_vnni<4, L, B, W, SM>(codes, sm, q, s, t0, acc_out);
        case 3: return panel_rows_vnni<3, L, B, W, SM>(codes, sm, q, s, t0, acc_out);
        case 2: return panel_rows_vnni<2, L, B, W, SM>(codes, sm, q, s, t0, acc_out);
        default: return panel_rows_vnni<1, L, B, W, SM>(codes, sm, q, s, t0, acc_out);
      }
    };
    auto run_len = [&](auto bits, auto widths) {
      if (s.block_len == 16) run(bits, std::integral_constant<int, 16>(), widths);
      else run(bits, std::integral_constant<int, 32>(), widths);
    };
    const std::false_type narrow;
    if (wide) run_len(std::integral_constant<int, 8>(), std::true_type());
    else if (s.bits == 8) run_len(std::integral_constant<int, 8>(), narrow);
    else if (s.bits == 6) run_len(std::integral_constant<int, 6>(), narrow);
    else if (s.bits == QUANT_CODES_IQ4_NL)
      run_len(std::integral_constant<int, QUANT_CODES_IQ4_NL>(), narrow);
    else run_len(std::integral_constant<int, 4>(), narrow);
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if (!plain) {
    auto run = [&](auto bits, auto widths, int64_t first, int64_t rows, float* out) {
      constexpr int B = decltype(bits)::value;
      constexpr bool W = decltype(widths)::value;
      switch (rows) {
        case 4: return panel_rows_avx2<4, B, W, SM>(codes, sm, q, s, first, out);
        case 3: return panel_rows_avx2<3, B, W, SM>(codes, sm, q, s, first, out);
        case 2: return panel_rows_avx2<2, B, W, SM>(codes, sm, q, s, first, out);
        default: return panel_rows_avx2<1, B, W, SM>(codes, sm, q, s, first, out);
      }
    };
    auto run_small = [&](auto bits, auto len, int64_t first, int64_t rows, float* out) {
      constexpr int B = decltype(bits)::value, L = decltype(len)::value;
      switch (rows) {
        case 4: return panel_rows_avx2_small<4, L, B, SM>(codes, sm, q, s, first, out);
        case 3: return panel_rows_avx2_small<3, L, B, SM>(codes, sm, q, s, first, out);
        case 2: return panel_rows_avx2_small<2, L, B, SM>(codes, sm, q, s, first, out);
        default: return panel_rows_avx2_small<1, L, B, SM>(codes, sm, q, s, first, out);
      }
    };
    auto run_len = [&](auto bits, int64_t first, int64_t rows, float* out) {
      if (s.block_len == 16) run_small(bits, std::integral_constant<int, 16>(), first, rows, out);
      else run_small(bits, std::integral_constant<int, 32>(), first, rows, out);
    };
    const std::integral_constant<int, 8> bytes;
    const std::false_type narrow;
    for (int64_t done = 0; done < n; done += QB_TILE_AVX2) {
      const int64_t rows = std::min<int64_t>(QB_TILE_AVX2, n - done);
      float* out = acc_out + done * QB_ROWS;
      if (wide) run(bytes, std::true_type(), t0 + done, rows, out);
      else if (s.bits == 8) run(bytes, narrow, t0 + done, rows, out);
      else if (s.bits == 6) run_len(std::integral_constant<int, 6>(), t0 + done, rows, out);
      else if (s.bits == QUANT_CODES_IQ4_NL)  // codes up to 241: widened, as 8-bit ones
        run(std::integral_constant<int, QUANT_CODES_IQ4_NL>(), narrow, t0 + done, rows, out);
      else run_len(std::integral_constant<int, 4>(), t0 + done, rows, out);
    }
    return;
  }
#endif
  panel_rows_plain(codes, sm, q, s, t0, n, wide, acc_out);
}

}  // namespace

std::string quant_blocks_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "avx512vnni";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return "avx2";
#else
  return "plain";
#endif
}

bool quant_blocks_vectorised() { return quant_blocks_isa() != "plain"; }

namespace {

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store_u32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, sizeof v); }

// Row j's L codes `src` (one a byte) written into a panel's block in the layout code_of
// reads: 8-bit, step k's 4 codes at bytes 64 k + 4 j; 4-bit, steps 2c and 2c + 1 as the
// low and high nibbles of bytes 64 c + 4 j; 6-bit, those nibbles, then the top 2 bits of
// steps 4g..4g+3 at bits 0-1, 2-3, 4-5, 6-7 of bytes L * 8 + 64 g + 4 j. Returns the OR of
// the codes (the caller checks their range). NOTE: whole 4-byte groups, one row's each:
// rows never share a written byte, so panels (and rows) pack in any order, and nothing
// needs zeroing first.
static_assert(std::endian::native == std::endian::little, "the 32-bit groups are little-endian");
template <int L, int BITS>
inline uint8_t pack_row_block(const uint8_t* src, uint8_t* block, int64_t j) {
  uint8_t seen = 0;
  for (int i = 0; i < L; ++i) seen |= src[i];
  uint8_t* at = block + 4 * j;
  if constexpr (BITS == 8) {
    for (int k = 0; k < L / 4; ++k) store_u32(at + 64 * k, load_u32(src + 4 * k));
  } else {
    constexpr uint32_t kLow = 0x0F0F0F0F, kTop = 0x03030303;
    for (int c = 0; c < L / 8; ++c)
      store_u32(at + 64 * c,
                (load_u32(src + 8 * c) & kLow) | ((load_u32(src + 8 * c + 4) & kLow) << 4));
    if constexpr (BITS == 6) {
      for (int g = 0; g < L / 16; ++g) {
        uint32_t tops = 0;  // NOTE: >> 4 moves a byte's bits 4-5 to 0-1; the mask drops
        for (int kk = 0; kk < 4; ++kk)  // what its neighbour shifted in
          tops |= ((load_u32(src + 16 * g + 4 * kk) >> 4) & kTop) << (2 * kk);
        store_u32(at + L * 8 + 64 * g, tops);
      }
    }
  }
  return seen;
}

// Whether every value is an fp16 value (c10::Half holds it exactly): NaN is not.
bool all_fp16_values(const float* v, int64_t n) {
  std::atomic<bool> all{true};
  parallel_for(0, n, int64_t(1) << 16, [&](int64_t first, int64_t last) {
    bool ok = true;
    for (int64_t i = first; i < last; ++i) ok &= float(c10::Half(v[i])) == v[i];
    if (!ok) all.store(false, std::memory_order_relaxed);
  });
  return all.load();
}

// Rows [first_row, last_row) of pack_quant_blocks' output; returns the OR of their codes.
template <int L, int BITS, typename S>
uint8_t pack_rows(const uint8_t* codes, const float* scales, const float* mins, int64_t first_row,
                  int64_t last_row, int64_t blocks, uint8_t* packed, S* sm) {
  constexpr int64_t block_bytes = L * QB_ROWS * BITS / 8;
  uint8_t seen = 0;
  for (int64_t o = first_row; o < last_row; ++o) {
    const int64_t p = o / QB_ROWS, j = o % QB_ROWS;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = p * blocks + b;
      seen |= pack_row_block<L, BITS>(codes + (o * blocks + b) * L, packed + at * block_bytes, j);
      sm[at * 2 * QB_ROWS + j] = S(scales[o * blocks + b]);
      sm[at * 2 * QB_ROWS + QB_ROWS + j] = S(mins[o * blocks + b]);
    }
  }
  return seen;
}

}  // namespace

// codes (out, blocks, block_len) uint8 (< 16 when bits == 4; IQ4_NL: its indices, < 16),
// scales and mins (out, blocks) fp32 -> (packed codes (panels, blocks, block bytes),
// scales_mins (panels, blocks, 2, 16), fp16 where that holds every value exactly, else fp32).
// NOTE: the padding rows of the last panel (past `out`) are zero codes, scales and mins.
std::tuple<torch::Tensor, torch::Tensor> pack_quant_blocks(torch::Tensor codes,
                                                           torch::Tensor scales,
                                                           torch::Tensor mins, int64_t bits) {
  TORCH_CHECK(codes.scalar_type() == kUInt8 && codes.dim() == 3,
              "codes must be uint8 (out, blocks, block_len)");
  check_cpu_float(scales, "scales");
  check_cpu_float(mins, "mins");
  codes = codes.contiguous();
  scales = scales.contiguous();
  mins = mins.contiguous();
  const int64_t out = codes.size(0), blocks = codes.size(1), block_len = codes.size(2);
  TORCH_CHECK(block_len == 16 || block_len == 32, "block_len must be 16 or 32");
  TORCH_CHECK(quant_codes_format_known(bits), "bits must be 4, 6 or 8 (or ", QUANT_CODES_IQ4_NL,
              ": IQ4_NL's indices)");
  bits = quant_codes_stored_bits(bits);  // NOTE: IQ4_NL's indices are packed as 4-bit codes
  TORCH_CHECK(scales.sizes() == mins.sizes() && scales.dim() == 2 && scales.size(0) == out &&
                  scales.size(1) == blocks,
              "scales and mins must be (out, blocks)");
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* dp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  // NOTE: fp16 where every scale and min is an fp16 value (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0: d, m,
  // -8d, -16d, -128d), widened exactly in the kernel: the same fp32 values, half the bytes.
  const bool half = all_fp16_values(dp, out * blocks) && all_fp16_values(mp, out * blocks);
  const int64_t panels = (out + QB_ROWS - 1) / QB_ROWS;
  const int64_t block_bytes = block_len * QB_ROWS * bits / 8;
  auto packed = torch::empty({panels, blocks, block_bytes}, codes.options());
  auto sm = torch::empty({panels, blocks, 2, QB_ROWS},
                         scales.options().dtype(half ? kFloat16 : kFloat32));
  if (panels > 0 && out % QB_ROWS != 0) {  // the last panel's padding rows
    packed[panels - 1].zero_();
    sm[panels - 1].zero_();
  }
  std::atomic<uint8_t> seen{0};
  auto pack = [&](auto length, auto width, auto* sm_data) {
    constexpr int L = decltype(length)::value, BITS = decltype(width)::value;
    // NOTE: panels in parallel: a panel's bytes are its 16 rows' only
    parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
      const uint8_t chunk = pack_rows<L, BITS>(cp, dp, mp, first * QB_ROWS,
                                               std::min(out, last * QB_ROWS), blocks,
                                               packed.data_ptr<uint8_t>(), sm_data);
      seen.fetch_or(chunk, std::memory_order_relaxed);
    });
  };
  auto with_scales = [&](auto length, auto width) {
    if (half) pack(length, width, sm.data_ptr<c10::Half>());
    else pack(length, width, sm.data_ptr<float>());
  };
  auto with_bits = [&](auto length) {
    if (bits == 8) with_scales(length, std::integral_constant<int, 8>());
    else if (bits == 6) with_scales(length, std::integral_constant<int, 6>());
    else with_scales(length, std::integral_constant<int, 4>());
  };
  if (block_len == 16) with_bits(std::integral_constant<int, 16>());
  else with_bits(std::integral_constant<int, 32>());
  if (bits == 4 || bits == 6)
    TORCH_CHECK(seen.load() < (1 << bits), "a ", bits, "-bit code above ", (1 << bits) - 1);
  return {packed, sm};
}

// scale_factors, min_factors (out, blocks) int8 and supers (out, blocks * block_len / 256, 2)
// fp32 fp16 values (each super-block's d and m) -> the factored scales_mins of
// pack_quant_blocks' panels: (panels, bytes), per panel the factors (blocks, 2, 16) then the
// supers' (S, 2, 16) fp16; uint8. min_factors none (the scale factors serve the mins too):
// the factors (blocks, 16), int8 (QUANT_SCALES_FACTORED_SHARED). Row j of block b:
// d = supers[b / per_super][0] * scale_factors[b], m likewise.
torch::Tensor pack_factored_scales(torch::Tensor scale_factors,
                                   c10::optional<torch::Tensor> min_factors,
                                   torch::Tensor supers) {
  const bool shared = !min_factors.has_value();
  TORCH_CHECK(scale_factors.scalar_type() == kInt8 && scale_factors.dim() == 2 &&
                  (shared || (min_factors->scalar_type() == kInt8 &&
                              min_factors->sizes() == scale_factors.sizes())),
              "scale_factors and min_factors must be int8 (out, blocks)");
  check_cpu_float(supers, "supers");
  const int64_t out = scale_factors.size(0), blocks = scale_factors.size(1);
  TORCH_CHECK(supers.dim() == 3 && supers.size(0) == out && supers.size(2) == 2 &&
                  supers.size(1) > 0 && blocks % supers.size(1) == 0,
              "supers must be (out, super-blocks, 2), each super-block whole blocks");
  const int64_t nsuper = supers.size(1), per_super = blocks / nsuper;
  TORCH_CHECK(QK_K_WEIGHTS % per_super == 0 && (QK_K_WEIGHTS / per_super == 16 ||
                                                QK_K_WEIGHTS / per_super == 32),
              "a super-block is ", QK_K_WEIGHTS, " weights in blocks of 16 or 32");
  const torch::Tensor halves = supers.to(kFloat16).contiguous();
  TORCH_CHECK(halves.to(kFloat32).equal(supers),
              "supers must be fp16 values (the K-quants' d and dmin, -4 d, -32 d)");
  const int64_t block_len = QK_K_WEIGHTS / per_super;
  scale_factors = scale_factors.contiguous();
  const torch::Tensor mins = shared ? scale_factors : min_factors->contiguous();
  const int64_t panels = (out + QB_ROWS - 1) / QB_ROWS;
  const int64_t panel_bytes = factored_panel_bytes(blocks, block_len, shared);
  const int64_t stride = shared ? QB_ROWS : 2 * QB_ROWS;
  auto packed = torch::zeros({panels, panel_bytes},
                             torch::dtype(shared ? kInt8 : kUInt8));
  auto* pp = static_cast<uint8_t*>(packed.data_ptr());
  const int8_t* sf = scale_factors.data_ptr<int8_t>();
  const int8_t* mf = mins.data_ptr<int8_t>();
  const c10::Half* sp = halves.data_ptr<c10::Half>();
  // NOTE: panels in parallel: a panel's bytes are its 16 rows' only
  parallel_for(0, panels, 1, [&](int64_t first_panel, int64_t last_panel) {
  for (int64_t o = first_panel * QB_ROWS; o < std::min(out, last_panel * QB_ROWS); ++o) {
    const int64_t p = o / QB_ROWS, j = o % QB_ROWS;
    auto* factors = reinterpret_cast<int8_t*>(pp + p * panel_bytes);
    auto* scales = reinterpret_cast<c10::Half*>(pp + p * panel_bytes + blocks * stride);
    for (int64_t b = 0; b < blocks; ++b) {
      factors[b * stride + j] = sf[o * blocks + b];
      if (!shared) factors[b * stride + QB_ROWS + j] = mf[o * blocks + b];
    }
    for (int64_t g = 0; g < nsuper; ++g) {
      scales[g * 2 * QB_ROWS + j] = sp[(o * nsuper + g) * 2];
      scales[g * 2 * QB_ROWS + QB_ROWS + j] = sp[(o * nsuper + g) * 2 + 1];
    }
  }
  });
  return packed;
}

void check_quant_blocks(const torch::Tensor& codes, const torch::Tensor& sm, int64_t in,
                        int64_t out_features, int64_t block_len, int64_t bits) {
  shape_of(codes, sm, in, out_features, block_len, bits);
}

// y (rows, out) = x (rows, in) @ W^T on raw pointers (check_quant_blocks checked the shapes).
namespace {

// Panel p's scales (PlainScales or FactoredScales) over the packed `scales_mins`.
template <typename Fn>
void with_panel_scales(const void* scales_mins, int64_t format, int64_t blocks,
                       int64_t block_len, Fn&& fn) {
  if (format == QUANT_SCALES_FACTORED || format == QUANT_SCALES_FACTORED_SHARED) {
    const auto* bytes = static_cast<const uint8_t*>(scales_mins);
    const int64_t shift = std::countr_zero(uint64_t(QK_K_WEIGHTS / block_len));
    auto factored = [&](auto shared) {
      constexpr bool SHARED = decltype(shared)::value;
      const int64_t panel_bytes = factored_panel_bytes(blocks, block_len, SHARED);
      const int64_t factor_bytes = blocks * FactoredScales<SHARED>::kStride;
      fn([=](int64_t p) {
        const uint8_t* panel = bytes + p * panel_bytes;
        return FactoredScales<SHARED>{reinterpret_cast<const int8_t*>(panel),
                                      reinterpret_cast<const c10::Half*>(panel + factor_bytes),
                                      shift};
      });
    };
    if (format == QUANT_SCALES_FACTORED_SHARED) factored(std::true_type());
    else factored(std::false_type());
  } else if (format == QUANT_SCALES_F16) {
    const auto* half = static_cast<const c10::Half*>(scales_mins);
    fn([=](int64_t p) { return PlainScales<c10::Half>{half + p * blocks * 2 * QB_ROWS}; });
  } else {
    const auto* full = static_cast<const float*>(scales_mins);
    fn([=](int64_t p) { return PlainScales<float>{full + p * blocks * 2 * QB_ROWS}; });
  }
}

template <typename PanelScales>
void quant_block_linear_typed(const float* x, int64_t rows, int64_t in, const uint8_t* codes,
                              const PanelScales& scales_of, int64_t out_features,
                              int64_t block_len, int64_t bits, bool wide, float* y,
                              bool force_plain) {
  const int64_t panels = (out_features + QB_ROWS - 1) / QB_ROWS;
  const QuantBlockShape s{in, in / block_len, block_len, bits, panels, out_features};
  const QuantizedRows& q = quantize_activations(x, rows, s.in, block_len, wide, force_plain);
  parallel_for(0, s.panels, 1, [&](int64_t begin, int64_t end) {
    float lanes[QB_TILE * QB_ROWS];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t first = p * QB_ROWS, width = std::min(QB_ROWS, out_features - first);
      for (int64_t t0 = 0; t0 < rows; t0 += QB_TILE) {
        const int64_t n = std::min<int64_t>(QB_TILE, rows - t0);
        panel_rows(codes + p * s.blocks * s.block_bytes(), scales_of(p), q, s, t0, n, wide,
                   force_plain, lanes);
        for (int64_t t = 0; t < n; ++t)
          std::copy_n(lanes + t * QB_ROWS, width, y + (t0 + t) * out_features + first);
      }
    }
  });
}

}  // namespace

void check_activation_bits(int64_t activation_bits, int64_t bits) {
  TORCH_CHECK(activation_bits == 8 || activation_bits == 16, "activation_bits must be 8 or 16, "
              "got ", activation_bits);
  TORCH_CHECK(activation_bits == 8 || bits == 8, "16-bit activations take 8-bit codes only, "
              "not format ", bits);
}

void quant_block_linear_into(const float* x, int64_t rows, int64_t in, const uint8_t* codes,
                             const void* sm, int64_t scale_format, int64_t out_features,
                             int64_t block_len, int64_t bits, int64_t activation_bits, float* y,
                             bool force_plain) {
  // NOTE: checked again here (make_linear checks it once): a wide kernel on 4-bit codes
  // would read past its blocks
  check_activation_bits(activation_bits, bits);
  with_panel_scales(sm, scale_format, in / block_len, block_len, [&](auto scales_of) {
    quant_block_linear_typed(x, rows, in, codes, scales_of, out_features, block_len, bits,
                             activation_bits == 16, y, force_plain);
  });
}

namespace {

// Rows `ids` of the weight (as pack_quant_blocks packed it) in fp32: the token embedding
// looked up from the tied LM head's blocks (or its own), so a GGUF's table is never held in
// fp32. NOTE: w = u * d + m with two roundings, as BlockWeights.dequantize computes it (no
// fused multiply-add: the attribute keeps the compiler from contracting it), so a row is
// bit-equal to the fp32 table the model would otherwise hold.
template <typename PanelScales>
__attribute__((optimize("fp-contract=off"))) void block_rows_into(
    const uint8_t* codes, const PanelScales& scales_of, int64_t out_features, int64_t in,
    int64_t block_len, int64_t bits, const int64_t* ids, int64_t n, float* out) {
  const int64_t blocks = in / block_len;
  const int64_t block_bytes = block_len * QB_ROWS * quant_codes_stored_bits(bits) / 8;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t o = ids[r], p = o / QB_ROWS, j = o % QB_ROWS;
    TORCH_CHECK(o >= 0 && o < out_features, "row ", o, " outside [0, ", out_features, ")");
    const auto scales = scales_of(p);
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = codes + (p * blocks + b) * block_bytes;
      const float d = scales.d(b, j), m = scales.m(b, j);
      float* y = out + r * in + b * block_len;
      for (int64_t i = 0; i < block_len; ++i) {
        const float scaled = float(code_of(block, block_len, bits, j, i)) * d;
        y[i] = scaled + m;
      }
    }
  }
}

}  // namespace

void quant_block_rows_into(const uint8_t* codes, const void* scales_mins, int64_t scale_format,
                           int64_t out_features, int64_t in, int64_t block_len, int64_t bits,
                           const int64_t* ids, int64_t n, float* out) {
  with_panel_scales(scales_mins, scale_format, in / block_len, block_len, [&](auto scales_of) {
    block_rows_into(codes, scales_of, out_features, in, block_len, bits, ids, n, out);
  });
}

// (n, in) fp32: rows `ids` of the (out_features, in) weight in pack_quant_blocks' blocks.
torch::Tensor quant_block_rows(torch::Tensor codes, torch::Tensor sm, int64_t out_features,
                               int64_t block_len, int64_t bits, torch::Tensor ids) {
  TORCH_CHECK(codes.dim() == 3, "codes must come from pack_quant_blocks");
  const int64_t in = codes.size(1) * block_len;
  check_quant_blocks(codes, sm, in, out_features, block_len, bits);
  ids = ids.to(kInt64).contiguous();
  TORCH_CHECK(ids.dim() == 1, "ids must be (n,)");
  auto out = torch::empty({ids.numel(), in}, torch::dtype(kFloat32));
  quant_block_rows_into(codes.data_ptr<uint8_t>(), sm.data_ptr(), quant_scale_format(sm),
                        out_features, in, block_len, bits, ids.data_ptr<int64_t>(),
                        ids.numel(), out.data_ptr<float>());
  return out;
}

// y (T, out) = x (T, in) @ W^T, W as pack_quant_blocks' blocks, x quantized per block to
// activation_bits (8 or 16).
torch::Tensor quant_block_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor sm,
                                 int64_t out_features, int64_t block_len, int64_t bits,
                                 int64_t activation_bits, bool force_plain) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be (T, in)");
  x = x.contiguous();
  check_quant_blocks(codes, sm, x.size(1), out_features, block_len, bits);
  auto y = torch::empty({x.size(0), out_features}, x.options());
  quant_block_linear_into(x.data_ptr<float>(), x.size(0), x.size(1), codes.data_ptr<uint8_t>(),
                          sm.data_ptr(), quant_scale_format(sm), out_features, block_len, bits,
                          activation_bits, y.data_ptr<float>(), force_plain);
  return y;
}

}  // namespace slotserve::kernels
