// Fused CPU kernels for the decode step: each replaces several small eager torch ops.
//
// At batch 1 a decode step of SmolLM2-135M spent about a third of its time outside the
// matmuls, in some 25 small torch ops per layer (RMSNorm alone is 9 ops in torch 2.13's CPU
// build); these kernels do the same math in one pass each. The torch code in
// slotserve/model/layers.py and slotserve/attention/torch_paged.py stays the reference:
// tests/model/test_fused_ops.py checks every kernel here against it.
//
// Plain loops, fp32 accumulation; `#pragma omp simd` lets the compiler vectorise the
// reductions (no -ffast-math: it would flush denormals for the whole process).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
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
  x = x.contiguous();
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
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
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
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v must have unit stride in hd");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  slot_mapping = slot_mapping.to(torch::kInt64).contiguous();
  const int64_t tokens = k.size(0), heads = k.size(1), head_dim = k.size(2);
  const int64_t num_slots = k_cache.numel() / (heads * head_dim);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t dst = (slots[t] * heads + h) * head_dim;
      std::copy_n(k.data_ptr<float>() + t * k.stride(0) + h * k.stride(1), head_dim,
                  k_cache.data_ptr<float>() + dst);
      std::copy_n(v.data_ptr<float>() + t * v.stride(0) + h * v.stride(1), head_dim,
                  v_cache.data_ptr<float>() + dst);
    }
  }
}

// One query per sequence over its cached context, read straight from the paged cache.
// q: (D, nh, hd), unit stride in hd; k_cache, v_cache: (num_blocks, bs, nkv, hd);
// block_tables: (D, maxb) int64; context_lens: (D,) int64 -> out (D, nh, hd).
// NOTE: the g = nh / nkv query heads sharing a KV head are done together (head h reads KV
// head h / g, as HF groups them), so each K/V row is read once per sequence.
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
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  TORCH_CHECK(group * num_kv_heads == num_heads, "num_heads must be a multiple of nkv");
  auto out = torch::empty({seqs, num_heads, head_dim}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t row = num_kv_heads * head_dim;  // floats between two cached positions
  // NOTE: waking a second thread costs more than attending a short context: small batches
  // (tables of fewer than SERIAL_POSITIONS positions in all) run on the calling thread.
  constexpr int64_t SERIAL_POSITIONS = 1024;
  const int64_t tasks = seqs * num_kv_heads;
  const int64_t grain = seqs * max_blocks * block_size < SERIAL_POSITIONS ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t len = lens[seq];
      TORCH_CHECK(len > 0 && len <= max_blocks * block_size, "bad context length");
      const int64_t* table = tables + seq * max_blocks;
      auto cached = [&](const float* cache, int64_t pos) {  // K or V row of one position
        return cache + (table[pos / block_size] * block_size + pos % block_size) * row +
               kv_head * head_dim;
      };
      const float* queries[64];
      TORCH_CHECK(group <= 64, "at most 64 query heads per KV head");
      for (int64_t j = 0; j < group; ++j)
        queries[j] = qp + seq * q.stride(0) + (kv_head * group + j) * q.stride(1);
      scores.resize(group * len);  // (g, len)
      for (int64_t pos = 0; pos < len; ++pos) {
        const float* key = cached(kp, pos);
        for (int64_t j = 0; j < group; ++j)
          scores[j * len + pos] = dot(queries[j], key, head_dim) * float(scale);
      }
      for (int64_t j = 0; j < group; ++j) {  // softmax over the context, in place
        float* s = scores.data() + j * len;
        const float top = *std::max_element(s, s + len);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t pos = 0; pos < len; ++pos) total += (s[pos] = vec_exp(s[pos] - top));
        const float inv = 1.f / total;
        for (int64_t pos = 0; pos < len; ++pos) s[pos] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);  // (g, hd)
      for (int64_t pos = 0; pos < len; ++pos) {
        const float* value = cached(vp, pos);
        for (int64_t j = 0; j < group; ++j) {
          const float p = scores[j * len + pos];
          float* a = acc.data() + j * head_dim;
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i) a[i] += p * value[i];
        }
      }
      for (int64_t j = 0; j < group; ++j)
        std::copy_n(acc.data() + j * head_dim, head_dim,
                    op + (seq * num_heads + kv_head * group + j) * head_dim);
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (fp32)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused (T, 2I) gate-up output");
  m.def("rotary_", &rotary_, "rotate-half RoPE in place");
  m.def("write_kv_", &write_kv_, "store new K/V at their cache slots");
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query per sequence over its paged K/V context");
}
