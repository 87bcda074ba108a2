// The paged KV cache's kernels: storing the new tokens' K/V at their slots, and decode
// attention (one query per sequence) read straight from the cache's blocks.
//
// The cache is float32, bfloat16 or int8 (`--kv-cache-dtype`): bf16 halves the bytes
// decode attention reads, which at 64 sequences of a few hundred positions outweigh the
// weights, and int8 nearly halves them again. K/V are rounded to bf16 (to nearest even, as
// torch's .to(torch.bfloat16)) when stored, widened back to fp32 exactly when read; or
// quantized to int8 codes with an fp32 scale per 32 elements (ops.h, KV_INT8_GROUP) when
// stored, read as code x scale in fp32 (slotserve/attention/kv_int8.py, bit for bit).
// Queries, scores and sums stay fp32. NOTE: the element type is a template parameter of
// every loop, chosen once per call (with_cache_elements): no per-element branch.

#include "common.h"
#include "ops.h"

#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace slotserve::kernels {

namespace {

// f(k_cache's elements, v_cache's elements) as float, c10::BFloat16 or int8_t pointers,
// whichever the caches hold.
template <typename F>
void with_cache_elements(const KvCacheView& cache, F f) {
  switch (cache.elements) {
    case KvElements::kBf16:
      f(static_cast<c10::BFloat16*>(cache.k), static_cast<c10::BFloat16*>(cache.v));
      break;
    case KvElements::kInt8:
      f(static_cast<int8_t*>(cache.k), static_cast<int8_t*>(cache.v));
      break;
    default: f(static_cast<float*>(cache.k), static_cast<float*>(cache.v));
  }
}

// n floats -> the cache's element type (a copy, or bf16 rounded to nearest even).
inline void store_row(const float* src, int64_t n, float* dst) { std::copy_n(src, n, dst); }
inline void store_row(const float* src, int64_t n, c10::BFloat16* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}
// n floats -> an int8 head row: n codes, then one fp32 scale per KV_INT8_GROUP of them.
// scale = amax / 127, code = nearest-even(x * (1 / scale)) (kv_int8.quantize's ops, in
// its order: the same bits). NOTE: a NaN keeps its run's scale NaN (its codes 0), so it
// reaches attention's output as it would from a float cache.
inline void store_row(const float* src, int64_t n, int8_t* dst) {
  for (int64_t at = 0, run = 0; at < n; at += KV_INT8_GROUP, ++run) {
    const int64_t len = std::min(KV_INT8_GROUP, n - at);
    float amax = 0.f;
    for (int64_t i = 0; i < len; ++i) {
      const float a = std::fabs(src[at + i]);
      if (a > amax || std::isnan(a)) amax = std::isnan(amax) ? amax : a;
    }
    const float scale = amax / 127.f;
    const float inverse = scale > 0.f ? 1.f / scale : 0.f;
    for (int64_t i = 0; i < len; ++i) {
      const float code = std::min(std::max(std::nearbyint(src[at + i] * inverse), -127.f), 127.f);
      dst[at + i] = std::isnan(code) ? int8_t(0) : static_cast<int8_t>(code);
    }
    std::memcpy(dst + n + int64_t(sizeof(float)) * run, &scale, sizeof(float));
  }
}

// An int8 head row (hd codes, then their scales) -> hd floats, code x scale.
inline void dequantize_head(const int8_t* head, int64_t head_dim, float* out) {
  for (int64_t at = 0, run = 0; at < head_dim; at += KV_INT8_GROUP, ++run) {
    float scale;
    std::memcpy(&scale, head + head_dim + int64_t(sizeof(float)) * run, sizeof(float));
    const int64_t len = std::min(KV_INT8_GROUP, head_dim - at);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) out[at + i] = float(head[at + i]) * scale;
  }
}

// The head size whose int8 row is `width` bytes (kv_int8_row_bytes' inverse), or -1.
int64_t kv_int8_head_dim(int64_t width) {
  for (int64_t head_dim = width; head_dim > 0 && kv_int8_row_bytes(head_dim) >= width;
       --head_dim)
    if (kv_int8_row_bytes(head_dim) == width) return head_dim;
  return -1;
}

}  // namespace

// The caches' pointers and shape: both float32, both bfloat16 or both int8, on the CPU,
// contiguous, (num_blocks, bs, nkv, hd) each (int8: (num_blocks, bs, nkv, row bytes)).
KvCacheView kv_cache_view(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  (dtype == kFloat32 || dtype == torch::kBFloat16 || dtype == kInt8) &&
                  v_cache.scalar_type() == dtype,
              "k_cache and v_cache must be float32 or bfloat16 (or int8 rows), the same, on "
              "the CPU");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "the caches must be (num_blocks, bs, nkv, hd), both the same");
  const int64_t width = k_cache.size(3);
  const KvElements elements = dtype == torch::kBFloat16 ? KvElements::kBf16
                              : dtype == kInt8            ? KvElements::kInt8
                                                          : KvElements::kFloat;
  const int64_t head_dim = elements == KvElements::kInt8 ? kv_int8_head_dim(width) : width;
  TORCH_CHECK(head_dim > 0, "an int8 cache's rows must be hd codes and 4 bytes per ",
              KV_INT8_GROUP, " of them, not ", width, " bytes");
  return {k_cache.data_ptr(), v_cache.data_ptr(), elements, k_cache.size(0),
          k_cache.size(1), k_cache.size(2), head_dim, width};
}

// Store T tokens' K and V (nkv heads of hd each, contiguous; token strides given) at their
// flat cache slots (checked by the caller).
void write_kv_rows(const KvCacheView& cache, const float* k, int64_t k_token_stride,
                   const float* v, int64_t v_token_stride, int64_t tokens,
                   const int64_t* slots) {
  const int64_t heads = cache.num_kv_heads, head_dim = cache.head_dim;
  with_cache_elements(cache, [&](auto* kc, auto* vc) {
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = (slots[t] * heads + h) * cache.head_stride;
        store_row(k + t * k_token_stride + h * head_dim, head_dim, kc + dst);
        store_row(v + t * v_token_stride + h * head_dim, head_dim, vc + dst);
      }
  });
}

// Store the new tokens' K and V, (T, nkv, hd) each (unit stride in hd), at their flat
// cache slots (T,) of k_cache, v_cache (num_blocks, bs, nkv, hd), float32 or bfloat16, or
// int8 (each head quantized: store_row).
void write_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
               torch::Tensor slot_mapping) {
  const KvCacheView cache = kv_cache_view(k_cache, v_cache);
  check_cpu_float(k, "k");
  check_cpu_float(v, "v");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v must have unit stride in hd");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == cache.num_kv_heads &&
                  k.size(2) == cache.head_dim,
              "k, v must be (T, nkv, hd) and the caches (num_blocks, bs, nkv, hd)");
  if (k.stride(1) != cache.head_dim) k = k.contiguous();  // heads side by side, as stored
  if (v.stride(1) != cache.head_dim) v = v.contiguous();
  slot_mapping = slot_mapping.to(kInt64).contiguous();
  TORCH_CHECK(slot_mapping.numel() == k.size(0), "one slot per new token");
  check_indices(slot_mapping, cache.num_blocks * cache.block_size, "slot");  // before any write
  write_kv_rows(cache, k.data_ptr<float>(), k.stride(0), v.data_ptr<float>(), v.stride(0),
                k.size(0), slot_mapping.data_ptr<int64_t>());
}

// Tables and lengths checked once, so that the kernel never reads outside the cache. Only the
// blocks a query reads are checked: with a sliding window (window > 0) those that hold the
// last `window` positions, so the entries before them may be anything (blocks no layer reads
// again, which a cache manager may have given back).
void check_block_tables(const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                        int64_t num_blocks, int64_t block_size, int64_t window) {
  TORCH_CHECK(block_tables.scalar_type() == kInt64 &&
                  context_lens.scalar_type() == kInt64 && block_tables.dim() == 2 &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "block_tables (D, maxb) and context_lens (D,) must be contiguous int64");
  const int64_t seqs = block_tables.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(context_lens.numel() == seqs, "one context length per block table");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: full attention)");
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t seq = 0; seq < seqs; ++seq) {
    TORCH_CHECK(lens[seq] > 0 && lens[seq] <= max_blocks * block_size, "bad context length");
    for (int64_t b = first_window_position(lens[seq], window) / block_size;
         b * block_size < lens[seq]; ++b) {
      const int64_t block = tables[seq * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of range");
    }
  }
}

namespace {

// NOTE: a sequence's blocks lie anywhere in the pool, so the hardware prefetcher loses the
// thread at every block boundary: asking for the K/V rows 16 positions ahead made decode
// attention 7-21% faster at batch 16-64 here (none at batch 1).
constexpr int64_t PREFETCH_POSITIONS = 16;
template <typename T>
inline void prefetch_row(const T* row, int64_t width) {
  for (int64_t i = 0; i < width; i += 64 / int64_t(sizeof(T)))  // one cache line each
    __builtin_prefetch(row + i);
}

// Each of the n rows of scores (n, len), in place; where tops is given, row j's largest score
// in tops[j] and its sum of exp(score - top) in totals[j] (what merges split rows).
void softmax_rows(float* scores, int64_t n, int64_t len, float* tops = nullptr,
                  float* totals = nullptr) {
  for (int64_t j = 0; j < n; ++j) {
    float* s = scores + j * len;
#if defined(__AVX2__) && defined(__FMA__)
    // NOTE: gcc left vec_exp's loop and std::max_element scalar (10% and 7% of decode
    // attention's time at 64 x 300 on a Zen 3), and a masked store costs ~18 uops on Zen: whole
    // vectors plain, the last part-filled one masked, so every score goes through the same
    // exp8 and each lane's sum runs over the same vectors as before (the same bits).
    const int64_t whole = len / 8 * 8;
    __m256 maxima = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t pos = 0; pos < whole; pos += 8)
      maxima = _mm256_max_ps(maxima, _mm256_loadu_ps(s + pos));
    float top = max8(maxima);
    for (int64_t pos = whole; pos < len; ++pos) top = std::max(top, s[pos]);
    const __m256 shift = _mm256_set1_ps(top);
    __m256 sums = _mm256_setzero_ps();
    for (int64_t pos = 0; pos < whole; pos += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + pos), shift));
      _mm256_storeu_ps(s + pos, e);
      sums = _mm256_add_ps(sums, e);
    }
    if (whole < len) {
      const __m256i lanes = lanes_below(len - whole);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(s + whole, lanes), shift));
      _mm256_maskstore_ps(s + whole, lanes, e);
      sums = _mm256_add_ps(sums, _mm256_and_ps(e, _mm256_castsi256_ps(lanes)));
    }
    const float total = sum8(sums);
#else
    const float top = *std::max_element(s, s + len);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t pos = 0; pos < len; ++pos) total += (s[pos] = vec_exp(s[pos] - top));
#endif
    if (tops) tops[j] = top, totals[j] = total;
    const float inv = 1.f / total;
    for (int64_t pos = 0; pos < len; ++pos) s[pos] *= inv;
  }
}

// attend (below) over an int8 cache: each position's heads in [first, first + width)
// dequantized into fp32 (code x scale), then attend's fp32 math over them.
template <typename RowOf>
void attend_int8(const float* const* queries, const int64_t* kv_offsets, int64_t n,
                 const int8_t* k_cache, const int8_t* v_cache, int64_t start, int64_t end,
                 RowOf row_of, int64_t first, int64_t width, int64_t head_dim,
                 int64_t head_stride, float scale, std::vector<float>& scores,
                 float* const* out) {
  const int64_t len = end - start, heads = width / head_stride;
  scores.resize(n * len);  // (n, len): column i is position start + i
  std::vector<float> rows(heads * head_dim);  // one position's heads, dequantized
  int64_t at[MAX_ATTENTION_HEADS];            // query j's head in rows
  for (int64_t j = 0; j < n; ++j) at[j] = (kv_offsets[j] - first) / head_stride * head_dim;
  auto dequantize_position = [&](const int8_t* cache, int64_t pos) {
    const int8_t* row = cache + row_of(pos) + first;
    for (int64_t h = 0; h < heads; ++h)
      dequantize_head(row + h * head_stride, head_dim, rows.data() + h * head_dim);
  };
  for (int64_t i = 0; i < len; ++i) {
    dequantize_position(k_cache, start + i);
    for (int64_t j = 0; j < n; ++j)
      scores[j * len + i] = dot(queries[j], rows.data() + at[j], head_dim) * scale;
  }
  softmax_rows(scores.data(), n, len);
  for (int64_t j = 0; j < n; ++j) std::fill_n(out[j], head_dim, 0.f);
  for (int64_t i = 0; i < len; ++i) {
    dequantize_position(v_cache, start + i);
    for (int64_t j = 0; j < n; ++j) {
      const float p = scores[j * len + i];
      const float* value = rows.data() + at[j];
      float* o = out[j];
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) o[d] += p * value[d];
    }
  }
}

// The n query heads `queries` of one sequence over the cached positions [start, end): query
// j reads the K/V head at offset kv_offsets[j] (elements) of each cached row; `row_of(pos)`
// is the offset of position pos's row in the cache tensors, and [first, first + width) the
// part of the row any of the n reads; head_stride: the elements between two KV heads (hd,
// or an int8 row's bytes). scores: scratch; out: n rows of hd.
template <typename T, typename RowOf>
void attend(const float* const* queries, const int64_t* kv_offsets, int64_t n,
            const T* k_cache, const T* v_cache, int64_t start, int64_t end, RowOf row_of,
            int64_t first, int64_t width, int64_t head_dim, int64_t head_stride, float scale,
            std::vector<float>& scores, float* const* out) {
  if constexpr (std::is_same_v<T, int8_t>) {
    attend_int8(queries, kv_offsets, n, k_cache, v_cache, start, end, row_of, first, width,
                head_dim, head_stride, scale, scores, out);
    return;
  }
  const int64_t len = end - start;
  scores.resize(n * len);  // (n, len): column i is position start + i
  for (int64_t i = 0; i < len; ++i) {
    if (i + PREFETCH_POSITIONS < len)
      prefetch_row(k_cache + row_of(start + i + PREFETCH_POSITIONS) + first, width);
    const T* keys = k_cache + row_of(start + i);
    for (int64_t j = 0; j < n; ++j)
      scores[j * len + i] = dot(queries[j], keys + kv_offsets[j], head_dim) * scale;
  }
  softmax_rows(scores.data(), n, len);
  for (int64_t j = 0; j < n; ++j) std::fill_n(out[j], head_dim, 0.f);
  for (int64_t i = 0; i < len; ++i) {
    if (i + PREFETCH_POSITIONS < len)
      prefetch_row(v_cache + row_of(start + i + PREFETCH_POSITIONS) + first, width);
    const T* values = v_cache + row_of(start + i);
    for (int64_t j = 0; j < n; ++j) {
      const float p = scores[j * len + i];
      const T* value = values + kv_offsets[j];
      float* o = out[j];
#pragma omp simd
      for (int64_t i = 0; i < head_dim; ++i) o[i] += p * to_float(value[i]);
    }
  }
}

// NOTE: the register kernels ask for the row PREFETCH_BLOCKS blocks on (the last one there
// is, while a block is left): at 64 sequences x 300 positions with 16 layers' KV from memory
// (1B's shapes, AMX Xeon) the next block's row came too late: 55.8 ms a step, 49.2 two
// blocks on, 48.5 three, 50.5 four (/tmp probe of paged_decode_attention, one run each).
constexpr int64_t PREFETCH_BLOCKS = 2;

#if defined(__AVX512F__)
// f(pos - start, offset of pos's row, offset of the row to ask for ahead or -1) for each of a
// sequence's cached positions [start, end), block by block (no division per position); the
// blocks before start's are never touched.
static_assert(PREFETCH_POSITIONS == 16, "the row ahead is a row of a later block");
template <typename F>
inline void for_each_row(const int64_t* table, int64_t start, int64_t end, int64_t block_size,
                         int64_t row, F f) {
  for (int64_t b = start / block_size, first = b * block_size; first < end;
       ++b, first += block_size) {
    const int64_t base = table[b] * block_size * row;
    const bool next = block_size == PREFETCH_POSITIONS && first + block_size < end;
    int64_t k = next ? PREFETCH_BLOCKS : 0;
    while (k > 1 && first + k * block_size >= end) --k;
    const int64_t ahead = k > 0 ? table[b + k] * block_size * row : -1;
    for (int64_t i = std::max<int64_t>(start - first, 0); i < std::min(block_size, end - first);
         ++i)
      f(first + i - start, base + i * row, next ? ahead + i * row : -1);
  }
}

// 16 cached elements as fp32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The elements of one cached head of 16 * NV values: as many, or an int8 row's bytes.
template <int NV, typename T>
constexpr int64_t head_elements() {
  return std::is_same_v<T, int8_t> ? kv_int8_row_bytes(16 * NV) : 16 * NV;
}

// One cached head of 16 * NV values as NV vectors of fp32: float and bf16 loaded (bf16
// widened exactly), int8 codes times their run's scale (one per KV_INT8_GROUP = 2 vectors).
template <int NV, typename T>
inline void load_head(const T* head, __m512* out) {
  if constexpr (std::is_same_v<T, int8_t>) {
    static_assert(KV_INT8_GROUP == 32 && NV % 2 == 0, "a scale per two vectors");
    for (int v = 0; v < NV; ++v) {
      float scale;
      std::memcpy(&scale, head + 16 * NV + int64_t(sizeof(float)) * (v / 2), sizeof(float));
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(head + 16 * v));
      out[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)),
                             _mm512_set1_ps(scale));
    }
  } else {
    for (int v = 0; v < NV; ++v) out[v] = load16(head + 16 * v);
  }
}

// The G query heads that share one KV head (head_dim = 16 * NV), with the queries and the
// outputs held in AVX-512 registers while the context streams by: per cached position NV
// loads and G * NV multiply-adds, where the generic attend's short runtime-length loops
// cost several times that in loop overhead (measured: compute, not memory, set its pace).
// scores: scratch (G, len). kv_offset: the KV head's offset (elements) in a cached row.
// tops, totals: where given (a run of a cut context), each query head's largest score and its
// sum of exp(score - top), for merge_runs.
template <int NV, int G, typename T>
void attend_kv_head_avx512(const float* const* queries, float* const* out,
                           const T* k_cache, const T* v_cache, const int64_t* table,
                           int64_t start, int64_t end, int64_t block_size, int64_t row,
                           int64_t kv_offset, float scale, float* scores, float* tops,
                           float* totals) {
  const int64_t len = end - start;  // scores' columns: positions start..end-1
  __m512 q[G][NV];
  for (int j = 0; j < G; ++j)
    for (int v = 0; v < NV; ++v) q[j][v] = _mm512_loadu_ps(queries[j] + 16 * v);
  for_each_row(table, start, end, block_size, row, [&](int64_t pos, int64_t at, int64_t ahead) {
    if (ahead >= 0) prefetch_row(k_cache + ahead + kv_offset, head_elements<NV, T>());
    __m512 key[NV];
    load_head<NV>(k_cache + at + kv_offset, key);
    for (int j = 0; j < G; ++j) {
      __m512 acc = _mm512_mul_ps(q[j][0], key[0]);
      for (int v = 1; v < NV; ++v) acc = _mm512_fmadd_ps(q[j][v], key[v], acc);
      scores[j * len + pos] = _mm512_reduce_add_ps(acc) * scale;
    }
  });
  softmax_rows(scores, G, len, tops, totals);
  __m512 o[G][NV];
  for (int j = 0; j < G; ++j)
    for (int v = 0; v < NV; ++v) o[j][v] = _mm512_setzero_ps();
  for_each_row(table, start, end, block_size, row, [&](int64_t pos, int64_t at, int64_t ahead) {
    if (ahead >= 0) prefetch_row(v_cache + ahead + kv_offset, head_elements<NV, T>());
    __m512 value[NV];
    load_head<NV>(v_cache + at + kv_offset, value);
    for (int j = 0; j < G; ++j) {
      const __m512 p = _mm512_set1_ps(scores[j * len + pos]);
      for (int v = 0; v < NV; ++v) o[j][v] = _mm512_fmadd_ps(p, value[v], o[j][v]);
    }
  });
  for (int j = 0; j < G; ++j)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out[j] + 16 * v, o[j][v]);
}

// The `group` query heads of one KV head, in register-sized chunks (at most 16 registers of
// outputs: 4 heads of 64, 2 of 128); tops, totals: the group's (G,) each, or null.
template <int NV, typename T>
void attend_kv_head_chunks(const float* const* queries, float* const* out, int64_t group,
                           const T* k_cache, const T* v_cache, const int64_t* table,
                           int64_t start, int64_t end, int64_t block_size, int64_t row,
                           int64_t kv_offset, float scale, std::vector<float>& scores,
                           float* tops, float* totals) {
  constexpr int MAX_G = 16 / NV;
  scores.resize(MAX_G * (end - start));
  for (int64_t j = 0; j < group; j += MAX_G) {
    const auto args = std::make_tuple(queries + j, out + j, k_cache, v_cache, table, start,
                                      end, block_size, row, kv_offset, scale, scores.data(),
                                      tops ? tops + j : nullptr, tops ? totals + j : nullptr);
    switch (std::min<int64_t>(MAX_G, group - j)) {
      case 1: std::apply(attend_kv_head_avx512<NV, 1, T>, args); break;
      case 2: std::apply(attend_kv_head_avx512<NV, 2, T>, args); break;
      case 3: std::apply(attend_kv_head_avx512<NV, MAX_G >= 3 ? 3 : 1, T>, args); break;
      default: std::apply(attend_kv_head_avx512<NV, MAX_G >= 4 ? 4 : 1, T>, args); break;
    }
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// The AVX2 counterpart of attend_kv_head_avx512 (CPUs without AVX-512: the avx2 class), for
// the same reason: the generic attend's runtime-length loops, not the memory, set its pace
// (Zen 3, SmolLM2's shapes: 1 x 300 positions 1.43 ms for 30 layers, 64 x 300 78 ms, 5-6 GB/s
// of a bf16 cache). Eight lanes a vector, so the queries stay in L1 rather than registers.

// Elements 8 v .. 8 v + 7 of a cached head of hd values as fp32: float and bf16 loaded (bf16
// widened exactly), int8 codes times their run's scale (KV_INT8_GROUP = 4 vectors a scale).
template <int HD>
inline __m256 load8(const float* head, int v) { return _mm256_loadu_ps(head + 8 * v); }
template <int HD>
inline __m256 load8(const c10::BFloat16* head, int v) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(head + 8 * v));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
template <int HD>
inline __m256 load8(const int8_t* head, int v) {
  static_assert(KV_INT8_GROUP == 32, "a scale per four vectors");
  float scale;
  std::memcpy(&scale, head + HD + int64_t(sizeof(float)) * (v / 4), sizeof(float));
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(head + 8 * v));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), _mm256_set1_ps(scale));
}

// f(pos - start, offset of pos's row, positions, offset of the same row PREFETCH_BLOCKS blocks
// on or -1) for each block of a sequence's cached positions [start, end): the block's first
// position read, its row, and how many positions of the block are read (their rows follow).
template <typename F>
inline void for_each_block(const int64_t* table, int64_t start, int64_t end,
                           int64_t block_size, int64_t row, F f) {
  for (int64_t b = start / block_size, first = b * block_size; first < end;
       ++b, first += block_size) {
    const int64_t from = std::max<int64_t>(start - first, 0);
    const int64_t to = std::min(block_size, end - first);
    int64_t k = PREFETCH_BLOCKS;
    while (k > 0 && first + k * block_size >= end) --k;
    const int64_t ahead = k > 0 ? (table[b + k] * block_size + from) * row : -1;
    f(first + from - start, (table[b] * block_size + from) * row, to - from, ahead);
  }
}

constexpr int64_t VALUES_EARLY_BYTES = 128 * 1024;  // attend_heads_avx2's NOTE

// A task's query heads over one sequence's cached positions (hd = HD): `kv_heads` KV heads
// from kv_offset on (elements into a cached row; head_stride apart), each read by `group`
// queries, G at a time (G divides group). Block by block: each cached position's scores by
// two chains of multiply-adds a query (even and odd vectors), then the block's values in
// slices of DV vectors, a slice's G x DV sums in registers while the block's positions go by
// (AVX2's 16 registers hold no more), kept in `out` between blocks. The task's part of the
// rows PREFETCH_BLOCKS blocks on is asked for while a block is read.
// NOTE: each output is summed position by position in order, whatever G, the slices, the
// blocks and the heads beside it: a query's result does not depend on its task (batch
// invariant). scores: scratch (kv_heads x group, len).
template <int HD, int G, typename T>
void attend_heads_avx2(const float* const* queries, float* const* out, int64_t group,
                       int64_t kv_heads, const T* k_cache, const T* v_cache,
                       const int64_t* table, int64_t start, int64_t end, int64_t block_size,
                       int64_t row, int64_t kv_offset, int64_t head_stride, float scale,
                       float* scores, float* tops, float* totals) {
  constexpr int NV = HD / 8;
  const int64_t len = end - start;  // scores' columns: positions start..end-1
  const int64_t width = kv_heads * head_stride, n = kv_heads * group;
  // NOTE: a short context's values are asked for beside its keys (they stay in L2 until the
  // values' pass), a long one's in that pass.
  const bool values_early = len * width * int64_t(sizeof(T)) <= VALUES_EARLY_BYTES;
  for_each_block(table, start, std::min(end, start + PREFETCH_BLOCKS * block_size), block_size,
                 row, [&](int64_t, int64_t at, int64_t count, int64_t) {
    for (int64_t i = 0; i < count; ++i) {
      prefetch_row(k_cache + at + i * row + kv_offset, width);
      if (values_early) prefetch_row(v_cache + at + i * row + kv_offset, width);
    }
  });
  for_each_block(table, start, end, block_size, row,
                 [&](int64_t pos, int64_t at, int64_t count, int64_t ahead) {
    for (int64_t i = 0; i < count; ++i) {
      if (ahead >= 0) prefetch_row(k_cache + ahead + i * row + kv_offset, width);
      if (ahead >= 0 && values_early) prefetch_row(v_cache + ahead + i * row + kv_offset, width);
      for (int64_t q = 0; q < n; q += G) {
        const T* key = k_cache + at + i * row + kv_offset + q / group * head_stride;
        __m256 acc[G][2];
        for (int j = 0; j < G; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        for (int v = 0; v < NV; ++v) {
          const __m256 k = load8<HD>(key, v);
          for (int j = 0; j < G; ++j)
            acc[j][v & 1] =
                _mm256_fmadd_ps(_mm256_loadu_ps(queries[q + j] + 8 * v), k, acc[j][v & 1]);
        }
        for (int j = 0; j < G; ++j)
          scores[(q + j) * len + pos + i] = sum8(_mm256_add_ps(acc[j][0], acc[j][1])) * scale;
      }
    }
  });
  softmax_rows(scores, n, len, tops, totals);
  constexpr int DV = std::min(NV, G == 1 ? 8 : G == 2 ? 4 : 2);  // G x DV <= 8 registers
  for (int64_t j = 0; j < n; ++j) std::fill_n(out[j], HD, 0.f);
  for_each_block(table, start, end, block_size, row,
                 [&](int64_t pos, int64_t at, int64_t count, int64_t ahead) {
    if (ahead >= 0 && !values_early)
      for (int64_t i = 0; i < count; ++i)
        prefetch_row(v_cache + ahead + i * row + kv_offset, width);
    for (int64_t q = 0; q < n; q += G) {
      const T* values = v_cache + at + kv_offset + q / group * head_stride;
      for (int first = 0; first < NV; first += DV) {
        __m256 o[G][DV];
        for (int j = 0; j < G; ++j)
          for (int v = 0; v < DV; ++v) o[j][v] = _mm256_loadu_ps(out[q + j] + 8 * (first + v));
        for (int64_t i = 0; i < count; ++i) {
          __m256 p[G];
          for (int j = 0; j < G; ++j)
            p[j] = _mm256_broadcast_ss(scores + (q + j) * len + pos + i);
          for (int v = 0; v < DV; ++v) {
            const __m256 x = load8<HD>(values + i * row, first + v);
            for (int j = 0; j < G; ++j) o[j][v] = _mm256_fmadd_ps(p[j], x, o[j][v]);
          }
        }
        for (int j = 0; j < G; ++j)
          for (int v = 0; v < DV; ++v) _mm256_storeu_ps(out[q + j] + 8 * (first + v), o[j][v]);
      }
    }
  });
}

// attend_heads_avx2 with the most queries a chunk that divide `group` (at most 4).
template <int HD, typename T>
void attend_heads_avx2_of(const float* const* queries, float* const* out, int64_t group,
                          int64_t kv_heads, const T* k_cache, const T* v_cache,
                          const int64_t* table, int64_t start, int64_t end, int64_t block_size,
                          int64_t row, int64_t kv_offset, int64_t head_stride, float scale,
                          std::vector<float>& scores, float* tops, float* totals) {
  scores.resize(kv_heads * group * (end - start));
  const auto args = std::make_tuple(queries, out, group, kv_heads, k_cache, v_cache, table,
                                    start, end, block_size, row, kv_offset, head_stride, scale,
                                    scores.data(), tops, totals);
  if (group % 4 == 0) std::apply(attend_heads_avx2<HD, 4, T>, args);
  else if (group % 3 == 0) std::apply(attend_heads_avx2<HD, 3, T>, args);
  else if (group % 2 == 0) std::apply(attend_heads_avx2<HD, 2, T>, args);
  else std::apply(attend_heads_avx2<HD, 1, T>, args);
}
#endif

// Whether this build's decode attention cuts long contexts into runs (the register kernels).
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool SPLITS_LONG_CONTEXTS = true;
#else
constexpr bool SPLITS_LONG_CONTEXTS = false;
#endif
// NOTE (batch invariance): a context of more than SPLIT_POSITIONS read positions is cut into
// runs of SPLIT_POSITIONS from its first read position, each attended by tasks of its own,
// and the runs' outputs merged in order (flash-decoding's merge, merge_runs). The cut depends
// on the sequence's own positions only, never on its batch or the threads. What it buys: one
// long sequence's KV heads spread over every thread (batch 1 on SmolLM2: 3 KV heads ran on 2
// threads as 2:1, and on a many-core CPU only as many threads as KV heads worked).
constexpr int64_t SPLIT_POSITIONS = 512;

// A task: query heads of KV heads [kv_first, kv_first + kv_per_task) of sequence `seq` over
// its read positions [start, end); `run`: the run's index among the cut contexts' runs (its
// outputs in their scratch), or -1 for a context attended whole (outputs straight to out).
struct AttentionTask {
  int64_t seq, kv_first, start, end, run;
};

// out[seq, head] for each cut sequence: its runs' outputs (normalized within the run),
// weighted by each run's sum of exp(score - the run's top) rescaled to the largest top, in
// run order. runs[seq]: the sequence's first run and count (count 1: not cut).
void merge_runs(const std::vector<std::pair<int64_t, int64_t>>& runs, int64_t num_heads,
                int64_t head_dim, const float* run_out, const float* tops, const float* totals,
                float* out) {
  for (int64_t seq = 0; seq < int64_t(runs.size()); ++seq) {
    const auto [first, count] = runs[seq];
    if (count == 1) continue;
    for (int64_t head = 0; head < num_heads; ++head) {
      float top = -std::numeric_limits<float>::infinity(), weights = 0.f;
      for (int64_t r = first; r < first + count; ++r)
        top = std::max(top, tops[r * num_heads + head]);
      float* o = out + (seq * num_heads + head) * head_dim;
      std::fill_n(o, head_dim, 0.f);
      for (int64_t r = first; r < first + count; ++r) {
        const int64_t at = r * num_heads + head;
        const float weight = totals[at] * std::exp(tops[at] - top);
        weights += weight;
        const float* part = run_out + at * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] += weight * part[d];
      }
      const float inv = 1.f / weights;
      for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
    }
  }
}

}  // namespace

// One query per sequence over its cached context, read straight from the paged cache: q
// (D, nh, hd) at the given strides (unit stride in hd), block tables (D, max_blocks) and
// context lengths (D,) checked by check_block_tables -> out (D, nh, hd), contiguous.
// window > 0: a sliding window (HF's: the query at position L - 1 sees the last `window`
// positions, L - window .. L - 1); the blocks before it are skipped, not masked.
// NOTE: query head h reads KV head h / (nh / nkv), as HF groups them. A task reads whole
// cached rows (all KV heads of a position, contiguous) when there are enough sequences to
// keep the threads busy, and one KV head's part of each row otherwise.
void decode_attention_into(const float* q, int64_t seqs, int64_t num_heads,
                           int64_t q_token_stride, int64_t q_head_stride,
                           const KvCacheView& cache, const int64_t* tables, int64_t max_blocks,
                           const int64_t* lens, double scale, int64_t window, float* out) {
  const int64_t block_size = cache.block_size, num_kv_heads = cache.num_kv_heads;
  const int64_t head_dim = cache.head_dim, group = num_heads / num_kv_heads;
  const int64_t head_stride = cache.head_stride;  // hd, or an int8 row's bytes
  const int64_t row = num_kv_heads * head_stride;  // elements between two cached positions
  const int64_t kv_per_task = seqs >= 2 * pool_threads() ? num_kv_heads : 1;
  const int64_t tasks_per_seq = num_kv_heads / kv_per_task;
  const int64_t heads_per_task = kv_per_task * group;
  const bool cuts = SPLITS_LONG_CONTEXTS && (head_dim == 64 || head_dim == 128);
  std::vector<AttentionTask> tasks;
  std::vector<std::pair<int64_t, int64_t>> runs(seqs);  // a sequence's first run, count
  int64_t cut_runs = 0;
  for (int64_t seq = 0; seq < seqs; ++seq) {
    const int64_t start = first_window_position(lens[seq], window), end = lens[seq];
    const int64_t count = cuts && end - start > SPLIT_POSITIONS
                              ? (end - start + SPLIT_POSITIONS - 1) / SPLIT_POSITIONS
                              : 1;
    runs[seq] = {cut_runs, count};
    for (int64_t t = 0; t < tasks_per_seq; ++t)
      for (int64_t r = 0; r < count; ++r)
        tasks.push_back({seq, t * kv_per_task, start + r * SPLIT_POSITIONS,
                         r + 1 < count ? start + (r + 1) * SPLIT_POSITIONS : end,
                         count > 1 ? cut_runs + r : -1});
    if (count > 1) cut_runs += count;
  }
  // the cut runs' outputs (cut_runs, nh, hd), tops and totals (cut_runs, nh)
  std::vector<float> run_out(cut_runs * num_heads * head_dim), run_tops(cut_runs * num_heads),
      run_totals(cut_runs * num_heads);
  // NOTE: waking a second thread costs more than attending a very short context: tables of
  // fewer than SERIAL_POSITIONS positions in all run on the calling thread. (It was 1024
  // while the engine's OpenMP workers slept between regions; with them spinning, batch 1's
  // attention at ~180 positions took 0.55-0.60 ms per step on both threads, 0.78 on one.)
  constexpr int64_t SERIAL_POSITIONS = 64;
  const int64_t positions = max_blocks * block_size;  // a sequence's most positions read
  const int64_t num_tasks = int64_t(tasks.size());
  const int64_t grain =
      seqs * (window > 0 ? std::min(window, positions) : positions) < SERIAL_POSITIONS
          ? num_tasks
          : 1;
  // (kc, vc): the caches' elements, float, c10::BFloat16 or int8_t
  with_cache_elements(cache, [&](const auto* kc, const auto* vc) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(kc)>>;
    parallel_for(0, num_tasks, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      const float* queries[MAX_ATTENTION_HEADS];
      float* outs[MAX_ATTENTION_HEADS];
      int64_t kv_offsets[MAX_ATTENTION_HEADS];
      for (int64_t index = begin; index < end; ++index) {
        const AttentionTask& task = tasks[index];
        const int64_t seq = task.seq, kv_first = task.kv_first;
        const int64_t* table = tables + seq * max_blocks;
        auto row_of = [&](int64_t pos) {
          return (table[pos / block_size] * block_size + pos % block_size) * row;
        };
        float* const to = task.run < 0 ? out + seq * num_heads * head_dim
                                       : run_out.data() + task.run * num_heads * head_dim;
        for (int64_t j = 0; j < heads_per_task; ++j) {
          const int64_t head = kv_first * group + j;
          queries[j] = q + seq * q_token_stride + head * q_head_stride;
          outs[j] = to + head * head_dim;
          kv_offsets[j] = head / group * head_stride;
        }
#if defined(__AVX512F__)
        if (head_dim == 64 || head_dim == 128) {
          for (int64_t h = 0; h < kv_per_task; ++h) {
            const auto chunks =
                head_dim == 64 ? attend_kv_head_chunks<4, T> : attend_kv_head_chunks<8, T>;
            const int64_t at = task.run * num_heads + (kv_first + h) * group;
            chunks(queries + h * group, outs + h * group, group, kc, vc, table, task.start,
                   task.end, block_size, row, (kv_first + h) * head_stride, float(scale),
                   scores, task.run < 0 ? nullptr : run_tops.data() + at,
                   task.run < 0 ? nullptr : run_totals.data() + at);
          }
          continue;
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if (head_dim == 64 || head_dim == 128) {
          const auto heads = head_dim == 64 ? attend_heads_avx2_of<64, T>
                                            : attend_heads_avx2_of<128, T>;
          const int64_t at = task.run * num_heads + kv_first * group;
          heads(queries, outs, group, kv_per_task, kc, vc, table, task.start, task.end,
                block_size, row, kv_first * head_stride, head_stride, float(scale), scores,
                task.run < 0 ? nullptr : run_tops.data() + at,
                task.run < 0 ? nullptr : run_totals.data() + at);
          continue;
        }
#endif
        attend(queries, kv_offsets, heads_per_task, kc, vc, task.start, task.end, row_of,
               kv_first * head_stride, kv_per_task * head_stride, head_dim, head_stride,
               float(scale), scores, outs);
      }
    });
  });
  if (cut_runs > 0)
    merge_runs(runs, num_heads, head_dim, run_out.data(), run_tops.data(), run_totals.data(),
               out);
}

// q: (D, nh, hd), unit stride in hd; k_cache, v_cache: (num_blocks, bs, nkv, hd);
// block_tables: (D, maxb) int64; context_lens: (D,) int64; window: a sliding window (the
// last `window` positions), 0 for full attention -> out (D, nh, hd).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t window) {
  check_cpu_float(q, "q");
  const KvCacheView cache = kv_cache_view(k_cache, v_cache);
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be (D, nh, hd), unit stride in hd");
  block_tables = block_tables.to(kInt64).contiguous();
  context_lens = context_lens.to(kInt64).contiguous();
  const int64_t seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  TORCH_CHECK(cache.head_dim == head_dim && cache.num_kv_heads > 0 &&
                  block_tables.dim() == 2 && block_tables.size(0) == seqs,
              "q (D, nh, hd), caches (num_blocks, bs, nkv, hd), block_tables (D, maxb)");
  TORCH_CHECK(num_heads % cache.num_kv_heads == 0 && num_heads <= MAX_ATTENTION_HEADS,
              "num_heads must be a multiple of nkv, at most 256");
  check_block_tables(block_tables, context_lens, cache.num_blocks, cache.block_size, window);
  auto out = torch::empty({seqs, num_heads, head_dim}, q.options());
  decode_attention_into(q.data_ptr<float>(), seqs, num_heads, q.stride(0), q.stride(1), cache,
                        block_tables.data_ptr<int64_t>(), block_tables.size(1),
                        context_lens.data_ptr<int64_t>(), scale, window,
                        out.data_ptr<float>());
  return out;
}

}  // namespace slotserve::kernels
