// The paged KV cache's kernels: storing the new tokens' K/V at their slots, and decode
// attention (one query per sequence) read straight from the cache's blocks.
//
// The cache is float32 or bfloat16 (`--kv-cache-dtype`): bf16 halves the bytes decode
// attention reads, which at 64 sequences of a few hundred positions outweigh the weights.
// K/V are rounded to bf16 (to nearest even, as torch's .to(torch.bfloat16)) when stored,
// widened back to fp32 exactly when read; queries, scores and sums stay fp32.

#include "common.h"
#include "ops.h"

#include <tuple>
#include <type_traits>
#include <vector>

namespace slotserve::kernels {

namespace {

// f(k_cache's elements, v_cache's elements) as float or c10::BFloat16 pointers, whichever
// the caches hold.
template <typename F>
void with_cache_elements(const KvCacheView& cache, F f) {
  if (cache.bf16)
    f(static_cast<c10::BFloat16*>(cache.k), static_cast<c10::BFloat16*>(cache.v));
  else
    f(static_cast<float*>(cache.k), static_cast<float*>(cache.v));
}

// n floats -> the cache's element type (a copy, or bf16 rounded to nearest even).
inline void store_row(const float* src, int64_t n, float* dst) { std::copy_n(src, n, dst); }
inline void store_row(const float* src, int64_t n, c10::BFloat16* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

}  // namespace

// The caches' pointers and shape: both float32 or both bfloat16, on the CPU, contiguous,
// (num_blocks, bs, nkv, hd) each.
KvCacheView kv_cache_view(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  (dtype == torch::kFloat32 || dtype == torch::kBFloat16) &&
                  v_cache.scalar_type() == dtype,
              "k_cache and v_cache must be float32 or bfloat16 (the same) on the CPU");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "the caches must be (num_blocks, bs, nkv, hd), both the same");
  return {k_cache.data_ptr(), v_cache.data_ptr(), dtype == torch::kBFloat16, k_cache.size(0),
          k_cache.size(1), k_cache.size(2), k_cache.size(3)};
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
        const int64_t dst = (slots[t] * heads + h) * head_dim;
        store_row(k + t * k_token_stride + h * head_dim, head_dim, kc + dst);
        store_row(v + t * v_token_stride + h * head_dim, head_dim, vc + dst);
      }
  });
}

// Store the new tokens' K and V, (T, nkv, hd) each (unit stride in hd), at their flat
// cache slots (T,) of k_cache, v_cache (num_blocks, bs, nkv, hd), float32 or bfloat16.
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
  slot_mapping = slot_mapping.to(torch::kInt64).contiguous();
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
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 &&
                  context_lens.scalar_type() == torch::kInt64 && block_tables.dim() == 2 &&
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

// Each of the n rows of scores (n, len), in place.
void softmax_rows(float* scores, int64_t n, int64_t len) {
  for (int64_t j = 0; j < n; ++j) {
    float* s = scores + j * len;
    const float top = *std::max_element(s, s + len);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t pos = 0; pos < len; ++pos) total += (s[pos] = vec_exp(s[pos] - top));
    const float inv = 1.f / total;
    for (int64_t pos = 0; pos < len; ++pos) s[pos] *= inv;
  }
}

// The n query heads `queries` of one sequence over the cached positions [start, end): query
// j reads the K/V head at offset kv_offsets[j] (elements) of each cached row; `row_of(pos)`
// is the offset of position pos's row in the cache tensors, and [first, first + width) the
// part of the row any of the n reads. scores: scratch; out: n rows of hd.
template <typename T, typename RowOf>
void attend(const float* const* queries, const int64_t* kv_offsets, int64_t n,
            const T* k_cache, const T* v_cache, int64_t start, int64_t end, RowOf row_of,
            int64_t first, int64_t width, int64_t head_dim, float scale,
            std::vector<float>& scores, float* const* out) {
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

#if defined(__AVX512F__)
// f(pos - start, offset of pos's row, offset of the row PREFETCH_POSITIONS ahead or -1) for
// each of a sequence's cached positions [start, end), block by block (no division per
// position); the blocks before start's are never touched.
static_assert(PREFETCH_POSITIONS == 16, "the row ahead is the same row of the next block");
template <typename F>
inline void for_each_row(const int64_t* table, int64_t start, int64_t end, int64_t block_size,
                         int64_t row, F f) {
  for (int64_t b = start / block_size, first = b * block_size; first < end;
       ++b, first += block_size) {
    const int64_t base = table[b] * block_size * row;
    const bool next = block_size == PREFETCH_POSITIONS && first + block_size < end;
    const int64_t ahead = next ? table[b + 1] * block_size * row : -1;
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

// The G query heads that share one KV head (head_dim = 16 * NV), with the queries and the
// outputs held in AVX-512 registers while the context streams by: per cached position NV
// loads and G * NV multiply-adds, where the generic attend's short runtime-length loops
// cost several times that in loop overhead (measured: compute, not memory, set its pace).
// scores: scratch (G, len). kv_offset: the KV head's offset (elements) in a cached row.
template <int NV, int G, typename T>
void attend_kv_head_avx512(const float* const* queries, float* const* out,
                           const T* k_cache, const T* v_cache, const int64_t* table,
                           int64_t start, int64_t end, int64_t block_size, int64_t row,
                           int64_t kv_offset, float scale, float* scores) {
  const int64_t len = end - start;  // scores' columns: positions start..end-1
  __m512 q[G][NV];
  for (int j = 0; j < G; ++j)
    for (int v = 0; v < NV; ++v) q[j][v] = _mm512_loadu_ps(queries[j] + 16 * v);
  for_each_row(table, start, end, block_size, row, [&](int64_t pos, int64_t at, int64_t ahead) {
    if (ahead >= 0) prefetch_row(k_cache + ahead + kv_offset, 16 * NV);
    __m512 key[NV];
    for (int v = 0; v < NV; ++v) key[v] = load16(k_cache + at + kv_offset + 16 * v);
    for (int j = 0; j < G; ++j) {
      __m512 acc = _mm512_mul_ps(q[j][0], key[0]);
      for (int v = 1; v < NV; ++v) acc = _mm512_fmadd_ps(q[j][v], key[v], acc);
      scores[j * len + pos] = _mm512_reduce_add_ps(acc) * scale;
    }
  });
  softmax_rows(scores, G, len);
  __m512 o[G][NV];
  for (int j = 0; j < G; ++j)
    for (int v = 0; v < NV; ++v) o[j][v] = _mm512_setzero_ps();
  for_each_row(table, start, end, block_size, row, [&](int64_t pos, int64_t at, int64_t ahead) {
    if (ahead >= 0) prefetch_row(v_cache + ahead + kv_offset, 16 * NV);
    __m512 value[NV];
    for (int v = 0; v < NV; ++v) value[v] = load16(v_cache + at + kv_offset + 16 * v);
    for (int j = 0; j < G; ++j) {
      const __m512 p = _mm512_set1_ps(scores[j * len + pos]);
      for (int v = 0; v < NV; ++v) o[j][v] = _mm512_fmadd_ps(p, value[v], o[j][v]);
    }
  });
  for (int j = 0; j < G; ++j)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out[j] + 16 * v, o[j][v]);
}

// The `group` query heads of one KV head, in register-sized chunks (at most 16 registers of
// outputs: 4 heads of 64, 2 of 128).
template <int NV, typename T>
void attend_kv_head_chunks(const float* const* queries, float* const* out, int64_t group,
                           const T* k_cache, const T* v_cache, const int64_t* table,
                           int64_t start, int64_t end, int64_t block_size, int64_t row,
                           int64_t kv_offset, float scale, std::vector<float>& scores) {
  constexpr int MAX_G = 16 / NV;
  scores.resize(MAX_G * (end - start));
  for (int64_t j = 0; j < group; j += MAX_G) {
    const auto args = std::make_tuple(queries + j, out + j, k_cache, v_cache, table, start,
                                      end, block_size, row, kv_offset, scale, scores.data());
    switch (std::min<int64_t>(MAX_G, group - j)) {
      case 1: std::apply(attend_kv_head_avx512<NV, 1, T>, args); break;
      case 2: std::apply(attend_kv_head_avx512<NV, 2, T>, args); break;
      case 3: std::apply(attend_kv_head_avx512<NV, MAX_G >= 3 ? 3 : 1, T>, args); break;
      default: std::apply(attend_kv_head_avx512<NV, MAX_G >= 4 ? 4 : 1, T>, args); break;
    }
  }
}
#endif

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
  const int64_t row = num_kv_heads * head_dim;  // elements between two cached positions
  const int64_t kv_per_task = seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks_per_seq = num_kv_heads / kv_per_task;
  const int64_t heads_per_task = kv_per_task * group;
  // NOTE: waking a second thread costs more than attending a very short context: tables of
  // fewer than SERIAL_POSITIONS positions in all run on the calling thread. (It was 1024
  // while the engine's OpenMP workers slept between regions; with them spinning, batch 1's
  // attention at ~180 positions took 0.55-0.60 ms per step on both threads, 0.78 on one.)
  constexpr int64_t SERIAL_POSITIONS = 64;
  const int64_t tasks = seqs * tasks_per_seq;  // one (sequence, KV heads) each
  const int64_t positions = max_blocks * block_size;  // a sequence's most positions read
  const int64_t grain =
      seqs * (window > 0 ? std::min(window, positions) : positions) < SERIAL_POSITIONS ? tasks
                                                                                       : 1;
  // (kc, vc): the caches' elements, float or c10::BFloat16
  with_cache_elements(cache, [&](const auto* kc, const auto* vc) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(kc)>>;
    at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      const float* queries[MAX_ATTENTION_HEADS];
      float* outs[MAX_ATTENTION_HEADS];
      int64_t kv_offsets[MAX_ATTENTION_HEADS];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t seq = task / tasks_per_seq;
        const int64_t kv_first = task % tasks_per_seq * kv_per_task;
        const int64_t* table = tables + seq * max_blocks;
        const int64_t start = first_window_position(lens[seq], window), end = lens[seq];
        auto row_of = [&](int64_t pos) {
          return (table[pos / block_size] * block_size + pos % block_size) * row;
        };
        for (int64_t j = 0; j < heads_per_task; ++j) {
          const int64_t head = kv_first * group + j;
          queries[j] = q + seq * q_token_stride + head * q_head_stride;
          outs[j] = out + (seq * num_heads + head) * head_dim;
          kv_offsets[j] = head / group * head_dim;
        }
#if defined(__AVX512F__)
        if (head_dim == 64 || head_dim == 128) {
          for (int64_t h = 0; h < kv_per_task; ++h) {
            const auto chunks =
                head_dim == 64 ? attend_kv_head_chunks<4, T> : attend_kv_head_chunks<8, T>;
            chunks(queries + h * group, outs + h * group, group, kc, vc, table, start, end,
                   block_size, row, (kv_first + h) * head_dim, float(scale), scores);
          }
          continue;
        }
#endif
        attend(queries, kv_offsets, heads_per_task, kc, vc, start, end, row_of,
               kv_first * head_dim, kv_per_task * head_dim, head_dim, float(scale), scores,
               outs);
      }
    });
  });
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
  block_tables = block_tables.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
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
