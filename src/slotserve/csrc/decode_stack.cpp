// The decode stack's code: a linear layer by its kernel, and the layers of an all-decode
// iteration in the order of slotserve/model/llama.py's LlamaDecoderLayer (decode_stack.h).

#include "decode_stack.h"

#include "ops.h"
#include "panels.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace slotserve::kernels {

torch::Tensor LinearWeights::operator()(const torch::Tensor& x) const {  // (T, in) -> (T, out)
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
  if (kind == Kind::kSegments) {
    std::vector<torch::Tensor> parts;
    for (const LinearWeights& segment : segments) parts.push_back(segment(x));
    return torch::cat(parts, 1);
  }
  torch::Tensor y = kind == Kind::kPanel      ? panel_linear(x, a, out_features)
                    : kind == Kind::kInt8     ? int8_linear(x, a, b)
                    : kind == Kind::kQuantBlocks
                        ? quant_block_linear(x, a, b, out_features, block_len, bits,
                                             activation_bits, false)
                    : kind == Kind::kPanelBf16 && amx_min_rows > 0 &&
                            x.size(0) >= amx_min_rows && amx_bf16_usable()
                        ? panel_linear_bf16_amx(x, a, out_features)
                        : panel_linear_bf16(x, a, out_features, dot_rows(x.size(0)));
  return bias ? y.add_(*bias) : y;
}

LinearWeights make_linear(const std::string& kind, torch::Tensor a,
                          c10::optional<torch::Tensor> b, c10::optional<torch::Tensor> bias,
                          int64_t out_features, int64_t amx_min_rows, int64_t block_len,
                          int64_t bits, int64_t activation_bits) {
  using Kind = LinearWeights::Kind;
  const bool panel = kind == "panel" || kind == "panel_bf16" || kind == "panel_bf16_dot";
  const bool blocks = kind == "gguf_blocks";
  TORCH_CHECK(kind == "plain" || kind == "mkl" || kind == "int8" || panel || blocks,
              "linear kind must be plain, mkl, int8 or panel (or panel_bf16, panel_bf16_dot, "
              "gguf_blocks), got ", kind);
  TORCH_CHECK(kind == "plain" || panel || b, kind, " linear needs its second tensor");
  TORCH_CHECK(!(panel || blocks) || out_features > 0, kind, " linear needs out_features");
  TORCH_CHECK(!blocks || ((block_len == 16 || block_len == 32) && quant_codes_format_known(bits)),
              "gguf_blocks linear needs block_len 16 or 32 and bits 4, 6 or 8 (or ",
              QUANT_CODES_IQ4_NL, ": IQ4_NL's indices)");
  if (blocks) check_activation_bits(activation_bits, bits);
  const Kind parsed = kind == "plain"        ? Kind::kPlain
                      : kind == "mkl"        ? Kind::kMkl
                      : kind == "int8"       ? Kind::kInt8
                      : kind == "panel"      ? Kind::kPanel
                      : kind == "panel_bf16" ? Kind::kPanelBf16
                      : blocks               ? Kind::kQuantBlocks
                                             : Kind::kPanelBf16Dot;
  LinearWeights weights{parsed, a, b ? *b : torch::Tensor(), bias, out_features, amx_min_rows};
  weights.block_len = blocks ? block_len : 0;
  weights.bits = blocks ? bits : 0;
  weights.activation_bits = blocks ? activation_bits : 8;
  return weights;
}

LinearWeights make_segments(const std::vector<LinearWeights>& segments) {
  TORCH_CHECK(!segments.empty(), "a segmented linear needs at least one segment");
  for (const LinearWeights& segment : segments)
    TORCH_CHECK(segment.kind != LinearWeights::Kind::kSegments, "segments do not nest");
  LinearWeights weights{LinearWeights::Kind::kSegments, torch::Tensor(), torch::Tensor(),
                        c10::nullopt, 0, 0};
  weights.segments = segments;
  weights.out_features = weights.outputs();
  return weights;
}

int64_t LinearWeights::outputs() const {
  if (kind == Kind::kSegments) {
    int64_t total = 0;
    for (const LinearWeights& segment : segments) total += segment.outputs();
    return total;
  }
  switch (kind) {
    case Kind::kPlain: return a.size(1);  // W (in, out)
    case Kind::kMkl: return b.size(0);    // (out, in)
    case Kind::kInt8: return a.size(0);   // (out, in)
    default: return out_features;
  }
}

void LinearWeights::check_shape(int64_t in, int64_t out) const {
  if (kind == Kind::kSegments) {
    for (const LinearWeights& segment : segments) segment.check_shape(in, -1);
    TORCH_CHECK(out < 0 || outputs() == out, "a linear layer gives ", outputs(),
                " outputs where ", out, " are needed");
    return;
  }
  TORCH_CHECK(out < 0 || outputs() == out, "a linear layer gives ", outputs(),
              " outputs where ", out, " are needed");
  const int64_t takes = kind == Kind::kPlain   ? a.size(0)
                        : kind == Kind::kMkl   ? b.size(1)
                        : kind == Kind::kInt8  ? a.size(1)
                        : kind == Kind::kPanel ? a.size(1)
                                               : -1;  // bf16 panels, blocks: checked below
  TORCH_CHECK(takes == -1 || takes == in, "a linear layer takes ", takes, " inputs, not ", in);
  if (kind == Kind::kPanel) {
    check_cpu_float(a, "panels");
    TORCH_CHECK(a.dim() == 3 && a.size(2) == PANEL_WIDTH && a.is_contiguous(),
                "panels must come from pack_panels");
  }
  if (kind == Kind::kPanelBf16 || kind == Kind::kPanelBf16Dot)
    check_bf16_panels(torch::empty({0, in}), a, out_features);
  if (kind == Kind::kQuantBlocks) check_quant_blocks(a, b, in, out_features, block_len, bits);
  TORCH_CHECK(kind == Kind::kMkl || kind == Kind::kPlain || kind == Kind::kInt8 ||
                  kind == Kind::kQuantBlocks ||  // check_quant_blocks: the 16-row panels
                  (out_features > (a.size(0) - 1) * PANEL_WIDTH &&
                   out_features <= a.size(0) * PANEL_WIDTH),
              "out_features does not fit the panels");
  if (bias) {
    check_cpu_float(*bias, "bias");
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == outputs(), "one bias per output");
  }
}

void LinearWeights::into(const float* x, int64_t rows, int64_t in, float* y) const {
  const int64_t outs = outputs();
  if (kind == Kind::kSegments) {  // NOTE: one row's outputs are contiguous: no copy at batch 1
    std::vector<float> part;
    int64_t first = 0;
    for (const LinearWeights& segment : segments) {
      const int64_t width = segment.outputs();
      if (rows == 1) {
        segment.into(x, 1, in, y + first);
      } else {
        part.resize(rows * width);
        segment.into(x, rows, in, part.data());
        for (int64_t r = 0; r < rows; ++r)
          std::copy_n(part.data() + r * width, width, y + r * outs + first);
      }
      first += width;
    }
    return;
  }
  const bool amx = kind == Kind::kPanelBf16 && amx_min_rows > 0 && rows >= amx_min_rows &&
                   amx_bf16_usable();
  if (kind == Kind::kPanel) {
    panel_linear_into(x, rows, in, a.data_ptr<float>(), a.size(0), outs, y);
  } else if ((kind == Kind::kPanelBf16 && !amx) || kind == Kind::kPanelBf16Dot) {
    panel_linear_bf16_into(x, rows, in,
                           reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>()),
                           a.size(0), outs, y, dot_rows(rows));
  } else if (kind == Kind::kQuantBlocks) {
    quant_block_linear_into(x, rows, in, a.data_ptr<uint8_t>(), b.data_ptr(),
                            quant_scale_format(b), outs, block_len, bits, activation_bits, y);
  } else {  // operator() adds the bias
    const torch::Tensor out = (*this)(torch::from_blob(const_cast<float*>(x), {rows, in}));
    std::copy_n(out.data_ptr<float>(), rows * outs, y);
    return;
  }
  if (!bias) return;
  const float* b = bias->data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
#pragma omp simd
    for (int64_t j = 0; j < outs; ++j) y[r * outs + j] += b[j];
}

void DecodeStack::add_layer(torch::Tensor input_norm, torch::Tensor post_attention_norm,
                            const LinearWeights& qkv, const LinearWeights& o,
                            const LinearWeights& gate_up, const LinearWeights& down,
                            int64_t window, c10::optional<torch::Tensor> q_norm,
                            c10::optional<torch::Tensor> k_norm,
                            c10::optional<torch::Tensor> pre_feedforward_norm,
                            c10::optional<torch::Tensor> post_feedforward_norm,
                            bool local_rope) {
  const int64_t hidden = final_norm_.numel(), q_size = num_heads_ * head_dim_;
  const int64_t kv_size = num_kv_heads_ * head_dim_;
  for (const torch::Tensor* norm : {&final_norm_, &input_norm, &post_attention_norm}) {
    check_cpu_float(*norm, "norm weight");
    TORCH_CHECK(norm->is_contiguous() && norm->numel() == hidden,
                "every norm weight must be (H,), contiguous");
  }
  TORCH_CHECK(num_kv_heads_ > 0 && num_heads_ % num_kv_heads_ == 0 &&
                  num_heads_ <= MAX_ATTENTION_HEADS && head_dim_ % 2 == 0,
              "num_heads must be a multiple of num_kv_heads, at most 256; head_dim even");
  qkv.check_shape(hidden, q_size + 2 * kv_size);
  o.check_shape(q_size, hidden);
  gate_up.check_shape(hidden, -1);
  TORCH_CHECK(gate_up.outputs() % 2 == 0, "gate_up gives an even number of outputs");
  down.check_shape(gate_up.outputs() / 2, hidden);
  TORCH_CHECK(layers_.empty() || gate_up.outputs() == layers_[0].gate_up.outputs(),
              "every layer has the same intermediate size");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: full attention)");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm: both or neither");
  for (const auto* norm : {&q_norm, &k_norm}) {
    if (!norm->has_value()) continue;
    check_cpu_float(**norm, "q/k norm weight");
    TORCH_CHECK((*norm)->is_contiguous() && (*norm)->numel() == head_dim_,
                "q_norm and k_norm weights must be (head_dim,), contiguous");
  }
  TORCH_CHECK(pre_feedforward_norm.has_value() == post_feedforward_norm.has_value(),
              "pre_feedforward_norm and post_feedforward_norm: both or neither");
  TORCH_CHECK(layers_.empty() ||
                  layers_[0].pre_feedforward_norm.defined() == pre_feedforward_norm.has_value(),
              "every layer has sandwich norms or none does");
  for (const auto* norm : {&pre_feedforward_norm, &post_feedforward_norm}) {
    if (!norm->has_value()) continue;
    check_cpu_float(**norm, "norm weight");
    TORCH_CHECK((*norm)->is_contiguous() && (*norm)->numel() == hidden,
                "every norm weight must be (H,), contiguous");
  }
  const bool all_windowed = layers_.empty() || read_window_ > 0;
  read_window_ = all_windowed && window > 0 ? std::max(read_window_, window) : 0;
  layers_.push_back({input_norm, post_attention_norm, qkv, o, gate_up, down, window,
                     q_norm ? *q_norm : torch::Tensor(), k_norm ? *k_norm : torch::Tensor(),
                     pre_feedforward_norm ? *pre_feedforward_norm : torch::Tensor(),
                     post_feedforward_norm ? *post_feedforward_norm : torch::Tensor(),
                     local_rope});
}

void DecodeStack::set_activation(const std::string& name) {
  TORCH_CHECK(name == "silu" || name == "gelu" || name == "gelu_pytorch_tanh",
              "activation must be silu, gelu or gelu_pytorch_tanh, got ", name);
  activation_ = name == "silu"   ? Activation::kSilu
                : name == "gelu" ? Activation::kGelu
                                 : Activation::kGeluTanh;
}

void DecodeStack::set_lookup_tables(torch::Tensor embedding, torch::Tensor cos,
                                    torch::Tensor sin, c10::optional<torch::Tensor> cos_local,
                                    c10::optional<torch::Tensor> sin_local) {
  TORCH_CHECK(cos_local.has_value() == sin_local.has_value(),
              "cos_local and sin_local: both or neither");
  torch::Tensor local_cos = cos_local ? *cos_local : cos;
  torch::Tensor local_sin = sin_local ? *sin_local : sin;
  for (const torch::Tensor* table : {&embedding, &cos, &sin, &local_cos, &local_sin}) {
    TORCH_CHECK(table->device().is_cpu(), "lookup tables must be on the CPU");
    TORCH_CHECK(table->dim() == 2 && table->is_contiguous(), "lookup tables are 2-D, contiguous");
  }
  for (const torch::Tensor* table : {&cos, &sin, &local_cos, &local_sin})
    check_cpu_float(*table, "a RoPE table");
  const auto kind = embedding.scalar_type();  // NOTE: a 16-bit table is widened exactly
  TORCH_CHECK(kind == kFloat32 || kind == torch::kBFloat16 || kind == torch::kHalf,
              "the embedding must be float32, bfloat16 or float16");
  TORCH_CHECK(embedding.size(1) == final_norm_.numel(), "the embedding must be (V, H)");
  TORCH_CHECK(cos.size(1) == head_dim_ / 2 && sin.sizes() == cos.sizes(),
              "cos and sin must be (max positions, hd/2)");
  TORCH_CHECK(local_cos.sizes() == cos.sizes() && local_sin.sizes() == cos.sizes(),
              "the local cos and sin must be shaped as cos");
  embedding_ = embedding;
  cos_ = cos;
  sin_ = sin;
  cos_local_ = cos_local ? *cos_local : torch::Tensor();
  sin_local_ = sin_local ? *sin_local : torch::Tensor();
}

void DecodeStack::set_block_embedding(torch::Tensor codes, torch::Tensor scales_mins,
                                      int64_t block_len, int64_t bits) {
  TORCH_CHECK(embedding_.defined(), "set_lookup_tables first");
  check_quant_blocks(codes, scales_mins, embedding_.size(1), embedding_.size(0), block_len,
                     bits);
  embedding_codes_ = codes;
  embedding_scales_mins_ = scales_mins;
  embedding_block_len_ = block_len;
  embedding_bits_ = bits;
}

namespace {

// The step's inputs, checked, and the caches' pointers (one view per layer).
struct StepInputs {
  torch::Tensor ids, positions, slots, tables, lens;
  std::vector<KvCacheView> caches;
};

StepInputs check_step(torch::Tensor input_ids, torch::Tensor positions,
                      const std::vector<torch::Tensor>& caches, torch::Tensor slot_mapping,
                      torch::Tensor block_tables, torch::Tensor context_lens,
                      const torch::Tensor& embedding, const torch::Tensor& cos,
                      int64_t num_kv_heads, int64_t head_dim, size_t layers,
                      int64_t read_window) {
  TORCH_CHECK(embedding.defined(), "set_lookup_tables first");
  TORCH_CHECK(caches.size() == 2 * layers, "one k and one v cache per layer");
  StepInputs in{input_ids.to(kInt64).contiguous(),
                positions.to(kInt64).contiguous(),
                slot_mapping.to(kInt64).contiguous(),
                block_tables.to(kInt64).contiguous(),
                context_lens.to(kInt64).contiguous(), {}};
  const int64_t D = in.ids.numel();
  TORCH_CHECK(in.ids.dim() == 1 && in.positions.dim() == 1 && in.positions.numel() == D,
              "input_ids and positions must be (D,)");
  check_indices(in.ids, embedding.size(0), "token id");
  check_indices(in.positions, cos.size(0), "position");
  TORCH_CHECK(in.slots.numel() == D && in.tables.dim() == 2 && in.tables.size(0) == D,
              "one slot and one block table per sequence");
  for (size_t i = 0; i < layers; ++i) {
    in.caches.push_back(kv_cache_view(caches[2 * i], caches[2 * i + 1]));
    const KvCacheView& c = in.caches.back();
    TORCH_CHECK(c.num_kv_heads == num_kv_heads && c.head_dim == head_dim &&
                    c.num_blocks == in.caches[0].num_blocks &&
                    c.block_size == in.caches[0].block_size,
                "every layer's caches must be (num_blocks, bs, nkv, hd), the same");
  }
  if (layers == 0) return in;
  const KvCacheView& first = in.caches[0];
  check_block_tables(in.tables, in.lens, first.num_blocks, first.block_size, read_window);
  check_indices(in.slots, first.num_blocks * first.block_size, "slot");
  return in;
}

// Qwen3's q/k norms: each token's q heads (nh rows of hd at the start of its qkv row) and
// k heads (the nkv rows after them) normalized in place. NOTE: rms_norm_rows row by row, as
// the Python layer's ops.rms_norm over the (T * n, hd) heads: the same bits.
void norm_heads_rows(float* qkv, int64_t tokens, int64_t token_stride, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, const float* q_norm,
                     const float* k_norm, double eps) {
  for (int64_t t = 0; t < tokens; ++t) {
    float* q = qkv + t * token_stride;
    float* k = q + num_heads * head_dim;
    rms_norm_rows(q, q_norm, q, num_heads, head_dim, eps);
    rms_norm_rows(k, k_norm, k, num_kv_heads, head_dim, eps);
  }
}

// gate_up (rows, 2I) -> act (rows, I) = gelu(gate) * up: ATen's ops on the same shapes and
// strides as the Python GatedMLP's `act(gate) * up` (its split views), so the same bits.
void gelu_mul_rows(const float* gate_up, float* act, int64_t rows, int64_t inter, bool tanh) {
  const torch::Tensor both = torch::from_blob(const_cast<float*>(gate_up), {rows, 2 * inter});
  const torch::Tensor out =
      at::gelu(both.narrow(1, 0, inter), tanh ? "tanh" : "none")
          .mul(both.narrow(1, inter, inter))
          .contiguous();
  std::copy_n(out.data_ptr<float>(), rows * inter, act);
}

// rows[i] of table (row width `width`) for each index i -> out (n, width).
void gather_rows(const float* table, int64_t width, const int64_t* indices, int64_t n,
                 float* out) {
  for (int64_t i = 0; i < n; ++i) std::copy_n(table + indices[i] * width, width, out + i * width);
}

// The embedding's rows of `ids` as fp32, whatever the table's dtype (set_lookup_tables'):
// a bf16 or fp16 row widened exactly (WidenedEmbedding's lookup).
void gather_embedding(const torch::Tensor& table, const int64_t* ids, int64_t n, float* out) {
  const int64_t width = table.size(1);
  with_weight_values(table, [&](const auto* values) {
    for (int64_t i = 0; i < n; ++i) widen_row(values + ids[i] * width, width, 1, out + i * width);
  });
}

}  // namespace

torch::Tensor DecodeStack::forward(torch::Tensor input_ids, torch::Tensor positions,
                                   const std::vector<torch::Tensor>& caches,
                                   torch::Tensor slot_mapping, torch::Tensor block_tables,
                                   torch::Tensor context_lens) const {
  const SpinScope spinning;  // NOTE: the pool's workers stay hot between this step's jobs
  const int64_t hidden = final_norm_.numel(), half = head_dim_ / 2;
  const StepInputs in = check_step(input_ids, positions, caches, slot_mapping, block_tables,
                                   context_lens, embedding_, cos_, num_kv_heads_, head_dim_,
                                   layers_.size(), read_window_);
  const int64_t D = in.ids.numel(), q_size = num_heads_ * head_dim_;
  const int64_t kv_size = num_kv_heads_ * head_dim_, qkv_size = q_size + 2 * kv_size;
  const int64_t gate_up_size = layers_.empty() ? 0 : layers_[0].gate_up.outputs();
  const int64_t inter = gate_up_size / 2;
  auto y = torch::empty({D, hidden}, final_norm_.options());
  // the workspace: every activation of a layer, reused by the next; RoPE's rows
  const bool local_tables = cos_local_.defined();
  for (const DecoderLayerWeights& layer : layers_)
    TORCH_CHECK(!layer.local_rope || local_tables,
                "a layer rotates with the local RoPE tables: give set_lookup_tables them");
  auto work = torch::empty(
      {D * (4 * hidden + qkv_size + q_size + gate_up_size + inter + 4 * half)},
      final_norm_.options());
  float* residual = work.data_ptr<float>();  // (D, H), added to in place
  float* h = residual + D * hidden;          // (D, H) the normed input of a block
  float* qkv = h + D * hidden;               // (D, q + 2 kv)
  float* attn = qkv + D * qkv_size;          // (D, nh, hd)
  float* o = attn + D * q_size;              // (D, H)
  float* gate_up = o + D * hidden;           // (D, 2I)
  float* act = gate_up + D * gate_up_size;   // (D, I)
  float* mlp_out = act + D * inter;          // (D, H) the MLP's output, not yet added
  float* cos_rows = mlp_out + D * hidden;    // (D, hd/2)
  float* sin_rows = cos_rows + D * half;     // (D, hd/2)
  float* cos_local_rows = sin_rows + D * half;        // (D, hd/2) local_rope's
  float* sin_local_rows = cos_local_rows + D * half;  // (D, hd/2)
  const int64_t* ids = in.ids.data_ptr<int64_t>();
  const int64_t* token_positions = in.positions.data_ptr<int64_t>();
  if (embedding_codes_.defined())
    quant_block_rows_into(embedding_codes_.data_ptr<uint8_t>(), embedding_scales_mins_.data_ptr(),
                          quant_scale_format(embedding_scales_mins_),
                          embedding_.size(0), hidden, embedding_block_len_, embedding_bits_, ids,
                          D, residual);
  else
    gather_embedding(embedding_, ids, D, residual);
  gather_rows(cos_.data_ptr<float>(), half, token_positions, D, cos_rows);
  gather_rows(sin_.data_ptr<float>(), half, token_positions, D, sin_rows);
  if (local_tables) {
    gather_rows(cos_local_.data_ptr<float>(), half, token_positions, D, cos_local_rows);
    gather_rows(sin_local_.data_ptr<float>(), half, token_positions, D, sin_local_rows);
  }
  if (embed_scale_ != 0.0) {  // Gemma: x * sqrt(H) in fp32, as the Python model
    const float scale = static_cast<float>(embed_scale_);
#pragma omp simd
    for (int64_t i = 0; i < D * hidden; ++i) residual[i] *= scale;
  }
  if (layers_.empty()) {
    rms_norm_rows(residual, final_norm_.data_ptr<float>(), y.data_ptr<float>(), D, hidden,
                  eps_);
    return y;
  }
  const int64_t* slots = in.slots.data_ptr<int64_t>();
  const int64_t* tables = in.tables.data_ptr<int64_t>();
  const int64_t* lens = in.lens.data_ptr<int64_t>();
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecoderLayerWeights& layer = layers_[i];
    const KvCacheView& cache = in.caches[i];
    // attention block
    if (i == 0)
      rms_norm_rows(residual, layer.input_norm.data_ptr<float>(), h, D, hidden, eps_);
    else
      add_rms_norm_rows(residual, mlp_out, layer.input_norm.data_ptr<float>(), h, D, hidden,
                        eps_);
    layer.qkv.into(h, D, hidden, qkv);
    if (layer.q_norm.defined())
      norm_heads_rows(qkv, D, qkv_size, num_heads_, num_kv_heads_, head_dim_,
                      layer.q_norm.data_ptr<float>(), layer.k_norm.data_ptr<float>(), eps_);
    // q and k heads side by side at the start of each qkv row: rotated in place
    rotary_rows(qkv, D, num_heads_ + num_kv_heads_, half, qkv_size, head_dim_,
                layer.local_rope ? cos_local_rows : cos_rows,
                layer.local_rope ? sin_local_rows : sin_rows);
    write_kv_rows(cache, qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size, D, slots);
    decode_attention_into(qkv, D, num_heads_, qkv_size, head_dim_, cache, tables,
                          in.tables.size(1), lens, scale_, layer.window, attn);
    // MLP block
    layer.o.into(attn, D, q_size, o);
    const bool sandwich = layer.pre_feedforward_norm.defined();
    if (sandwich)  // Gemma: the attention's output normalized (in place), then added
      rms_norm_rows(o, layer.post_attention_norm.data_ptr<float>(), o, D, hidden, eps_);
    add_rms_norm_rows(residual, o,
                      (sandwich ? layer.pre_feedforward_norm : layer.post_attention_norm)
                          .data_ptr<float>(),
                      h, D, hidden, eps_);
    layer.gate_up.into(h, D, hidden, gate_up);
    if (activation_ == Activation::kSilu)
      silu_mul_rows(gate_up, act, D, inter);
    else
      gelu_mul_rows(gate_up, act, D, inter, activation_ == Activation::kGeluTanh);
    layer.down.into(act, D, inter, mlp_out);
    if (sandwich)  // Gemma: the MLP's output normalized (in place) before it is added
      rms_norm_rows(mlp_out, layer.post_feedforward_norm.data_ptr<float>(), mlp_out, D,
                    hidden, eps_);
  }
  add_rms_norm_rows(residual, mlp_out, final_norm_.data_ptr<float>(), y.data_ptr<float>(), D,
                    hidden, eps_);
  return y;
}

}  // namespace slotserve::kernels
