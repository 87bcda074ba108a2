// Fused CPU kernels: each replaces several small eager torch ops (or, for the int8 matmul,
// a slower torch kernel).
//
// At batch 1 a decode step of SmolLM2-135M spent about a third of its time outside the
// matmuls, in some 25 small torch ops per layer (RMSNorm alone is 9 ops in torch 2.13's CPU
// build); these kernels do the same math in one pass each. The torch code in
// slotserve/model/layers.py, slotserve/attention/torch_paged.py and
// slotserve/model/linear_kernels.py stays the reference: tests/model/test_fused_ops.py,
// tests/unit/test_paged_attention.py and tests/model/test_linear_kernels.py check every
// kernel here against it.
//
// Plain loops, fp32 accumulation; `#pragma omp simd` lets the compiler vectorise the
// reductions (no -ffast-math: it would flush denormals for the whole process).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

void check_cpu_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32");
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

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y (T, H) = x / rms(x) * weight, row by row.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && weight.numel() == x.size(1), "x must be (T, H), weight (H,)");
  check_cpu_float(weight, "weight");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t rows = x.size(0), hidden = x.size(1);
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * hidden;
      float* yr = yp + r * hidden;
      const float inv = 1.f / std::sqrt(dot(xr, xr, hidden) / hidden + float(eps));
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) yr[i] = xr[i] * inv * wp[i];
    }
  });
  return y;
}

// gate_up (T, 2I) -> silu(gate) * up (T, I).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_cpu_float(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be (T, 2I)");
  gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto y = torch::empty({rows, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gp + r * 2 * inter;
      const float* up = gate + inter;
      float* yr = yp + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) yr[i] = gate[i] / (1.f + vec_exp(-gate[i])) * up[i];
    }
  });
  return y;
}

// Rotate-half RoPE in place. x: (T, n, hd) with a contiguous last dim (a view into the
// qkv output is fine); cos, sin: (T, hd/2) of each token's position.
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be (T, n, hd) with unit stride in hd");
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even");
  check_cpu_float(cos, "cos");
  check_cpu_float(sin, "sin");
  TORCH_CHECK(cos.numel() == tokens * half && sin.numel() == tokens * half,
              "cos and sin must hold (T, hd/2) values");
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = xp + t * token_stride + h * head_stride;
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

// Store the new tokens' K and V, (T, nkv, hd) each (unit stride in hd), at their flat
// cache slots (T,) of k_cache, v_cache (num_blocks, bs, nkv, hd).
void write_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
               torch::Tensor slot_mapping) {
  check_cpu_float(k_cache, "k_cache");
  check_cpu_float(v_cache, "v_cache");
  check_cpu_float(k, "k");
  check_cpu_float(v, "v");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v must have unit stride in hd");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k_cache.sizes() == v_cache.sizes() &&
                  k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "k, v must be (T, nkv, hd) and the caches (num_blocks, bs, nkv, hd)");
  slot_mapping = slot_mapping.to(torch::kInt64).contiguous();
  TORCH_CHECK(slot_mapping.numel() == k.size(0), "one slot per new token");
  const int64_t tokens = k.size(0), heads = k.size(1), head_dim = k.size(2);
  const int64_t num_slots = k_cache.numel() / (heads * head_dim);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)  // all checked before anything is written
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t dst = (slots[t] * heads + h) * head_dim;
      std::copy_n(k.data_ptr<float>() + t * k.stride(0) + h * k.stride(1), head_dim,
                  k_cache.data_ptr<float>() + dst);
      std::copy_n(v.data_ptr<float>() + t * v.stride(0) + h * v.stride(1), head_dim,
                  v_cache.data_ptr<float>() + dst);
    }
  }
}

// Tables and lengths checked once, so that the kernel never reads outside the cache.
void check_tables(const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                  int64_t num_blocks, int64_t block_size) {
  const int64_t seqs = block_tables.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(context_lens.numel() == seqs, "one context length per block table");
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t seq = 0; seq < seqs; ++seq) {
    TORCH_CHECK(lens[seq] > 0 && lens[seq] <= max_blocks * block_size, "bad context length");
    for (int64_t b = 0; b * block_size < lens[seq]; ++b) {
      const int64_t block = tables[seq * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of range");
    }
  }
}

// NOTE: a sequence's blocks lie anywhere in the pool, so the hardware prefetcher loses the
// thread at every block boundary: asking for the K/V rows 16 positions ahead made decode
// attention 7-21% faster at batch 16-64 here (none at batch 1).
constexpr int64_t PREFETCH_POSITIONS = 16;
inline void prefetch_row(const float* row, int64_t width) {
  for (int64_t i = 0; i < width; i += 16)  // 16 floats: one cache line
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

// The n query heads `queries` of one sequence over `len` cached positions: query j reads
// the K/V head at offset kv_offsets[j] (floats) of each cached row; `row_of(pos)` is the
// offset of position pos's row in the cache tensors, and [first, first + width) the part of
// the row any of the n reads. scores: scratch; out: n rows of hd.
template <typename RowOf>
void attend(const float* const* queries, const int64_t* kv_offsets, int64_t n,
            const float* k_cache, const float* v_cache, int64_t len, RowOf row_of,
            int64_t first, int64_t width, int64_t head_dim, float scale,
            std::vector<float>& scores, float* const* out) {
  scores.resize(n * len);  // (n, len)
  for (int64_t pos = 0; pos < len; ++pos) {
    if (pos + PREFETCH_POSITIONS < len)
      prefetch_row(k_cache + row_of(pos + PREFETCH_POSITIONS) + first, width);
    const float* keys = k_cache + row_of(pos);
    for (int64_t j = 0; j < n; ++j)
      scores[j * len + pos] = dot(queries[j], keys + kv_offsets[j], head_dim) * scale;
  }
  softmax_rows(scores.data(), n, len);
  for (int64_t j = 0; j < n; ++j) std::fill_n(out[j], head_dim, 0.f);
  for (int64_t pos = 0; pos < len; ++pos) {
    if (pos + PREFETCH_POSITIONS < len)
      prefetch_row(v_cache + row_of(pos + PREFETCH_POSITIONS) + first, width);
    const float* values = v_cache + row_of(pos);
    for (int64_t j = 0; j < n; ++j) {
      const float p = scores[j * len + pos];
      const float* value = values + kv_offsets[j];
      float* o = out[j];
#pragma omp simd
      for (int64_t i = 0; i < head_dim; ++i) o[i] += p * value[i];
    }
  }
}

#if defined(__AVX512F__)
// f(pos, offset of pos's row, offset of the row PREFETCH_POSITIONS ahead or -1) for each of a
// sequence's first `len` cached positions, block by block (no division per position).
static_assert(PREFETCH_POSITIONS == 16, "the row ahead is the same row of the next block");
template <typename F>
inline void for_each_row(const int64_t* table, int64_t len, int64_t block_size, int64_t row,
                         F f) {
  for (int64_t b = 0, start = 0; start < len; ++b, start += block_size) {
    const int64_t base = table[b] * block_size * row;
    const bool next = block_size == PREFETCH_POSITIONS && start + block_size < len;
    const int64_t ahead = next ? table[b + 1] * block_size * row : -1;
    for (int64_t i = 0; i < std::min(block_size, len - start); ++i)
      f(start + i, base + i * row, next ? ahead + i * row : -1);
  }
}

// The G query heads that share one KV head (head_dim = 16 * NV), with the queries and the
// outputs held in AVX-512 registers while the context streams by: per cached position NV
// loads and G * NV multiply-adds, where the generic attend's short runtime-length loops
// cost several times that in loop overhead (measured: compute, not memory, set its pace).
// scores: scratch (G, len). kv_offset: the KV head's offset (floats) in a cached row.
template <int NV, int G>
void attend_kv_head_avx512(const float* const* queries, float* const* out,
                           const float* k_cache, const float* v_cache, const int64_t* table,
                           int64_t len, int64_t block_size, int64_t row, int64_t kv_offset,
                           float scale, float* scores) {
  __m512 q[G][NV];
  for (int j = 0; j < G; ++j)
    for (int v = 0; v < NV; ++v) q[j][v] = _mm512_loadu_ps(queries[j] + 16 * v);
  for_each_row(table, len, block_size, row, [&](int64_t pos, int64_t at, int64_t ahead) {
    if (ahead >= 0) prefetch_row(k_cache + ahead + kv_offset, 16 * NV);
    __m512 key[NV];
    for (int v = 0; v < NV; ++v) key[v] = _mm512_loadu_ps(k_cache + at + kv_offset + 16 * v);
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
  for_each_row(table, len, block_size, row, [&](int64_t pos, int64_t at, int64_t ahead) {
    if (ahead >= 0) prefetch_row(v_cache + ahead + kv_offset, 16 * NV);
    __m512 value[NV];
    for (int v = 0; v < NV; ++v) value[v] = _mm512_loadu_ps(v_cache + at + kv_offset + 16 * v);
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
template <int NV>
void attend_kv_head_chunks(const float* const* queries, float* const* out, int64_t group,
                           const float* k_cache, const float* v_cache, const int64_t* table,
                           int64_t len, int64_t block_size, int64_t row, int64_t kv_offset,
                           float scale, std::vector<float>& scores) {
  constexpr int MAX_G = 16 / NV;
  scores.resize(MAX_G * len);
  for (int64_t j = 0; j < group; j += MAX_G) {
    const auto args = std::make_tuple(queries + j, out + j, k_cache, v_cache, table, len,
                                      block_size, row, kv_offset, scale, scores.data());
    switch (std::min<int64_t>(MAX_G, group - j)) {
      case 1: std::apply(attend_kv_head_avx512<NV, 1>, args); break;
      case 2: std::apply(attend_kv_head_avx512<NV, 2>, args); break;
      case 3: std::apply(attend_kv_head_avx512<NV, MAX_G >= 3 ? 3 : 1>, args); break;
      default: std::apply(attend_kv_head_avx512<NV, MAX_G >= 4 ? 4 : 1>, args); break;
    }
  }
}
#endif

// One query per sequence over its cached context, read straight from the paged cache.
// q: (D, nh, hd), unit stride in hd; k_cache, v_cache: (num_blocks, bs, nkv, hd);
// block_tables: (D, maxb) int64; context_lens: (D,) int64 -> out (D, nh, hd).
// NOTE: query head h reads KV head h / (nh / nkv), as HF groups them. A task reads whole
// cached rows (all KV heads of a position, contiguous) when there are enough sequences to
// keep the threads busy, and one KV head's part of each row otherwise.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  check_cpu_float(q, "q");
  check_cpu_float(k_cache, "k_cache");
  check_cpu_float(v_cache, "v_cache");
  TORCH_CHECK(q.stride(2) == 1, "q must have unit stride in hd");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  block_tables = block_tables.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == head_dim &&
                  num_kv_heads > 0 && block_tables.size(0) == seqs,
              "q (D, nh, hd), caches (num_blocks, bs, nkv, hd), block_tables (D, maxb)");
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  constexpr int64_t MAX_HEADS = 256;
  TORCH_CHECK(group * num_kv_heads == num_heads && num_heads <= MAX_HEADS,
              "num_heads must be a multiple of nkv, at most 256");
  check_tables(block_tables, context_lens, k_cache.size(0), block_size);
  auto out = torch::empty({seqs, num_heads, head_dim}, q.options());
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t row = num_kv_heads * head_dim;  // floats between two cached positions
  const int64_t kv_per_task = seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks_per_seq = num_kv_heads / kv_per_task;
  const int64_t heads_per_task = kv_per_task * group;
  // NOTE: waking a second thread costs more than attending a short context: small batches
  // (tables of fewer than SERIAL_POSITIONS positions in all) run on the calling thread.
  constexpr int64_t SERIAL_POSITIONS = 1024;
  const int64_t tasks = seqs * tasks_per_seq;  // one (sequence, KV heads) each
  const int64_t grain = seqs * max_blocks * block_size < SERIAL_POSITIONS ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    const float* queries[MAX_HEADS];
    float* outs[MAX_HEADS];
    int64_t kv_offsets[MAX_HEADS];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / tasks_per_seq, kv_first = task % tasks_per_seq * kv_per_task;
      const int64_t* table = tables + seq * max_blocks;
      auto row_of = [&](int64_t pos) {
        return (table[pos / block_size] * block_size + pos % block_size) * row;
      };
      for (int64_t j = 0; j < heads_per_task; ++j) {
        const int64_t head = kv_first * group + j;
        queries[j] = q.data_ptr<float>() + seq * q.stride(0) + head * q.stride(1);
        outs[j] = out.data_ptr<float>() + (seq * num_heads + head) * head_dim;
        kv_offsets[j] = head / group * head_dim;
      }
#if defined(__AVX512F__)
      if (head_dim == 64 || head_dim == 128) {
        for (int64_t h = 0; h < kv_per_task; ++h) {
          const auto chunks = head_dim == 64 ? attend_kv_head_chunks<4> : attend_kv_head_chunks<8>;
          chunks(queries + h * group, outs + h * group, group, k_cache.data_ptr<float>(),
                 v_cache.data_ptr<float>(), table, lens[seq], block_size, row,
                 (kv_first + h) * head_dim, float(scale), scores);
        }
        continue;
      }
#endif
      attend(queries, kv_offsets, heads_per_task, k_cache.data_ptr<float>(),
             v_cache.data_ptr<float>(), lens[seq], row_of, kv_first * head_dim,
             kv_per_task * head_dim, head_dim, float(scale), scores, outs);
    }
  });
  return out;
}

// ---- int8 weights x int16 activations -----------------------------------------------
// Weight-only int8 would convert every weight to float (one core's vector units, not the
// memory, set the pace then). Instead each token's activations are quantized to int16 with
// one scale per token (|error| <= max|x| / 65534, finer than bfloat16's 8 bits), and the
// products are summed in int32 by AVX-512's 16-bit dot product: 32 weights per instruction.

constexpr int64_t INT16_MAX_Q = 32767;
// NOTE: a lane adds 2 products of at most 127 * 32767 per 32 inputs; flushing the int32
// lanes to float every FLUSH_EVERY inputs keeps them below 2^31 whatever the values.
constexpr int64_t FLUSH_EVERY = 4096;
// NOTE: the weights are read once per step, straight from memory: asking for the bytes 4 KB
// ahead (later in this row or in the next rows) ran the model's int8 matmuls in 7.3 ms
// instead of 10.5 here (benchmarks/PERF.md). A prefetch past the end never faults.
constexpr int64_t PREFETCH_BYTES = 4096;

// x (T, in) fp32 -> int16 (T, in) and each row's scale, x ~= q * scale.
std::pair<torch::Tensor, torch::Tensor> quantize_rows_int16(const torch::Tensor& x) {
  const int64_t rows = x.size(0), in = x.size(1);
  auto q = torch::empty({rows, in}, x.options().dtype(torch::kInt16));
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
#else
  for (int t = 0; t < TOKENS; ++t) out[t] = 0.f;
#endif
  // The tail (everything, without AVX-512), summed exactly in int64 and added once.
  int64_t rest[TOKENS] = {};
  for (; i < in; ++i)
    for (int t = 0; t < TOKENS; ++t) rest[t] += int32_t(w[i]) * x[t * in + i];
  for (int t = 0; t < TOKENS; ++t) out[t] += float(rest[t]);
}

// y (T, out) ~= x (T, in) @ (qweight (out, in) int8 * scales (out,))^T.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales) {
  check_cpu_float(x, "x");
  check_cpu_float(scales, "scales");
  TORCH_CHECK(qweight.scalar_type() == torch::kInt8 && qweight.is_contiguous(),
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
  at::parallel_for(0, outs, 16, [&](int64_t begin, int64_t end) {
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

// ---- fp32 linear over weight panels ---------------------------------------------------
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

constexpr int64_t PANEL_WIDTH = 32;  // outputs per panel: two 16-float vectors
constexpr int PANEL_TILE_ROWS = 12;  // 12 rows x 2 vectors = 24 accumulators
constexpr int64_t PANEL_PREFETCH_BYTES = 8192;  // 8 KB ahead: 4 KB was slower at 4-16 rows

// tile(panel, first row, rows, cols) for every panel (in parallel) and every tile of rows.
// NOTE: the rows go in tiles as even as possible (64 rows: 11 11 11 11 10 10, not
// 12 x 5 + 4), and a panel's tiles in row order, whatever the thread.
template <typename Tile>
void for_each_panel_tile(int64_t tokens, int64_t num_panels, int64_t out_features,
                         const Tile& tile) {
  if (tokens == 0) return;
  const int64_t tiles = (tokens + PANEL_TILE_ROWS - 1) / PANEL_TILE_ROWS;
  const int64_t base = tokens / tiles, extra = tokens % tiles;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(PANEL_WIDTH, out_features - p * PANEL_WIDTH);
      for (int64_t t = 0, row = 0; t < tiles; ++t) {
        const int rows = int(base + (t < extra ? 1 : 0));
        tile(p, row, rows, cols);
        row += rows;
      }
    }
  });
}

// weight (out, in) -> panels (ceil(out / 32), in, 32), the last one padded with zeros.
torch::Tensor pack_panels(torch::Tensor weight) {
  check_cpu_float(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "weight must be (out, in)");
  const int64_t outs = weight.size(0), in = weight.size(1);
  const int64_t panels = (outs + PANEL_WIDTH - 1) / PANEL_WIDTH;
  auto padded = torch::zeros({panels * PANEL_WIDTH, in}, weight.options());
  padded.narrow(0, 0, outs).copy_(weight);
  return padded.view({panels, PANEL_WIDTH, in}).transpose(1, 2).contiguous();
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
    _mm_prefetch(reinterpret_cast<const char*>(w) + PANEL_PREFETCH_BYTES, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w) + PANEL_PREFETCH_BYTES + 64, _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * in + k]);
      acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
    }
  }
  store_panel_tile<ROWS>(acc, y, outs, cols);
#else
  // The same sums in the same order, without AVX-512 (fma keeps each step's rounding).
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

// Whether panel_tile runs its AVX-512 code (else the plain loops: right, but slower than
// MKL's GEMM, so model/linear_kernels.py then picks MKL).
bool panel_linear_vectorised() {
#if defined(__AVX512F__)
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
  if (tokens == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_each_panel_tile(tokens, num_panels, out_features,
                      [&](int64_t p, int64_t row, int rows, int64_t cols) {
    panel_tile_of(rows, xp + row * in, pp + p * in * PANEL_WIDTH, in,
                  yp + row * out_features + p * PANEL_WIDTH, out_features, cols,
                  std::make_integer_sequence<int, PANEL_TILE_ROWS>{});
  });
  return y;
}

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

// Input pairs of a panel: ceil(in / 2), rounded up to 16 (the AMX kernel's tile of pairs;
// the other kernels stop at the last real pair).
inline int64_t padded_pairs(int64_t in) { return ((in + 1) / 2 + 15) / 16 * 16; }

// weight (out, in) fp32 -> panels (ceil(out / 32), padded_pairs(in), 64) bf16, zero padded.
torch::Tensor pack_panels_bf16(torch::Tensor weight) {
  check_cpu_float(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "weight must be (out, in)");
  const int64_t outs = weight.size(0), in = weight.size(1);
  const int64_t panels = (outs + PANEL_WIDTH - 1) / PANEL_WIDTH, pairs = padded_pairs(in);
  auto padded = torch::zeros({panels * PANEL_WIDTH, 2 * pairs}, weight.options());
  padded.narrow(0, 0, outs).narrow(1, 0, in).copy_(weight);
  return padded.to(torch::kBFloat16)  // round to nearest even
      .view({panels, PANEL_WIDTH, pairs, 2})
      .permute({0, 2, 1, 3})
      .contiguous()
      .view({panels, pairs, 2 * PANEL_WIDTH});
}

// NOTE: set by a test (set_force_plain_loops) to run the plain-loop fallbacks of the bf16
// kernels on a CPU that has the instructions: the path a CPU without them takes.
bool g_force_plain_loops = false;

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
    _mm_prefetch(reinterpret_cast<const char*>(w) + PANEL_PREFETCH_BYTES, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w) + PANEL_PREFETCH_BYTES + 64, _MM_HINT_T0);
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

#if defined(__AVX512BF16__)
// y[r, :cols] = xb[r, :] . panel for ROWS rows of bf16 x (pairs of inputs as one int32).
template <int ROWS>
void panel_tile_bf16_dot(const uint32_t* xb, const uint16_t* panel, int64_t pairs, float* y,
                         int64_t outs, int64_t cols) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const uint16_t* w = panel + kp * 2 * PANEL_WIDTH;
    _mm_prefetch(reinterpret_cast<const char*>(w) + PANEL_PREFETCH_BYTES, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w) + PANEL_PREFETCH_BYTES + 64, _MM_HINT_T0);
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

// Which bf16 modes run vectorised here: (fp32 activations: AVX-512F; bf16 activations:
// AVX512_BF16). Without, the plain loops: right, but slower than the fp32 panels.
std::tuple<bool, bool> panel_bf16_vectorised() {
#if defined(__AVX512F__)
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
#if defined(__AVX512F__)
  ((rows == R + 1 ? (panel_tile_bf16_widen<R + 1>(x, panel, in, y, outs, cols), 0) : 0), ...);
#else
  panel_tile_bf16_plain(rows, x, xb, panel, in, y, outs, cols);
#endif
}

// y (T, out) = x (T, in) @ W^T, W given as pack_panels_bf16(W (out, in)); x fp32, rounded
// to bf16 first when bf16_activations.
torch::Tensor panel_linear_bf16(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                                bool bf16_activations) {
  check_cpu_float(x, "x");
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == torch::kBFloat16,
              "panels must be bfloat16 on the CPU");
  x = x.contiguous();
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == 2 * PANEL_WIDTH &&
                  panels.is_contiguous(), "x must be (T, in), panels from pack_panels_bf16");
  const int64_t tokens = x.size(0), in = x.size(1), num_panels = panels.size(0);
  const int64_t pairs = (in + 1) / 2, pairs16 = padded_pairs(in);
  TORCH_CHECK(panels.size(1) == pairs16, "x and panels disagree on in_features");
  TORCH_CHECK(out_features > (num_panels - 1) * PANEL_WIDTH &&
                  out_features <= num_panels * PANEL_WIDTH, "out_features does not fit panels");
  auto y = torch::empty({tokens, out_features}, x.options());
  if (tokens == 0) return y;
  torch::Tensor xb;  // (T, 2 * pairs) bf16, the odd input's partner zero
  if (bf16_activations) {
    xb = torch::zeros({tokens, 2 * pairs}, x.options().dtype(torch::kBFloat16));
    xb.narrow(1, 0, in).copy_(x);  // round to nearest even
  }
  const float* xp = x.data_ptr<float>();
  const uint16_t* xbp =
      bf16_activations ? reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()) : nullptr;
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  for_each_panel_tile(tokens, num_panels, out_features,
                      [&](int64_t p, int64_t row, int rows, int64_t cols) {
    panel_tile_bf16_of(rows, bf16_activations, xp + row * in,
                       xbp ? xbp + row * 2 * pairs : nullptr,
                       pp + p * pairs16 * 2 * PANEL_WIDTH, in,
                       yp + row * out_features + p * PANEL_WIDTH, out_features, cols,
                       std::make_integer_sequence<int, PANEL_TILE_ROWS>{});
  });
  return y;
}

// ---- bf16 panels on AMX (many rows) ---------------------------------------------------
// At 64+ rows a step is compute-bound: AMX's tile multiply (TDPBF16PS: a 16 x 32 bf16 tile
// of x times a 32 x 16 tile of weights into 16 x 16 fp32 sums) does in one instruction
// what takes 32 FMAs. The weight tiles are read straight from the bf16 panels (16 input
// pairs x 16 outputs, row stride one panel row), x is rounded to bf16 (round to nearest
// even), and the sums stay fp32 to the output. NOTE: like the vdpbf16ps mode each row's
// sums do not depend on the other rows (batch invariant among AMX calls), but they differ
// from the fp32-activation mode's: a caller that switches mode by row count gives up bit-
// for-bit batch invariance across that switch.
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

// y[rows0 .. rows0 + 32) x [p * 32, +cols) for two blocks of 16 rows of xb (bf16 rows of
// stride ldx elements, padded with zero rows), the weights of one panel.
void amx_panel_block(const uint16_t* xb, int64_t ldx, const uint16_t* panel, int64_t pairs16,
                     float* tmp /* 32 x 32 */) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kp = 0; kp < pairs16; kp += AMX_PAIRS) {
    const uint16_t* w = panel + kp * 2 * PANEL_WIDTH;
    _tile_loadd(6, w, 2 * PANEL_WIDTH * 2);
    _tile_loadd(7, w + PANEL_WIDTH, 2 * PANEL_WIDTH * 2);
    _tile_loadd(4, xb + 2 * kp, ldx * 2);
    _tile_loadd(5, xb + AMX_ROWS * ldx + 2 * kp, ldx * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, tmp, 32 * 4);
  _tile_stored(1, tmp + 16, 32 * 4);
  _tile_stored(2, tmp + 16 * 32, 32 * 4);
  _tile_stored(3, tmp + 16 * 32 + 16, 32 * 4);
}
#endif

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
  check_cpu_float(x, "x");
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == torch::kBFloat16,
              "panels must be bfloat16 on the CPU");
  x = x.contiguous();
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == 2 * PANEL_WIDTH &&
                  panels.is_contiguous(), "x must be (T, in), panels from pack_panels_bf16");
  const int64_t tokens = x.size(0), in = x.size(1), num_panels = panels.size(0);
  const int64_t pairs16 = panels.size(1);
  TORCH_CHECK(pairs16 == padded_pairs(in), "x and panels disagree on in_features");
  TORCH_CHECK(out_features > (num_panels - 1) * PANEL_WIDTH &&
                  out_features <= num_panels * PANEL_WIDTH, "out_features does not fit panels");
  auto y = torch::empty({tokens, out_features}, x.options());
  if (tokens == 0) return y;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  // x in bf16, zero-padded to a multiple of 2 x 16 rows and of 32 inputs
  const int64_t blocks = (tokens + 2 * AMX_ROWS - 1) / (2 * AMX_ROWS), ldx = 2 * pairs16;
  auto xb = torch::zeros({blocks * 2 * AMX_ROWS, ldx}, x.options().dtype(torch::kBFloat16));
  xb.narrow(0, 0, tokens).narrow(1, 0, in).copy_(x);
  const uint16_t* xbp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float tmp[2 * AMX_ROWS * PANEL_WIDTH];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(PANEL_WIDTH, out_features - p * PANEL_WIDTH);
      for (int64_t b = 0; b < blocks; ++b) {
        amx_panel_block(xbp + b * 2 * AMX_ROWS * ldx, ldx, pp + p * pairs16 * 2 * PANEL_WIDTH,
                        pairs16, tmp);
        const int64_t rows = std::min(2 * AMX_ROWS, tokens - b * 2 * AMX_ROWS);
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

// ---- the decode stack: every decoder layer of an all-decode iteration in one call -----
// At batch 1 a step's kernels are short (a few us each) and the Python around them (module
// calls, views, ~15 calls per layer) cost 2-3 ms of a 10-25 ms step. For an iteration of
// decodes only, DecodeStack runs the same kernels in the same order as
// slotserve/model/llama.py's LlamaDecoderLayer, from C++, with the GIL released: the CPU's
// counterpart of replaying a captured CUDA graph. Prefills and mixed batches stay in Python.

// One linear layer's weights, in whichever form its kernel (model/linear_kernels.py) keeps.
struct LinearWeights {
  enum class Kind { kPlain, kMkl, kInt8, kPanel, kPanelBf16, kPanelBf16Dot };
  Kind kind;  // plain: a = W (in, out); mkl: a = packed, b = shape-only (out, in) view;
              // int8: a = qweight (out, in), b = scales (out,); panel: a = pack_panels(W);
              // panel_bf16 (fp32 activations), panel_bf16_dot (bf16 activations):
              // a = pack_panels_bf16(W)
  torch::Tensor a, b;
  c10::optional<torch::Tensor> bias;
  int64_t out_features;  // panels only (the last panel may be padded)
  int64_t amx_min_rows;  // panel_bf16: from this many rows on, AMX where usable (0: never)

  torch::Tensor operator()(const torch::Tensor& x) const {  // (T, in) -> (T, out)
    if (kind == Kind::kMkl) {
      static auto mkl_linear =
          c10::Dispatcher::singleton()
              .findSchemaOrThrow("mkl::_mkl_linear", "")
              .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&,
                                   const torch::Tensor&, const c10::optional<torch::Tensor>&,
                                   int64_t)>();
      return mkl_linear.call(x, a, b, bias, x.size(0));
    }
    if (kind == Kind::kPlain) return bias ? torch::addmm(*bias, x, a) : torch::mm(x, a);
    torch::Tensor y = kind == Kind::kPanel      ? panel_linear(x, a, out_features)
                      : kind == Kind::kInt8     ? int8_linear(x, a, b)
                      : kind == Kind::kPanelBf16 && amx_min_rows > 0 &&
                              x.size(0) >= amx_min_rows && amx_bf16_usable()
                          ? panel_linear_bf16_amx(x, a, out_features)
                          : panel_linear_bf16(x, a, out_features, kind == Kind::kPanelBf16Dot);
    return bias ? y.add_(*bias) : y;
  }
};

LinearWeights make_linear(const std::string& kind, torch::Tensor a,
                          c10::optional<torch::Tensor> b, c10::optional<torch::Tensor> bias,
                          int64_t out_features, int64_t amx_min_rows) {
  using Kind = LinearWeights::Kind;
  const bool panel = kind == "panel" || kind == "panel_bf16" || kind == "panel_bf16_dot";
  TORCH_CHECK(kind == "plain" || kind == "mkl" || kind == "int8" || panel,
              "linear kind must be plain, mkl, int8 or panel (or panel_bf16, panel_bf16_dot), got ",
              kind);
  TORCH_CHECK(kind == "plain" || panel || b, kind, " linear needs its second tensor");
  TORCH_CHECK(!panel || out_features > 0, "panel linear needs out_features");
  const Kind parsed = kind == "plain"        ? Kind::kPlain
                      : kind == "mkl"        ? Kind::kMkl
                      : kind == "int8"       ? Kind::kInt8
                      : kind == "panel"      ? Kind::kPanel
                      : kind == "panel_bf16" ? Kind::kPanelBf16
                                             : Kind::kPanelBf16Dot;
  return {parsed, a, b ? *b : torch::Tensor(), bias, out_features, amx_min_rows};
}

struct DecoderLayerWeights {
  torch::Tensor input_norm, post_attention_norm;  // (H,)
  LinearWeights qkv, o, gate_up, down;
};

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
              double scale, torch::Tensor final_norm)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        scale_(scale), final_norm_(final_norm) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor post_attention_norm,
                 const LinearWeights& qkv, const LinearWeights& o,
                 const LinearWeights& gate_up, const LinearWeights& down) {
    layers_.push_back({input_norm, post_attention_norm, qkv, o, gate_up, down});
  }

  // x (D, H): the embeddings of D decode tokens, one per sequence; cos, sin (D, hd/2);
  // caches: k and v of each layer in turn; slot_mapping (D,); block_tables (D, maxb);
  // context_lens (D,) -> the final norm of the last hidden state (D, H).
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                        const std::vector<torch::Tensor>& caches, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, torch::Tensor context_lens) const {
    TORCH_CHECK(caches.size() == 2 * layers_.size(), "one k and one v cache per layer");
    const int64_t D = x.size(0), q_size = num_heads_ * head_dim_;
    const int64_t kv_size = num_kv_heads_ * head_dim_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecoderLayerWeights& layer = layers_[i];
      const torch::Tensor &k_cache = caches[2 * i], &v_cache = caches[2 * i + 1];
      // attention block
      torch::Tensor qkv = layer.qkv(rms_norm(x, layer.input_norm, eps_));  // (D, q + 2 kv)
      torch::Tensor qk = qkv.narrow(1, 0, q_size + kv_size)
                             .view({D, num_heads_ + num_kv_heads_, head_dim_});
      rotary_(qk, cos, sin);  // in place, inside qkv
      torch::Tensor q = qk.narrow(1, 0, num_heads_);                // (D, nh, hd)
      torch::Tensor k = qk.narrow(1, num_heads_, num_kv_heads_);    // (D, nkv, hd)
      torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size)
                            .view({D, num_kv_heads_, head_dim_});  // (D, nkv, hd)
      write_kv_(k_cache, v_cache, k, v, slot_mapping);
      torch::Tensor attn = paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                  context_lens, scale_);  // (D, nh, hd)
      x = x + layer.o(attn.view({D, q_size}));
      // MLP block
      torch::Tensor gate_up = layer.gate_up(rms_norm(x, layer.post_attention_norm, eps_));
      x = x + layer.down(silu_mul(gate_up));  // (D, H)
    }
    return rms_norm(x, final_norm_, eps_);
  }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  torch::Tensor final_norm_;
  std::vector<DecoderLayerWeights> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (fp32)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused (T, 2I) gate-up output");
  m.def("rotary_", &rotary_, "rotate-half RoPE in place");
  m.def("write_kv_", &write_kv_, "store new K/V at their cache slots");
  m.def("int8_linear", &int8_linear, "x @ int8 weights (per-channel scales), int16 activations");
  m.def("pack_panels", &pack_panels, "fp32 weights (out, in) as panels for panel_linear");
  m.def("panel_linear", &panel_linear, "x @ W^T, W as pack_panels(W) (fp32)");
  m.def("panel_linear_vectorised", &panel_linear_vectorised,
        "whether panel_linear runs vectorised (AVX-512)");
  m.def("pack_panels_bf16", &pack_panels_bf16,
        "fp32 weights (out, in) rounded to bf16, as panels for panel_linear_bf16");
  m.def("panel_linear_bf16", &panel_linear_bf16,
        "x @ W^T, W as pack_panels_bf16(W), fp32 accumulation; activations fp32 or rounded "
        "to bf16", py::arg("x"), py::arg("panels"), py::arg("out_features"),
        py::arg("bf16_activations") = false);
  m.def("panel_linear_bf16_amx", &panel_linear_bf16_amx,
        "x @ W^T on AMX-BF16, W as pack_panels_bf16(W), x rounded to bf16, fp32 sums");
  m.def("amx_bf16_usable", &amx_bf16_usable, "whether panel_linear_bf16_amx runs here");
  m.def("panel_bf16_vectorised", &panel_bf16_vectorised,
        "(fp32-activation mode, bf16-activation mode) run vectorised (AVX-512F, AVX512_BF16)");
  m.def("set_force_plain_loops", &set_force_plain_loops,
        "tests: run the bf16 panel kernels' plain-loop fallbacks even where vectorised");
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query per sequence over its paged K/V context");
  py::class_<LinearWeights>(m, "LinearWeights");
  m.def("linear_weights", &make_linear, "a linear layer's weights for DecodeStack",
        py::arg("kind"), py::arg("a"), py::arg("b") = py::none(), py::arg("bias") = py::none(),
        py::arg("out_features") = -1, py::arg("amx_min_rows") = 0);
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, double, double, torch::Tensor>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>(),
           "all decoder layers and the final norm of an all-decode iteration");
}
